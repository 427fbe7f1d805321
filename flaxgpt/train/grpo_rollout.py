"""GRPO's rollouts by the serving engine (grpo.rollout = "engine"): the G completions of each prompt
decoded by flaxgpt.serve.engine.Engine from the current weights, in the training process.

    rollouts = EngineRollouts(model_config, Sampling(temperature=1.0, eos_id=eos), max_new_tokens=64,
                              slots=128, max_len=W, lora_spec=spec)
    prompts, completion_ids = rollouts.sample(weights, prompt_ids, G, seed=s)

weights: the policy's parameters, or with LoRA over a float32 base the base with the adapters merged
(`merged`: one more copy of the base, no adapter products a token), or (base, adapters) added
unmerged (models.lora.step_fn, lora_spec given), so a bfloat16 or int8 base (lora.base_dtype = int8,
QLoRA-style) rolls out too. The engine's step_fn is a Partial over the weights, replaced at each
call (serve.launch swaps its adapter stack the same way): new weights every step, the engine's
programs compiled once.

Continuous batching: completions take the engine's `slots` as they free up (one that ends at EOS
frees its slot for the next after the `generate` call it ended in); a prompt is prefilled once into
the engine's page pool and copied into the windows of its G completions' slots (the engine's slot
windows: each slot decodes over its own consecutive pages, read in place: on a 2-core CPU 0.92x
d9de538's contiguous engine, where reading shared pages through a table was about 0.8x), each first
token drawn from the prefill's logits with its own key: `Engine.insert_group` (one call) when G
slots are free, else `Engine.fork` + `insert` one at a time (the prompt's pages held until its last
completion is placed). Nothing waits on the device until a `generate` call ends. The serving
engine's prefix cache stays off: the weights change every step.

Over several devices the engine runs over this process's devices of the training mesh (Engine(mesh=...):
the weights as the trainer placed them for it, by sharding.SERVE_RULES; the pool's heads split), or
with grpo.engine_devices = n over the last n devices, the trainer's mesh over the rest (split_devices). Over
several processes (a multi-host job) each process rolls out its own prompts with its own engine, on
weights gathered whole onto it (LocalWeights); the update runs over the global mesh.

Keys: completion n (prompt n // G's) decodes with Rows.of(..., seed=s, stream=n), the key
fold_in(key(s), n) that `generate(rng=key(s))` gives its row n, so the tokens are those of
grpo_task.sample_groups(..., rng=jax.random.key(s)) (up to float rounding of the other shapes: the
engine prefills one prompt at a time, padded to its bucket).

Shape letters: N completions (prompts x G), G group size, B slots, C decode steps a generate call.
"""

from __future__ import annotations

import collections
import contextlib
import copy
from concurrent.futures import ThreadPoolExecutor

import jax
from jax.experimental import multihost_utils

from flaxgpt import sharding
from flaxgpt.decode.sampling import Rows, Sampling
from flaxgpt.models import gpt, lora
from flaxgpt.serve.engine import Engine
from flaxgpt.train.grpo_task import Completion

# decode steps a generate call at most: a whole completion where it fits (one host round trip; the
# loop stops early when every slot is done), as generate's chunk; a freed slot waits out the call
CHUNK = 256
PAGE = 16  # positions a page of the engine's pool


def engine_devices(devices, process: int | None = None) -> list:
    """The devices the engine decodes on: those of the training mesh's `devices` that this process
    (or `process`) holds. Several processes: each rolls out its own prompts on its own devices, and
    the update runs over them all."""
    process = jax.process_index() if process is None else process
    return [d for d in devices if d.process_index == process]


def split_devices(devices, engine: int) -> tuple[list, list]:
    """(the trainer's devices, the engine's) for grpo.engine_devices = `engine` > 0: the engine takes
    the last `engine` of `devices`, the trainer's mesh the rest (Rollouts.reserve; flaxgpt aot)."""
    devices = list(devices)
    if not 0 < engine < len(devices):
        raise ValueError(
            f"grpo.engine_devices={engine} leaves the trainer none of the run's {len(devices)} devices: "
            f"set it below {len(devices)} (0: the engine shares the trainer's)"
        )
    return devices[:-engine], devices[-engine:]


