"""One engine over the devices of several processes (serve.py --mesh across hosts): process 0's
scheduler drives it, every other process replays its calls.

    leader = Leader(engine)            # process 0: the scheduler's engine (Scheduler(leader, ...))
    follow(engine)                     # every other process: replays until the leader stops
    leader.stop()                      # process 0, after the scheduler's thread ended

Every process builds the same Engine over the global mesh: its programs are SPMD programs over all
devices, so each process must run the same programs in the same order. Process 0 alone runs the HTTP
server and the scheduler; each engine call the scheduler makes (start_prefill, prefill_step, insert,
hold, mixed, generate, speculate, keep, release, cancel, ...) first goes out to the other processes as
a plan, (method, arguments), broadcast from process 0 (multihost_utils.broadcast_one_to_all), then
runs. A follower receives the plan and makes the same call on its engine: its block manager, page
tables and decode state stay equal to the leader's, call by call (they are deterministic functions of
the calls), and its programs meet the leader's collectives. The plan is the one description of an
engine call: nothing else decides on a follower.

A plan's arguments are plain values (prompt ids, host Rows, bitmasks, drafts); the objects an engine
call returns and a later one takes (a PrefillJob, a Prefix) travel as handles, numbered in the order
both sides made them. A structured-output step's bitmask is computed on process 0 before the step
(its `fill` function would run on process 0 only) and travels in the plan. Runtime LoRA adapters are
process 0's state (their weights written into the stack by process 0's pool): refused before start
(launch.check_replayable).

The bytes are a pickle of the plan: they come from process 0 of the same job (the party that also
chose the weights every process loads), through the job's own collective.
"""

from __future__ import annotations

import itertools
import pickle
import threading

import numpy as np

from flaxgpt.serve.engine import Engine, PrefillJob, Prefix

HEAD = 1024  # int32 words of the first broadcast: its length word and a short plan inline (most plans)

STOP = "stop"
# the engine's methods a scheduler calls; each one is a plan
CALLS = (
    "prefill", "start_prefill", "prefill_step", "insert", "cancel", "drop", "keep", "release", "hold",
    "mixed", "generate", "speculate", "speculate_with_draft", "clear_blocks",
)  # fmt: skip


class Handle(int):
    """A PrefillJob or Prefix in a plan: the number both sides gave it when a call returned it."""


def _broadcast(plan: bytes | None) -> bytes:
    """process 0's `plan` on every process (None elsewhere): a HEAD-word buffer whose first word is the
    length, the rest in a second broadcast padded to a power of two (a few compiled shapes)."""
    from jax.experimental import multihost_utils

    head = np.zeros(HEAD, np.int32)
    words = None
    if plan is not None:
        words = np.frombuffer(plan + b"\0" * (-len(plan) % 4), np.int32)
        head[0] = len(plan)
        head[1 : 1 + min(len(words), HEAD - 1)] = words[: HEAD - 1]
    head = np.asarray(multihost_utils.broadcast_one_to_all(head))
    n = int(head[0])
    body = head[1:]
    if -(-n // 4) > HEAD - 1:  # the rest of a long plan (a long prompt, a bitmask)
        rest = -(-n // 4) - (HEAD - 1)
        tail = np.zeros(1 << (rest - 1).bit_length(), np.int32)
        if words is not None:
            tail[:rest] = words[HEAD - 1 :]
        tail = np.asarray(multihost_utils.broadcast_one_to_all(tail))
        body = np.concatenate([body, tail[:rest]])
    return body.tobytes()[:n]


class _Handles:
    """The PrefillJobs and Prefixes a side holds for later calls, by handle: both sides number what
    the same calls return in the same order, and forget what a call consumed."""

    CONSUME = ("insert", "cancel", "drop", "hold")  # calls after which no plan names the object

    def __init__(self):
        self.objects: dict[int, object] = {}  # handle -> object
        self.numbers: dict[int, Handle] = {}  # id(object) -> handle
        self.made = itertools.count()

    def encode(self, x):
        return self.numbers[id(x)] if isinstance(x, (PrefillJob, Prefix)) else x

    def decode(self, x):
        return self.objects[x] if isinstance(x, Handle) else x

    def after(self, name: str, args, out):
        """Book-keeping once call `name` on `args` returned `out`."""
        done = [x for x in args if isinstance(x, (PrefillJob, Prefix))] if name in self.CONSUME else []
        if name == "prefill_step" and out is not None:  # the job is complete: its Prefix goes on
            done.append(args[0])
        for x in done:
            self.objects.pop(self.numbers.pop(id(x), -1), None)
        if isinstance(out, (PrefillJob, Prefix)):
            h = Handle(next(self.made))
            self.objects[h], self.numbers[id(out)] = out, h


class Leader:
    """Process 0's engine: each call in CALLS is broadcast as a plan, then run; anything else (sizes,
    held, logprobs, blocks) is read from the engine."""

    def __init__(self, engine: Engine, send=_broadcast):
        self.engine, self._send, self._handles = engine, send, _Handles()
        self._lock = threading.Lock()  # one plan at a time: stop() from another thread waits for a call
        self._stopped = False

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def __setattr__(self, name, value):
        if name == "step_fn":  # a new adapter stack on process 0 alone: refused before start
            raise ValueError("the engine's weights cannot change while several processes serve it")
        object.__setattr__(self, name, value)

    @property
    def blocks(self):
        return _Blocks(self)

    def _call(self, name, *args, **kwargs):
        with self._lock:
            if self._stopped:
                raise RuntimeError("the serving job has stopped")
            enc = self._handles.encode
            plan = (name, tuple(map(enc, args)), {k: enc(v) for k, v in kwargs.items()})
            self._send(pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL))
            out = _run(self.engine, name, args, kwargs)
            self._handles.after(name, args, out)
            return out

    def generate(self, steps=None, mask_BW=None):
        if callable(mask_BW):  # the bitmask now, into the plan (a follower cannot run the grammar)
            mask_BW = mask_BW()
        return self._call("generate", steps, mask_BW)

    def stop(self):
        """Followers return from `follow`; later calls raise."""
        with self._lock:
            if not self._stopped:
                self._stopped = True
                self._send(pickle.dumps((STOP, (), {})))


def _method(name):
    return lambda self, *args, **kwargs: self._call(name, *args, **kwargs)


for _name in CALLS:
    if _name != "generate":
        setattr(Leader, _name, _method(_name))


class _Blocks:
    """The leader's block manager as the scheduler sees it: clear() is a plan, the rest reads."""

    def __init__(self, leader: Leader):
        self._leader = leader

    def clear(self):
        self._leader.clear_blocks()

    def __getattr__(self, name):
        return getattr(self._leader.engine.blocks, name)


def _run(engine: Engine, name: str, args, kwargs):
    if name == "clear_blocks":
        return engine.blocks.clear()
    return getattr(engine, name)(*args, **kwargs)


def follow(engine: Engine, receive=lambda: _broadcast(None)) -> int:
    """Replay process 0's plans on this process's engine until it stops -> plans replayed. A call that
    raised on process 0 (a prompt too long for the window) raises here too, and is skipped alike."""
    handles, n = _Handles(), 0
    while True:
        name, args, kwargs = pickle.loads(receive())
        if name == STOP:
            return n
        args, kwargs = tuple(map(handles.decode, args)), {k: handles.decode(v) for k, v in kwargs.items()}
        n += 1
        try:
            out = _run(engine, name, args, kwargs)
        except Exception:  # the leader's call raised the same: its scheduler fails that request
            continue
        handles.after(name, args, out)
