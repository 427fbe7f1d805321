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
summed (kernels.pallas_decode.pipelined). q . k and p . v are Triton dots (the tensor cores), with the
G query heads repeated to MIN_ROWS rows where fewer (GPT-2's G = 1: as multiplies summed across
threads they were 205 shuffles and 24 barriers a block in the compiled PTX, 20 and 14 now), in XLA's
path's arithmetic: q . k in q's dtype with float32 sums (full float32 for float32, not TF32), then the
scale; softmax in float32, the probabilities rounded to v's dtype for p . v; the output rounded to q's
dtype. The cache buffers are the call's outputs too (input_output_aliases): written in
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
MIN_ROWS = 16  # rows of a tensor-core product (Triton's dot): fewer query heads are repeated to it
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
        compiler_params=plgpu.CompilerParams(num_warps=8, num_stages=1),  # its loads queued by the kernel
        interpret=interpret,
        name="decode_attention",
    )
    return call(q_NGK, k_NK, v_NK, pos_B.astype(jnp.int32), k_NSK, v_NSK)


def _kernel(S, bs, scale, softcap, J, q_ref, kn_ref, vn_ref, pos_ref, kc_ref, vc_ref, y_ref, ko_ref, vo_ref):
    del kc_ref, vc_ref  # the same buffers as ko_ref, vo_ref (aliased): read and written through those
    f32 = jnp.float32
    n = pl.program_id(0)
    pos = pos_ref[n // J]
    q = q_ref[n, :, :]  # [G, K]
    (G, K), R = q.shape, max(MIN_ROWS, q.shape[0])
    # the tensor cores' products take >= 16 rows: G < 16 query heads are repeated to R rows (the same
    # arithmetic on each copy, so their results are equal bit for bit; one copy is stored)
    q_RK = q if G == R else jnp.broadcast_to(q[None], (R // G, G, K)).reshape(R, K)
    kn, vn = kn_ref[n, :], vn_ref[n, :]

    # XLA's path's arithmetic (models.attention.attend_cached): q . k in q's dtype with float32 sums (full
    # float32 products for float32, not TF32), then the scale; the probabilities rounded to v's dtype
    def dot(a, b, contract_b):  # a [R, X] . b over b's axis contract_b -> [R, Y] float32
        exact = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
        dims = (((1,), (contract_b,)), ((), ()))
        return jax.lax.dot_general(a, b, dims, precision=exact, preferred_element_type=f32)

    @pl.when(pos < S)
    def _write():
        ko_ref[n, pl.ds(pos, 1), :] = kn[None, :].astype(ko_ref.dtype)
        vo_ref[n, pl.ds(pos, 1), :] = vn[None, :].astype(vo_ref.dtype)

    def logits(s):
        s = s * scale
        return softcap * jnp.tanh(s / softcap) if softcap else s

    # the new key first (rounded as the cache holds it, then to q's dtype), then the positions before pos
    new = pos < S
    kn_q = kn.astype(ko_ref.dtype).astype(q.dtype).astype(f32)
    top = jnp.where(new, logits(jnp.sum(q_RK.astype(f32) * kn_q[None, :], axis=1)), _NEG)  # [R]
    total = jnp.where(new, jnp.ones_like(top), jnp.zeros_like(top))
    acc = total[:, None] * vn.astype(vo_ref.dtype).astype(f32)[None, :]  # [R, K]
    before = jnp.minimum(pos, S)

    blocks = pl.cdiv(before, bs)

    def tiles(j):  # block j's keys and values as the cache holds them
        rows = pl.ds(j * bs, bs)
        return ko_ref[n, rows, :], vo_ref[n, rows, :]

    def step(j, kv, carry):
        top, total, acc = carry
        k, v = kv
        s = logits(dot(q_RK, k.astype(q.dtype), 1))  # [R, bs]
        s = jnp.where((j * bs + jnp.arange(bs))[None, :] < before, s, _NEG)
        top_new = jnp.maximum(top, jnp.max(s, axis=1))
        p = jnp.exp(s - top_new[:, None])
        fade = jnp.exp(top - top_new)
        acc = acc * fade[:, None] + dot(p.astype(v.dtype), v, 0)
        return top_new, total * fade + jnp.sum(p, axis=1), acc

    # AHEAD blocks' keys and values in flight while a block waits on its own (pallas_decode.pipelined):
    # a program's blocks are one DRAM round trip after another otherwise; where no position precedes
    # pos, block 0 is read and unused (S >= bs)
    top, total, acc = pallas_decode.pipelined(0, blocks, AHEAD, tiles, step, (top, total, acc))
    y_RK = acc / total[:, None]
    # one of the equal copies: their max, since Pallas' Triton lowering has no slice of a value
    y_GK = y_RK if G == R else jnp.max(y_RK.reshape(R // G, G, K), axis=0)
    y_ref[n, :, :] = y_GK.astype(y_ref.dtype)