class LocalWeights:
    """The weights a rollout reads, whole on this process. Over several processes the trainer's arrays
    span devices this process cannot address, and the trainer runs under the global mesh: `scope`
    gathers each leaf (multihost_utils.process_allgather: an all-gather, then a host copy, every
    rollout; the frozen weights once a run) onto this process's devices and runs the rollout under a
    mesh of them, so the engine's and generate's new arrays stay here too. One process: unchanged."""

    def __init__(self):
        self.frozen = None  # the local copy of the run's frozen weights (never trained: one serves)
        self.mesh = None  # this process's devices, (data 1, fsdp n)

    @contextlib.contextmanager
    def scope(self, params, frozen):
        """with local.scope(params, frozen) as (params, frozen): the rollout, on this process's copies."""
        if jax.process_count() == 1:
            yield params, frozen
            return
        local = self._local(params), self.frozen_of(frozen)
        with jax.set_mesh(self.mesh):
            yield local

    def frozen_of(self, frozen):
        if jax.process_count() == 1:
            return frozen
        if self.frozen is None:
            self.frozen = self._local(frozen)
        return self.frozen

    def _local(self, tree):
        if self.mesh is None:
            self.mesh = sharding.make_mesh(1, -1, jax.local_devices())
        whole = sharding.replicated(self.mesh)

        def one(x):
            if not isinstance(x, jax.Array) or x.is_fully_addressable:
                return x
            return jax.device_put(multihost_utils.process_allgather(x, tiled=True), whole)

        return jax.tree.map(one, tree)


def merged(policy, merge_lora: bool) -> bool:
    """Whether a run's rollouts decode LoRA's adapters merged into the base (grpo.merge_lora, where
    the policy's merge is exact to rounding: train.policy.LoraPolicy.merges): once a step, W + s A B,
    instead of x A B added to every product of every decoded token (a 4 x 256 Llama, LoRA r 16 on
    all 7 projections, 32 rows: the rollout 1.04x on a 2-core CPU, where the large products and the
    cache's reads dominate; on a GPU, launch-bound, 14 small products a layer and token fewer). What
    the trainer, generate and flaxgpt aot's rollout programs follow."""
    return getattr(policy, "lora", None) is not None and merge_lora and policy.merges()


def decoder_step(config: gpt.GPTConfig, lora_spec: lora.LoraSpec | None, weights):
    """The decoders' step_fn a rollout samples from, the engine's and generate's alike: over params
    (lora_spec None: a full policy, or LoRA merged into its base, `merged`), or over LoRA's
    (base, adapters) unmerged."""
    if lora_spec is None:
        return gpt.step_fn(config, weights)
    base, adapters = weights
    return lora.step_fn(config, lora_spec, base, adapters)


def check_over_devices(processes: int, off_policy_steps: int) -> None:
    """Over several processes, the rollouts run in step with the update (LocalWeights' gathers are
    collectives every process makes in the same order); off-policy rollouts on a thread: one line."""
    if processes > 1 and off_policy_steps:
        raise ValueError(
            f"grpo.off_policy_steps={off_policy_steps} samples on a rollout thread of one process; this run "
            f"has {processes} processes: set grpo.off_policy_steps=0 (each process then rolls out its "
            "own prompts in step with the update)"
        )


