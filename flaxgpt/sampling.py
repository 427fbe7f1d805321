"""Autoregressive sampling over a fixed-size KV cache.

    step = gpt_step_fn(config, params)
    cache = KVCache.for_config(config, batch=B, max_len=cache_length(config.block_size, P, N))
    tokens_BN, lengths_B = generate(step, cache, prompt_BP, prompt_lengths_B, max_new_tokens=N,
                                    rng=jax.random.key(0), temperature=0.8, top_k=200)

`generate` knows nothing about the model beyond `step_fn(tokens_BT, positions_BT, cache) ->
(logits_BTV, cache)`, which must write the keys/values of `tokens` at `positions` into the cache
and attend to cache positions <= each query's own. Prompts are right-padded and delimited by
their lengths (never by a token id: GPT-2's token 0 is "!").

How it runs: one jitted prefill writes all prompts at once and samples each row's first token;
then a jitted `lax.while_loop` decodes one token per row per step at per-row positions, `chunk`
steps per call, with the whole state (cache included) donated so the buffers are updated in
place. Shapes depend only on (batch, prompt buffer, cache length, chunk), never on
`max_new_tokens`, so any length runs without recompiling; `stream_generate` yields each chunk
as it arrives.

Beyond the window (W = cache length, at most block_size): learned positions cannot slide, so
when a row has W tokens in its cache and must feed one more, its window is rebuilt from its
most recent `keep` tokens (default W // 2): the last keep-1 fed tokens are re-prefilled at
positions 0..keep-2 and the pending token is fed at keep-1. Equivalently, with n the row's
length so far and o the start of its context (o = 0 at first): whenever n - o > W, o = n - keep;
the next token is predicted from tokens[o:n] at positions 0..n-o-1. Half a window amortises one
re-prefill over W/2 tokens while keeping at least W/2 tokens of context; keep = W re-prefills
every step and equals nanoGPT's crop-to-the-last-W-tokens loop. Other rows in the batch feed
their own unchanged window prefix in that pass (rewriting equal keys/values), so a row's
tokens do not depend on its neighbours.

Shape letters: B batch, P prompt buffer, T step length, W cache (window) length, V vocab,
C chunk, N new tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from flaxgpt.cache import KVCache

# ---------------------------------------------------------------- selection (pure functions)


def top_k_mask(logits_BV: jax.Array, k: int) -> jax.Array:
    """-inf everywhere but the k largest logits of each row (ties with the k-th are kept)."""
    if k <= 0 or k >= logits_BV.shape[-1]:
        return logits_BV
    kth_B1 = jax.lax.top_k(logits_BV, k)[0][..., -1:]
    return jnp.where(logits_BV >= kth_B1, logits_BV, -jnp.inf)


def top_p_mask(logits_BV: jax.Array, p: float, *, is_sorted: bool = False) -> jax.Array:
    """Nucleus: keep the smallest set of largest logits whose probability reaches p.

    A token is kept when the probability of the tokens strictly above it is < p, so the most
    likely token always survives; ties with the last kept logit are kept too.
    """
    if p >= 1.0:
        return logits_BV
    logits_BV = logits_BV.astype(jnp.float32)
    sorted_BV = logits_BV if is_sorted else -jnp.sort(-logits_BV, axis=-1)  # descending
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    above_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    n_keep_B1 = jnp.sum(above_BV < p, axis=-1, keepdims=True)  # >= 1
    threshold_B1 = jnp.take_along_axis(sorted_BV, n_keep_B1 - 1, axis=-1)
    return jnp.where(logits_BV >= threshold_B1, logits_BV, -jnp.inf)


def sample_logits(rng, logits_BV, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """One token per row: greedy when temperature == 0, else temperature, then top-k, then top-p.

    With top_k the nucleus and the draw work on the k sorted candidates only, so the full
    vocabulary is touched once (by lax.top_k) rather than sorted.
    """
    logits_BV = logits_BV.astype(jnp.float32)  # fp32: bf16 logits lose the tail
    if temperature == 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits_BV = logits_BV / temperature
    if 0 < top_k < logits_BV.shape[-1]:
        vals_BK, idx_BK = jax.lax.top_k(logits_BV, top_k)
        vals_BK = top_p_mask(vals_BK, top_p, is_sorted=True)
        choice_B = jax.random.categorical(rng, vals_BK, axis=-1)
        return jnp.take_along_axis(idx_BK, choice_B[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jax.random.categorical(rng, top_p_mask(logits_BV, top_p), axis=-1).astype(jnp.int32)


def check_sampling_args(temperature: float, top_k: int, top_p: float):
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}; 1 disables nucleus sampling")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = no top-k), got {top_k}")


# ---------------------------------------------------------------- the decode state and loop


@struct.dataclass
class DecodeState:
    cache: KVCache
    window_BW: jax.Array  # tokens at each cache position (to re-prefill from)
    fill_B: jax.Array  # tokens written in the cache; the pending token goes at this position
    last_B: jax.Array  # the latest sampled token, not yet fed
    count_B: jax.Array  # new tokens produced so far
    done_B: jax.Array  # hit EOS or max_new_tokens
    step: jax.Array  # scalar: selection steps taken (folds into the rng)
    rng: jax.Array


@struct.dataclass
class Sampling:
    """Static selection settings (hashable: part of the compiled function's key)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    eos_id: int | None = None


def _select(s: Sampling, rng, step, logits_BV):
    return sample_logits(
        jax.random.fold_in(rng, step), logits_BV, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p
    )


def _is_eos(s: Sampling, tok_B):
    return jnp.zeros(tok_B.shape, bool) if s.eos_id is None else tok_B == s.eos_id


@functools.partial(jax.jit, static_argnames=("sampling",), donate_argnames=("cache",))
def _prefill(step_fn, cache, prompt_BP, lengths_B, rng, max_new_tokens, sampling: Sampling):
    B, P = prompt_BP.shape
    W = cache.max_len
    positions_BP = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    logits_BPV, cache = step_fn(prompt_BP, positions_BP, cache)
    logits_BV = jnp.take_along_axis(logits_BPV, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
    first_B = _select(sampling, rng, 0, logits_BV)
    window_BW = jnp.zeros((B, W), jnp.int32).at[:, :P].set(prompt_BP)
    count_B = jnp.ones((B,), jnp.int32)
    done_B = _is_eos(sampling, first_B) | (count_B >= max_new_tokens)
    state = DecodeState(
        cache=cache,
        window_BW=window_BW,
        fill_B=lengths_B,
        last_B=first_B,
        count_B=count_B,
        done_B=done_B,
        step=jnp.int32(1),
        rng=rng,
    )
    return state, first_B


def _slide(step_fn, keep: int, state: DecodeState, overflow_B):
    """Rows with a full window restart it from their last `keep` tokens (see module docstring)."""
    W = state.window_BW.shape[1]
    recent_BW = jnp.concatenate([state.window_BW[:, W - keep + 1 :], state.window_BW[:, keep - 1 :]], 1)
    window_BW = jnp.where(overflow_B[:, None], recent_BW, state.window_BW)
    cache = state.cache
    if keep > 1:
        B = window_BW.shape[0]
        # every row re-writes positions 0..keep-2 from its own window: unchanged rows get back
        # the keys/values they had; positions past a row's fill are garbage it overwrites later
        positions_BT = jnp.broadcast_to(jnp.arange(keep - 1, dtype=jnp.int32), (B, keep - 1))
        _, cache = step_fn(window_BW[:, : keep - 1], positions_BT, cache)
    fill_B = jnp.where(overflow_B, keep - 1, state.fill_B)
    return state.replace(cache=cache, window_BW=window_BW, fill_B=fill_B)


@functools.partial(jax.jit, static_argnames=("chunk", "keep", "sampling"), donate_argnames=("state",))
def _decode_chunk(step_fn, state: DecodeState, max_new_tokens, chunk: int, keep: int, sampling: Sampling):
    """Up to `chunk` steps of one token per unfinished row -> (state, tokens_BC)."""
    B, W = state.window_BW.shape
    rows_B = jnp.arange(B)

    def cond(carry):
        state, _, j = carry
        return (j < chunk) & ~jnp.all(state.done_B)

    def body(carry):
        state, out_BC, j = carry
        active_B = ~state.done_B
        overflow_B = active_B & (state.fill_B >= W)
        state = jax.lax.cond(
            jnp.any(overflow_B), functools.partial(_slide, step_fn, keep), lambda s, _: s, state, overflow_B
        )
        pos_B = jnp.minimum(state.fill_B, W - 1)  # finished rows idle at a valid position
        logits_B1V, cache = step_fn(state.last_B[:, None], pos_B[:, None], state.cache)
        tok_B = _select(sampling, state.rng, state.step, logits_B1V[:, -1])
        count_B = state.count_B + active_B
        state = state.replace(
            cache=cache,
            window_BW=state.window_BW.at[rows_B, pos_B].set(state.last_B),
            fill_B=state.fill_B + active_B,
            last_B=jnp.where(active_B, tok_B, state.last_B),
            count_B=count_B,
            done_B=state.done_B | _is_eos(sampling, tok_B) | (count_B >= max_new_tokens),
            step=state.step + 1,
        )
        out_BC = out_BC.at[:, j].set(jnp.where(active_B, tok_B, 0))
        return state, out_BC, j + 1

    out_BC = jnp.zeros((B, chunk), jnp.int32)
    state, out_BC, _ = jax.lax.while_loop(cond, body, (state, out_BC, jnp.int32(0)))
    return state, out_BC


# ---------------------------------------------------------------- public entry points


def stream_generate(
    step_fn,
    cache: KVCache,
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
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield (tokens_BC, counts_B) as they are decoded: row b's next counts[b] tokens.

    `cache` is donated (do not reuse it). Arguments as in `generate`.
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
    max_new = jnp.int32(max_new_tokens)
    state, first_B = _prefill(step_fn, cache, prompt_BP, jnp.asarray(lengths), rng, max_new, sampling)
    yield np.asarray(first_B)[:, None], np.ones(B, np.int32)
    count = np.ones(B, np.int32)
    while not bool(np.all(state.done_B)):
        state, out_BC = _decode_chunk(step_fn, state, max_new, chunk, keep, sampling)
        new_count = np.asarray(state.count_B)
        yield np.asarray(out_BC), new_count - count
        count = new_count


def generate(
    step_fn,
    cache: KVCache,
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
    chunk: int = 256,
):
    """Sample up to max_new_tokens after each prompt -> (tokens_BN [int32], lengths_B).

    prompt_BP: right-padded prompts, prompt_lengths_B: their lengths (1..P). cache: an empty
    KVCache whose length W (<= the model's block_size) is the context window; it is donated.
    temperature 0 is greedy; top_k 0 and top_p 1 disable those filters. A row stops after
    eos_id (included in its output) or max_new_tokens; entries past lengths[b] are 0.
    keep: tokens kept when a row's window fills (default W // 2; see the module docstring).
    """
    B = np.shape(prompt_lengths_B)[0]
    tokens_BN = np.zeros((B, max(max_new_tokens, 0)), np.int32)
    lengths_B = np.zeros(B, np.int32)
    for out_BC, n_B in stream_generate(
        step_fn,
        cache,
        prompt_BP,
        prompt_lengths_B,
        max_new_tokens=max_new_tokens,
        rng=rng,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_id=eos_id,
        keep=keep,
        chunk=chunk,
    ):
        for b in range(B):
            tokens_BN[b, lengths_B[b] : lengths_B[b] + n_B[b]] = out_BC[b, : n_B[b]]
        lengths_B += n_B
    return tokens_BN, lengths_B


def cache_length(block_size: int, prompt_len: int, max_new_tokens: int, multiple: int = 64) -> int:
    """Cache length for a request: prompt + new tokens rounded up to `multiple`, at most block_size."""
    need = prompt_len + max_new_tokens
    return min(block_size, -(-need // multiple) * multiple)


@functools.cache
def _gpt_apply(config):
    from flaxgpt.gpt import GPT  # here so generate itself never depends on the model

    model = GPT(config)

    def apply(params, tokens_BT, positions_BT, cache):
        return model.apply({"params": params}, tokens_BT, positions=positions_BT, cache=cache)

    return apply


def gpt_step_fn(config, params) -> jax.tree_util.Partial:
    """The GPT as a step_fn; a Partial carries params as a jit argument, not baked-in constants.

    (A tied LM head needs no transposed copy of wte: with few rows the model multiplies by the
    [V, D] table as it lies; see GPT.__call__.)
    """
    if config.scan_layers:  # decode unrolled: each layer reads its own cache buffer in place
        from flaxgpt.gpt import unstack_layers

        params = unstack_layers(params, config.n_layer)
        config = dataclasses.replace(config, scan_layers=False)
    config = dataclasses.replace(config, remat="none")  # no gradients here
    return jax.tree_util.Partial(_gpt_apply(config), params)
