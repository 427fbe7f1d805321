"""The model runner: the page pool and every slot's decoding state on the device, and the jitted programs
that advance them (vLLM v1's model runner). It decides nothing and allocates nothing: the engine hands
it block tables (serve/block_manager.py) and says which request goes where.

    runner = Runner(step_fn, pool, slots=8, chunk=4, max_k=256, mesh=None)
    prefix = runner.prefill(table_M, adapter, chunk_1P, start, size, rows)   # a prompt chunk, in place
    runner.insert(prefix, slot, table_M)      # the request's state into slot `slot`; its table is its row
    first_R, lp_R = runner.insert_group(prefix, rows_R, slots_R, tables_RM)   # several, one prefill
    runner.copy_pages(src, dst)               # a forked request's partial block
    tokens_BC, count_B, done_B = runner.generate(stop_B, steps)               # every slot, `steps` tokens

The pool is one `AdapterCache` over a `models.paged.PagedKVCache`: each row's adapter slot (0: the
base; a plain GPT's step ignores it) travels with its block table. A prefill writes a request's chunk
straight into the pool through a one-row view of it (the same pages, that request's table); `insert`
only sets the slot's row of the table and its decoding state: no keys or values move. The slots'
table is an argument of the compiled step, uploaded when the host's copy changed: nothing recompiles.

Over a mesh (serve.py --mesh N) the programs are traced under it (sharding.under_mesh with
SERVE_RULES: the weights' MLP and vocabulary split, placed by the caller) and the pool and per-slot
arrays placed by sharding.row_shardings: the pool's key/value heads split over the devices where they
divide (each device holds its heads of every page), the slots' arrays by slots. A mesh may span the
processes of a job (serve/replay.py): every process then runs every call, and what the host reads of
a program's outputs is gathered by all of them (`fetch`).

Compiled programs: one prefill per prompt bucket, insert, the page copy, generate for `chunk` steps
and for one step, and a structured-output step in two halves (feed, then take under the bitmask the
host computed meanwhile); an echo request's prefill per bucket on first use; with the mixed step
(serve/mixed.py) its `hold` and one step per width.

Shape letters: B slots, M pages per row, P prompt bucket, V vocab, C chunk, R requests of a group.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flaxgpt import sharding
from flaxgpt.decode.logits import adjust_logits
from flaxgpt.decode.sampler import greedy, token_logprobs
from flaxgpt.decode.sampling import (
    GPU_LOOP_OPTIONS,
    PAD,
    DecodeState,
    Rows,
    Sampling,
    decode_chunk,
    feed,
    finished,
    next_tokens,
    take,
)
from flaxgpt.models.cache import AdapterCache
from flaxgpt.serve.mixed import hold, mixed_step


class Logprobs(NamedTuple):
    """A token's float32 log-probability and its MAX_LOGPROBS most likely alternatives (sampling's
    token_logprobs), any leading shape."""

    chosen: jax.Array
    top_ids: jax.Array
    top: jax.Array


class Prefix(NamedTuple):
    """A prefilled request, ready to insert: its first token and settings (its keys and values are in
    the pool, in the pages of its block table, which the engine's block manager keeps as `owner`'s)."""

    first: jax.Array  # [] the first new token
    length: jax.Array  # [] prompt length
    done: jax.Array  # [] the first token already finished it (EOS, or max_new 1)
    rows: Rows  # each field [1]
    logits: jax.Array  # [V] the prompt's last position's: `fork` draws another request's first token
    adapter: jax.Array  # [] the adapter slot it decodes with (0: the base)
    seen: jax.Array  # [V] bool: the prompt's tokens (repetition penalty)
    logprobs: Logprobs  # the first token's ([], [K], [K])
    echo: Logprobs | None = None  # echo: each chunk position's next token's ([P], [P, K], [P, K])
    owner: object = None  # host: the block manager's key for its pages (None inside the programs)


def _first(rows_1: Rows, logits_1V, seen_1V, mask_1W, max_k: int):
    """The first new token of a request from its prompt's last logits -> (first_1, done_1, Logprobs)."""
    counts_1V = jnp.zeros(logits_1V.shape, jnp.int32)  # nothing generated yet: only repetition applies
    adjusted_1V = adjust_logits(rows_1, logits_1V, counts_1V, seen_1V, mask_1W)
    first_1 = next_tokens(rows_1, jnp.zeros((1,), jnp.int32), adjusted_1V, max_k)
    done_1 = finished(rows_1, first_1, jnp.ones((1,), jnp.int32))
    return first_1, done_1, Logprobs(*token_logprobs(logits_1V, first_1, rows_1.logprobs_B))


