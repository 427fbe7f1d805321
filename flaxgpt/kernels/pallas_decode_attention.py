"""A decoding step's attention over a contiguous KV cache with the step's key and value written into the
cache by the same kernel: Pallas on the Triton backend, for GPUs.

    y_BHK, k_NSK, v_NSK = attend(qkv_BCK, pos_B, k_NSK, v_NSK, scale=K**-0.5)
    ... = attend(..., interpret=True)             # the same program run by Pallas on the CPU

N = B * J cache rows (key/value head j of sequence b, models/cache.py's ContiguousLayer), G query heads
a key/value head (H = J * G), C = H + 2J, S cache positions, K head dim; one query position a row
(decoding). XLA's decoding step is 4-7 kernels a layer here (the k and v scatters, q . k, softmax, p . v,
and for a Llama the ropes and p . v's split-K sum; docs/accelerators.md); this is one, and q, k and v
come as one array, so whatever writes them (rope's fusion, or c_attn's output as it lies) is one kernel
too. A program owns one cache row: it writes the new key and
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

A cache longer than SPAN positions is split into ranges, a program each (flash-decoding's split: the
Llama-3-8B shape's 8 key/value heads over 8192 positions are 64 programs, not 8 walking 128 blocks
alone), each writing its softmax terms (max, sum, weighted values; the first range also the new key's)
for XLA to merge after. XLA's path stays the default until a lease measures this against it
(benchmarks/decode_attention.py; gpu_lease.py's `+attention` rows).

Who calls it and when: models/cache.py (ContiguousLayer.attend) where models.linear.decode_kernels takes
the attention kernel (FLAXGPT_DECODE_KERNELS=on or attention), without a window or the attention weights
asked for. `why_not` says why a shape does not tile ("" when it does).
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
# cache positions a program walks at most (a multiple of BLOCK_S): a longer cache is split over
# programs whose partial softmaxes (max, sum, weighted values) XLA merges after, flash-decoding's
# split, so a long cache's few key/value heads (the Llama-3-8B shape's 8) are not 8 programs walking
# every position alone; caches up to SPAN (the lease's decoding: 192-320) are one program a row
SPAN = 1024
_NEG = -1e30  # a masked logit: finite, so a fully masked block gives exp(-inf + inf) nowhere


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def why_not(N: int, G: int, S: int, K: int) -> str:
    """'' when the kernel takes q [N, G, K] over a cache [N, S, K], else why not."""
    if not (_pow2(G) and _pow2(K) and K >= 16):
        return f"G={G} query heads a key/value head and head dim K={K} must be powers of two (K >= 16)"
    if S % BLOCK_S if S >= BLOCK_S else not (_pow2(S) and S >= 16):  # a block is a Triton tile: 2^n rows
        return f"cache length S={S} must be a multiple of {BLOCK_S}, or a power of two from 16 below it"
    return ""


def attend(
    qkv_BCK, pos_B, k_NSK, v_NSK, *, scale: float, softcap: float = 0.0, span: int = SPAN, interpret=False
):
    """(y [B, H, K] in q's dtype, keys [N, S, K], values [N, S, K]): each key/value head's new key and
    value written at its sequence's position (dropped where >= S), then softmax(scale * q . k) . v
    over positions <= it. qkv_BCK: sequence b's H query heads, then its J keys, then its J values
    (C = H + 2J), as one array: the product's columns q | k | v as they lie, or rope's one fusion
    writing them (a kernel a layer where three arrays took three); its J cache rows are consecutive
    (N = B * J), and query heads j*G .. j*G+G-1 read key/value head j. A cache longer than `span`
    positions is split into ceil(S / span) ranges, a program each, merged after by XLA."""
    B, C, K = qkv_BCK.shape
    N, S = k_NSK.shape[:2]
    J = N // B
    if N % B or C <= 2 * J or (C - 2 * J) % J:
        raise ValueError(f"decode attention: q|k|v {qkv_BCK.shape} of {B} sequences over {N} cache rows: "
                         "N must be B x J and C = H + 2J with J dividing H")  # fmt: skip
    H = C - 2 * J
    why = why_not(N, H // J, S, K)
    if why:
        raise ValueError(f"decode attention cannot take q|k|v {qkv_BCK.shape} over a cache {k_NSK.shape}: "
                         f"{why}; FLAXGPT_DECODE_KERNELS=off keeps XLA's path")  # fmt: skip
    bs, G = min(BLOCK_S, S), H // J
    parts = -(-S // span)
    if parts > 1 and span % bs:
        raise ValueError(f"decode attention: span={span} is not a multiple of the block of {bs} positions")
    blocks_per = span // bs if parts > 1 else -(-S // bs)
    kernel = functools.partial(_kernel, S, bs, blocks_per, parts, float(scale), float(softcap), J, G)
    f32 = jnp.float32
    if parts == 1:  # y
        shapes = [jax.ShapeDtypeStruct((B, H, K), qkv_BCK.dtype)]
    else:  # each range's max and sum of exp(logit - max) [N, parts, G], its weighted values [N, parts, G, K]
        shapes = [jax.ShapeDtypeStruct((N, parts, G), f32)] * 2 + [
            jax.ShapeDtypeStruct((N, parts, G, K), f32)
        ]
    caches = [jax.ShapeDtypeStruct(k_NSK.shape, k_NSK.dtype), jax.ShapeDtypeStruct(v_NSK.shape, v_NSK.dtype)]
    call = pl.pallas_call(
        kernel,
        grid=(N, parts),
        out_shape=(*shapes, *caches),
        input_output_aliases={2: len(shapes), 3: len(shapes) + 1},  # the caches, updated in place
        compiler_params=plgpu.CompilerParams(num_warps=8, num_stages=1),  # its loads queued by the kernel
        interpret=interpret,
        name="decode_attention",
    )
    *out, k_NSK, v_NSK = call(qkv_BCK, pos_B.astype(jnp.int32), k_NSK, v_NSK)
    if parts == 1:
        return out[0], k_NSK, v_NSK
    top_NPG, total_NPG, acc_NPGK = out  # merged: each range's terms rescaled to the largest max
    fade_NPG = jnp.exp(top_NPG - jnp.max(top_NPG, axis=1, keepdims=True))
    y_NGK = jnp.sum(acc_NPGK * fade_NPG[..., None], axis=1) / jnp.sum(total_NPG * fade_NPG, axis=1)[..., None]
    return y_NGK.astype(qkv_BCK.dtype).reshape(B, H, K), k_NSK, v_NSK


def _kernel(S, bs, blocks_per, parts, scale, softcap, J, G, qkv_ref, pos_ref, kc_ref, vc_ref, *out_refs):
    del kc_ref, vc_ref  # the same buffers as ko_ref, vo_ref (aliased): read and written through those
    *out_refs, ko_ref, vo_ref = out_refs
    f32 = jnp.float32
    n, part = pl.program_id(0), pl.program_id(1)  # part: which range of the cache's positions
    b, j, H = n // J, n % J, G * J
    pos = pos_ref[b]
    q = qkv_ref[b, pl.ds(j * G, G), :]  # [G, K]
    K, R = q.shape[1], max(MIN_ROWS, G)
    # the tensor cores' products take >= 16 rows: G < 16 query heads are repeated to R rows (the same
    # arithmetic on each copy, so their results are equal bit for bit; one copy is stored)
    q_RK = q if G == R else jnp.broadcast_to(q[None], (R // G, G, K)).reshape(R, K)
    kn, vn = qkv_ref[b, H + j, :], qkv_ref[b, H + J + j, :]

    # XLA's path's arithmetic (models.attention.attend_cached): q . k in q's dtype with float32 sums (full
    # float32 products for float32, not TF32), then the scale; the probabilities rounded to v's dtype
    def dot(a, b, contract_b):  # a [R, X] . b over b's axis contract_b -> [R, Y] float32
        exact = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
        dims = (((1,), (contract_b,)), ((), ()))
        return jax.lax.dot_general(a, b, dims, precision=exact, preferred_element_type=f32)

    # the first range's program writes the new key and value, and counts them
    new = (pos < S) & (part == 0)

    @pl.when(new)
    def _write():
        ko_ref[n, pl.ds(pos, 1), :] = kn[None, :].astype(ko_ref.dtype)
        vo_ref[n, pl.ds(pos, 1), :] = vn[None, :].astype(vo_ref.dtype)

    def logits(s):
        s = s * scale
        return softcap * jnp.tanh(s / softcap) if softcap else s

    # the new key first (rounded as the cache holds it, then to q's dtype), then the positions before pos
    kn_q = kn.astype(ko_ref.dtype).astype(q.dtype).astype(f32)
    top = jnp.where(new, logits(jnp.sum(q_RK.astype(f32) * kn_q[None, :], axis=1)), _NEG)  # [R]
    total = jnp.where(new, jnp.ones_like(top), jnp.zeros_like(top))
    acc = total[:, None] * vn.astype(vo_ref.dtype).astype(f32)[None, :]  # [R, K]
    before = jnp.minimum(pos, S)

    lo = part * blocks_per
    hi = jnp.minimum(lo + blocks_per, pl.cdiv(before, bs))  # this range's blocks before pos (maybe none)

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
    # pos in this range, its first block is read and unused (lo < the cache's blocks)
    top, total, acc = pallas_decode.pipelined(lo, hi, AHEAD, tiles, step, (top, total, acc))
    # one of the equal copies: their max, since Pallas' Triton lowering has no slice of a value
    one = lambda x_R: x_R if G == R else jnp.max(x_R.reshape(R // G, G, *x_R.shape[1:]), axis=0)  # noqa: E731
    if parts == 1:
        y_ref = out_refs[0]
        y_ref[b, pl.ds(j * G, G), :] = one(acc / total[:, None]).astype(y_ref.dtype)
    else:
        top_ref, total_ref, acc_ref = out_refs
        top_ref[n, part, :], total_ref[n, part, :], acc_ref[n, part, :, :] = one(top), one(total), one(acc)
