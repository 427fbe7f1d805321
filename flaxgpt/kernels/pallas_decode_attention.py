"""A decoding step's attention over a contiguous KV cache with the step's key and value written into the
cache by the same kernel: Pallas on the Triton backend, for GPUs.

    y_NGK, k_NSK, v_NSK = attend(q_NGK, k_NK, v_NK, pos_B, k_NSK, v_NSK, scale=K**-0.5)
    ... = attend(..., interpret=True)             # the same program run by Pallas on the CPU

N = B * J cache rows (key/value head j of sequence b, models/cache.py's ContiguousLayer), G query heads
a key/value head, S cache positions, K head dim; one query position a row (decoding). XLA's decoding
step is four kernels a layer here (the k scatter, q . k, the v scatter, softmax + p . v: 48 of GPT-2's
157 a token, docs/accelerators.md); this is one. A program owns one cache row: it writes the new key and
value at `pos` (positions >= S are dropped, as the scatter's), and attends over the cache's positions
before `pos` plus the new key, read from registers rather than back from the cache (a program's store
is not ordered before its own later loads); blocks of BLOCK_S positions with an online softmax (a
running max and sum), only the blocks before `pos` read, AHEAD blocks' loads queued ahead of the one
summed (kernels.pallas_decode.pipelined). Logits and softmax in float32; the output
rounded to q's dtype. The cache buffers are the call's outputs too (input_output_aliases): written in
place, never copied.

Who calls it and when: models/cache.py (ContiguousLayer.attend) where models.linear.decode_kernels takes
the decode kernels, without a window or the attention weights asked for. `why_not` says why a shape
does not tile ("" when it does).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flaxgpt.kernels import pallas_decode

BLOCK_S = 64  # cache positions a step: a [64, K] tile of keys and one of values
AHEAD = 2  # blocks whose loads are in flight ahead of the one being summed
_NEG = -1e30  # a masked logit: finite, so a fully masked block gives exp(-inf + inf) nowhere


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def why_not(N: int, G: int, S: int, K: int) -> str:
    """'' when the kernel takes q [N, G, K] over a cache [N, S, K], else why not."""
    if not (_pow2(G) and _pow2(K) and K >= 16):
        return f"G={G} query heads a key/value head and head dim K={K} must be powers of two (K >= 16)"
    if S % min(BLOCK_S, S) or S < 16:
        return f"cache length S={S} must be >= 16 and a multiple of {BLOCK_S} (or smaller than it)"
    return ""


def attend(q_NGK, k_NK, v_NK, pos_B, k_NSK, v_NSK, *, scale: float, softcap: float = 0.0, interpret=False):
    """(y [N, G, K] in q's dtype, keys [N, S, K], values [N, S, K]): the new key and value written at
    the row's position (dropped where >= S), then softmax(scale * q . k) . v over positions <= it.
    pos_B: a position per sequence, its N / B cache rows (key/value heads) consecutive; B = N gives each
    row its own (the positions are not broadcast over the heads first: a GPU kernel a token)."""
    N, G, K = q_NGK.shape
    S = k_NSK.shape[1]
    why = why_not(N, G, S, K)
    if why:
        raise ValueError(f"decode attention cannot take q {q_NGK.shape} over a cache {k_NSK.shape}: {why}; "
                         "FLAXGPT_DECODE_KERNELS=off keeps XLA's path")  # fmt: skip
    if N % pos_B.shape[0]:
        raise ValueError(f"decode attention: {pos_B.shape[0]} positions for {N} cache rows (a divisor of N)")
    J = N // pos_B.shape[0]
    kernel = functools.partial(_kernel, S, min(BLOCK_S, S), float(scale), float(softcap), J)
    shapes = (
        jax.ShapeDtypeStruct((N, G, K), q_NGK.dtype),
        jax.ShapeDtypeStruct(k_NSK.shape, k_NSK.dtype),
        jax.ShapeDtypeStruct(v_NSK.shape, v_NSK.dtype),
    )
    call = pl.pallas_call(
        kernel,
        grid=(N,),
        out_shape=shapes,
        input_output_aliases={4: 1, 5: 2},  # the caches, updated in place
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),  # its loads queued by the kernel
        interpret=interpret,
        name="decode_attention",
    )
    return call(q_NGK, k_NK, v_NK, pos_B.astype(jnp.int32), k_NSK, v_NSK)


def _kernel(S, bs, scale, softcap, J, q_ref, kn_ref, vn_ref, pos_ref, kc_ref, vc_ref, y_ref, ko_ref, vo_ref):
    del kc_ref, vc_ref  # the same buffers as ko_ref, vo_ref (aliased): read and written through those
    f32 = jnp.float32
    n = pl.program_id(0)
    pos = pos_ref[n // J]
    q = q_ref[n, :, :].astype(f32) * scale  # [G, K]
    kn, vn = kn_ref[n, :], vn_ref[n, :]

    @pl.when(pos < S)
    def _write():
        ko_ref[n, pl.ds(pos, 1), :] = kn[None, :].astype(ko_ref.dtype)
        vo_ref[n, pl.ds(pos, 1), :] = vn[None, :].astype(vo_ref.dtype)

    def logits(s):
        return softcap * jnp.tanh(s / softcap) if softcap else s

    # the new key first (rounded as the cache holds it), then the cache's positions before pos
    new = pos < S
    top = jnp.where(new, logits(jnp.sum(q * kn.astype(ko_ref.dtype).astype(f32)[None, :], axis=1)), _NEG)
    total = jnp.where(new, jnp.ones_like(top), jnp.zeros_like(top))
    acc = total[:, None] * vn.astype(vo_ref.dtype).astype(f32)[None, :]  # [G, K]
    before = jnp.minimum(pos, S)

    blocks = pl.cdiv(before, bs)

    def tiles(j):  # block j's keys and values as the cache holds them
        rows = pl.ds(j * bs, bs)
        return ko_ref[n, rows, :], vo_ref[n, rows, :]

    def step(j, kv, carry):
        top, total, acc = carry
        k, v = kv[0].astype(f32), kv[1].astype(f32)  # [bs, K]
        s = logits(jnp.sum(q[:, None, :] * k[None, :, :], axis=2))  # [G, bs]
        s = jnp.where((j * bs + jnp.arange(bs))[None, :] < before, s, _NEG)
        top_new = jnp.maximum(top, jnp.max(s, axis=1))
        p = jnp.exp(s - top_new[:, None])
        fade = jnp.exp(top - top_new)
        acc = acc * fade[:, None] + jnp.sum(p[:, :, None] * v[None, :, :], axis=1)
        return top_new, total * fade + jnp.sum(p, axis=1), acc

    # AHEAD blocks' keys and values in flight while a block waits on its own (pallas_decode.pipelined):
    # a program's blocks are one DRAM round trip after another otherwise; where no position precedes
    # pos, block 0 is read and unused (S >= bs)
    top, total, acc = pallas_decode.pipelined(0, blocks, AHEAD, tiles, step, (top, total, acc))
    y_ref[n, :, :] = (acc / total[:, None]).astype(y_ref.dtype)
