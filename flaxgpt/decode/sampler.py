"""How one token is chosen from logits: greedy, or temperature, min-p, top-k and top-p and a draw, each
row with its own key and settings (arrays, so one compiled program serves any mix), and the float32
logprobs reported for it. The decode loop (decode/sampling.py), speculative decoding and the serving
engine's steps draw through here.

    tok_B = select_rows(keys_B, logits_BV, temperature_B, top_k_B, top_p_B, min_p_B=min_p_B)
    tok_B = sample_logits(rng, logits_BV, temperature=0.8, top_k=200)     # one setting for every row
    chosen_B, top_ids_BK, top_BK = token_logprobs(logits_BV, tok_B, want_B)

Shape letters: B rows, V vocab, K candidates (or logprob alternatives).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

MAX_LOGPROBS = 20  # top alternatives a row may ask for (OpenAI's limit): a static width of the outputs


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


def _threshold(sorted_BK, scaled_BV, top_k_B, top_p_B, min_p_B):
    """Lowest kept logit of each row from its K largest (sorted descending) -> (thr_B, fits_B).

    min-p keeps tokens with probability >= min_p times the most likely one's, top-k the logits >=
    the k-th largest (ties kept): the kept set is both; top-p then keeps the smallest set of largest
    kept logits whose probability, renormalised over the kept set, reaches p (vLLM's order: min-p,
    then top-k and top-p). fits_B: the K candidates decided it (else the row needs all V sorted).
    """
    B, K = sorted_BK.shape
    V = scaled_BV.shape[-1]
    topk_on_B = (top_k_B > 0) & (top_k_B < V)
    kth_B = jnp.take_along_axis(sorted_BK, jnp.clip(top_k_B - 1, 0, K - 1)[:, None], -1)[:, 0]
    kth_B = jnp.where(topk_on_B, kth_B, -jnp.inf)
    # p(x) >= min_p * p(max)  <=>  logit(x) >= logit(max) + log(min_p). The max of the K candidates
    # (the vocabulary's: they hold it), not sorted_BK[:, 0]: a second slice of lax.top_k's sort stops
    # XLA:CPU rewriting it into its TopK call, and the whole vocabulary was sorted every step (GPT-2,
    # 16 rows, top_k 50: 2x the step); nor a max over V (a two-kernel pass on a GPU every token)
    top_B = jnp.max(sorted_BK, axis=-1)
    min_p_thr_B = jnp.where(min_p_B > 0, top_B + jnp.log(jnp.maximum(min_p_B, 1e-30)), -jnp.inf)
    kth_B = jnp.maximum(kth_B, min_p_thr_B)
    kept_BV = scaled_BV >= kth_B[:, None]
    # jax.nn.logsumexp's arithmetic over the kept logits, with their max known: it is top_B (kth_B <=
    # top_B for min_p <= 1; an empty kept set sums to 0 either way), so no second pass for the max (a
    # two-kernel reduction over V on a GPU, every token)
    amax_B = jnp.where(jnp.isfinite(top_B), top_B, 0.0)
    sum_B = jnp.sum(jnp.where(kept_BV, jnp.exp(scaled_BV - amax_B[:, None]), 0.0), axis=-1)
    lse_B = jnp.log(sum_B) + amax_B
    kept_BK = sorted_BK >= kth_B[:, None]
    probs_BK = jnp.where(kept_BK, jnp.exp(sorted_BK - lse_B[:, None]), 0.0)
    cum_BK = jnp.cumsum(probs_BK, axis=-1)
    n_keep_B = jnp.sum(((cum_BK - probs_BK) < top_p_B[:, None]) & kept_BK, axis=-1)  # >= 1
    nucleus_B = jnp.take_along_axis(sorted_BK, jnp.maximum(n_keep_B, 1)[:, None] - 1, -1)[:, 0]
    thr_B = jnp.where(top_p_B < 1, nucleus_B, kth_B)
    fits_B = (~topk_on_B | (top_k_B <= K)) & ((top_p_B >= 1) | (cum_BK[:, -1] >= top_p_B) | ~kept_BK[:, -1])
    return thr_B, fits_B


def greedy(logits_XV):
    """The highest-scoring token along the last axis, compared in fp32 (bf16 ties break differently)."""
    return jnp.argmax(logits_XV.astype(jnp.float32), axis=-1).astype(jnp.int32)


def _categorical_in_blocks(key, x_V, block: int = 256):
    """One draw from softmax(x_V) in two: a block of `block` tokens by its total probability
    (logsumexp of its logits), then a token within that block; P(block) P(token | block) is the
    token's probability, and it takes V / block + block random numbers instead of V."""
    V = x_V.shape[-1]
    n = -(-V // block)
    x_NS = jnp.pad(x_V, (0, n * block - V), constant_values=-jnp.inf).reshape(n, block)
    key_n, key_s = jax.random.split(key)
    b = jax.random.categorical(key_n, jax.nn.logsumexp(x_NS, axis=-1))
    return (b * block + jax.random.categorical(key_s, x_NS[b])).astype(jnp.int32)


def _passes(temperature_B, top_k_B, top_p_B, min_p_B, V: int | None = None):
    """(sampled_B, filtered_B): rows that draw (temperature > 0) and rows whose draw is filtered
    (top-k, top-p or min-p on; top_k >= V counts as off when V is given)."""
    sampled_B = ~(temperature_B <= 0)
    top_k_on_B = (top_k_B > 0) if V is None else (top_k_B > 0) & (top_k_B < V)
    return sampled_B, sampled_B & (top_k_on_B | (top_p_B < 1) | (min_p_B > 0))


def branches(temperature_B, top_k_B, top_p_B, min_p_B):
    """Whether select_rows' filter and draw passes may run for rows with these settings -> two scalars.
    Settings never change in a decode loop: it asks this once, outside its token loop, where each
    conditional's test was a kernel a token. The filter's answer also counts rows whose top_k >= V
    (select_rows' own test knows V): a pass that runs for no row changes no token."""
    sampled_B, filtered_B = _passes(temperature_B, top_k_B, top_p_B, min_p_B)
    return jnp.any(filtered_B), jnp.any(sampled_B)


class RowTests(NamedTuple):
    """The sampling conditionals' tests that depend on the rows' settings alone (which never change in
    a decode loop), computed once a chunk, outside its token loop: inside, each was a kernel a token.
    Each may say yes where no row needs the pass (a bias id >= V counted): the pass then changes nothing."""

    biased: jax.Array  # some row has a logit_bias entry (decode.logits.adjust_logits)
    runs: tuple  # `branches`: some row filters, some row draws

    @classmethod
    def of(cls, rows) -> RowTests:
        """rows: decode.sampling.Rows."""
        tests = branches(rows.temperature_B, rows.top_k_B, rows.top_p_B, rows.min_p_B)
        return cls(jnp.any(rows.bias_ids_BL >= 0), tests)


def select_rows(
    keys_B, logits_BV, temperature_B, top_k_B, top_p_B, *, min_p_B=None, max_k: int = 256, runs=None
):
    """One token per row, each row with its own key and settings (arrays, so one program serves all).

    temperature 0 is greedy; else logits / temperature, min-p (0 = off), top-k (0 = off), top-p
    (1 = off), then a draw with the row's key over the tokens the filters keep. Filters look at the
    `max_k` largest logits (lax.top_k); only when some row's top_k or nucleus reaches past them is the whole
    vocabulary sorted, and a row's result never depends on whether that happened (each row uses one
    path, chosen by itself). The draw is _categorical_in_blocks': V / 256 + 256 random numbers
    per row where jax.random.categorical takes V (threefry: 35 ms for 16 rows of GPT-2's 50257 on a
    2-core CPU, a fifth of a decoding step). runs: `branches`' answer for these rows, if known.
    """
    logits_BV = logits_BV.astype(jnp.float32)  # fp32: bf16 logits lose the tail
    B, V = logits_BV.shape
    K = min(max_k, V)
    min_p_B = jnp.zeros((B,), jnp.float32) if min_p_B is None else min_p_B
    sampled_B, filter_B = _passes(temperature_B, top_k_B, top_p_B, min_p_B, V)
    greedy_B = ~sampled_B
    scaled_BV = logits_BV / jnp.where(greedy_B, 1.0, temperature_B)[:, None]

    def candidates(_):
        return _threshold(jax.lax.top_k(scaled_BV, K)[0], scaled_BV, top_k_B, top_p_B, min_p_B)

    def everything(_):
        return _threshold(-jnp.sort(-scaled_BV, axis=-1), scaled_BV, top_k_B, top_p_B, min_p_B)[0]

    run_filter, run_draw = (jnp.any(filter_B), jnp.any(sampled_B)) if runs is None else runs
    none = (jnp.full((B,), -jnp.inf), jnp.ones((B,), bool))
    thr_B, fits_B = jax.lax.cond(run_filter, candidates, lambda _: none, None)
    full_B = filter_B & ~fits_B
    thr_full_B = jax.lax.cond(jnp.any(full_B), everything, lambda _: none[0], None)

    def draw(_):  # each row its own key: a row's token never depends on its neighbours, nor on max_k
        # the threshold and mask inside the branch: XLA fuses them into its passes (no pass of their own)
        thr = jnp.where(full_B, thr_full_B, jnp.where(filter_B, thr_B, -jnp.inf))
        masked_BV = jnp.where(scaled_BV >= thr[:, None], scaled_BV, -jnp.inf)
        return jax.vmap(_categorical_in_blocks)(keys_B, masked_BV)

    drawn_B = jax.lax.cond(run_draw, draw, lambda _: jnp.zeros((B,), jnp.int32), None)
    return jnp.where(greedy_B, greedy(logits_BV), drawn_B)


def sample_logits(rng, logits_BV, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """One token per row: greedy when temperature == 0, else temperature, then top-k, then top-p
    (select_rows with these settings on every row; row b draws with fold_in(rng, b))."""
    if temperature == 0:
        return greedy(logits_BV)
    logits_BV = logits_BV.astype(jnp.float32)  # fp32: bf16 logits lose the tail
    B = logits_BV.shape[0]
    keys_B = jax.vmap(lambda b: jax.random.fold_in(rng, b))(jnp.arange(B))
    full = lambda x, dtype: jnp.full((B,), x, dtype)  # noqa: E731
    return select_rows(
        keys_B, logits_BV, full(temperature, jnp.float32), full(top_k, jnp.int32), full(top_p, jnp.float32)
    )


def check_sampling_args(temperature: float, top_k: int, top_p: float):
    if not (math.isfinite(temperature) and temperature >= 0):  # nan and inf too: they sample garbage
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:  # (False for nan)
        raise ValueError(f"top_p must be in (0, 1], got {top_p}; 1 disables nucleus sampling")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = no top-k), got {top_k}")


def token_logprobs(logits_BV, tok_B, want_B):
    """-> (logprob_B of tok_B, top ids [B, MAX_LOGPROBS], their logprobs): float32 log-softmax of the
    logits as the model gave them (before bias, penalties and temperature: vLLM's default), zeros
    unless some row wants them (want_B >= 0)."""
    B, V = logits_BV.shape
    K = MAX_LOGPROBS

    def compute(_):
        lp_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
        top_lp_BK, top_ids_BK = jax.lax.top_k(lp_BV, min(K, V))
        if V < K:  # a tiny vocabulary: the missing alternatives at -inf
            top_lp_BK = jnp.pad(top_lp_BK, ((0, 0), (0, K - V)), constant_values=-jnp.inf)
            top_ids_BK = jnp.pad(top_ids_BK, ((0, 0), (0, K - V)))
        chosen_B = jnp.take_along_axis(lp_BV, tok_B[:, None], -1)[:, 0]
        return chosen_B, top_ids_BK.astype(jnp.int32), top_lp_BK

    def none(_):
        return jnp.zeros((B,), jnp.float32), jnp.zeros((B, K), jnp.int32), jnp.zeros((B, K), jnp.float32)

    return jax.lax.cond(jnp.any(want_B >= 0), compute, none, None)
