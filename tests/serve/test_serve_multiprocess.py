"""serve.py as a job of several processes (srun -n 2, mpirun, SkyPilot num_nodes 2, a JobSet): every
process joins and builds the same engine over all the job's devices; process 0 serves and broadcasts
each engine call as a plan, the others replay it (serve/replay.py).

In one process: a follower engine fed the leader's plans through a queue ends in the leader's state
(block manager, tables, the device pool and decode state) and the scheduler's replies are a plain
engine's. Across processes (slow): 2 processes x 1 CPU device with Slurm's variables (gloo), the
openai client's greedy tokens from process 0 equal a one-process server's; SIGTERM drains process 0,
which stops the follower; both exit 0.
"""

import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import jax
import numpy as np
import pytest

from flaxgpt.data.tokenizers import CharTokenizer
from flaxgpt.decode.sampling import Rows, Sampling
from flaxgpt.serve import launch, replay
from flaxgpt.serve.engine import Engine
from flaxgpt.serve.scheduler import Failed, Finish, Scheduler, Sequence
from tests.procs import xla_flags
from tests.serve.test_paged import BLOCKS, CFG, CHARS, PAGE, SLOTS, W, params, step  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]


class EvenTokens:
    """A grammar (the scheduler's Matcher interface) that allows even token ids only, for 5 tokens:
    its mask is computed on the leader and must reach the follower in the plan."""

    def __init__(self):
        self.n = 0

    def fill(self, mask_BW, row):
        mask_BW[row] = 0x55555555  # bits 0, 2, 4, ...: even ids

    def accept(self, token):
        assert token % 2 == 0, token
        self.n += 1

    def done(self):
        return self.n >= 5


def requests():
    rng = np.random.default_rng(5)
    system = rng.integers(0, CFG.vocab_size, 10).tolist()  # a prefix the later prompts share
    greedy, sampled = Sampling(temperature=0), Sampling(temperature=0.9, top_k=5)
    out = [
        Sequence(system, Rows.of(greedy, max_new_tokens=12)),
        Sequence(system[:8] + [3, 4, 5], Rows.of(sampled, max_new_tokens=9, seed=4)),
        Sequence(rng.integers(0, CFG.vocab_size, 20).tolist(), Rows.of(greedy, max_new_tokens=6), logprobs=2),
        Sequence([1, 2, 3], Rows.of(greedy, max_new_tokens=8), grammar=EvenTokens()),
        Sequence([7] * (W + 1), Rows.of(greedy, max_new_tokens=2)),  # too long: fails on both
        Sequence([2, 9], Rows.of(greedy, max_new_tokens=5), echo=True, logprobs=1),
    ]
    return out


def serve(engine, seqs):
    """The scheduler over `engine` serves `seqs` (submitted together) -> each one's events."""
    sched = Scheduler(engine, CharTokenizer(CHARS))
    sched.start()
    assert sched.ready.wait(300)
    events = [[] for _ in seqs]
    for i, s in enumerate(seqs):
        s.emit = events[i].append
    sched.submit(*seqs)
    assert sched.drain(timeout=300)
    sched.close()
    return events


def state_of(engine: Engine):
    """What must be equal on every process: the block manager's pages and cache, the slots' table and
    every array of the device state (pool, decode state)."""
    b = engine.blocks
    leaves = [jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
              for x in jax.tree.leaves(engine.runner.state)]  # fmt: skip
    return (
        b.refs.tolist(), list(b.free_pages), list(b.blocks.items()), engine.runner._table.tolist(),
        [np.asarray(x).tolist() for x in leaves],
    )  # fmt: skip


@pytest.mark.parametrize("mixed, speculate", [(0, 0), (16, 0), (0, 3)])
def test_a_follower_fed_the_plans_ends_in_the_leader_s_state(step, mixed, speculate):  # noqa: F811
    """Two programs, the mixed step, prompt-lookup drafts: the same calls leave the same state."""
    kw = dict(slots=SLOTS, chunk=3, prefill_chunk=16, page=PAGE, prefix_blocks=BLOCKS, mixed=mixed)
    kw["speculate"] = speculate
    plans = queue.Queue()
    leader = replay.Leader(Engine(step, CFG, **kw), send=plans.put)
    follower, replayed = Engine(step, CFG, **kw), []
    thread = threading.Thread(
        target=lambda: replayed.append(replay.follow(follower, receive=lambda: plans.get(timeout=300)))
    )
    thread.start()
    try:
        events = serve(leader, requests())
    finally:
        leader.stop()
        thread.join(timeout=300)
    assert replayed and replayed[0] > 10  # warm-up and serving calls, every one replayed
    assert state_of(follower) == state_of(leader.engine)
    plain = serve(Engine(step, CFG, **kw), requests())
    assert events == plain  # the leader serves as a plain engine does
    assert isinstance(events[4][-1], Failed) and "context window" in events[4][-1].message
    assert all(isinstance(e[-1], Finish) for i, e in enumerate(events) if i != 4)
    with pytest.raises(RuntimeError, match="stopped"):
        leader.generate()