def _prefill(
    step_fn, state: DecodeState, table_1M, adapter, chunk_1P, start, size, rows: Rows, seen_1V,
    mask_1W, max_k: int, targets_1P=None,
):  # fmt: skip
    """Prompt positions start .. start + size - 1 (chunk_1P right-padded to its bucket P) of one request
    into the pool through its table (its positions < start already there); the token after the chunk is
    sampled (seen_1V: the prompt's tokens, mask_1W: its structured-output bitmask) -> (state with the
    pool written, Prefix). targets_1P (echo): the token after each chunk position, whose logprobs the
    Prefix then carries."""
    P = chunk_1P.shape[1]
    pool = state.cache
    row = AdapterCache(pool.inner.with_table(table_1M), jnp.reshape(adapter, (1,)))
    # pads past the request's pages land on the scratch page or past the window (dropped); pads inside
    # its pages are overwritten by the next chunk or by decoding before any query can see them
    positions_1P = start + jnp.arange(P, dtype=jnp.int32)[None]
    at = None if targets_1P is not None else jnp.reshape(size - 1, (1,))
    logits_1TV, row = step_fn(chunk_1P, positions_1P, row, logits_at=at)
    last_1V = logits_1TV[:, -1] if at is not None else jnp.take(logits_1TV, size - 1, axis=1)
    rows_1 = rows.keyed()
    first_1, done_1, lp = _first(rows_1, last_1V, seen_1V, mask_1W, max_k)
    echo = None
    if targets_1P is not None:
        echo = Logprobs(*token_logprobs(logits_1TV[0], targets_1P[0], jnp.zeros((P,), jnp.int32)))
    pool = pool.replace(inner=pool.inner.replace(k=row.inner.k, v=row.inner.v))
    prefix = Prefix(
        first_1[0], start + size, done_1[0], rows_1, last_1V[0], jnp.asarray(adapter, jnp.int32),
        seen_1V[0], jax.tree_util.tree_map(lambda x: x[0], lp), echo,
    )  # fmt: skip
    return state.replace(cache=pool), prefix


def _fork(logits_V, seen_V, rows: Rows, max_k: int):
    """(first, done, rows, logprobs) of another request on the same prompt: its first token from the
    logits."""
    rows_1 = rows.keyed()
    first_1, done_1, lp = _first(rows_1, logits_V[None], seen_V[None], None, max_k)
    return first_1[0], done_1[0], rows_1, jax.tree_util.tree_map(lambda x: x[0], lp)


