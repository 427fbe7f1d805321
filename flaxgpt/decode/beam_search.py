"""Beam search (and greedy decoding, its one-beam case) that sees a model only through a step
function and its cache's `take_rows`:

    step(tokens_BT, positions_BT, cache) -> (logits_BTV, cache)
    cache.take_rows(rows_R) -> the cache of those rows, in that order

It runs as one `lax.while_loop` (call it inside `jax.jit`): a fixed-size cache is filled one
position per step, and the loop stops when no live prefix can beat the finished ones. With
beam_size 1 and alpha 0 it is greedy decoding (stop at the first EOS); the encoder-decoder's
greedy decoding is exactly that (flaxgpt.decode.translate.generate with beam_size=1).

Beam search keeps the W best unfinished prefixes ("live") and the W best finished
sequences per source, scored with GNMT's length penalty ((5 + len) / 6) ** alpha
(alpha = 0.6 in "Attention Is All You Need"). Beam rows are flattened into the batch:
row b * W + w is beam w of source b, and after each step the cache takes its rows
so that every row follows the prefix it now extends.

Shape letters: B sources, W beam size, R = B * W rows, N max decoded tokens, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

NEG_INF = -1.0e9  # a finite "impossible" score: -inf would turn into NaN in sums and divisions


def length_penalty(length, alpha: float):
    """GNMT's length normalization, ((5 + length) / 6) ** alpha; length counts EOS."""
    return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


def _gather_beams(x_BW_, idx_BK):
    """x [B, W, ...] -> [B, K, ...]: for each source, the beams named by idx."""
    idx = idx_BK.reshape(idx_BK.shape + (1,) * (x_BW_.ndim - 2))
    return jnp.take_along_axis(x_BW_, idx, axis=1)


@struct.dataclass
class _BeamState:
    step: jax.Array  # tokens decoded so far (scalar)
    live_seqs: jax.Array  # [B, W, N + 1], column 0 is BOS, pad after the last token
    live_logp: jax.Array  # [B, W] sorted best first
    fin_seqs: jax.Array  # [B, W, N + 1]
    fin_scores: jax.Array  # [B, W] length-normalized, sorted best first
    fin_flags: jax.Array  # [B, W] True where fin_seqs holds a real finished sequence
    cache: object


