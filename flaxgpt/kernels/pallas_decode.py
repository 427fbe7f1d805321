"""A decoding row's float GEMV with the norm before it and the residual after it, one Pallas kernel for
GPUs (the Triton backend).

    y_MN = gemv(x_MK, w_KN, b_N, norm=Norm("layernorm", g_K, beta_K, 1e-5), activation=gelu)
    y_MN = gemv(h_MK, w_KN, b_N, residual_MN=x_MN)      # x + h @ w + b: c_proj and the residual add
    y_MN = gemv(x_MK, wte_VK, norm=Norm(...), rows_w=True)  # ln_f + a tied head: w as [N, K] rows
    y_MN = gemv(..., interpret=True)                     # the same program run by Pallas on the CPU

GPT-2 at batch 1 is launch-bound: its compiled token loop is 228 kernels, 14 a layer, at ~1.9 us a
launch on an H100 (docs/accelerators.md, "Kernels a decoding token"). XLA leaves each LayerNorm as two
kernels before the product that reads it, writes a one-row product as a multiply and a separate sum,
and the residual add apart. Here one program owns `bn` output channels: it first walks the row once
for the norm's statistics (K floats a row, from L2 after the first program), then walks K again,
normalizing each block of x as it multiplies it by the weight tile [bk, bn] (the weights read once, as
flax's kernel [K, N] lies: each tile's rows contiguous), and its epilogue adds the bias, applies the
activation and adds the residual. So ln_1 + c_attn, ln_2 + c_fc + GELU, and each c_proj + bias +
residual are one kernel each; so is the final norm + a tied head (`rows_w`: the weight as the token
table lies, [V, K], each program's tile [bn, bk] the rows of its channels).

The arithmetic is the plain path's: the norm in float32 (flax's LayerNorm: var = E[x^2] - E[x]^2,
clipped at 0; RMSNorm: E[x^2]), rounded to the compute dtype before the product as the plain path
hands the product a rounded input; products and sums in float32; the output rounded to the compute
dtype before the residual is added (the plain path adds two rounded arrays), then to the output dtype.

Rows are few (M <= MAX_ROWS: decoding; a prefill's many rows are a compute-bound GEMM, XLA's); the
products are multiplies and row sums, not Triton's dot, whose tiles start at 16 rows. Tiles never read
past the arrays (as kernels.pallas_qgemv): the last block of channels starts at N - bn and the last
block of K at K - bk, the inputs an earlier block summed masked; bn and bk are powers of two (Triton's
rule) no larger than N and K. `why_not` says why a shape does not tile ("" when it does); `gemv`
refuses the others in one line. `tiles=Tiles(bn, bk, num_warps, num_stages)` overrides the tiling
(kernels.pallas_qgemv takes the same; benchmarks/kernel_sweep.py times a grid of them on a GPU);
None takes the tiling measured fastest for the shape on the card where FLAXGPT_GEMV_TILES names
kernel_sweep's file (kernels.tuned), else `default_tiles`, 4 warps and 3 stages, chosen on paper.

The K loop is pipelined by the kernel itself: step j + num_stages - 1's inputs (weight tile, x, the
norm's scale and bias) are asked for at the top of step j, so num_stages - 1 steps' loads are in flight
while step j waits on its own. Triton's pipeliner leaves loads that feed no dot alone (the compiled
PTX had none ahead, and each step's row sums, crossing warps, put barriers between one step's loads
and the next's: the ~5 us a call the 2026-11-29 lease measured), so Triton is told 1 stage. Where a
thread holds them (`tile_sums_fit`: batch 1 at the default tiles) each
row's products are summed as whole tiles and along K once after the loop, so the loop has no shuffle
(tests/aot/test_decode_kernels.py reads the PTX compiled for an H100, and ptxas's registers).
Who calls it and when: models.linear (`decode_kernels`, FLAXGPT_DECODE_KERNELS: float weights as [K, N],
and `--quantize bf16`'s as their rows [N, K], the layout whose programs read long runs with few channels
each: ROWS_BLOCK_N); models.gpt (a tied head).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flaxgpt.kernels import tuned

MAX_ROWS = 8  # decoding rows the kernel takes; more are prefill, where XLA's GEMM is compute-bound
BLOCK_N = 32  # output channels a program: GPT-2's 768 make 24 programs, c_fc's 3072 make 96
BLOCK_K = 128  # inputs a step: a [128, 32] float32 tile, 32 values a thread at 4 warps
MIN_DIM = 16  # the smallest K step, and the smallest N and K of a weight the kernel takes
# output channels a program: any power of two (the products are multiplies and row sums, not Triton's
# dot, whose tiles start at 16): GPT-2's 768 outputs make 24 programs at 32, 192 at 4 (of 132 SMs)
MIN_BLOCK_N = 1
# float32 sums a thread may hold for tile_sums (a row's [bk, bn] products kept whole, summed along K
# once): 32 at batch 1's default tiles (32 x 128 and 8 x 256 at 4 warps: 4,096 and 2,048 sums)
TILE_SUMS = 32
# w as rows [N, K] (`rows_w`: a tied head's table, `--quantize bf16`'s weights): fewer channels a
# program and longer steps along K, each channel's bf16 run 512 bytes (a prediction for a GPU until
# benchmarks/kernel_sweep.py's bf16_rows measures it): GPT-2's 768 outputs make 96 programs
ROWS_BLOCK_N = 8
ROWS_BLOCK_K = 256
NORMS = ("layernorm", "rmsnorm")
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class Tiles(NamedTuple):
    """A GEMV kernel's tiling: output channels a program (a power of two >= MIN_BLOCK_N), inputs a step
    (a power of two >= MIN_DIM), at most N and K, Triton's warps a program, and the pipeline's stages
    (the kernel's own: num_stages - 1 steps' loads queued ahead, `pipelined`); split_k > 1 (only
    kernels.pallas_qgemv's) splits K into that many ranges, each its own program, summed after."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1

    def why_not(self, N: int, K: int) -> str:
        """'' when the tiling fits w with N outputs and K inputs, else why not."""
        for name, v, side, dim, least in (
            ("block_n", self.block_n, "N", N, MIN_BLOCK_N),
            ("block_k", self.block_k, "K", K, MIN_DIM),
        ):
            if v < least or v & (v - 1):
                return f"{name}={v} is not a power of two >= {least}"
            if v > dim:
                return f"{name}={v} > {side}={dim}"
        if self.num_warps not in (1, 2, 4, 8, 16, 32):  # Triton's: a power of two, at most 1024 threads
            return f"num_warps={self.num_warps} is not a power of two <= 32"
        if self.num_stages < 1:
            return f"num_stages={self.num_stages} < 1"
        if self.split_k < 1:
            return f"split_k={self.split_k} < 1"
        return ""


class Norm(NamedTuple):
    """The norm applied to x before the product: flax's LayerNorm (scale, bias or None) or RMSNorm
    (scale; bias None), over the last axis, in float32."""

    kind: str
    scale_K: Any
    bias_K: Any
    eps: float


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def why_not(M: int, N: int, K: int) -> str:
    """'' when the kernel tiles x [M, K] @ w [K, N], else why not."""
    if M > MAX_ROWS:
        return f"{M} rows > MAX_ROWS {MAX_ROWS} (prefill: a compute-bound GEMM)"
    if N < MIN_DIM or K < MIN_DIM:
        return f"w [{K}, {N}] has a side < {MIN_DIM} (Triton's smallest tile)"
    return ""


def _dtypes_why(*dtypes) -> str:
    """'' when the kernel takes every one of these dtypes, else the first it does not."""
    bad = [str(jnp.dtype(d)) for d in dtypes if jnp.dtype(d) not in DTYPES]
    return f"dtype {bad[0]} (the kernel takes float32, bfloat16, float16)" if bad else ""


def takes(M: int, N: int, K: int, *dtypes) -> bool:
    """Whether `gemv` takes x [M, K] @ w [K, N] with these dtypes
    (x's, w's, the compute's, the output's)."""
    return not (why_not(M, N, K) or _dtypes_why(*dtypes))


def default_tiles(N: int, K: int, rows_w: bool = False) -> Tiles:
    """The tiling `gemv` takes when given none (kernel_sweep marks its row as the default): BLOCK_N and
    BLOCK_K, ROWS_BLOCK_N and ROWS_BLOCK_K with `rows_w`, within the shape."""
    most_n, most_k = (ROWS_BLOCK_N, ROWS_BLOCK_K) if rows_w else (BLOCK_N, BLOCK_K)
    return Tiles(min(most_n, _pow2_floor(N)), min(most_k, _pow2_floor(K)))


def gemv(
    x_MK,
    w_KN,
    bias_N=None,
    *,
    norm: Norm | None = None,
    activation=None,
    residual_MN=None,
    rows_w: bool = False,
    dtype=None,
    out_dtype=None,
    tiles: Tiles | None = None,
    interpret: bool = False,
):
    """residual + activation(norm(x) @ w + bias) -> [M, N] in `out_dtype` (default `dtype`); `dtype`
    (default x's) is the compute dtype the normalized x and the product are rounded to (the plain
    path's). `rows_w`: w_KN is given as its transpose [N, K] (a tied head's token table), read as it lies.
    `tiles`: the tiling (None: the one measured for the shape on the card, kernels.tuned's
    FLAXGPT_GEMV_TILES, else `default_tiles`)."""
    M, K = x_MK.shape
    w_K, N = w_KN.shape[::-1] if rows_w else w_KN.shape
    dtype = jnp.dtype(dtype or x_MK.dtype)
    out_dtype = jnp.dtype(out_dtype or dtype)
    if w_K != K:
        raise ValueError(f"decode gemv: x {x_MK.shape} and w {w_KN.shape} (rows_w={rows_w}) disagree on K")
    why = why_not(M, N, K)
    why = why or _dtypes_why(x_MK.dtype, w_KN.dtype)
    if norm is not None and norm.kind not in NORMS:
        why = why or f"norm {norm.kind!r} (it takes {NORMS})"
    if why:
        raise ValueError(f"decode gemv cannot take x {x_MK.shape} @ w [{K}, {N}]: {why}; "
                         "FLAXGPT_DECODE_KERNELS=off keeps XLA's path")  # fmt: skip
    if residual_MN is not None and residual_MN.shape != (M, N):
        raise ValueError(f"decode gemv: residual {residual_MN.shape} is not the output's [{M}, {N}]")
    args, have = [x_MK], []
    for name, a in (
        ("g", None if norm is None else norm.scale_K),
        ("beta", None if norm is None else norm.bias_K),
        ("w", w_KN),
        ("b", bias_N),
        ("res", residual_MN),
    ):
        if a is not None:
            args.append(a)
            have.append(name)
    measured = None if tiles else tuned.lookup(tuned.kernel_name(w_KN.dtype, rows_w), N, K, M)
    tiles = tiles or (Tiles(*measured) if measured else default_tiles(N, K, rows_w))
    why = tiles.why_not(N, K) or (
        f"split_k={tiles.split_k}: this kernel's epilogue (norm, activation, residual) needs whole "
        "sums; split K in kernels.pallas_qgemv only" if tiles.split_k != 1 else "")  # fmt: skip
    if why:
        where = tuned.source() if measured else ""
        raise ValueError(f"decode gemv: tiles {tuple(tiles)}{where} do not fit w [{K}, {N}]: {why}")
    spec = _Spec(
        M, N, K, tiles.block_n, tiles.block_k, tuple(have),
        None if norm is None else norm.kind, 0.0 if norm is None else float(norm.eps), activation, dtype,
        rows_w, tiles.num_stages - 1,
        tile_sums_fit(M, tiles),
    )  # fmt: skip
    call = pl.pallas_call(
        functools.partial(_kernel, spec),
        grid=(pl.cdiv(N, spec.bn),),
        out_shape=jax.ShapeDtypeStruct((M, N), out_dtype),
        # the stages are the kernel's own (`ahead`): Triton's pipeliner would add none to these loads
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        interpret=interpret,
        name="decode_gemv",
    )
    return call(*args)


def normalize(x, norm: Norm) -> jax.Array:
    """norm(x) over the last axis in float32 (at least), flax's LayerNorm / RMSNorm arithmetic: the
    kernel's prologue as XLA's steps (models.linear when the kernel is not taken)."""
    acc = jnp.promote_types(x.dtype, jnp.float32)
    x = x.astype(acc)
    mean_sq = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    if norm.kind == "rmsnorm":
        return x * (jax.lax.rsqrt(mean_sq + norm.eps) * norm.scale_K.astype(acc))
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.maximum(mean_sq - jnp.square(mean), 0.0)
    y = (x - mean) * (jax.lax.rsqrt(var + norm.eps) * norm.scale_K.astype(acc))
    return y if norm.bias_K is None else y + norm.bias_K.astype(acc)


class _Spec(NamedTuple):
    M: int
    N: int
    K: int
    bn: int
    bk: int
    have: tuple  # which of g, beta, w, b, res were passed (their refs follow x's in this order)
    norm: str | None
    eps: float
    activation: Any
    dtype: Any
    rows_w: bool  # w given as [N, K]
    ahead: int  # steps' inputs loaded ahead of the step using them (tiles.num_stages - 1)
    tile_sums: bool  # products summed as whole tiles (TILE_SUMS a thread at most), along K at the end


def _kernel(s: _Spec, x_ref, *refs):
    *refs, o_ref = refs
    refs = dict(zip(s.have, refs, strict=True))
    f32 = jnp.float32
    first = jnp.minimum(pl.program_id(0) * s.bn, s.N - s.bn)  # in bounds: see the module doc
    cols = pl.ds(first, s.bn)
    steps = pl.cdiv(s.K, s.bk)

    def block(j):
        """Step j's inputs: bk from min(j * bk, K - bk), and which of them no earlier step took."""
        start = jnp.minimum(j * s.bk, s.K - s.bk)
        return pl.ds(start, s.bk), start + jnp.arange(s.bk) >= j * s.bk

    stats = [(0.0, 1.0)] * s.M  # (mean, 1 / std) a row
    if s.norm is not None:

        def moments(j, sums):  # sums as vectors, reduced once after the loop (a reduction a step crosses
            ks, fresh = block(j)  # warps: barriers)
            out = []
            for m in range(s.M):
                x = jnp.where(fresh, x_ref[m, ks].astype(f32), 0.0)
                out += [sums[2 * m] + x, sums[2 * m + 1] + x * x]
            return tuple(out)

        zeros = tuple(jnp.zeros((s.bk,), f32) for _ in range(2 * s.M))
        sums = [jnp.sum(v) for v in jax.lax.fori_loop(0, steps, moments, zeros)]
        stats = []
        for m in range(s.M):
            mean, mean_sq = sums[2 * m] / s.K, sums[2 * m + 1] / s.K
            if s.norm == "rmsnorm":
                stats.append((0.0, jax.lax.rsqrt(mean_sq + s.eps)))
            else:
                stats.append((mean, jax.lax.rsqrt(jnp.maximum(mean_sq - mean * mean, 0.0) + s.eps)))

    def loads(j):
        """Step j's inputs as they lie: the weight tile ([bn, bk] rows, or [bk, bn]), the norm's scale
        and bias, each row's x."""
        ks = block(j)[0]
        w = refs["w"][cols, ks] if s.rows_w else refs["w"][ks, cols]
        g_beta = {k: refs[k][ks] for k in ("g", "beta") if k in refs}
        return w, g_beta, tuple(x_ref[m, ks] for m in range(s.M))

    def step(j, inputs, accs):
        w, g_beta, xs = inputs
        ks, fresh = block(j)
        if s.rows_w:  # the table's rows of these channels, [bn, bk], summed along its rows (no transpose)
            w = jnp.where(fresh[None, :], w.astype(f32), 0.0)
        else:
            w = jnp.where(fresh[:, None], w.astype(f32), 0.0)  # [bk, bn]
        g = g_beta["g"].astype(f32) if "g" in g_beta else 1.0
        beta = g_beta["beta"].astype(f32) if "beta" in g_beta else 0.0
        out = []
        for acc, x, (mean, rstd) in zip(accs, xs, stats, strict=True):
            x = jnp.where(fresh, x.astype(f32), 0.0)
            if s.norm is not None:  # normalized, then rounded as the plain path hands it to the product
                x = ((x - mean) * (rstd * g) + beta).astype(s.dtype).astype(f32)
            xw = x[None, :] * w if s.rows_w else x[:, None] * w
            out.append(acc + (xw if s.tile_sums else sum_k(xw)))
        return tuple(out)

    sum_k = functools.partial(jnp.sum, axis=1 if s.rows_w else 0)
    # tile_sums: each row's products summed as whole tiles, along K once after the loop (a sum a step
    # crosses warps: barriers and shuffles every step), where the tiles fit the registers
    shape = ((s.bn, s.bk) if s.rows_w else (s.bk, s.bn)) if s.tile_sums else (s.bn,)
    zeros = tuple(jnp.zeros(shape, f32) for _ in range(s.M))
    accs = pipelined(0, steps, s.ahead, loads, step, zeros)
    accs = [sum_k(acc) for acc in accs] if s.tile_sums else accs
    b = refs["b"][cols].astype(f32) if "b" in refs else 0.0
    for m, acc in enumerate(accs):
        y = acc + b
        if s.activation is not None:
            y = s.activation(y)
        if "res" in refs:  # two rounded arrays added, as the plain path's x + h
            y = refs["res"][m, cols].astype(f32) + y.astype(s.dtype).astype(f32)
        o_ref[m, cols] = y.astype(o_ref.dtype)


def tile_sums_fit(M: int, tiles: Tiles) -> bool:
    """Whether M rows' [block_n, block_k] float32 products fit TILE_SUMS a thread: a GEMV may then sum
    them as whole tiles and along K once after its loop (no sum crossing threads a step)."""
    return M * tiles.block_n * tiles.block_k <= TILE_SUMS * 32 * tiles.num_warps


def pipelined(lo, hi, ahead: int, loads, step, init):
    """fori_loop(lo, hi) of accs = step(j, inputs, accs) where step j's inputs, `loads(j)` (a pytree of
    loads from refs), were asked for `ahead` steps before it: at the top of step j - ahead, so that many
    steps' loads are in flight while a step waits on its own. Triton's pipeliner (num_stages) leaves
    loads that feed no dot alone, and a step's sums crossing warps put barriers that loads asked later
    would wait behind (the decode GEMVs' and attention's loops, as the 2026-11-29 lease timed them).
    Steps past hi - 1 load step hi - 1 again (unused); lo < hi is the caller's (an empty loop loads
    step lo's inputs, unused: they must be in bounds). The kernels here and in kernels.pallas_qgemv and
    kernels.pallas_decode_attention loop through it."""

    def body(j, carry):
        accs, queued = carry
        if not queued:
            return step(j, loads(j), accs), queued
        inputs, queued = queued[0], (*queued[1:], loads(jnp.minimum(j + len(queued), hi - 1)))
        return step(j, inputs, accs), queued

    last = jnp.maximum(hi - 1, lo)
    primed = tuple(loads(jnp.minimum(lo + i, last)) for i in range(ahead))
    return jax.lax.fori_loop(lo, hi, body, (init, primed))[0]