def _insert(state: DecodeState, prefix: Prefix, slots_R, table_RM):
    """The prefilled request(s) into slots slots_R [R] (one prefix's first token, settings [R] each
    field): their tables become those rows of the pool's table, their state the slots'."""
    R = slots_R.shape[0]
    put = lambda x_B, v: x_B.at[slots_R].set(jnp.reshape(v, (R, *x_B.shape[1:])))  # noqa: E731
    cache = state.cache
    cache = cache.replace(
        inner=cache.inner.replace(table_BM=put(cache.inner.table_BM, table_RM)),
        adapter_B=put(cache.adapter_B, jnp.broadcast_to(prefix.adapter, (R,))),
    )
    V = state.counts_BV.shape[1]
    first_RV = jax.nn.one_hot(jnp.broadcast_to(prefix.first, (R,)), V, dtype=jnp.int32)
    return state.replace(
        cache=cache,
        last_B=put(state.last_B, prefix.first),
        fill_B=put(state.fill_B, jnp.broadcast_to(prefix.length, (R,))),
        count_B=put(state.count_B, jnp.ones((R,), jnp.int32)),
        done_B=put(state.done_B, prefix.done),
        rows=jax.tree_util.tree_map(put, state.rows, prefix.rows),
        counts_BV=put(state.counts_BV, first_RV),
        seen_BV=put(state.seen_BV, jnp.broadcast_to(prefix.seen, (R, V)) | first_RV.astype(bool)),
    )


def _insert_group(state: DecodeState, prefix: Prefix, rows: Rows, slots_R, table_RM, max_k: int):
    """R requests on one prefilled prompt into slots slots_R, request r with the settings rows[r]
    (fields [R]), each first token drawn from the prefill's logits as fork's -> (state, first_R,
    Logprobs of [R]: fork's, of the prompt's last logits)."""
    R = slots_R.shape[0]
    rows_R = rows.keyed()
    V = prefix.logits.shape[-1]
    logits_RV = adjust_logits(
        rows_R, jnp.broadcast_to(prefix.logits, (R, V)), jnp.zeros((R, V), jnp.int32),
        jnp.broadcast_to(prefix.seen, (R, V)),
    )  # fmt: skip
    first_R = next_tokens(rows_R, jnp.zeros((R,), jnp.int32), logits_RV, max_k)
    done_R = finished(rows_R, first_R, jnp.ones((R,), jnp.int32))
    group = prefix._replace(first=first_R, done=done_R, rows=rows_R)
    lp_R = Logprobs(*token_logprobs(jnp.broadcast_to(prefix.logits, (R, V)), first_R, rows_R.logprobs_B))
    return _insert(state, group, slots_R, table_RM), first_R, lp_R


def _copy_pages(state: DecodeState, src_R, dst_R):
    """Page dst_R[r] takes page src_R[r]'s keys and values, every layer (a forked prompt's partial block)."""
    inner = state.cache.inner
    move = lambda buf_JPpK: buf_JPpK.at[:, dst_R].set(buf_JPpK[:, src_R])  # noqa: E731
    inner = inner.replace(k=tuple(map(move, inner.k)), v=tuple(map(move, inner.v)))
    return state.replace(cache=state.cache.replace(inner=inner))


def _feed(step_fn, state: DecodeState, stop_B):
    """A structured-output step's first half: every row's pending token through the model (sampling's
    feed) -> (state with the cache written, raw logits_BV, pos_B). The host fills the bitmask meanwhile."""
    state = state.replace(done_B=state.done_B | stop_B)
    raw_BV, cache, pos_B = feed(step_fn, state)
    return state.replace(cache=cache), raw_BV, pos_B


def _take(state: DecodeState, raw_BV, pos_B, mask_BW, max_k: int):
    """Its second half: the tokens drawn under the bitmask (sampling's take) -> (state, tok_B1, Logprobs
    of [B, 1] ...), as generate's outputs for one step."""
    state, tok_B, lp = take(state, raw_BV, state.cache, pos_B, mask_BW, max_k, 0, True)
    return state, tok_B[:, None], tuple(x[:, None] for x in lp)


