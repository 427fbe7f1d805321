"""Speculative decoding: a small draft model proposes, the target model verifies.

    tokens_BN, lengths_B, stats = speculative_generate(
        target_step, target_cache, draft_step, draft_cache, prompt_BP, prompt_lengths_B,
        max_new_tokens=N, rng=jax.random.key(0), draft_tokens=4, temperature=0.8, top_k=200)
    stats.acceptance  # fraction of drafted tokens the target kept

Both models are seen only as `step_fn(tokens_BT, positions_BT, cache) -> (logits_BTV, cache)`
(as in sampling.py); they must share the tokenizer. Each round the draft proposes k tokens one
at a time, the target scores all of them in one call of k + 1 tokens, and the longest agreeing
prefix is kept plus one token from the target, so every round yields 1 to k + 1 tokens for one
target call (its weights are read once per round instead of once per token).

Greedy (temperature 0): a drafted token is kept when it is the target's argmax, and the extra
token is the target's argmax, so the output is plain greedy decoding's. Sampling: the standard
rule (Leviathan et al. 2023; Chen et al. 2023): with p and q the target's and draft's
distributions after temperature / top-k / top-p, drafted token x is kept with probability
min(1, p(x) / q(x)); at the first rejection the replacement is drawn from max(0, p - q)
renormalised; if all k are kept, one more is drawn from p. Each emitted token is then
distributed exactly as under p.

Rows advance at their own pace (per-row positions in both caches). Cache entries a row wrote
past its accepted tokens are garbage that it overwrites before attending to them (a cache whose
sliding-window layers keep rings must let a row take back k positions: `cache.rewind` >= k; every
cache kind of models/cache.py says its `rewind`). The
window does not slide: prompt + max_new_tokens + k + 1 must fit in both caches.

Shape letters: B batch, P prompt buffer, k draft tokens per round, V vocab, N new tokens.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from flaxgpt.decode.sampler import check_sampling_args, greedy, top_k_mask, top_p_mask
from flaxgpt.decode.sampling import Sampling


class SpecStats(NamedTuple):
    rounds: int  # target calls after the prefill
    drafted: int  # tokens proposed by the draft (summed over rows)
    accepted: int  # of those, kept

    @property
    def acceptance(self) -> float:
        return self.accepted / max(self.drafted, 1)


@struct.dataclass
class SpecState:
    target: Any  # the target's cache
    draft: Any  # the draft's cache
    prev_B: jax.Array  # the token at position fill - 1 (fed to both models)
    last_B: jax.Array  # the newest token, not yet fed
    fill_B: jax.Array  # positions written with accepted tokens
    out_BN: jax.Array  # emitted tokens (k + 1 spare columns)
    count_B: jax.Array
    done_B: jax.Array
    stats: jax.Array  # [3] int32: rounds, drafted, accepted
    rng: jax.Array


def _filtered(s: Sampling, logits_BXV):
    """Logits after temperature, top-k and top-p (the distribution tokens are drawn from)."""
    logits_BXV = logits_BXV.astype(jnp.float32) / s.temperature
    shape = logits_BXV.shape
    flat = logits_BXV.reshape(-1, shape[-1])
    return top_p_mask(top_k_mask(flat, s.top_k), s.top_p).reshape(shape)


def _draw(s: Sampling, rng, logits_BV):
    if s.temperature == 0:
        return greedy(logits_BV)
    return jax.random.categorical(rng, _filtered(s, logits_BV), axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("sel", "n_out"), donate_argnames=("target", "draft"))
def _prefill(target_step, target, draft_step, draft, prompt_BP, lengths_B, rng, max_new, sel, n_out):
    B, P = prompt_BP.shape
    positions_BP = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    # logits_at: the last prompt token's logits, and the padding after it need not be written
    logits_B1V, target = target_step(prompt_BP, positions_BP, target, logits_at=lengths_B - 1)
    _, draft = draft_step(prompt_BP, positions_BP, draft, logits_at=lengths_B - 1)
    logits_BV = logits_B1V[:, 0]
    first_B = _draw(sel, jax.random.fold_in(rng, 0), logits_BV)
    done_B = jnp.full((B,), max_new <= 1)
    if sel.eos_id is not None:
        done_B |= first_B == sel.eos_id
    return SpecState(
        target=target,
        draft=draft,
        prev_B=jnp.take_along_axis(prompt_BP, (lengths_B - 1)[:, None], axis=1)[:, 0],
        last_B=first_B,
        fill_B=lengths_B,
        out_BN=jnp.zeros((B, n_out), jnp.int32).at[:, 0].set(first_B),
        count_B=jnp.ones((B,), jnp.int32),
        done_B=done_B,
        stats=jnp.zeros((3,), jnp.int32),
        rng=rng,
    )


def _propose(draft_step, sel: Sampling, k: int, state: SpecState, rng):
    """k draft tokens per row -> (tokens_Bk, draft logits_BkV, cache)."""
    B = state.fill_B.shape[0]
    # the first call also rewrites position fill - 1, which a fully accepted round left unwritten
    tokens_BT = jnp.stack([state.prev_B, state.last_B], axis=1)
    positions_BT = jnp.stack([state.fill_B - 1, state.fill_B], axis=1)
    cache = state.draft
    drafted, logits = [], []
    for j in range(k):
        logits_BTV, cache = draft_step(tokens_BT, positions_BT, cache)
        logits_BV = logits_BTV[:, -1]
        tok_B = _draw(sel, jax.random.fold_in(rng, j), logits_BV)
        drafted.append(tok_B)
        logits.append(logits_BV)
        tokens_BT = tok_B[:, None]
        positions_BT = (state.fill_B + j + 1)[:, None]
    del B
    return jnp.stack(drafted, 1), jnp.stack(logits, 1), cache


def _verify(sel: Sampling, rng, drafted_Bk, q_logits_BkV, p_logits_BKV):
    """-> (n_B accepted drafted tokens, next_B the target's token after them)."""
    B, k = drafted_Bk.shape
    if sel.temperature == 0:
        best_BK = greedy(p_logits_BKV)
        agree_Bk = drafted_Bk == best_BK[:, :k]
        n_B = jnp.sum(jnp.cumprod(agree_Bk, axis=1), axis=1)
        return n_B, jnp.take_along_axis(best_BK, n_B[:, None], axis=1)[:, 0]
    p_BKV = jax.nn.softmax(_filtered(sel, p_logits_BKV), axis=-1)
    q_BkV = jax.nn.softmax(_filtered(sel, q_logits_BkV), axis=-1)
    p_x = jnp.take_along_axis(p_BKV[:, :k], drafted_Bk[..., None], axis=-1)[..., 0]
    q_x = jnp.take_along_axis(q_BkV, drafted_Bk[..., None], axis=-1)[..., 0]
    u_Bk = jax.random.uniform(jax.random.fold_in(rng, 0), (B, k))
    keep_Bk = u_Bk * q_x < p_x  # u < p/q without dividing by a zero q
    n_B = jnp.sum(jnp.cumprod(keep_Bk, axis=1), axis=1)
    p_n = jnp.take_along_axis(p_BKV, n_B[:, None, None], axis=1)[:, 0]  # [B, V]
    q_pad_BKV = jnp.concatenate([q_BkV, jnp.zeros_like(q_BkV[:, :1])], axis=1)  # all kept: from p
    q_n = jnp.take_along_axis(q_pad_BKV, n_B[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_n - q_n, 0.0)
    total = jnp.sum(residual, axis=-1, keepdims=True)
    residual = jnp.where(total > 0, residual, p_n)  # p == q exactly: the residual is p itself
    logits = jnp.where(residual > 0, jnp.log(residual), -jnp.inf)
    next_B = jax.random.categorical(jax.random.fold_in(rng, 1), logits, axis=-1).astype(jnp.int32)
    return n_B, next_B


@functools.partial(jax.jit, static_argnames=("sel", "k"), donate_argnames=("state",))
def _decode(target_step, draft_step, state: SpecState, max_new, sel: Sampling, k: int):
    B = state.fill_B.shape[0]
    rows_B = jnp.arange(B)

    def body(state: SpecState):
        rng = jax.random.fold_in(state.rng, state.stats[0] + 1)
        active_B = ~state.done_B
        drafted_Bk, q_logits_BkV, draft = _propose(draft_step, sel, k, state, jax.random.fold_in(rng, 0))
        tokens_BK = jnp.concatenate([state.last_B[:, None], drafted_Bk], axis=1)  # K = k + 1
        positions_BK = state.fill_B[:, None] + jnp.arange(k + 1)
        p_logits_BKV, target = target_step(tokens_BK, positions_BK, state.target)
        n_B, next_B = _verify(sel, jax.random.fold_in(rng, 1), drafted_Bk, q_logits_BkV, p_logits_BKV)

        new_BK = jnp.concatenate([drafted_Bk, next_B[:, None]], axis=1)
        new_BK = jnp.where(jnp.arange(k + 1) < n_B[:, None], new_BK, next_B[:, None])  # [d_1..d_n, next]
        n_new_B = n_B + 1
        if sel.eos_id is not None:  # stop after the first EOS among the new tokens
            eos_BK = (new_BK == sel.eos_id) & (jnp.arange(k + 1) < n_new_B[:, None])
            first_eos_B = jnp.argmax(eos_BK, axis=1)
            n_new_B = jnp.where(jnp.any(eos_BK, axis=1), first_eos_B + 1, n_new_B)
        n_new_B = jnp.where(active_B, jnp.minimum(n_new_B, max_new - state.count_B), 0)
        cols_BK = state.count_B[:, None] + jnp.arange(k + 1)
        cols_BK = jnp.where(jnp.arange(k + 1) < n_new_B[:, None], cols_BK, state.out_BN.shape[1] - 1)
        out_BN = state.out_BN.at[rows_B[:, None], cols_BK].set(
            jnp.where(jnp.arange(k + 1) < n_new_B[:, None], new_BK, state.out_BN[:, -1:])
        )
        count_B = state.count_B + n_new_B
        done_B = state.done_B | (count_B >= max_new)
        if sel.eos_id is not None:
            done_B |= jnp.any((new_BK == sel.eos_id) & (jnp.arange(k + 1) < n_new_B[:, None]), axis=1)
        prev_B = jnp.where(
            n_B > 0, jnp.take_along_axis(drafted_Bk, jnp.maximum(n_B - 1, 0)[:, None], 1)[:, 0], state.last_B
        )
        n_active = jnp.sum(active_B)
        stats = state.stats + jnp.stack([1, k * n_active, jnp.sum(jnp.where(active_B, n_B, 0))]).astype(
            jnp.int32
        )
        return state.replace(
            target=target,
            draft=draft,
            prev_B=jnp.where(active_B, prev_B, state.prev_B),
            last_B=jnp.where(active_B, next_B, state.last_B),
            fill_B=state.fill_B + jnp.where(active_B, n_B + 1, 0),
            out_BN=out_BN,
            count_B=count_B,
            done_B=done_B,
            stats=stats,
        )

    return jax.lax.while_loop(lambda s: ~jnp.all(s.done_B), body, state)


def speculative_generate(
    target_step,
    target_cache,
    draft_step,
    draft_cache,
    prompt_BP,
    prompt_lengths_B,
    *,
    max_new_tokens: int,
    rng,
    draft_tokens: int = 4,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | None = None,
):
    """-> (tokens_BN [int32], lengths_B, SpecStats); both caches are donated.

    Arguments as in `sampling.generate`; `draft_tokens` (k) is the tokens drafted per round.
    """
    check_sampling_args(temperature, top_k, top_p)
    k = int(draft_tokens)
    if k < 1:
        raise ValueError(f"draft_tokens must be >= 1, got {draft_tokens}")
    prompt_BP = jnp.asarray(prompt_BP, jnp.int32)
    lengths = np.asarray(prompt_lengths_B, np.int32)
    B, P = prompt_BP.shape
    if lengths.shape != (B,) or lengths.min() < 1 or lengths.max() > P:
        raise ValueError(f"prompt lengths must be {B} values in [1, {P}], got {lengths.tolist()}")
    need = P + max_new_tokens + k + 1
    for name, cache in (("target", target_cache), ("draft", draft_cache)):
        if cache.max_len < need:
            raise ValueError(
                f"the {name} cache holds {cache.max_len} positions; speculative decoding does not "
                f"slide the window and needs prompt {P} + max_new_tokens {max_new_tokens} + "
                f"draft_tokens {k} + 1 = {need}"
            )
        rewind = cache.rewind  # the cache interface's: None, a row may go back any number of positions
        if rewind is not None and rewind < k:
            raise ValueError(
                f"the {name} cache lets a row take back {rewind} written positions (its sliding-window "
                f"rings); a rejected draft takes back up to draft_tokens {k}: make it with rewind={k}"
            )
    if max_new_tokens < 1:
        return np.zeros((B, 0), np.int32), np.zeros(B, np.int32), SpecStats(0, 0, 0)
    sel = Sampling(float(temperature), int(top_k), float(top_p), eos_id)
    as_partial = lambda f: f if isinstance(f, jax.tree_util.Partial) else jax.tree_util.Partial(f)
    target_step, draft_step = as_partial(target_step), as_partial(draft_step)
    max_new = jnp.int32(max_new_tokens)
    # the output buffer is sized by the cache, not by max_new_tokens: one compile for any length
    n_out = target_cache.max_len + k + 1
    state = _prefill(
        target_step,
        target_cache,
        draft_step,
        draft_cache,
        prompt_BP,
        jnp.asarray(lengths),
        rng,
        max_new,
        sel,
        n_out,
    )
    state = _decode(target_step, draft_step, state, max_new, sel, k)
    count_B = np.asarray(state.count_B)
    tokens_BN = np.asarray(state.out_BN)[:, :max_new_tokens]
    tokens_BN = np.where(np.arange(max_new_tokens) < count_B[:, None], tokens_BN, 0)
    rounds, drafted, accepted = (int(x) for x in np.asarray(state.stats))
    return tokens_BN, count_B, SpecStats(rounds, drafted, accepted)


def check_draft(
    *,
    target_vocab: int,
    draft_vocab: int,
    target_params: int,
    draft_params: int,
    target_tokenizer=None,
    draft_tokenizer=None,
):
    """One-line errors for a draft that cannot serve the target (tokenizers as their to_meta())."""
    if draft_vocab != target_vocab:
        raise ValueError(f"the draft's vocabulary has {draft_vocab} tokens, the target's {target_vocab}")
    if target_tokenizer is not None and draft_tokenizer is not None and target_tokenizer != draft_tokenizer:
        name = lambda meta: meta.get("name", meta.get("kind", "?"))  # noqa: E731
        raise ValueError(
            f"the draft's tokenizer ({name(draft_tokenizer)}) differs from the target's "
            f"({name(target_tokenizer)}): the same ids would mean different text"
        )
    if draft_params >= target_params:
        raise ValueError(
            f"the draft has {draft_params:,} parameters, not fewer than the target's {target_params:,}; "
            "a draft must be the smaller model"
        )
