"""The serving engine: continuous batching over one fixed-size KV cache of `slots` rows.

    engine = Engine(gpt_step_fn(config, params), lambda b: KVCache.for_config(config, b, W), slots=8)
    prefix = engine.prefill(prompt_ids, RowSampling.of(Sampling(temperature=0.8), max_new_tokens=64, seed=7))
    engine.insert(prefix, slot=3)              # the request now owns row 3 of the cache
    job = engine.start_prefill(prompt_ids, rows)   # or in chunks: prefill_step until it is done
    while (prefix := engine.prefill_step(job)) is None: ...   # (decode steps may run in between)
    tokens_BC, new_B, done_B = engine.generate()   # up to `chunk` tokens for every busy slot
    engine.insert(engine.fork(prefix, other_rows), slot=5)     # the same prompt for another request
    first_R = engine.insert_group(prefix, [rows_a, rows_b], [6, 7])   # or several in one call

The interface is JetStream's (prefill, insert into a slot, generate for all slots); the scheduler
(flaxgpt/serve/scheduler.py) decides who goes where and when. Like `sampling.generate`, the engine sees
the model only as `step_fn(tokens_BT, positions_BT, cache) -> (logits_BTV, cache)`, with the
prefill asking for the logits of the prompt's last position only (`logits_at`).

A request is prefilled alone into a one-row cache, in calls of at most `prefill_chunk` prompt
tokens (each right-padded to the smallest prompt bucket that holds it, at positions offset by the
tokens before it), so a scheduler can run a long prompt's chunks between decode steps
(start_prefill, then prefill_step until it returns the Prefix); then its row is copied into the
slots cache. With a prefix cache (flaxgpt/serve/prefix_cache.py) the one-row cache starts with the
KV of the longest cached block prefix of the prompt and only the rest is prefilled; the prompt's
full blocks are kept for later requests, and when a request ends (`keep`) the full blocks of its
prompt and reply, read from its slot: a conversation's next turn reuses its whole history.
Between `generate` calls the other slots keep their rows.

The paged engine (slots_cache a models.paged.PagedKVCache, serve.py --kv_cache paged): the slots and
the prefix cache share the cache's one page pool, cached prefixes are mapped into block tables in place
and prefills write straight into the pool; its host side is serve/paged_slots.py (PagedSlots).
Every slot decodes at its own position with its own sampling settings and key, all as arrays of
the one jitted step, so requests come and go without recompiling: the step is `generate`'s own
(decode.sampling.decode_chunk: per-row keys, stop rules and padding in one place). Free and
finished slots idle (they feed their last token at their last position and their outputs are
dropped). A request must fit its window: prompt + max_new_tokens <= W.

Exactness: a row's computation depends only on that row (per-row positions, keys, settings; no
cross-row reductions), and a position's keys and values only on the tokens up to it, so a request
decodes the tokens `generate` gives it alone with the same cache length, key and settings, however
its prompt was split into chunks or taken from the prefix cache (up to float rounding of matmuls
of other shapes).

Many LoRA adapters (models.multi_lora): the caches are AdapterCaches, whose rows carry their adapter
slot; `start_prefill(..., adapter=slot)` tags a request's one-row cache and `insert` copies the tag
with its keys and values, so rows of different adapters decode in one step. The stacked adapter
weights are step_fn's (a Partial's) arguments: an adapter swapped into a slot (serve.adapters; its
write, from serve.launch) replaces `engine.step_fn` with one over the written stack (same shapes: no
recompile). The prefix cache is off (its blocks know no adapter).

Compiled programs: one prefill per prompt bucket, one insert, generate for `chunk` steps and for
one step (+ the contiguous engine's prefix cache: its restore, and its save from a one-row cache and
from the slots cache): len(buckets) + 3 (+ 3; the paged engine's prefix cache is host bookkeeping).

Shape letters: B slots, P prompt bucket, W cache length, V vocab, C chunk, K sampling candidates.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flaxgpt import sharding
from flaxgpt.decode.sampling import (
    GPU_LOOP_OPTIONS,
    DecodeState,
    Rows,
    Sampling,
    decode_chunk,
    finished,
    next_tokens,
)
from flaxgpt.models.cache import AdapterCache
from flaxgpt.models.paged import PagedKVCache
from flaxgpt.serve.paged_slots import PagedSlots
from flaxgpt.serve.prefix_cache import PrefixCache, block_digests


class RowSampling(NamedTuple):
    """One request's decoding settings (a decode.sampling.Sampling, its length, its key) as arrays:
    the same compiled program serves any values."""

    seed: np.ndarray  # u32; token i is drawn with fold_in(fold_in(key(seed), stream), i)
    stream: np.ndarray  # i32: the row of `generate`'s batch this request matches (choice index)
    temperature: np.ndarray  # f32, 0 = greedy
    top_k: np.ndarray  # i32, 0 = off
    top_p: np.ndarray  # f32 in (0, 1], 1 = off
    max_new: np.ndarray  # i32 >= 1
    eos: np.ndarray  # i32, -1 = none

    @classmethod
    def of(cls, sampling: Sampling | None = None, *, max_new_tokens, seed=0, stream=0):
        s = sampling or Sampling()
        return cls(
            seed=np.uint32(seed),
            stream=np.int32(stream),
            temperature=np.float32(s.temperature),
            top_k=np.int32(s.top_k),
            top_p=np.float32(s.top_p),
            max_new=np.int32(max_new_tokens),
            eos=np.int32(-1 if s.eos_id is None else s.eos_id),
        )

    def device_rows(self) -> Rows:
        """This request as one row of the decode loop's settings (traced): key fold_in(key(seed), stream),
        the key `generate(rng=key(seed))` gives its row `stream`."""
        one = lambda x: jnp.reshape(jnp.asarray(x), (1,))  # noqa: E731
        key = jax.random.fold_in(jax.random.key(self.seed), self.stream)
        return Rows(
            key_B=jnp.reshape(key, (1,)),
            temperature_B=one(self.temperature),
            top_k_B=one(self.top_k),
            top_p_B=one(self.top_p),
            max_new_B=one(self.max_new),
            eos_B=one(self.eos),
        )


class Prefix(NamedTuple):
    """A prefilled request, ready to insert: its one-row cache, first token and settings."""

    cache: object  # batch 1
    first: jax.Array  # [] the first new token
    length: jax.Array  # [] prompt length
    done: jax.Array  # [] the first token already finished it (EOS, or max_new 1)
    rows: Rows  # each field [1]
    logits: jax.Array  # [V] the prompt's last position's: `fork` draws another request's first token
    pages: object = None  # paged engine: the host table [M] of the pages it was prefilled into


def _prefill_body(step_fn, cache, chunk_1P, start, size, rows: RowSampling, max_k: int) -> Prefix:
    """Prompt positions start .. start + size - 1 (chunk_1P right-padded to its bucket P) into a
    one-row cache already holding positions < start; the token after the chunk is sampled."""
    P = chunk_1P.shape[1]
    # pads past the window write nothing (a scatter drops out-of-range positions); pads inside it
    # are overwritten by the next chunk or by decoding before any query can see them
    positions_1P = start + jnp.arange(P, dtype=jnp.int32)[None]
    logits_11V, cache = step_fn(chunk_1P, positions_1P, cache, logits_at=jnp.reshape(size - 1, (1,)))
    rows_1 = rows.device_rows()
    first_1 = next_tokens(rows_1, jnp.zeros((1,), jnp.int32), logits_11V[:, 0], max_k)
    done_1 = finished(rows_1, first_1, jnp.ones((1,), jnp.int32))
    return Prefix(cache, first_1[0], start + size, done_1[0], rows_1, logits_11V[0, 0])


@functools.partial(jax.jit, static_argnames=("max_k",))
def _fork(logits_V, rows: RowSampling, max_k: int):
    """(first, done, rows) of another request on the same prompt: its first token from the logits."""
    rows_1 = rows.device_rows()
    first_1 = next_tokens(rows_1, jnp.zeros((1,), jnp.int32), logits_V[None], max_k)
    return first_1[0], finished(rows_1, first_1, jnp.ones((1,), jnp.int32))[0], rows_1


_prefill = jax.jit(_prefill_body, static_argnames=("max_k",), donate_argnames=("cache",))


@functools.partial(jax.jit, donate_argnames=("state",))
def _insert(state: DecodeState, prefix: Prefix, slot) -> DecodeState:
    def put(x_B, v):
        return x_B.at[slot].set(jnp.reshape(v, ()))

    return state.replace(  # any cache kind copies a one-row cache in; the paged engine's is in place
        cache=state.cache if prefix.cache is None else state.cache.insert_row(prefix.cache, slot),
        last_B=put(state.last_B, prefix.first),
        fill_B=put(state.fill_B, prefix.length),
        count_B=put(state.count_B, 1),
        done_B=put(state.done_B, prefix.done),
        rows=jax.tree_util.tree_map(put, state.rows, prefix.rows),
    )


@functools.partial(jax.jit, static_argnames=("max_k",), donate_argnames=("state",))
def _insert_group(state: DecodeState, prefix: Prefix, rows: RowSampling, slots_R, max_k: int):
    """The prefilled prompt into slots slots_R [R], request r with the settings rows[r] (fields [R]):
    each first token drawn from the prefill's logits, as fork's."""
    R = slots_R.shape[0]
    rows_R = jax.tree_util.tree_map(lambda x: x[:, 0], jax.vmap(RowSampling.device_rows)(rows))
    logits_RV = jnp.broadcast_to(prefix.logits, (R, prefix.logits.shape[-1]))
    first_R = next_tokens(rows_R, jnp.zeros((R,), jnp.int32), logits_RV, max_k)
    cache = state.cache
    for r in range(R):  # R copies of the one row (R is the group size: small, static)
        cache = cache.insert_row(prefix.cache, slots_R[r])
    put = lambda x_B, v_R: x_B.at[slots_R].set(v_R)  # noqa: E731
    state = state.replace(
        cache=cache,
        last_B=put(state.last_B, first_R),
        fill_B=put(state.fill_B, jnp.full((R,), prefix.length)),
        count_B=put(state.count_B, jnp.ones((R,), jnp.int32)),
        done_B=put(state.done_B, finished(rows_R, first_R, jnp.ones((R,), jnp.int32))),
        rows=jax.tree_util.tree_map(put, state.rows, rows_R),
    )
    return state, first_R


def programs(mesh=None):
    """(prefill, insert, generate) jitted: the functions above and the decode loop's step
    (decode.sampling.decode_chunk), or for `mesh` the same traced under it (sharding.under_mesh with
    SERVE_RULES: kernels chosen for its devices)."""
    if mesh is None:
        return _prefill, _insert, decode_chunk
    under = lambda f: sharding.under_mesh(f.__wrapped__, mesh, sharding.SERVE_RULES)  # noqa: E731
    return tuple(
        jax.jit(under(f), static_argnames=static, donate_argnames=donated, compiler_options=options)
        for f, static, donated, options in (
            (_prefill, ("max_k",), ("cache",), None),
            (_insert, (), ("state",), None),
            (decode_chunk, ("chunk", "keep", "max_k"), ("state",), GPU_LOOP_OPTIONS),
        )
    )


def prompt_buckets(max_len: int, smallest: int = 16) -> tuple[int, ...]:
    """Powers of two from `smallest` and the midpoints between them (16, 24, 32, 48, 64, 96, ...)
    up to max_len, and max_len itself."""
    # prefill is compute-bound: with midpoints a prompt is padded by under a third (powers of two
    # alone: up to half), for two compiled programs per doubling
    out, b = [], smallest
    while b < max_len:
        out += [b] + ([b * 3 // 2] if b * 3 // 2 < max_len else [])
        b *= 2
    return (*out, max_len)


def empty_slots(cache, slots: int) -> DecodeState:
    """The state of `slots` free slots over an empty slots cache (batch `slots`)."""
    zeros = lambda dtype: jnp.zeros((slots,), dtype)  # noqa: E731
    return DecodeState(
        cache=cache,
        last_B=zeros(jnp.int32),
        fill_B=zeros(jnp.int32),
        count_B=zeros(jnp.int32),
        done_B=jnp.ones((slots,), bool),  # every slot starts free
        rows=Rows.same(jax.random.key(0), slots, Sampling(), 1),
    )


def _placed(make_cache, mesh, batch: int):
    cache = make_cache(batch)
    return jax.device_put(cache, sharding.row_shardings(cache, mesh))


class PrefillJob:
    """A request being prefilled (host side): its one-row cache and how far the prompt has gone in."""

    def __init__(self, prompt_ids, rows: RowSampling, cache, hit: int, digests, pages=None):
        self.prompt_ids, self.rows, self.cache = list(prompt_ids), rows, cache
        self.pages = pages  # paged engine: its table [M] (serve/paged_slots.py); cache is then None
        self.hit = hit  # prompt tokens whose KV came from the prefix cache
        self.done_upto = hit  # positions < done_upto are in `cache`
        self.digests = digests  # the prompt's block digests (prefix cache), else None

    @property
    def left(self) -> int:
        return len(self.prompt_ids) - self.done_upto


class Engine:
    """prefill / insert / generate over one slots cache; see the module docstring."""

    def __init__(
        self,
        step_fn,
        make_cache,
        *,
        slots: int,
        chunk: int = 4,
        max_k: int = 256,
        buckets=None,
        prefill_chunk: int | None = None,
        prefix_block: int = 16,
        prefix_blocks: int = 0,
        mesh=None,
        slots_cache=None,
    ):
        """make_cache(batch) -> an empty cache (all with the same length W, the request window).
        prefill_chunk: the most prompt tokens one prefill call runs (default W: a prompt in one
        call); prefix_blocks: the prefix cache's capacity in blocks of prefix_block positions (0: off);
        slots_cache: the slots cache if not make_cache(slots); a models.paged.PagedKVCache makes this a
        paged engine (serve/paged_slots.py): its pool is shared with the prefix cache (blocks are its
        pages: prefix_block must be its page size, and it needs 1 + slots * M + prefix_blocks pages).
        mesh: run over its devices: the programs traced under it, every cache and slot array split
        by rows (sharding.row_shardings: slots; a one-row cache's heads); the weights stay where
        step_fn's params are (sharding.param_shardings(..., SERVE_RULES) on it). None: one device."""
        if slots < 1 or chunk < 1:
            raise ValueError(f"slots and chunk must be >= 1, got slots {slots} chunk {chunk}")
        Partial = jax.tree_util.Partial  # a jit argument (params traced, not baked in)
        self.step_fn = step_fn if isinstance(step_fn, Partial) else Partial(step_fn)
        if mesh is not None:
            make_cache = functools.partial(_placed, make_cache, mesh)
        self.make_cache, self.slots, self.chunk, self.max_k = make_cache, slots, chunk, max_k
        self._prefill, self._insert, self._generate = programs(mesh)
        cache = make_cache(slots) if slots_cache is None else slots_cache
        if cache.batch != slots or cache.max_len != jax.eval_shape(lambda: make_cache(1)).max_len:
            raise ValueError(f"the slots cache holds {cache.batch} x {cache.max_len}, not {slots} slots")
        self.max_len = cache.max_len
        self.prefill_chunk = min(prefill_chunk or self.max_len, self.max_len)
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.buckets = tuple(buckets or prompt_buckets(self.prefill_chunk))
        if max(self.buckets) != self.prefill_chunk:
            raise ValueError(f"the largest prompt bucket must be {self.prefill_chunk}: {self.buckets}")
        # every buffer committed to the device, as the programs' outputs are: an uncommitted
        # jnp.zeros cache in a prompt's first chunk and a committed one in its next are two jit
        # signatures, and the second would compile mid-serving (each bucket, insert, ...)
        # (over a mesh make_cache places, and so commits, every cache itself)
        device = jax.devices()[0]
        self._new_row = (  # noqa: E731
            (lambda: jax.device_put(make_cache(1), device)) if mesh is None else (lambda: make_cache(1))
        )
        self.prefix_cache = self.paged = None
        if isinstance(cache, PagedKVCache):
            self.paged = PagedSlots(
                cache, slots=slots, block=prefix_block, blocks=prefix_blocks, mesh=mesh, body=_prefill_body
            )
            self.prefix_cache, cache = self.paged.prefix_cache, self.paged.attach(cache)
            prefix_blocks = 0  # the pages' own prefix cache, set above
        if prefix_blocks and cache.has_rings:
            raise ValueError(
                "the prefix cache keeps every position's keys and values; this model's sliding-window "
                "layers keep only their window (ring buffers): serve it without a prefix cache"
            )
        if prefix_blocks and isinstance(cache, AdapterCache):
            # its blocks are keyed by tokens alone, and a row's keys and values depend on its adapter
            raise ValueError("the prefix cache does not tell adapters apart: serve adapters without it")
        if prefix_blocks:
            self.prefix_cache = PrefixCache(self._new_row(), block=prefix_block, capacity=prefix_blocks)
            if mesh is None:
                self.prefix_cache.pool = jax.device_put(self.prefix_cache.pool, device)
        self.state = empty_slots(cache, slots)
        self.state = jax.device_put(
            self.state, device if mesh is None else sharding.row_shardings(self.state, mesh)
        )
        self._count = np.zeros(slots, np.int32)
        self._stop = np.zeros(slots, bool)
        self._finished = np.ones(slots, bool)  # as the last generate said (free slots too)
        # read at /metrics scrapes from another thread: sizes now, not the (donated) buffers then
        self._slot_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(cache)) // slots

    @property
    def pages(self):
        """The paged engine's page pool bookkeeping (a serve.pages.SharedPages), else None."""
        return None if self.paged is None else self.paged.pages

    @property
    def n_programs(self) -> int:
        copies = 3 if self.prefix_cache is not None and self.paged is None else 0  # restore, 2 saves
        return len(self.buckets) + 2 + (self.chunk > 1) + copies

    def kv_memory(self) -> dict:
        """The KV cache's memory: bytes a slot's whole window takes, and the blocks (pages) of the
        page pool (paged: the slots' and the prefix cache's; contiguous: the prefix cache's) with
        those held by no one and those read by more than one holder (shared in place)."""
        if self.paged is not None:
            return self.paged.memory()
        out = {"bytes_per_slot": self._slot_bytes, "blocks": 0, "free_blocks": 0, "shared_blocks": 0}
        if self.prefix_cache is not None:
            out.update(blocks=self.prefix_cache.capacity, free_blocks=len(self.prefix_cache.free))
        return out

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if n <= b:
                return b
        raise ValueError(f"prompt of {n} tokens is longer than the context window of {self.max_len} tokens")

    def start_prefill(self, prompt_ids, rows: RowSampling, adapter: int = 0) -> PrefillJob:
        """Check the request and take its cached prefix (if any): run the rest with prefill_step.
        adapter: the adapter slot its rows decode with (caches of kind models.cache.AdapterCache;
        0: none), carried by its one-row cache into its slot."""
        n = len(prompt_ids)
        if n < 1:
            raise ValueError("the prompt is empty; start it with an end-of-text token")
        if n + int(rows.max_new) > self.max_len:
            raise ValueError(
                f"prompt ({n} tokens) + max_new_tokens ({int(rows.max_new)}) exceeds the context "
                f"window of {self.max_len} tokens"
            )
        if adapter:
            cache = self._new_row()
            if not isinstance(cache, AdapterCache):
                raise ValueError(
                    f"adapter slot {adapter}: this engine's caches carry no adapter (AdapterCache)"
                )
            tag_1 = jax.device_put(np.full((1,), adapter, np.int32), cache.adapter_B.sharding)
            return PrefillJob(prompt_ids, rows, cache.replace(adapter_B=tag_1), 0, None)
        if self.paged is not None:  # positions up to the request's last go into pages of its own
            hit, table_M, digests = self.paged.open(prompt_ids, n + int(rows.max_new) - 1, self._finished)
            return PrefillJob(prompt_ids, rows, None, hit, digests, pages=table_M)
        if self.prefix_cache is None:
            return PrefillJob(prompt_ids, rows, self._new_row(), 0, None)
        hit, ids_M, digests = self.prefix_cache.match(prompt_ids)
        return PrefillJob(prompt_ids, rows, self.prefix_cache.restore(ids_M), hit, digests)

    def prefill_step(self, job: PrefillJob) -> Prefix | None:
        """Run the next prefill_chunk prompt tokens of `job`: the Prefix after its last chunk, else None."""
        start, size = job.done_upto, min(job.left, self.prefill_chunk)
        chunk_1P = np.zeros((1, self.bucket(size)), np.int32)
        chunk_1P[0, :size] = job.prompt_ids[start : start + size]
        args = (chunk_1P, np.int32(start), np.int32(size), job.rows)
        if self.paged is not None:  # into the shared pool through the job's table
            self.state, prefix = self.paged.prefill(self.step_fn, self.state, job.pages, *args, self.max_k)
        else:
            prefix = self._prefill(self.step_fn, job.cache, *args, max_k=self.max_k)
            job.cache = prefix.cache
        job.done_upto = start + size
        if job.left:
            return None
        if self.paged is not None:
            return self.paged.prefilled(job, prefix)
        if self.prefix_cache is not None:
            self.prefix_cache.save(prefix.cache, job.digests, first=job.hit // self.prefix_cache.block)
        return prefix

    def cancel(self, job: PrefillJob):
        """Give back what a prefill job holds that never reached a slot (paged: its pages)."""
        if self.paged is not None:
            self.paged.cancel(job)

    def prefill(self, prompt_ids, rows: RowSampling, adapter: int = 0) -> Prefix:
        """Run the prompt through the model alone; the first new token is in `prefix.first`."""
        job = self.start_prefill(prompt_ids, rows, adapter)
        while (prefix := self.prefill_step(job)) is None:
            pass
        return prefix

    def fork(self, prefix: Prefix, rows: RowSampling) -> Prefix:
        """The prefilled prompt of `prefix` for another request (n completions of one prompt: GRPO's
        group) without a second prefill: the same one-row cache, its own settings and first token
        (drawn as a prefill with `rows` draws it). A prefix is not consumed by insert: both go in.
        rows.max_new must fit the window as the prefill's did (not checked here: no wait on the device).
        Contiguous caches only (a paged prefix's pages have one owner)."""
        if self.paged is not None:
            self.paged.refuse("fork")
        first, done, rows_1 = _fork(prefix.logits, rows, max_k=self.max_k)
        return prefix._replace(first=first, done=done, rows=rows_1)

    def insert_group(self, prefix: Prefix, rows: list[RowSampling], slots: list[int]) -> jax.Array:
        """fork + insert for several requests on one prompt in one call (GRPO's G completions): request
        r takes slot slots[r] with rows[r]. -> their first tokens [R] (on the device). One compiled
        program per group size; over a mesh use fork and insert."""
        if self.paged is not None:
            self.paged.refuse("insert_group")
        if len(rows) != len(slots) or not rows:
            raise ValueError(f"{len(rows)} requests for {len(slots)} slots")
        stacked = RowSampling(*(np.stack(f) for f in zip(*rows, strict=True)))
        self.state, first_R = _insert_group(
            self.state, prefix, stacked, np.asarray(slots, np.int32), max_k=self.max_k
        )
        self._count[slots] = 1
        self._stop[slots] = False
        self._finished[slots] = False
        return first_R

    def insert(self, prefix: Prefix, slot: int):
        """The prefilled request takes slot `slot` (its previous occupant is gone)."""
        if self.paged is not None:  # its pages become the slot's row; nothing moves on the device
            self.paged.assign(slot, prefix.pages)
        self.state = self._insert(self.state, prefix._replace(pages=None), np.int32(slot))
        self._count[slot] = 1
        self._stop[slot] = False
        self._finished[slot] = False

    def keep(self, slot: int, tokens) -> int:
        """Offer slot `slot`'s KV to the prefix cache once its request ends (before the slot is reused):
        `tokens` are the tokens at its positions 0.. (the prompt and every generated token but the
        last, which was never fed), so the next turn of a conversation, whose prompt holds this one's
        prompt and reply, reuses both. -> blocks newly kept (0 without a prefix cache)."""
        if self.paged is not None:
            return self.paged.keep(slot, tokens)
        if self.prefix_cache is None:
            return 0
        digests = block_digests(tokens, self.prefix_cache.block)[: self.prefix_cache.M]
        return self.prefix_cache.save(self.state.cache, digests, row=slot)  # any kind: read by cache.row

    def release(self, slot: int):
        """Stop decoding `slot` before its end (cancelled, or a stop string): from the next generate
        (paged: its pages are given back now, its row idles on the scratch page)."""
        self._stop[slot] = True
        if self.paged is not None:
            self.paged.end(slot)

    def generate(self, steps: int | None = None):
        """-> (tokens_BC, new_B, done_B): slot b's next new_B[b] tokens are tokens_BC[b, :new_B[b]].
        steps: `chunk` (default) or 1 (one token each: a scheduler with prompts still prefilling
        comes back to them after one step rather than `chunk`)."""
        steps = steps or self.chunk
        if steps not in (1, self.chunk):
            raise ValueError(f"generate runs 1 or chunk ({self.chunk}) steps, got {steps}")
        stop_B = self._stop.copy()
        if self.paged is not None:  # the block table as insert, keep and release left it
            self.state = self.paged.upload(self.state)
        self.state, out_BC = self._generate(self.step_fn, self.state, stop_B, chunk=steps, max_k=self.max_k)
        count = np.array(self.state.count_B)  # a writable copy
        new_B, self._count = count - self._count, count
        self._finished = np.array(self.state.done_B)
        return np.asarray(out_BC), new_B, self._finished.copy()