def _speculate(step_fn, state: DecodeState, stop_B, drafts_BK, n_B, max_k: int):
    """One step that also checks drafted tokens (speculative decoding, the drafts proposed on the host):
    every row feeds its pending token and its n_B[b] drafts (n_B <= K; 0: a plain decode step) in one
    model call of K + 1 positions; a draft is kept while it is the model's greedy choice there (rows
    draft only when greedy), then one more token is drawn as a plain step draws it, from the logits after
    the last kept draft. -> (state, tokens_BT with PAD past each row's new ones, Logprobs of its first
    column), every row 1 to n_B + 1 new tokens (fewer at its EOS or max_new). Positions a row fed past
    what it keeps hold keys it overwrites before any query reads them (they are past its length)."""
    state = state.replace(done_B=state.done_B | stop_B)
    B, K = drafts_BK.shape
    T = K + 1
    W = state.cache.max_len
    rows = state.rows
    active_B = ~state.done_B
    t_T = jnp.arange(T)
    tokens_BT = jnp.concatenate([state.last_B[:, None], drafts_BK], axis=1)
    fed_BT = (t_T <= n_B[:, None]) & active_B[:, None]
    # positions not fed go past the window, where nothing is written (an idle row's too)
    positions_BT = jnp.where(fed_BT, state.fill_B[:, None] + t_T, W + t_T)
    logits_BTV, cache = step_fn(tokens_BT, positions_BT, state.cache)
    ok_BK = (drafts_BK == greedy(logits_BTV[:, :K])) & (t_T[:K] < n_B[:, None])
    kept_B = jnp.sum(jnp.cumprod(ok_BK, axis=1), axis=1)  # the longest agreeing prefix
    raw_BV = jnp.take_along_axis(logits_BTV, kept_B[:, None, None], axis=1)[:, 0]
    adjusted_BV = adjust_logits(rows, raw_BV, state.counts_BV, state.seen_BV)
    extra_B = next_tokens(rows, state.count_B + kept_B, adjusted_BV, max_k)
    new_BT = jnp.where(t_T < kept_B[:, None], jnp.pad(drafts_BK, ((0, 0), (0, 1))), extra_B[:, None])
    # each row's new tokens end at its EOS (included) or its max_new
    eos_BT = (new_BT == rows.eos_B[:, None]) & (t_T <= kept_B[:, None])
    upto_eos_B = jnp.where(jnp.any(eos_BT, axis=1), jnp.argmax(eos_BT, axis=1) + 1, T)
    n_new_B = jnp.minimum(jnp.minimum(kept_B + 1, upto_eos_B), rows.max_new_B - state.count_B)
    n_new_B = jnp.where(active_B, n_new_B, 0)
    out_BT = jnp.where(t_T < n_new_B[:, None], new_BT, PAD)
    count_B = state.count_B + n_new_B
    b_B = jnp.arange(B)
    last_B = jnp.where(active_B, new_BT[b_B, jnp.maximum(n_new_B - 1, 0)], state.last_B)
    got_BT = (t_T < n_new_B[:, None]).astype(state.counts_BV.dtype)
    counts_BV = state.counts_BV.at[b_B[:, None], jnp.where(got_BT > 0, new_BT, 0)].add(got_BT)
    seen_BV = state.seen_BV.at[b_B[:, None], jnp.where(got_BT > 0, new_BT, 0)].max(got_BT > 0)
    lp = token_logprobs(raw_BV, extra_B, jnp.where(active_B, rows.logprobs_B, -1))
    ended_B = jnp.any(eos_BT & (t_T < n_new_B[:, None]), axis=1) | (count_B >= rows.max_new_B)
    state = state.replace(
        cache=cache, last_B=last_B, fill_B=state.fill_B + n_new_B, count_B=count_B,
        done_B=state.done_B | (active_B & ended_B), counts_BV=counts_BV, seen_BV=seen_BV,
    )  # fmt: skip
    # the extra token's logprobs in the first column (rows that ask for logprobs draft nothing)
    lp = tuple(jnp.pad(x[:, None], ((0, 0), (0, K)) + ((0, 0),) * (x.ndim - 1)) for x in lp)
    return state, out_BT, lp