def test_plans_of_any_length_cross_the_broadcast_buffer():
    """A short plan fits the first buffer; a long one (a long prompt, a bitmask) takes a second."""
    for n in (0, 5, 4 * replay.HEAD - 8, 4 * replay.HEAD - 3, 4 * replay.HEAD + 1, 100_003):
        plan = bytes(np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8))
        assert replay._broadcast(plan) == plan


def test_adapters_are_refused_on_several_processes_in_one_line():
    launch.check_replayable(max_adapters=4, processes=1)  # one process: adapters as ever
    launch.check_replayable(processes=2)  # no adapters: several processes serve
    for kw in (dict(max_adapters=4), dict(allow_runtime_lora=True)):
        with pytest.raises(ValueError, match="a job of 2") as e:
            launch.check_replayable(processes=2, **kw)
        assert "\n" not in str(e.value) and "--adapter DIR" in str(e.value)


# ------------------------------------------------------------------ two processes (slow)

PROMPTS = ["ROMEO:", "the cat ", "a", "O Romeo, Romeo"]


def tiny_run(directory: Path):
    """A run directory of a tiny char GPT whose vocabulary (padded to 48) and MLP split over 2 devices."""
    import json

    from flaxgpt.models.gpt import GPTConfig, init_params
    from flaxgpt.runs.checkpoint import Checkpointer

    cfg = GPTConfig(
        vocab_size=len(CHARS), block_size=32, n_layer=2, n_head=2, n_embd=32, pad_vocab_multiple=8
    )
    (directory / "config.json").write_text(json.dumps({"model": {"kind": "gpt", **cfg.to_dict()}}))
    (directory / "meta.json").write_text(json.dumps({"tokenizer": CharTokenizer(CHARS).to_meta()}))
    ckpt = Checkpointer(directory, async_save=False)
    ckpt.save(1, {"params": init_params(cfg, jax.random.key(3))}, extra={})
    ckpt.close()


def serve_cmd(run, port, mesh):
    cmd = [sys.executable, str(ROOT / "serve.py"), "--out_dir", str(run), "--port", str(port)]
    # 2 slots, one prompt bucket, no prefix cache, chunk 1: few programs to compile on a loaded CPU
    return cmd + ["--mesh", str(mesh), "--slots", "2", "--prefill_chunk", "16", "--chunk", "1"]


def completions(url) -> list[str]:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)
    out = []
    for p in PROMPTS:
        r = client.completions.create(model="run", prompt=p, max_tokens=10, temperature=0)
        out.append(r.choices[0].text)
    return out


def clean_env(devices: int) -> dict:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "SKYPILOT_", "JOBSET_"))
    }
    env = {k: v for k, v in env.items() if not k.startswith("JAX_COORD")}
    return env | {
        "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices),
        "XLA_FLAGS": xla_flags(devices), "PYTHONUNBUFFERED": "1",
    }  # fmt: skip


def stop(procs, timeout=120) -> list[str]:
    """SIGTERM to every process (as Slurm sends it to every task), then their outputs; kills leftovers."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    try:
        return [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)


@pytest.mark.slow  # 3 server processes compiling on the CPU
def test_two_processes_under_srun_serve_the_tokens_of_one(tmp_path):
    pytest.importorskip("starlette")
    from tests.serve.test_serve import free_port, wait_healthy
    from tests.train.test_multihost import engine_env

    run = tmp_path / "run"
    run.mkdir()
    tiny_run(run)
    port, coordinator = free_port(), free_port()
    procs = [
        subprocess.Popen(
            serve_cmd(run, port, 2),
            cwd=ROOT,
            env=clean_env(1) | engine_env("slurm", i, coordinator),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    try:
        wait_healthy(procs[0], f"http://127.0.0.1:{port}")
        assert procs[1].poll() is None  # the follower replays; it serves nothing
        joined = completions(f"http://127.0.0.1:{port}")
    finally:
        outputs = stop(procs)
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{out[-3000:]}"
    assert "ready on" in outputs[0] and "ready on" not in outputs[1]

    port = free_port()
    one = subprocess.Popen(
        serve_cmd(run, port, 2), cwd=ROOT, env=clean_env(2), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_healthy(one, f"http://127.0.0.1:{port}")
        alone = completions(f"http://127.0.0.1:{port}")
    finally:
        stop([one])
    assert joined == alone and all(len(t) == 10 for t in alone), (joined, alone)
