"""int4 weights, two to a byte, with one scale per group of GROUP inputs: the layout and its product.

    packed_NH, scale_NG = quantize(w_NK, group)     # H = K / 2 bytes a row, G = K / group scales a row
    w_NK = dequantize(packed_NH, scale_NG)         # float32: (q - 0) * scale of q's group
    y_MN = matmul(x_MK, packed_NH, scale_NG)       # x @ w^T, the XLA form: unpack + scale + dot, one fusion

Symmetric (no zero points, as compressed-tensors' W4A16 and GPTQ's `sym=True` write them): q in [-8, 7],
scale = max |w| over the group / 7.5 (compressed-tensors' rule: half the 15-step range), so a file
quantized there and here from the same float weight holds the same integers. Byte j of a row holds
input 2j in its low nibble and input 2j + 1 in its high nibble, each as q + 8 (0..15): the bytes of
compressed-tensors' `pack-quantized` int32 words on a little-endian host, so reading or writing that
format is a reinterpretation of the same bytes (flaxgpt/hf/compressed.py), never a repack.

Letters: M rows of x, N output channels, K inputs, H = K / 2 packed bytes, G = K / group groups.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GROUPS = (32, 64, 128)  # group sizes offered (torchao's and AWQ's 64 / 128; 32 for small models)
OFFSET = 8  # q + OFFSET is the stored nibble (compressed-tensors' offset for 4 bits)


def check_group(K: int, group: int, name: str = "a weight") -> None:
    """One line when `group` does not split K: which sizes would."""
    if K % group:
        fits = [g for g in GROUPS if K % g == 0]
        fix = f"--quantize int4_g{fits[-1]}" if fits else "--quantize int8 (per-row scales)"
        raise ValueError(f"int4 group size {group} does not divide K={K} ({name}'s inputs): use {fix}")


def quantize(w_NK, group: int, name: str = "a weight"):
    """(packed uint8 [N, K/2], float32 scales [N, K/group]): symmetric per group, where w_NK is (a host
    array on the default device; a traced one traced, so jax.eval_shape gives the layout alone)."""
    N, K = w_NK.shape
    check_group(K, group, name)
    w_NGC = jnp.asarray(w_NK, jnp.float32).reshape(N, K // group, group)
    absmax_NG = jnp.abs(w_NGC).max(axis=-1)
    scale_NG = jnp.where(absmax_NG > 0, _divide(absmax_NG, jnp.full_like(absmax_NG, 7.5)), 1.0)
    q_NGC = _divide(w_NGC, jnp.broadcast_to(scale_NG[..., None], w_NGC.shape))
    q_NK = jnp.clip(jnp.rint(q_NGC), -8, 7).astype(jnp.int8).reshape(N, K)  # ties to even, as torch
    return pack(q_NK), scale_NG


def _divide(a, b):
    """a / b correctly rounded: XLA turns a division by a constant or a broadcast into a multiplication
    by its reciprocal, an ulp off, and a group's largest |w| / its scale then lands beside -7.5, not on
    it (-7 where compressed-tensors writes -8); a materialized divisor keeps the division."""
    return a / jax.lax.optimization_barrier(b)


def pack(q_NK) -> jax.Array:
    """int values in [-8, 7], K even -> uint8 [N, K/2]: low nibble the even input, high the odd."""
    u = (jnp.asarray(q_NK, jnp.int16) + OFFSET).astype(jnp.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack(packed_NH) -> jax.Array:
    """uint8 [N, K/2] -> int8 [N, K] in [-8, 7] (jax: traced into the consumer's fusion)."""
    lo = (packed_NH & 0xF).astype(jnp.int8) - OFFSET
    hi = (packed_NH >> 4).astype(jnp.int8) - OFFSET
    return jnp.stack([lo, hi], axis=-1).reshape(*packed_NH.shape[:-1], -1)


def dequantize(packed_NH, scale_NG, dtype=jnp.float32) -> jax.Array:
    """float [N, K]: each input's integer times its group's scale."""
    q_NK = unpack(packed_NH)
    N, K, G = q_NK.shape[0], q_NK.shape[1], scale_NG.shape[-1]
    w_NGC = q_NK.reshape(N, G, K // G).astype(dtype) * scale_NG[..., None].astype(dtype)
    return w_NGC.reshape(N, K)


def matmul(x_MK, packed_NH, scale_NG) -> jax.Array:
    """x @ dequantize(w)^T in float32 -> [M, N]: XLA fuses the unpack and scaling into the dot's operand
    on GPUs and TPUs (the weights read as 4 bits); on a CPU it widens them first (prefill's few calls).
    16-bit activations multiply 16-bit weights (int4 times a bfloat16 scale rounds once), float32 ones
    float32 weights; either way accumulated in float32."""
    dtype = x_MK.dtype if jnp.dtype(x_MK.dtype).itemsize == 2 else jnp.float32
    w_NK = dequantize(packed_NH, scale_NG, dtype)
    dims = (((1,), (1,)), ((), ()))
    return jax.lax.dot_general(x_MK.astype(dtype), w_NK, dims, preferred_element_type=jnp.float32)