def _sync(state: DecodeState, last_B, fill_B, done_B):
    """A draft model's state at the target's place (copies: the target's buffers are donated later)."""
    return state.replace(
        last_B=last_B + 0, fill_B=fill_B + 0, done_B=done_B | False, count_B=state.count_B * 0
    )


_PROGRAMS = (  # (function, static arguments, donated arguments, compiler options)
    (_prefill, ("max_k",), ("state",), None),
    (_insert, (), ("state",), None),
    (_insert_group, ("max_k",), ("state",), None),
    (_copy_pages, (), ("state",), None),
    (_fork, ("max_k",), (), None),
    (_feed, (), ("state",), None),
    (_take, ("max_k",), ("state",), None),
    (_speculate, ("max_k",), ("state",), None),
    (_sync, (), ("state",), None),
    (hold, (), ("state",), None),  # the mixed step's (serve/mixed.py)
    (mixed_step, ("max_k",), ("state",), None),
)


@functools.cache
def programs(mesh=None) -> dict:
    """The runner's jitted programs by name (and `generate`: decode.sampling.decode_chunk), traced under
    `mesh` (sharding.under_mesh with SERVE_RULES: kernels chosen for its devices) when one is given."""
    out = {}
    for f, static, donated, options in _PROGRAMS:
        g = f if mesh is None else sharding.under_mesh(f, mesh, sharding.SERVE_RULES)
        out[f.__name__.lstrip("_").removesuffix("_step")] = jax.jit(
            g, static_argnames=static, donate_argnames=donated, compiler_options=options
        )
    out["generate"] = decode_chunk if mesh is None else jax.jit(
        sharding.under_mesh(decode_chunk.__wrapped__, mesh, sharding.SERVE_RULES),
        static_argnames=("chunk", "keep", "max_k", "logprobs"), donate_argnames=("state",),
        compiler_options=GPU_LOOP_OPTIONS,
    )  # fmt: skip
    return out


def fetch(x) -> np.ndarray:
    """A program's output on the host. Over a mesh across processes an array split over their devices
    is gathered (process_allgather: a collective, so every process fetches the same outputs, as the
    replaying processes of serve/replay.py do); elsewhere np.asarray."""
    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _put_global(tree, shardings):
    """device_put over a mesh across processes: from host values (every process has the same), a typed
    PRNG key through its key data (a process's own arrays cannot go to another's devices)."""

    def put(x, where):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(put(jax.random.key_data(x), where), impl=jax.random.key_impl(x))
        return jax.device_put(np.asarray(x), where)

    return jax.tree.map(put, tree, shardings)


def empty_state(pool: AdapterCache, slots: int, vocab: int) -> DecodeState:
    """`slots` free slots over the pool (every row on the scratch page, the base adapter)."""
    zeros = lambda dtype: jnp.zeros((slots,), dtype)  # noqa: E731
    return DecodeState(
        cache=pool,
        last_B=zeros(jnp.int32),
        fill_B=zeros(jnp.int32),
        count_B=zeros(jnp.int32),
        done_B=jnp.ones((slots,), bool),  # every slot starts free
        rows=Rows.same(jax.random.key(0), slots, Sampling(), 1),
        counts_BV=jnp.zeros((slots, vocab), jnp.int32),
        seen_BV=jnp.zeros((slots, vocab), bool),
    )


