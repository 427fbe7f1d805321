"""The training loss of every task: masked, optionally label-smoothed cross-entropy in float32.

    loss_sum, n_tokens = cross_entropy(logits_BTV, targets_BT, mask_BT, label_smoothing=0.1)
    loss_sum, n_tokens = chunked_cross_entropy(hidden_BTD, head, targets_BT, mask_BT, chunk=128)
    logp_BT = token_logprobs(logits_BTV, targets_BT)              # DPO: log p of each target
    logp_BT = chunked_token_logprobs(hidden_BTD, head, targets_BT, chunk=128)
    loss_sum, n_tokens = fused_cross_entropy(hidden_BTD, unembed, targets_BT, mask_BT)  # fused
    logp_BT, entropy_BT = fused_token_logprobs(hidden_BTD, unembed, targets_BT)

Sums, not means: the train step adds micro-batches' sums and divides once by the token count,
so k micro-batches give exactly the gradient of one big batch.

`chunked_cross_entropy` is the same loss without the [B, T, V] float32 logits: `head` maps a chunk of
hidden states to its logits, one chunk of `chunk` positions of every row at a time (a lax.scan), and
jax.checkpoint makes the backward pass recompute each chunk's logits instead of keeping them. Chunks
run along time, not rows, so every chunk keeps the batch's sharding (each device its own rows).

`fused_cross_entropy` / `fused_token_logprobs` are the same values from the hidden states and the
unembedding (`unembed`, a kernels.linear_xent.Head, from gpt.unembedding) blocked over the vocabulary
instead (kernels/linear_xent.py): neither the forward nor the backward pass holds more than one
[B*T, block] block of logits, and the gradients w.r.t. the hidden states and the head's weight come
from one hand-written backward. `use_fused(optim.loss_impl)` is the training switch (docs/training.md).
`z_loss` (PaLM's, 0 = off) adds z_loss * logsumexp(logits)^2 per counted token on either path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flaxgpt.models import head as head_lib

LOSS_IMPLS = ("logits", "fused")


def token_logprobs(logits_BTV, targets_BT):
    """log p(target) at every position, float32 [B, T]."""
    logprobs_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logprobs_BTV, targets_BT[..., None], axis=-1)[..., 0]


def cross_entropy(logits_BTV, targets_BT, mask_BT=None, label_smoothing: float = 0.0, z_loss: float = 0.0):
    """(sum of per-token losses, number of counted tokens), both float32."""
    logits_BTV = logits_BTV.astype(jnp.float32)  # fp32 log-softmax even when the model runs in bf16
    if label_smoothing > 0:
        logprobs_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
        nll_BT = -jnp.take_along_axis(logprobs_BTV, targets_BT[..., None], axis=-1)[..., 0]
        nll_BT = (1.0 - label_smoothing) * nll_BT - label_smoothing * logprobs_BTV.mean(axis=-1)
    else:
        nll_BT = _nll(logits_BTV, targets_BT)
    if z_loss:
        nll_BT = nll_BT + z_loss * jnp.square(jax.nn.logsumexp(logits_BTV, axis=-1))
    mask_BT = jnp.ones_like(nll_BT) if mask_BT is None else mask_BT.astype(jnp.float32)
    return jnp.sum(nll_BT * mask_BT), jnp.sum(mask_BT)


@jax.custom_vjp
def _nll(logits_BTV, targets_BT):
    """-log softmax(logits)[target] = logsumexp(logits) - logits[target], float32.

    Hand-written backward (softmax - one_hot, one pass over [B, T, V] from the saved logits and
    logsumexp): autodiff of log_softmax keeps the [B, T, V] log-probabilities and their exp as
    arrays, two more passes each way over the largest tensor of a small model's step.
    """
    return _nll_fwd(logits_BTV, targets_BT)[0]


def _nll_fwd(logits_BTV, targets_BT):
    lse_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    target_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    return lse_BT - target_BT, (logits_BTV, lse_BT, targets_BT)


def _nll_bwd(res, g_BT):
    logits_BTV, lse_BT, targets_BT = res
    one_hot_BTV = jnp.arange(logits_BTV.shape[-1]) == targets_BT[..., None]
    d_BTV = (jnp.exp(logits_BTV - lse_BT[..., None]) - one_hot_BTV) * g_BT[..., None]
    return d_BTV, None  # integer targets: no cotangent


_nll.defvjp(_nll_fwd, _nll_bwd)


def _by_chunk(chunk: int, *xs_BT):
    """Arrays [B, T, ...] padded with zeros to a multiple of `chunk` positions and cut into
    [n, B, chunk, ...]: what a scan over position chunks walks (the padding masked or cut after)."""
    B, T = xs_BT[0].shape[:2]
    n = -(-T // chunk)

    def split(x_BT):
        x_BT = jnp.pad(x_BT, ((0, 0), (0, n * chunk - T)) + ((0, 0),) * (x_BT.ndim - 2))
        return jnp.swapaxes(x_BT.reshape(B, n, chunk, *x_BT.shape[2:]), 0, 1)

    return tuple(map(split, xs_BT))


def chunked_cross_entropy(
    hidden_BTD, head, targets_BT, mask_BT=None, label_smoothing=0.0, chunk=128, z_loss=0.0
):
    """cross_entropy(head(hidden_BTD), ...) computed `chunk` positions at a time.

    head: [B, t, D] hidden states -> [B, t, V] logits (closing over the head's weights; gradients
    reach them and hidden_BTD). T need not be a multiple of `chunk`: the tail is padded and masked.
    """
    B, T, D = hidden_BTD.shape
    mask_BT = jnp.ones((B, T), jnp.float32) if mask_BT is None else mask_BT.astype(jnp.float32)

    @jax.checkpoint  # the backward recomputes this chunk's logits: only [B, chunk, V] live at once
    def one_chunk(x_BtD, targets_Bt, mask_Bt):
        return cross_entropy(head(x_BtD), targets_Bt, mask_Bt, label_smoothing, z_loss)

    def body(carry, xs):
        loss_sum, weight = one_chunk(*xs)
        return (carry[0] + loss_sum, carry[1] + weight), None

    zero = jnp.zeros((), jnp.float32)
    (loss_sum, _), _ = jax.lax.scan(body, (zero, zero), _by_chunk(chunk, hidden_BTD, targets_BT, mask_BT))
    return loss_sum, jnp.sum(mask_BT)


def chunked_token_logprobs(hidden_BTD, head, targets_BT, chunk=128):
    """token_logprobs(head(hidden_BTD), targets_BT) `chunk` positions at a time: [B, T] float32."""
    B, T, D = hidden_BTD.shape

    @jax.checkpoint  # only one chunk's [B, chunk, V] logits live, forward and backward
    def one_chunk(_, xs):
        x_BtD, targets_Bt = xs
        return None, token_logprobs(head(x_BtD), targets_Bt)

    _, logp_nBt = jax.lax.scan(one_chunk, None, _by_chunk(chunk, hidden_BTD, targets_BT))
    return jnp.swapaxes(logp_nBt, 0, 1).reshape(B, -1)[:, :T]


def check_loss_impl(loss_impl: str) -> str:
    """optim.loss_impl, or a one-line error naming the choices (touches no device)."""
    if loss_impl not in LOSS_IMPLS:
        raise ValueError(f"optim.loss_impl {loss_impl!r}: choose one of {', '.join(LOSS_IMPLS)}")
    return loss_impl


def use_fused(loss_impl: str) -> bool:
    """optim.loss_impl -> whether the loss takes the fused path. "logits" is the default: the fused
    step measured slower on the CPU recipe and compiles to a slower bound for one H100 (it recomputes
    the head's product); "fused" is for memory, where the [B, T, V] logits do not fit (docs/training.md)."""
    return check_loss_impl(loss_impl) == "fused"


def _stats(hidden_BTD, unembed, targets_BT, scale=1.0, block=0):
    B, T, D = hidden_BTD.shape
    x_ND = hidden_BTD.reshape(B * T, D).astype(unembed.w.dtype)  # the head's compute dtype
    s = head_lib.stats(x_ND, unembed, targets_BT.reshape(B * T), scale=scale, block=block)
    return head_lib.Stats(*(v.reshape(B, T) for v in s))


def fused_cross_entropy(
    hidden_BTD, unembed, targets_BT, mask_BT=None, label_smoothing=0.0, z_loss=0.0, block=0
):
    """cross_entropy(logits of unembed on hidden_BTD, ...) without the [B, T, V] logits: the same
    (loss sum, token count), float32. block: vocabulary columns at a time (0: kernels.linear_xent.BLOCK)."""
    s = _stats(hidden_BTD, unembed, targets_BT, block=block)
    nll_BT = s.lse - s.target
    if label_smoothing > 0:  # mean log p over the vocabulary = mean logit - lse
        mean_logp_BT = s.total / unembed.vocab_size - s.lse
        nll_BT = (1.0 - label_smoothing) * nll_BT - label_smoothing * mean_logp_BT
    if z_loss:
        nll_BT = nll_BT + z_loss * jnp.square(s.lse)
    mask_BT = jnp.ones_like(nll_BT) if mask_BT is None else mask_BT.astype(jnp.float32)
    return jnp.sum(nll_BT * mask_BT), jnp.sum(mask_BT)


def fused_token_logprobs(hidden_BTD, unembed, targets_BT, temperature=1.0, block=0):
    """(log p(target) [B, T], entropy [B, T]) of softmax(logits / temperature), float32, from the
    hidden states without the [B, T, V] logits (token_logprobs; grpo_task.completion_logps)."""
    s = _stats(hidden_BTD, unembed, targets_BT, scale=1.0 / temperature, block=block)
    return s.target - s.lse, s.entropy
