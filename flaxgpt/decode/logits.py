"""The logits the sampler draws from: a structured-output mask's banned tokens at -inf, each row's
logit_bias, then the repetition, frequency and presence penalties (decode.sampling.Sampling's
definitions), each a conditional that rows asking for none of it skip.

    adjusted_BV = adjust_logits(rows, logits_BV, counts_BV, seen_BV, mask_BW)   # the engine
    adjusted_BV = adjust_logits(rows, logits_BV)                                 # generate: bias only

`rows` is a decode.sampling.Rows (its settings as arrays [B]). Shape letters: B rows, V vocab, W mask
words, L logit_bias entries.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def unpack_mask(mask_BW, V: int) -> jax.Array:
    """An int32 bitmask [B, ceil(V/32)] (bit j of word i: token 32 i + j allowed; the layout of
    llguidance and xgrammar) -> bool [B, V]."""
    bits_BW32 = (mask_BW[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits_BW32.reshape(mask_BW.shape[0], -1)[:, :V].astype(bool)


def biased_rows(rows, V: int, biased=None):
    """Whether some row has a logit_bias entry below V (`biased`: RowTests', if known)."""
    if biased is not None:
        return biased
    return jnp.any((rows.bias_ids_BL >= 0) & (rows.bias_ids_BL < V))


def add_bias(rows, x_BV):
    """x_BV (float32) with each row's logit_bias added (ids past V are none)."""
    B, V = x_BV.shape
    used_BL = (rows.bias_ids_BL >= 0) & (rows.bias_ids_BL < V)  # inside the branch: no pass of its own
    safe_BL = jnp.where(used_BL, rows.bias_ids_BL, 0)
    return x_BV.at[jnp.arange(B)[:, None], safe_BL].add(jnp.where(used_BL, rows.bias_BL, 0.0))


def adjust_logits(rows, logits_BV, counts_BV=None, seen_BV=None, mask_BW=None, biased=None):
    """The logits the sampler draws from (float32): a structured-output mask's banned tokens -inf,
    then logit_bias, repetition, frequency and presence penalties (Sampling's definitions). counts_BV:
    each token's count in the row's output so far; seen_BV: tokens in its prompt or output; both None
    when the caller keeps no counts (generate): bias only. Rows that ask for none of it cost a
    conditional, not a pass over the logits; biased: whether some row may have a bias (`RowTests`)."""
    logits_BV = logits_BV.astype(jnp.float32)
    if mask_BW is not None:
        logits_BV = jnp.where(unpack_mask(mask_BW, logits_BV.shape[1]), logits_BV, -jnp.inf)
    bias = functools.partial(add_bias, rows)
    logits_BV = jax.lax.cond(biased_rows(rows, logits_BV.shape[1], biased), bias, lambda x: x, logits_BV)
    if counts_BV is None:
        return logits_BV

    def penalize(x_BV):
        rep_B1 = rows.repetition_B[:, None]
        x_BV = jnp.where(seen_BV, jnp.where(x_BV > 0, x_BV / rep_B1, x_BV * rep_B1), x_BV)
        counts_BV_f = counts_BV.astype(jnp.float32)
        return x_BV - rows.frequency_B[:, None] * counts_BV_f - rows.presence_B[:, None] * (counts_BV > 0)

    on_B = (rows.repetition_B != 1) | (rows.frequency_B != 0) | (rows.presence_B != 0)
    return jax.lax.cond(jnp.any(on_B), penalize, lambda x: x, logits_BV)
