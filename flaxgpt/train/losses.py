"""The training loss of every task: masked, optionally label-smoothed cross-entropy in float32.

    loss_sum, n_tokens = cross_entropy(logits_BTV, targets_BT, mask_BT, label_smoothing=0.1)

Sums, not means: the train step adds micro-batches' sums and divides once by the token count,
so k micro-batches give exactly the gradient of one big batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(logits_BTV, targets_BT, mask_BT=None, label_smoothing: float = 0.0):
    """(sum of per-token losses, number of counted tokens), both float32."""
    logits_BTV = logits_BTV.astype(jnp.float32)  # fp32 log-softmax even when the model runs in bf16
    logprobs_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
    nll_BT = -jnp.take_along_axis(logprobs_BTV, targets_BT[..., None], axis=-1)[..., 0]
    if label_smoothing > 0:
        nll_BT = (1.0 - label_smoothing) * nll_BT - label_smoothing * logprobs_BTV.mean(axis=-1)
    mask_BT = jnp.ones_like(nll_BT) if mask_BT is None else mask_BT.astype(jnp.float32)
    return jnp.sum(nll_BT * mask_BT), jnp.sum(mask_BT)