def beam_search(
    step_fn: Callable,
    cache,
    *,
    batch_size: int,
    beam_size: int,
    max_len: int,
    bos_id: int,
    eos_id: int,
    pad_id: int = 0,
    alpha: float = 0.6,
):
    """-> (seqs [B, W, max_len], scores [B, W]), BOS dropped, EOS kept, pad after: the finished
    sequences best first (row 0 is the answer), then live prefixes in the slots no finished one
    fills, each scored as if finished (so not sorted against the finished ones).

    `cache` holds R = batch_size * beam_size rows (each source repeated beam_size times,
    row b * W + w), room for max_len positions, and a `take_rows(rows_R)` method. A source with
    no finished sequence after max_len tokens returns its live prefixes, scored as if finished.
    beam_size 1 with alpha 0 is greedy decoding: the single beam stops at its first EOS.
    """
    B, W, N = batch_size, beam_size, max_len
    if W < 1 or N < 1:
        raise ValueError(f"beam_size {W} and max_len {N} must be >= 1")
    if alpha < 0:
        raise ValueError(f"length penalty alpha {alpha} must be >= 0 (the paper uses 0.6)")
    seqs0 = jnp.full((B, W, N + 1), pad_id, jnp.int32).at[:, :, 0].set(bos_id)
    # only beam 0 starts alive: W identical beams would fill the first top-k with copies
    logp0 = jnp.tile(jnp.where(jnp.arange(W) == 0, 0.0, NEG_INF)[None], (B, 1))
    state = _BeamState(
        step=jnp.array(0, jnp.int32),
        live_seqs=seqs0,
        live_logp=logp0,
        fin_seqs=seqs0,
        fin_scores=jnp.full((B, W), NEG_INF),
        fin_flags=jnp.zeros((B, W), bool),
        cache=cache,
    )

    def can_improve(s: _BeamState):
        # log-probs only fall as tokens are added and the penalty is largest at N, so
        # live_logp / lp(N) bounds any score a live prefix can still reach
        best_live_B = s.live_logp[:, 0] / length_penalty(N, alpha)
        worst_fin_B = jnp.where(s.fin_flags.all(axis=1), s.fin_scores[:, -1], NEG_INF)
        return (s.step < N) & jnp.any(best_live_B > worst_fin_B)

    def body(s: _BeamState):
        tokens_R1 = jax.lax.dynamic_slice_in_dim(s.live_seqs, s.step, 1, axis=2).reshape(B * W, 1)
        positions_R1 = jnp.full((B * W, 1), s.step, jnp.int32)
        logits_R1V, cache = step_fn(tokens_R1, positions_R1, s.cache)
        logp_BWV = jax.nn.log_softmax(logits_R1V[:, -1].astype(jnp.float32)).reshape(B, W, -1)
        V = logp_BWV.shape[-1]
        # 2W candidates: even if W of them end in EOS, W live ones remain
        cand_logp_BC, cand_idx_BC = jax.lax.top_k((s.live_logp[..., None] + logp_BWV).reshape(B, -1), 2 * W)
        cand_beam_BC, cand_tok_BC = cand_idx_BC // V, cand_idx_BC % V
        cand_seqs = _gather_beams(s.live_seqs, cand_beam_BC).at[:, :, s.step + 1].set(cand_tok_BC)
        valid_BC = cand_logp_BC > NEG_INF / 2  # not descended from a dead initial beam
        # an EOS finishes a sequence only from the top W (fairseq's rule): with W = 1 this is
        # exactly greedy, and a lower-ranked EOS would not have survived a W-wide search anyway
        top_w_C = jnp.arange(2 * W) < W
        eos_BC = (cand_tok_BC == eos_id) & valid_BC & top_w_C[None]

        live_logp, pick_BW = jax.lax.top_k(jnp.where(cand_tok_BC == eos_id, NEG_INF, cand_logp_BC), W)
        live_seqs = _gather_beams(cand_seqs, pick_BW)
        if W > 1:  # one beam always extends itself: its rows need not move
            rows_R = (jnp.arange(B)[:, None] * W + _gather_beams(cand_beam_BC, pick_BW)).reshape(-1)
            cache = cache.take_rows(rows_R)

        new_scores = jnp.where(eos_BC, cand_logp_BC / length_penalty(s.step + 1, alpha), NEG_INF)
        scores = jnp.concatenate([s.fin_scores, new_scores], axis=1)
        fin_scores, keep_BW = jax.lax.top_k(scores, W)
        fin_seqs = _gather_beams(jnp.concatenate([s.fin_seqs, cand_seqs], axis=1), keep_BW)
        fin_flags = _gather_beams(jnp.concatenate([s.fin_flags, eos_BC], axis=1), keep_BW)
        return _BeamState(
            step=s.step + 1,
            live_seqs=live_seqs,
            live_logp=live_logp,
            fin_seqs=fin_seqs,
            fin_scores=fin_scores,
            fin_flags=fin_flags,
            cache=cache,
        )

    s = jax.lax.while_loop(can_improve, body, state)
    # the finished sequences (best first), then the best live prefixes in the slots no finished one
    # fills, as transformers' num_return_sequences fills them (they were PAD rows scored -1e9)
    n_fin_B1 = s.fin_flags.sum(axis=1, keepdims=True)
    w_1W = jnp.arange(s.fin_flags.shape[1])[None]
    pick_BW = jnp.where(w_1W < n_fin_B1, w_1W, w_1W.shape[1] + w_1W - n_fin_B1)
    seqs = _gather_beams(jnp.concatenate([s.fin_seqs, s.live_seqs], axis=1), pick_BW)
    live_scores = s.live_logp / length_penalty(N, alpha)
    scores = jnp.take_along_axis(jnp.concatenate([s.fin_scores, live_scores], axis=1), pick_BW, axis=1)
    return seqs[:, :, 1:], scores
