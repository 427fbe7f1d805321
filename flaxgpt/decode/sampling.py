"""Autoregressive sampling over a fixed-size KV cache.

    step = gpt.step_fn(config, params)      # any model's adapter: gpt.py provides the GPT's
    cache = KVCache.for_config(config, batch=B, max_len=cache_length(config.block_size, P, N))
    tokens_BN, lengths_B = generate(step, cache, prompt_BP, prompt_lengths_B, max_new_tokens=N,
                                    rng=jax.random.key(0), temperature=0.8, top_k=200)

`generate` knows nothing about the model beyond `step_fn(tokens_BT, positions_BT, cache) ->
(logits_BTV, cache)`, which must write the keys/values of `tokens` at `positions` into the cache
(nothing at positions >= cache.max_len) and attend to cache positions <= each query's own; the
prefill calls it with `logits_at=idx_B` (one time index per row) and reads logits [B, 1, V], so a
model can skip its head elsewhere, and need not write the padding after idx_B.
Prompts are right-padded and delimited by their lengths (never by a token id: GPT-2's token 0 is "!").

How it runs: one jitted prefill writes all prompts at once and samples each row's first token;
then a jitted `lax.while_loop` (`decode_chunk`, the serving engine's step too) decodes one token per
row per step at per-row positions, with per-row keys and settings (`Rows`: row b's token i is drawn
with fold_in(fold_in(rng, b), i)), `chunk` steps per call, with the whole state (cache included)
donated so the buffers are updated in place. Shapes depend only on (batch, prompt buffer, cache
length, chunk), never on `max_new_tokens` or the settings, so any length runs without
recompiling; `stream_generate` yields each chunk as it arrives (PAD past a row's new tokens).

Beyond the window (W = cache length, at most block_size): learned positions cannot slide, so
when a row has W tokens in its cache and must feed one more, its window is rebuilt from its
most recent `keep` tokens (default W // 2): the last keep-1 fed tokens are re-prefilled at
positions 0..keep-2 and the pending token is fed at keep-1. Equivalently, with n the row's
length so far and o the start of its context (o = 0 at first): whenever n - o > W, o = n - keep;
the next token is predicted from tokens[o:n] at positions 0..n-o-1. Half a window amortises one
re-prefill over W/2 tokens while keeping at least W/2 tokens of context; keep = W re-prefills
every step and equals nanoGPT's crop-to-the-last-W-tokens loop. Other rows in the batch feed
their window prefix in that pass at positions past the cache (W and on: a step_fn writes nothing
there), so a row's tokens do not depend on its neighbours.

On NVIDIA GPUs the token loop is compiled with XLA's command buffers over loops and conditionals
(GPU_LOOP_OPTIONS, `graphs=True`): the whole loop becomes one CUDA graph. Otherwise XLA evaluates a
while loop's condition on the host (a device-to-host copy and a wait every token) and launches each
token's few hundred small kernels one by one: at batch 1 the GPU waits on the host, not on memory.

Shape letters: B batch, P prompt buffer, T step length, W cache (window) length, V vocab,
C chunk, N new tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from flaxgpt.decode.logits import add_bias, adjust_logits, biased_rows
from flaxgpt.decode.sampler import (
    MAX_LOGPROBS,
    RowTests,
    check_sampling_args,
    greedy,
    select_rows,
    token_logprobs,
)

MAX_LOGIT_BIAS = 300  # logit_bias entries a request may carry: a static width of the settings


@struct.dataclass
class Sampling:
    """How a token is chosen from logits, with vLLM's definitions (applied in this order):
    logit_bias ((id, bias) pairs) added to the logits; repetition_penalty (1 = off) divides a positive
    logit and multiplies a negative one of every token in the prompt or the output so far;
    frequency_penalty (0 = off) subtracts itself times the token's count in the output,
    presence_penalty (0 = off) itself once if the token is in the output; then temperature
    (0 = greedy), min_p (0 = off: tokens below min_p times the top token's probability dropped),
    top_k (0 = off), top_p (1 = off). eos_id (None = none) ends a row. Static and hashable: part of
    a compiled decoder's key (speculative); the decode loop carries the same settings as per-row
    arrays (`Rows`), for generate and the engine. Penalties and logit_bias need the engine's token
    counts (serving); generate and speculative decoding take the first four fields."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    eos_id: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple = ()  # ((token id, bias), ...)


# ---------------------------------------------------------------- the decode loop (generate's, the engine's)

PAD = -1  # an output column a row did not fill (no token id is negative)


@struct.dataclass
class Rows:
    """Each row's decoding settings (a `Sampling`, its length, what it reports) as arrays [B], so one
    compiled program serves any values. Row b's token i is drawn with fold_in(key_B[b], i); generate
    gives row b the key fold_in(rng, b), and the serving engine a request's choice b
    fold_in(key(seed), b): the same tokens for the same seed."""

    key_B: jax.Array  # typed PRNG keys, or (seed, stream) pairs u32 [B, 2] of host rows (`of`, `keyed`)
    temperature_B: jax.Array  # f32, 0 = greedy
    top_k_B: jax.Array  # i32, 0 = off
    top_p_B: jax.Array  # f32 in (0, 1], 1 = off
    max_new_B: jax.Array  # i32 >= 1: new tokens at most
    eos_B: jax.Array  # i32, -1 = none
    min_p_B: jax.Array  # f32, 0 = off
    presence_B: jax.Array  # f32, 0 = off
    frequency_B: jax.Array  # f32, 0 = off
    repetition_B: jax.Array  # f32, 1 = off
    bias_ids_BL: jax.Array  # i32 [B, MAX_LOGIT_BIAS], -1 = unused
    bias_BL: jax.Array  # f32 [B, MAX_LOGIT_BIAS]
    logprobs_B: jax.Array  # i32: -1 = no logprobs, else the top alternatives wanted (0..MAX_LOGPROBS)

    @classmethod
    def same(cls, rng, batch: int, s: Sampling, max_new, logprobs: int = -1) -> Rows:
        """`batch` rows with the settings `s` and max_new; row b's key fold_in(rng, b)."""
        keys_B = jax.vmap(lambda b: jax.random.fold_in(rng, b))(jnp.arange(batch))
        return cls._filled(jnp, keys_B, s, max_new, logprobs)

    @classmethod
    def of(cls, s: Sampling | None = None, *, max_new_tokens, seed=0, stream=0, logprobs=-1) -> Rows:
        """One request's row on the host (the serving engine's, GRPO's): numpy values, so one compiled
        program serves any settings, its key given as (seed, stream) and made inside the program
        (`keyed`): fold_in(key(seed), stream), the key generate(rng=key(seed)) gives its row `stream`
        (the same tokens for the same seed). logprobs: -1 none, else the top alternatives wanted."""
        keys_B = np.array([[seed, stream]], np.uint32)
        return cls._filled(np, keys_B, s or Sampling(), max_new_tokens, -1 if logprobs is None else logprobs)

    @classmethod
    def _filled(cls, xp, key_B, s: Sampling, max_new, logprobs: int) -> Rows:
        """Rows with these keys (one per row) and every row the settings `s`, as `xp` arrays (jax.numpy
        inside a program, numpy on the host)."""
        B = key_B.shape[0]
        full = lambda x, dtype: xp.full((B,), x, dtype)  # noqa: E731
        ids_L, bias_L = bias_arrays(s.logit_bias)
        return cls(
            key_B=key_B,
            temperature_B=full(s.temperature, xp.float32),
            top_k_B=full(s.top_k, xp.int32),
            top_p_B=full(s.top_p, xp.float32),
            max_new_B=full(max_new, xp.int32),
            eos_B=full(-1 if s.eos_id is None else s.eos_id, xp.int32),
            min_p_B=full(s.min_p, xp.float32),
            presence_B=full(s.presence_penalty, xp.float32),
            frequency_B=full(s.frequency_penalty, xp.float32),
            repetition_B=full(s.repetition_penalty, xp.float32),
            bias_ids_BL=xp.broadcast_to(ids_L, (B, MAX_LOGIT_BIAS)),
            bias_BL=xp.broadcast_to(bias_L, (B, MAX_LOGIT_BIAS)),
            logprobs_B=full(logprobs, xp.int32),
        )

    def keyed(self) -> Rows:
        """These rows with typed keys: (seed, stream) pairs (`of`) made into fold_in(key(seed), stream)."""
        if jax.dtypes.issubdtype(self.key_B.dtype, jax.dtypes.prng_key):
            return self
        key = lambda pair: jax.random.fold_in(jax.random.key(pair[0]), pair[1])  # noqa: E731
        return self.replace(key_B=jax.vmap(key)(jnp.asarray(self.key_B)))

    @property
    def penalized(self) -> bool:
        """Some row's draws depend on the tokens seen so far (the engine then tracks its prompt's tokens);
        host rows only."""
        return bool(np.any((self.repetition_B != 1) | (self.presence_B != 0) | (self.frequency_B != 0)))

    @staticmethod
    def stack(rows: list[Rows]) -> Rows:
        """Host rows, one after another, as the rows of one batch."""
        return jax.tree_util.tree_map(lambda *x: np.concatenate(x), *rows)


def bias_arrays(logit_bias) -> tuple[np.ndarray, np.ndarray]:
    """((id, bias), ...) -> (ids [MAX_LOGIT_BIAS] i32 with -1 past the last, biases [MAX_LOGIT_BIAS] f32)."""
    if len(logit_bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
    ids_L = np.full(MAX_LOGIT_BIAS, -1, np.int32)
    bias_L = np.zeros(MAX_LOGIT_BIAS, np.float32)
    for i, (t, b) in enumerate(logit_bias):
        ids_L[i], bias_L[i] = t, b
    return ids_L, bias_L


def next_tokens(rows: Rows, count_B, logits_BV, max_k: int = 256, runs=None):
    """Row b's token number count_B[b] (0 = the prefill's), drawn with fold_in(key_B[b], count_B[b]).
    max_k 0: every row is greedy (generate knows it when it traces): the argmax alone, without the
    keys, the filters' conditionals and the float32 copy of the logits a mixed batch needs. runs:
    sampler.branches' answer for these rows (`RowTests`), if known."""
    if max_k == 0:
        return greedy(logits_BV)
    keys_B = jax.vmap(jax.random.fold_in)(rows.key_B, count_B)
    return select_rows(
        keys_B, logits_BV, rows.temperature_B, rows.top_k_B, rows.top_p_B, min_p_B=rows.min_p_B, max_k=max_k,
        runs=runs,
    )  # fmt: skip


def finished(rows: Rows, tok_B, count_B):
    """The stop rules: a row ends after its EOS (included) or its max_new-th token."""
    return (tok_B == rows.eos_B) | (count_B >= rows.max_new_B)


@struct.dataclass
class DecodeState:
    """Every row's decoding state (row b of each array is row b of the cache)."""

    cache: object  # whatever the step_fn reads and writes (models.cache: any kind)
    last_B: jax.Array  # the latest sampled token, not yet fed; it goes at position fill_B
    fill_B: jax.Array  # tokens written in the cache
    count_B: jax.Array  # new tokens produced so far (also the next token's key index)
    done_B: jax.Array  # finished (or, in the engine, a free slot): idles, its outputs dropped
    rows: Rows
    window_BW: jax.Array | None = None  # tokens at each cache position (to re-prefill from); None: no slide
    # the engine's, for penalties (None in generate): each token's count in a row's output, and the
    # tokens of its prompt or output
    counts_BV: jax.Array | None = None
    seen_BV: jax.Array | None = None


def _slide(step_fn, keep: int, state: DecodeState, overflow_B):
    """Rows with a full window restart it from their last `keep` tokens (see module docstring)."""
    W = state.window_BW.shape[1]
    recent_BW = jnp.concatenate([state.window_BW[:, W - keep + 1 :], state.window_BW[:, keep - 1 :]], 1)
    window_BW = jnp.where(overflow_B[:, None], recent_BW, state.window_BW)
    cache = state.cache
    if keep > 1:
        # overflowing rows re-write positions 0..keep-2 from their window; the others feed theirs
        # past the cache (positions >= W), where nothing is written: their caches stay as they were
        positions_BT = jnp.arange(keep - 1, dtype=jnp.int32) + jnp.where(overflow_B, 0, W)[:, None]
        _, cache = step_fn(window_BW[:, : keep - 1], positions_BT, cache)
    fill_B = jnp.where(overflow_B, keep - 1, state.fill_B)
    return state.replace(cache=cache, window_BW=window_BW, fill_B=fill_B)


# XLA's command buffer kinds (debug option xla_gpu_enable_command_buffer) with loops and conditionals
# added to its defaults; an option of the GPU compiler only: CPU and TPU programs ignore it
GPU_LOOP_OPTIONS = {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"
}


def _overflowing(state: DecodeState, W: int) -> jax.Array:
    """Rows still decoding whose window is full: they must slide before feeding another token."""
    return ~state.done_B & (state.fill_B >= W)


def feed(step_fn, state: DecodeState):
    """Every row's pending token through the model -> (raw logits_BV, the cache with it written, pos_B)."""
    W = state.cache.max_len
    pos_B = jnp.minimum(state.fill_B, W - 1)  # finished rows idle at a valid position
    logits_B1V, cache = step_fn(state.last_B[:, None], pos_B[:, None], state.cache)
    return logits_B1V[:, -1], cache, pos_B


def take(
    state: DecodeState, raw_BV, cache, pos_B, mask_BW, max_k: int, keep: int, logprobs: bool,
    tests: RowTests | None = None,
):  # fmt: skip
    """The next token of every unfinished row from `feed`'s logits, and the state after it
    -> (state, tok_B with PAD for finished rows, Logprobs-like tuple (empty unless `logprobs`)).
    tests: `RowTests.of(state.rows)` computed outside a token loop (None: here)."""
    rows_B = jnp.arange(raw_BV.shape[0])
    active_B = ~state.done_B
    biased, runs = (None, None) if tests is None else (tests.biased, tests.runs)
    if max_k == 0 and state.counts_BV is None and mask_BW is None:
        # greedy rows, at most a logit_bias: the bias's conditional ends in the argmax, so its skip
        # branch returns the tokens where it copied the logits (a GPU kernel a token, and another for
        # the float32 logits the argmax's own pass then reads)
        argmax = lambda x: greedy(add_bias(state.rows, x.astype(jnp.float32)))  # noqa: E731
        tok_B = jax.lax.cond(biased_rows(state.rows, raw_BV.shape[1], biased), argmax, greedy, raw_BV)
    else:
        adjusted_BV = adjust_logits(state.rows, raw_BV, state.counts_BV, state.seen_BV, mask_BW, biased)
        tok_B = next_tokens(state.rows, state.count_B, adjusted_BV, max_k, runs)
    count_B = state.count_B + active_B
    if keep:  # a select over the row, not a scatter: XLA's scatter costs a bounds check and a slice (kernels)
        at_BW = jnp.arange(state.window_BW.shape[1]) == pos_B[:, None]
        state = state.replace(window_BW=jnp.where(at_BW, state.last_B[:, None], state.window_BW))
    if state.counts_BV is not None:
        state = state.replace(
            counts_BV=state.counts_BV.at[rows_B, tok_B].add(active_B.astype(state.counts_BV.dtype)),
            seen_BV=state.seen_BV.at[rows_B, tok_B].max(active_B),
        )
    lp = ()
    if logprobs:
        lp = token_logprobs(raw_BV, tok_B, jnp.where(active_B, state.rows.logprobs_B, -1))
    state = state.replace(
        cache=cache,
        last_B=jnp.where(active_B, tok_B, state.last_B),
        fill_B=state.fill_B + active_B,
        count_B=count_B,
        done_B=state.done_B | (active_B & finished(state.rows, tok_B, count_B)),
    )
    return state, jnp.where(active_B, tok_B, PAD), lp


def _decode_chunk(
    step_fn, state: DecodeState, stop_B, chunk: int, keep: int = 0, max_k: int = 256, logprobs: bool = False
):
    """Up to `chunk` steps of one token per unfinished row -> (state, tokens_BC, PAD where a row made
    none), and with `logprobs` a third output (logprob_BC, top_ids_BCK, top_logprob_BCK: token_logprobs'
    of each step, zeros for rows that did not ask). stop_B: rows to stop now (the engine's released
    slots). keep: with state.window_BW, a row whose window is full restarts it from its last `keep`
    tokens (generate); 0: rows never slide (the engine: every request fits its window). The one
    decode step of `generate` and the serving engine (whose structured-output step runs `feed` and
    `take` as two programs, the host computing the bitmask in between).

    Full rows slide first (`_slide`), and the chunk ends early when another row's window fills: the
    slide is never a conditional inside the token loop, where it made XLA keep a copy of every
    layer's cache and copy it back after each token's cache write (on an H100, 24 copies of the
    whole cache and 25 extra kernels per GPT-2 token)."""
    B = state.last_B.shape[0]
    W = state.cache.max_len
    state = state.replace(done_B=state.done_B | stop_B)
    if keep:
        slide = functools.partial(_slide, step_fn, keep)
        overflow_B = _overflowing(state, W)
        state = jax.lax.cond(jnp.any(overflow_B), slide, lambda s, _: s, state, overflow_B)

    def cond(carry):
        state, _, _, j = carry
        go_on = (j < chunk) & jnp.any(~state.done_B)
        return go_on & ~jnp.any(_overflowing(state, W)) if keep else go_on

    tests = RowTests.of(state.rows)  # the rows' settings never change in the loop: its tests are taken here

    def body(carry):
        state, out_BC, lp_out, j = carry
        raw_BV, cache, pos_B = feed(step_fn, state)
        state, tok_B, lp = take(state, raw_BV, cache, pos_B, None, max_k, keep, logprobs, tests)

        def put(x_BC, x):  # column j (0 <= j < chunk) in place: .at[:, j] adds a kernel wrapping negative j
            return jax.lax.dynamic_update_slice_in_dim(x_BC, x[:, None].astype(x_BC.dtype), j, 1)

        lp_out = tuple(put(x_BC, x) for x_BC, x in zip(lp_out, lp))
        return state, put(out_BC, tok_B), lp_out, j + 1

    out_BC = jnp.full((B, chunk), PAD, jnp.int32)
    K = MAX_LOGPROBS
    lp_out = (
        (jnp.zeros((B, chunk), jnp.float32), jnp.zeros((B, chunk, K), jnp.int32),
         jnp.zeros((B, chunk, K), jnp.float32))
        if logprobs else ()
    )  # fmt: skip
    state, out_BC, lp_out, _ = jax.lax.while_loop(cond, body, (state, out_BC, lp_out, jnp.int32(0)))
    return (state, out_BC, lp_out) if logprobs else (state, out_BC)


_jit_chunk = functools.partial(
    jax.jit, static_argnames=("chunk", "keep", "max_k", "logprobs"), donate_argnames=("state",)
)
# decode_chunk: the token loop as one CUDA graph on NVIDIA GPUs; decode_chunk_plain without
# GPU_LOOP_OPTIONS (the same program elsewhere)
decode_chunk = _jit_chunk(_decode_chunk, compiler_options=GPU_LOOP_OPTIONS)
decode_chunk_plain = _jit_chunk(_decode_chunk)


@functools.partial(jax.jit, static_argnames=("max_k",), donate_argnames=("cache",))
def _prefill(step_fn, cache, prompt_BP, lengths_B, rows: Rows, max_k: int = 256):
    B, P = prompt_BP.shape
    positions_BP = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    logits_B1V, cache = step_fn(prompt_BP, positions_BP, cache, logits_at=lengths_B - 1)
    first_B = next_tokens(rows, jnp.zeros((B,), jnp.int32), logits_B1V[:, 0], max_k)
    count_B = jnp.ones((B,), jnp.int32)
    state = DecodeState(
        cache=cache,
        last_B=first_B,
        fill_B=lengths_B,
        count_B=count_B,
        done_B=finished(rows, first_B, count_B),
        rows=rows,
        window_BW=jnp.zeros((B, cache.max_len), jnp.int32).at[:, :P].set(prompt_BP),
    )
    return state, first_B


# ---------------------------------------------------------------- public entry points


def stream_generate(
    step_fn,
    cache,
    prompt_BP,
    prompt_lengths_B,
    *,
    max_new_tokens: int,
    rng,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    keep: int | None = None,
    chunk: int = 64,
    graphs: bool = True,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield (tokens_BC, counts_B) as they are decoded: row b's next counts[b] tokens.

    prompt_BP: right-padded prompts, prompt_lengths_B: their lengths (1..P). cache: an empty
    cache (any models.cache kind for the GPT: anything with `max_len` and `batch` that step_fn
    accepts) whose length W (<= the model's block_size) is the context window; it is donated (do
    not reuse it). temperature 0 is greedy; top_k 0 and top_p 1 disable those filters. A row stops
    after eos_id (included in its output) or max_new_tokens. keep: tokens kept when a row's
    window fills (default W // 2; see the module docstring). chunk: decode steps per call.
    graphs: on NVIDIA GPUs, the token loop as one CUDA graph (GPU_LOOP_OPTIONS; see the module docstring).
    """
    check_sampling_args(temperature, top_k, top_p)
    prompt_BP = jnp.asarray(prompt_BP, jnp.int32)
    lengths = np.asarray(prompt_lengths_B, np.int32)
    B, P = prompt_BP.shape
    W = cache.max_len
    keep = W // 2 if keep is None else keep
    if cache.batch != B or lengths.shape != (B,):
        raise ValueError(f"batch mismatch: prompts {B}, lengths {lengths.shape}, cache {cache.batch}")
    if P > W:
        raise ValueError(
            f"prompt buffer {P} is longer than the cache {W}; crop prompts to the last "
            f"{W} tokens or allocate a longer cache (at most block_size)"
        )
    if lengths.min() < 1 or lengths.max() > P:
        raise ValueError(
            f"prompt lengths must be in [1, {P}], got {lengths.tolist()}; "
            "start an empty prompt from an end-of-text token"
        )
    if not 1 <= keep <= W:
        raise ValueError(f"keep must be in [1, {W}] (the cache length), got {keep}")
    if max_new_tokens < 1:
        return
    sampling = Sampling(float(temperature), int(top_k), float(top_p), eos_id)
    step_fn = step_fn if isinstance(step_fn, jax.tree_util.Partial) else jax.tree_util.Partial(step_fn)
    rows = _same_rows(rng, B, sampling, max_new_tokens)
    max_k = 0 if sampling.temperature == 0 else 256  # greedy: the argmax alone (next_tokens)
    state, first_B = _prefill(step_fn, cache, prompt_BP, jnp.asarray(lengths), rows, max_k=max_k)
    yield np.asarray(first_B)[:, None], np.ones(B, np.int32)
    count, go_on_B = np.ones(B, np.int32), np.zeros(B, bool)
    while not bool(np.all(state.done_B)):
        run = decode_chunk if graphs else decode_chunk_plain
        state, out_BC = run(step_fn, state, go_on_B, chunk, keep, max_k)
        new_count = np.asarray(state.count_B)
        yield np.asarray(out_BC), new_count - count
        count = new_count


_same_rows = jax.jit(Rows.same, static_argnums=1)  # the settings traced: one compile per batch


def generate(
    step_fn, cache, prompt_BP, prompt_lengths_B, *, max_new_tokens: int, chunk: int = 256, **options
):
    """Sample up to max_new_tokens after each prompt -> (tokens_BN [int32], lengths_B).

    The chunks of `stream_generate` (same arguments; rng, temperature, top_k, top_p, eos_id, keep
    in `options`) collected: row b's tokens are tokens_BN[b, :lengths_B[b]], 0 after.
    """
    B = np.shape(prompt_lengths_B)[0]
    tokens_BN = np.zeros((B, max(max_new_tokens, 0)), np.int32)
    lengths_B = np.zeros(B, np.int32)
    chunks = stream_generate(
        step_fn, cache, prompt_BP, prompt_lengths_B, max_new_tokens=max_new_tokens, chunk=chunk, **options
    )
    for out_BC, n_B in chunks:
        for b in range(B):
            tokens_BN[b, lengths_B[b] : lengths_B[b] + n_B[b]] = out_BC[b, : n_B[b]]
        lengths_B += n_B
    return tokens_BN, lengths_B


def cache_length(block_size: int, prompt_len: int, max_new_tokens: int, multiple: int = 64) -> int:
    """Cache length for a request: prompt + new tokens rounded up to `multiple`, at most block_size."""
    need = prompt_len + max_new_tokens
    return min(block_size, -(-need // multiple) * multiple)
