"""Causal flash attention on TPU with JAX's Pallas splash-attention kernel.

Used by `attention.attend` for impl="pallas" (what `auto` picks on TPU) on the causal training and
prefill path only: queries and keys start together at position 0, no dropout, no attention maps.
Cached decoding, cross-attention and padding masks keep the explicit-mask XLA path.

The kernel is imported lazily (it pulls in Mosaic/TPU code) and built at trace time. When the
program is not for a TPU (kernels.target: the mesh context's devices, else the host's) it runs in
Pallas interpret mode: correct but slow, which is how the CPU tests check it.

Under a mesh context (`jax.set_mesh(mesh)`, or the trainer's `sharding.under_mesh`) the kernel runs
inside `jax.shard_map` with the batch split over every mesh axis, so each device attends over its
own rows. XLA cannot partition a Pallas custom call by itself: a kernel traced without the mesh over
a batch split across devices makes XLA all-gather q, k and v (and the gradients' operands) onto every
device and run the whole batch's attention on each; so on several TPU chips without a mesh
context (or with a batch the mesh does not divide) the XLA path runs instead.

Shape letters: B batch, T query length, S key length, H heads, K head dim (see layers.py).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from flaxgpt.kernels import target

BLOCK = 128  # the kernel's default block size: sequence lengths must be multiples of it


def fits(q_len: int, kv_len: int, batch: int = 1) -> bool:
    """Whether the kernel can run here; otherwise the caller uses XLA. Its blocks must tile the
    lengths, and on several TPU chips a mesh context must say how to split it per device: XLA
    cannot partition a Pallas (Mosaic) kernel by itself and refuses to compile one unsplit."""
    if q_len != kv_len or q_len % BLOCK:
        return False
    if target.platform() != "tpu":  # interpret mode takes any batch
        return True
    mesh = jax.sharding.get_abstract_mesh()
    return jax.device_count() == 1 if mesh.empty else batch % mesh.size == 0


def _kernel(seq_len: int, n_head: int, interpret: bool, window: int = 0, softcap: float = 0.0):
    # built afresh in every trace: the kernel holds arrays (the mask's block tables), and a kernel
    # cached across traces would leak one trace's values into another (inside nn.scan, say)
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    shape = (seq_len, seq_len)
    # a sliding window (Gemma, Mistral): key s seen by query t when t - (window - 1) <= s <= t
    one = (lambda: sm.LocalMask(shape, (window - 1, 0), 0)) if window else (lambda: sm.CausalMask(shape))
    mask = sm.MultiHeadMask([one() for _ in range(n_head)])
    cap = softcap or None  # Gemma 2: logits = cap * tanh(logits / cap)
    return sk.make_splash_mha(
        mask, head_shards=1, q_seq_shards=1, interpret=interpret, attn_logits_soft_cap=cap
    )


def _local_attention(q_BTHK, k_BSHK, v_BSHK, segment_ids_BT=None, *, window=0, softcap=0.0):
    _, T, H, K = q_BTHK.shape
    kernel = _kernel(T, H, target.platform() != "tpu", window, softcap)
    # the kernel takes one row [H, T, K] and does not scale the logits itself
    q_BHTK = jnp.swapaxes(q_BTHK * jnp.asarray(1.0 / math.sqrt(K), q_BTHK.dtype), 1, 2)
    k_BHSK, v_BHSK = jnp.swapaxes(k_BSHK, 1, 2), jnp.swapaxes(v_BSHK, 1, 2)
    if segment_ids_BT is None:
        y_BHTK = jax.vmap(kernel)(q_BHTK, k_BHSK, v_BHSK)
    else:  # packed rows: the kernel skips the blocks of other segments itself
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

        row = lambda q, k, v, s: kernel(q, k, v, segment_ids=sk.SegmentIds(q=s, kv=s))  # noqa: E731
        y_BHTK = jax.vmap(row)(q_BHTK, k_BHSK, v_BHSK, segment_ids_BT.astype(jnp.int32))
    return jnp.swapaxes(y_BHTK, 1, 2).astype(q_BTHK.dtype)


def causal_attention(
    q_BTHK: jax.Array, k_BSHK: jax.Array, v_BSHK: jax.Array, segment_ids_BT=None, window=0, softcap=0.0
) -> jax.Array:
    """softmax(q k^T / sqrt(K) + causal mask) v -> [B, T, H, K]; needs `fits(T, S, B)`.
    With segment ids [B, T] (packed rows) a query sees only keys of its own segment; with `window`
    only the last `window` keys; `softcap` bounds the logits (cap * tanh(logits / cap))."""
    local = functools.partial(_local_attention, window=window, softcap=softcap)
    mesh = jax.sharding.get_abstract_mesh()
    B = q_BTHK.shape[0]
    args = (q_BTHK, k_BSHK, v_BSHK) + (() if segment_ids_BT is None else (segment_ids_BT,))
    if mesh.empty or mesh.size == 1 or B % mesh.size:
        return local(*args)
    rows = PartitionSpec(tuple(mesh.axis_names))  # batch over every device, as flaxgpt.sharding does
    return jax.shard_map(local, mesh=mesh, in_specs=(rows,) * len(args), out_specs=rows, check_vma=False)(
        *args
    )