class Runner:
    """The device side of the engine; see the module docstring."""

    def __init__(
        self, step_fn, pool: AdapterCache, *, slots: int, chunk: int, max_k: int, vocab: int, mesh=None
    ):
        """pool: an AdapterCache over a PagedKVCache whose table has `slots` rows (all scratch, or the
        slots' own windows); vocab: the model's logits' width."""
        Partial = jax.tree_util.Partial  # a jit argument (params traced, not baked in)
        self.step_fn = step_fn if isinstance(step_fn, Partial) else Partial(step_fn)
        self.slots, self.chunk, self.max_k, self.mesh, self.vocab = slots, chunk, max_k, mesh, vocab
        self.mask_words = -(-vocab // 32)  # a structured-output bitmask's int32 words per row
        self.p = programs(mesh)
        state = empty_state(pool, slots, vocab)
        # every buffer committed to its devices, as the programs' outputs are: an uncommitted one in a
        # first call and a committed one in the next are two jit signatures (a compile mid-serving)
        where = jax.local_devices()[0] if mesh is None else sharding.row_shardings(state, mesh)
        self.state = jax.device_put(state, where) if jax.process_count() == 1 else _put_global(state, where)
        self._table = np.array(pool.inner.table_BM, np.int32)  # what the slots' table should be
        self._stale = False  # the device's table differs from it (rows set by `idle` since the last upload)
        # read at /metrics scrapes from another thread: sizes now, not the (donated) buffers then
        inner = pool.inner
        self.page_bytes = sum(x.nbytes for x in (*inner.k, *inner.v)) // inner.k[0].shape[1]

    def prefill(
        self, table_M, adapter: int, chunk_1P, start: int, size: int, rows: Rows, seen_V=None,
        mask_W=None, targets_P=None,
    ) -> Prefix:  # fmt: skip
        """seen_V: the prompt's tokens (bool [V]; None: none, for a request without penalties); mask_W:
        the first token's bitmask (None: any token); targets_P (echo): the token after each position."""
        seen_1V = np.zeros((1, self.vocab), bool) if seen_V is None else np.asarray(seen_V)[None]
        mask_1W = np.full((1, self.mask_words), -1, np.int32) if mask_W is None else np.asarray(mask_W)[None]
        targets = None if targets_P is None else np.asarray(targets_P, np.int32)[None]
        self.state, prefix = self.p["prefill"](
            self.step_fn, self.state, np.asarray(table_M, np.int32)[None], np.int32(adapter), chunk_1P,
            np.int32(start), np.int32(size), rows, seen_1V, mask_1W, max_k=self.max_k, targets_1P=targets,
        )  # fmt: skip
        if self.mesh is not None and jax.process_count() > 1:  # what the host reads, read by every process
            lp, echo = Logprobs(*map(fetch, prefix.logprobs)), prefix.echo
            echo = None if echo is None else Logprobs(*map(fetch, echo))
            prefix = prefix._replace(logprobs=lp, echo=echo)
        return prefix

    def fork(self, prefix: Prefix, rows: Rows) -> Prefix:
        first, done, rows_1, lp = self.p["fork"](prefix.logits, prefix.seen, rows, max_k=self.max_k)
        return prefix._replace(first=first, done=done, rows=rows_1, logprobs=lp)

    def insert(self, prefix: Prefix, slot: int, table_M):
        self.state = self.p["insert"](
            self.state, prefix._replace(owner=None, echo=None), np.asarray([slot], np.int32),
            np.asarray(table_M)[None],
        )  # fmt: skip
        self._table[slot] = table_M

    def insert_group(self, prefix: Prefix, rows: list[Rows], slots: list[int], tables_RM):
        stacked = Rows.stack(rows)
        self.state, first_R, lp_R = self.p["insert_group"](
            self.state, prefix._replace(owner=None, echo=None), stacked, np.asarray(slots, np.int32),
            np.asarray(tables_RM, np.int32), max_k=self.max_k,
        )  # fmt: skip
        self._table[slots] = tables_RM
        return first_R, lp_R

    def copy_pages(self, src: list[int], dst: list[int]):
        """Page dst[r] takes page src[r]'s contents; padded to a power of two with scratch-to-scratch
        copies (page 0: nobody reads it), so a few programs serve every count."""
        if src:
            n = 1 << (len(src) - 1).bit_length()
            pad = [0] * (n - len(src))
            self.state = self.p["copy_pages"](
                self.state, np.asarray(src + pad, np.int32), np.asarray(dst + pad, np.int32)
            )

    def idle(self, slot: int, table_M):
        """Slot `slot`'s row of the table, set on the host (its request ended: the scratch page); uploaded
        with the next generate."""
        self._table[slot] = table_M
        self._stale = True

    def _upload_table(self):
        if self._stale:  # a copy: the host's table changes in place while the step may still run
            cache = self.state.cache
            table = jax.device_put(np.array(self._table), cache.inner.table_BM.sharding)
            self.state = self.state.replace(cache=cache.replace(inner=cache.inner.replace(table_BM=table)))
            self._stale = False

    def _host(self, tokens, lp):
        """A step's outputs on the host: (tokens, count_B, done_B, Logprobs)."""
        count_B, done_B = fetch(self.state.count_B).copy(), fetch(self.state.done_B).copy()
        return fetch(tokens), count_B, done_B, Logprobs(*(fetch(x) for x in lp))

    def generate(self, stop_B, steps: int):
        """`steps` decode steps for every slot -> (tokens_BC, count_B, done_B, Logprobs of [B, C] ...)
        on the host."""
        self._upload_table()
        self.state, out_BC, lp = self.p["generate"](
            self.step_fn, self.state, stop_B, chunk=steps, max_k=self.max_k, logprobs=True
        )
        return self._host(out_BC, lp)

    def speculate(self, stop_B, drafts_BK, n_B):
        """One step checking n_B[b] drafted tokens drafts_BK[b] per slot (_speculate) -> generate's
        outputs, tokens_BT of K + 1 columns."""
        self._upload_table()
        self.state, out_BT, lp = self.p["speculate"](
            self.step_fn, self.state, stop_B, np.asarray(drafts_BK, np.int32), np.asarray(n_B, np.int32),
            max_k=self.max_k,
        )  # fmt: skip
        return self._host(out_BT, lp)

    def hold(self, slot: int, table_M, adapter: int, rows: Rows, seen_V, start: int):
        """Slot `slot` taken by a prefilling request (serve/mixed.py hold); seen_V as prefill's."""
        seen_V = np.zeros(self.vocab, bool) if seen_V is None else seen_V
        self.state = self.p["hold"](
            self.state, np.asarray([slot], np.int32), np.asarray(table_M, np.int32)[None], np.int32(adapter),
            rows, np.asarray(seen_V)[None], np.int32(start),
        )  # fmt: skip
        self._table[slot] = table_M

    def mixed(self, stop_B, forced_BT, n_B, ends_B):
        """One mixed step (serve/mixed.py mixed_step) -> generate's outputs for one step."""
        self._upload_table()
        self.state, out_B1, lp = self.p["mixed"](
            self.step_fn, self.state, stop_B, np.asarray(forced_BT, np.int32), np.asarray(n_B, np.int32),
            np.asarray(ends_B, bool), max_k=self.max_k,
        )  # fmt: skip
        return self._host(out_B1, lp)

    def sync(self, last_B, fill_B, done_B):
        """A draft model's slots set to where the target's are (its pending token, its length, which
        slots run): the target kept some of the draft's tokens and added its own."""
        self.state = self.p["sync"](self.state, last_B, fill_B, done_B)

    def generate_masked(self, stop_B, fill_mask):
        """One step under a structured-output bitmask, as generate(steps=1): the model runs (dispatched,
        not waited for) while `fill_mask()` computes the int32 bitmask [B, W] on the host, then the
        tokens are drawn under it. The mask's host work overlaps the device's forward pass (vLLM's
        order: the grammar's bitmask is built while the model runs and applied to its logits)."""
        self._upload_table()
        self.state, raw_BV, pos_B = self.p["feed"](self.step_fn, self.state, stop_B)
        mask_BW = fill_mask()
        self.state, out_B1, lp = self.p["take"](self.state, raw_BV, pos_B, mask_BW, max_k=self.max_k)
        return self._host(out_B1, lp)