class EngineRollouts:
    """A serving engine kept for a run's rollouts; see the module docstring."""

    def __init__(
        self,
        model_config: gpt.GPTConfig,
        sampling: Sampling,
        *,
        max_new_tokens: int,
        slots: int,
        max_len: int,
        lora_spec: lora.LoraSpec | None = None,
        chunk: int | None = None,
        mesh=None,
        logprobs: bool = False,
    ):
        self.config, self.sampling, self.lora = model_config, sampling, lora_spec
        self.logprobs = logprobs  # each completion's tokens' log-probs kept (Completion.logp)
        self.mesh = mesh  # several devices: Engine(mesh=...), weights placed by SERVE_RULES on it
        self.max_new, self.slots, self.max_len = int(max_new_tokens), slots, max_len
        self.chunk = chunk or min(self.max_new, CHUNK)
        # as generate: greedy rows take the argmax alone, sampled ones the top 256 candidates
        self.max_k = 0 if sampling.temperature == 0 else 256
        self.engine: Engine | None = None  # built at the first call, with its first weights

    def step_fn(self, weights):
        """The decoders' step_fn over these weights (`decoder_step`)."""
        return decoder_step(self.config, self.lora, weights)

    def engine_for(self, weights) -> Engine:
        """The run's engine (built at the first call) with these weights."""
        step_fn = self.step_fn(weights)
        if self.engine is None:
            # whole pages (positions past max_len are never written); no prefix cache: the weights
            # change every step, and a block's keys and values with them; a spare window of pages for
            # the prompt held while its completions are forked
            W = -(-self.max_len // PAGE) * PAGE
            self.engine = Engine(
                step_fn, self.config, slots=self.slots, max_len=W, chunk=self.chunk, max_k=self.max_k,
                page=PAGE, spare_pages=W // PAGE, mesh=self.mesh, slot_windows=True,
            )  # fmt: skip
        self.engine.step_fn = step_fn  # a jit argument: this step's weights, no recompile
        return self.engine

    def rows_for(self, n: int, seed: int, turn: int = 0, max_new: int | None = None) -> Rows:
        """Completion n's settings and key: (seed, stream n); an episode's later turns (grpo_episodes)
        draw from streams of their own, n + turn * 2**24, with the budget left (max_new)."""
        stream = n + (turn << 24)  # a u32: completions < 2**24 a step, turns < 256
        want = 0 if self.logprobs else -1  # the sampled token's log-prob, no alternatives
        max_new = max_new or self.max_new
        return Rows.of(self.sampling, max_new_tokens=max_new, seed=seed, stream=stream, logprobs=want)

    def replica(self, mesh, slots: int) -> EngineRollouts:
        """This engine's settings over `mesh` with `slots` slots, its own engine (Replicas')."""
        other = copy.copy(self)
        other.mesh, other.slots, other.engine = mesh, slots, None
        return other

    def shares(self, weights, n_prompts: int, play) -> list:
        """[play(self, weights, 0, n_prompts)]: the step's prompts as one share (Replicas.shares' k)."""
        return [play(self, weights, 0, n_prompts)]

    def sample(self, weights, prompt_ids, group_size: int, *, seed: int, stream0: int = 0):
        """(prompts, completion ids): N = prompts x G token lists, prompt-major (completion n is prompt
        n // G's; its key's stream stream0 + n: Replicas' share of a step starts at `stream0`), each
        ending with the EOS id when it stopped there (grpo_task.sample_groups'); with
        `logprobs` each a Completion carrying its tokens' log-probs under `weights` (the engine's, of the
        model's logits as token_logprobs gives them: softmax(logits / temperature)'s at temperature 1)."""
        engine, G = self.engine_for(weights), int(group_size)
        N = len(prompt_ids) * G
        firsts, rest = [None] * N, [[] for _ in range(N)]  # first tokens stay on the device till the end
        first_lp, rest_lp = [None] * N, [[] for _ in range(N)]
        waiting = collections.deque(range(N))
        free = list(range(self.slots))[::-1]
        owner: dict[int, int] = {}  # slot -> the completion decoding there
        prefix = None  # the prefill of the prompt whose completions are being started
        while waiting or owner:
            while waiting and free:  # no host wait here: prefill, fork and insert queue on the device
                n = waiting[0]
                # the whole group: one prefill, one insert (the prompt's pages shared, its partial block
                # copied into each completion's own)
                if G > 1 and n % G == 0 and len(free) >= G:
                    group = [waiting.popleft() for _ in range(G)]
                    slots = [free.pop() for _ in range(G)]
                    rows = [self.rows_for(stream0 + m, seed) for m in group]
                    prefix = engine.prefill(prompt_ids[n // G], rows[0], hold=True)
                    first_G, lp_G = engine.insert_group(prefix, rows, slots)
                    firsts[n : n + G] = [(first_G, g) for g in range(G)]
                    if self.logprobs:  # drawn from the prompt's logits with them, on the device
                        first_lp[n : n + G] = [(lp_G.chosen, g) for g in range(G)]
                    owner.update(zip(slots, group, strict=True))
                    continue
                waiting.popleft()
                rows = self.rows_for(stream0 + n, seed)
                if n % G == 0:  # a prompt's first completion: its one prefill
                    prefix = engine.prefill(prompt_ids[n // G], rows, hold=G > 1)
                first = prefix if G == 1 else engine.fork(prefix, rows)  # as the prefill's draw with rows
                if G > 1 and n % G == G - 1:  # the group's last: the prompt's own pages go back
                    engine.drop(prefix)
                firsts[n] = first.first
                if self.logprobs:
                    first_lp[n] = first.logprobs.chosen  # the prefill's or fork's draw kept it
                slot = free.pop()  # one done at its first token (EOS) idles there one generate call
                engine.insert(first, slot)
                owner[slot] = n
            tokens_BC, new_B, done_B = engine.generate()
            for slot, n in list(owner.items()):
                rest[n] += tokens_BC[slot, : new_B[slot]].tolist()
                if self.logprobs:
                    rest_lp[n] += engine.logprobs.chosen[slot, : new_B[slot]].tolist()
                if done_B[slot]:  # its slot goes to the next completion waiting
                    free.append(slot)
                    del owner[slot]
        firsts, first_lp = _on_host(firsts), _on_host(first_lp) if self.logprobs else first_lp
        out = [[int(f), *r] for f, r in zip(firsts, rest, strict=True)]
        if self.logprobs:
            out = [Completion(c, logp=[f, *r]) for c, f, r in zip(out, first_lp, rest_lp, strict=True)]
        return [list(p) for p in prompt_ids for _ in range(G)], out


class Replicas:
    """grpo.engine_replicas = k > 1: k engines (EngineRollouts.replica), each a share of the step's
    prompts (whole groups, in order: the keys are one engine's, so are the tokens) and slots of its
    own, each driven by a thread of its own; replica i on device i mod n of the engine's n devices,
    with the whole weights there. For a small model whose decoding step leaves cores or devices idle:
    XLA:CPU runs a product of 32 rows on one thread, and runs programs called from several threads at
    once, so on one CPU device k replicas decode on k cores (reading the same weights); over GPUs that
    each hold the model, replicas avoid the per-layer waits of one engine with its heads split. `mesh`
    None: the weights come as the trainer holds them (grpo_online._engine_weights), put on each
    replica's device here (no copy where they lie; LoRA's frozen base, unmerged, copied once to a
    device that does not hold it whole)."""

    mesh = None

    def __init__(self, one: EngineRollouts, devices, k: int):
        devices = list(devices)
        self.shardings = {d: sharding.replicated(sharding.make_mesh(1, 1, [d])) for d in devices}
        self.where = [devices[i % len(devices)] for i in range(k)]  # replica i's device
        self.parts = [one.replica(self.shardings[d].mesh, -(-one.slots // k)) for d in self.where]
        self.bases = {}  # unmerged LoRA: the frozen base's copy on each device
        self.pool = ThreadPoolExecutor(k, thread_name_prefix="rollout-replica")

    def _placed(self, weights, device):
        """The weights on `device`: the parameters (merged or not) put there at every rollout;
        LoRA's frozen base (weights (base, adapters), unmerged) read where the trainer holds it whole
        (as one engine does), else copied there once."""
        if not isinstance(weights, tuple):
            return jax.device_put(weights, self.shardings[device])
        base, adapters = weights
        if _whole_on(base, device):  # this rollout's base, no copy: it is valid until the update
            return jax.device_put(weights, self.shardings[device])
        if device not in self.bases:  # a copy: the train step donates the trainer's
            self.bases[device] = jax.device_put(base, self.shardings[device], may_alias=False)
        return self.bases[device], jax.device_put(adapters, self.shardings[device])

    def shares(self, weights, n_prompts: int, play) -> list:
        """[play(replica, its weights, lo, hi)] over the k replicas, each on a thread of its own: replica
        i takes the step's prompts lo = i*n//k up to hi = (i+1)*n//k (whole groups, in order; its keys'
        streams start at lo * G) and `weights` placed on its device."""
        k = len(self.parts)
        bounds = [n_prompts * i // k for i in range(k + 1)]
        # each device's copy, put here: jax 0.10's device_put of an array that spans several devices
        # is not safe from two threads at once (its slow path's buffer list read as another's)
        placed = {d: self._placed(weights, d) for d in dict.fromkeys(self.where)}

        def share(i):
            return play(self.parts[i], placed[self.where[i]], bounds[i], bounds[i + 1])

        return list(self.pool.map(share, range(k)))

    def sample(self, weights, prompt_ids, group_size: int, *, seed: int):
        """EngineRollouts.sample's (prompts, completion ids), each replica its share (`shares`)."""

        def play(part, mine, lo, hi):
            if lo == hi:
                return [], []
            return part.sample(mine, prompt_ids[lo:hi], group_size, seed=seed, stream0=lo * group_size)

        shares = self.shares(weights, len(prompt_ids), play)
        return [p for s in shares for p in s[0]], [c for s in shares for c in s[1]]


def _whole_on(tree, device) -> bool:
    """Whether every array of `tree` is held whole on `device` (replicated there, or on it alone)."""
    arrays = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    return all(x.sharding.is_fully_replicated and device in x.devices() for x in arrays)


def _on_host(values) -> list:
    """Device scalars, or (array, index) pairs into a group's array, as host numbers: one wait."""
    host = jax.device_get([v[0] if isinstance(v, tuple) else v for v in values])
    return [h[v[1]] if isinstance(v, tuple) else h for h, v in zip(host, values, strict=True)]
