"""A grouped matmul for mixtures of experts on GPUs, Pallas kernels for the Triton backend.

    y_AF = gmm(x_AD, w_EDF, group_sizes_E)                  # rows sorted by group, as jax.lax.ragged_dot
    y_AF = gmm(x_AD, w_EDF, group_sizes_E, interpret=True)  # the same programs run by Pallas on the CPU
    matmul, weight_grad, matmul_t = fp8_functions(tiled_matmul, tiled_weight_grad)  # for fp8_grouped

Rows starts_e .. ends_e - 1 of x (sorted by expert) times w[e]; rows past sum(group_sizes) give 0.
XLA on NVIDIA GPUs has no grouped GEMM (ragged_dot expands to every row through every expert), and
models.moe's tiled form multiplies each tile of rows by a gathered copy of its group's [D, F] matrix:
about 2E copies of a weight matrix a product and twice the rows' FLOPs. Here the weights are read in
place (megablox's scheme, on GPUs) and a tile of BM rows is multiplied only by the groups it overlaps.

The plan (`_plan`, jnp ops outside the kernel): row tiles of BM rows; each nonempty group visits the
tiles it overlaps, visits listed in tile order (groups are contiguous, so group order is tile order
too) and `first_T1[t]` .. `first_T1[t + 1]` are tile t's. Race-free by ownership: the program that
owns output tile (t, column block j) loops over all of tile t's visits itself, each visit's x rows
masked to its group's, into one float32 accumulator, and stores the tile once. (Per-visit partial
outputs summed afterwards would write and read [V, BM, F] more; programs per visit would race on the
tiles two groups share.) A tile straddling g groups costs g passes over K: (tiles + E - 1) passes in
all, ~A + E * BM rows of work, where the tiled form does ~2A.

Programs run in a swizzled order (`_swizzle`, Triton's grouped ordering): GROUP_M row tiles by all
column blocks, so the programs resident at once share x's rows and w's columns in L2 rather than
streaming all of x (or all of a group's matrix) once per column block (per tile).

Gradients (custom_vjp): dx = gmm(g, w^T), the transposed tiles of w read in place (`trans_b`, no
copy of the stack); dw = `tgmm(x, g)`, a program per [BM, BN] tile of dw[e], looping over group e's
rows BK at a time: each program owns its output, so nothing races either.

Float8 (model.fp8_experts, kernels.fp8.fp8_grouped's products; `fp8_functions`): gmm and tgmm take
`scale` and `out_dtype`, the float8 operands read as they are, float32 sums times the scalar scale in
the epilogue, stored in out_dtype; dX reads the e4m3 stack transposed in place (`transpose_w`). The
forward (e4m3 x e4m3) is a float8 dot; the backward's e5m2 x e4m3 tiles are widened to bf16 in
registers first (exact), as jax 0.10's Pallas takes one element type a dot (`_dot`).

Why Triton: tiles of products with masks, as kernels/pallas_xent.py; it compiles for every NVIDIA card
JAX supports in jax 0.10 and 0.11 and Pallas interprets it on a CPU (tests/kernels checks it so).
Opt-in: FLAXGPT_GROUPED=pallas (models.moe.grouped_matmul) until a lease measures it.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flaxgpt.kernels import fp8, target

GROUP_M = 8  # row tiles a swizzled group of programs (Triton's matmul tutorial's choice)
MIN_BLOCK = 16  # Triton's dot takes tiles of at least 16 in each dimension


class Tiles(NamedTuple):
    """gmm: programs of [block_m rows, block_n columns], stepping K block_k at a time; tgmm: dw tiles
    of [block_m, block_n], stepping the group's rows block_k at a time. Powers of two >= 16; a block
    larger than its dimension shrinks to the dimension's next power of two."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


def why_not(A: int, D: int, F: int, tiles: Tiles | None = None) -> str:
    """'' when gmm tiles x [A, D] @ w [E, D, F] (and its gradients), else why not."""
    if min(A, D, F) < MIN_BLOCK:
        return f"rows A={A}, D={D} and F={F} must each be >= {MIN_BLOCK} (Triton's smallest dot)"
    for name, b in (tiles or Tiles())._asdict().items():
        if name.startswith("block") and (b < MIN_BLOCK or b & (b - 1)):
            return f"{name}={b} is not a power of two >= {MIN_BLOCK}"
    return ""


def wanted(A: int, D: int, F: int) -> bool:
    """FLAXGPT_GROUPED's one reader (when traced; models.moe asks for the bf16 and the float8 products
    alike): whether a grouped product of x [A, D] by [E, D, F] takes these kernels: asked for (pallas;
    unset: the tiled form; anything else one line), one device (XLA cannot split a kernel), and shapes
    they tile."""
    mode = os.environ.get("FLAXGPT_GROUPED", "")
    if mode not in ("", "pallas"):
        raise ValueError(f"FLAXGPT_GROUPED={mode!r}: 'pallas' (the Triton grouped GEMM) or unset")
    return mode == "pallas" and target.one_device() and not why_not(A, D, F)


def _fit(block: int, n: int) -> int:
    """The block a dimension of n takes: `block`, or n's next power of two (>= 16) when smaller."""
    return min(block, max(MIN_BLOCK, 1 << (n - 1).bit_length()))


def gmm(x_AD, w_EDF, group_sizes_E, tiles: Tiles | None = None, interpret: bool = False, scale=None,
        out_dtype=None, transpose_w: bool = False):  # fmt: skip
    """Rows sorted by group [A, D] times their group's matrix [E, D, F] -> [A, F] in x's dtype (w is
    cast to it), accumulated in float32; rows past sum(group_sizes_E) give 0.

    The scaled form (kernels.fp8.fp8_grouped's, float8 operands): x and w keep their own dtypes, the
    float32 sums are multiplied by the scalar `scale` in the epilogue and stored in out_dtype (x's
    when None); transpose_w: w is [E, F, D], read as its transpose in place (fp8_grouped's dX). That
    form has no VJP of its own: fp8_grouped writes the backward from gmm and tgmm."""
    (A, D), F = x_AD.shape, w_EDF.shape[1 if transpose_w else 2]
    if why := why_not(A, D, F, tiles):
        raise ValueError(f"pallas_grouped.gmm cannot tile x {x_AD.shape} @ w {w_EDF.shape}: {why}; use "
                         "models.moe's tiled form (FLAXGPT_GROUPED unset)")  # fmt: skip
    tiles, group_sizes_E = tiles or Tiles(), group_sizes_E.astype(jnp.int32)
    if scale is None and not transpose_w:
        return _gmm(x_AD, w_EDF.astype(x_AD.dtype), group_sizes_E, tiles, interpret)
    scale_1 = jnp.reshape(jnp.asarray(1.0 if scale is None else scale, jnp.float32), (1,))
    return _call_gmm(x_AD, w_EDF, group_sizes_E, tiles, interpret, transpose_w, scale_1, out_dtype)


def fp8_functions(matmul, weight_grad, tiles: Tiles | None = None):
    """(matmul, weight_grad, matmul_t) for kernels.fp8.fp8_grouped through these kernels: gmm, tgmm
    and gmm reading w transposed in place (dX, no transposed copy of the float8 stack), scaled; each
    interpreted on CPUs, compiled on CUDA GPUs, and elsewhere the given `matmul` / `weight_grad`
    (fp8_grouped's contract: (a, b, group_sizes_E, scale, out_dtype))."""

    def on_platform(kernel, other):
        def call(a, b, group_sizes_E, scale, out_dtype):
            run = lambda interpret: lambda *args: kernel(*args, out_dtype, interpret)  # noqa: E731
            return jax.lax.platform_dependent(a, b, group_sizes_E, scale, cpu=run(True), cuda=run(False),
                                              default=lambda *args: other(*args, out_dtype))  # fmt: skip

        return call

    def forward(a, b, sizes, scale, out_dtype, interpret, transpose_w=False):
        kw = dict(scale=scale, out_dtype=out_dtype, transpose_w=transpose_w)
        return gmm(a, b, sizes, tiles=tiles, interpret=interpret, **kw)

    def grad(a, g, sizes, scale, out_dtype, interpret):
        # float32 out, then cast, as _gmm_bwd's dw (the round trip to float32 parameters dropped by XLA)
        return tgmm(a, g, sizes, tiles=tiles, interpret=interpret, scale=scale).astype(out_dtype)

    transposed = functools.partial(forward, transpose_w=True)
    return (
        on_platform(forward, matmul),
        on_platform(grad, weight_grad),
        on_platform(transposed, fp8.transposed(matmul)),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm(x_AD, w_EDF, group_sizes_E, tiles, interpret):
    return _call_gmm(x_AD, w_EDF, group_sizes_E, tiles, interpret, transpose=False)


def _gmm_fwd(x_AD, w_EDF, group_sizes_E, tiles, interpret):
    return _gmm(x_AD, w_EDF, group_sizes_E, tiles, interpret), (x_AD, w_EDF, group_sizes_E)


def _gmm_bwd(tiles, interpret, res, g_AF):
    x_AD, w_EDF, group_sizes_E = res
    g_AF = g_AF.astype(x_AD.dtype)
    dx_AD = _call_gmm(g_AF, w_EDF, group_sizes_E, tiles, interpret, transpose=True)
    dw_EDF = tgmm(x_AD, g_AF, group_sizes_E, tiles, interpret)
    # float32 out, then cast: float32 parameters cast to bf16 (mixed precision) take the gradient back
    # in float32 and XLA drops the round trip, so it is written once (a bf16 store plus XLA's convert:
    # 61.5 GB of HBM traffic, not 55.9, a Mixtral layer's step compiled for h100-1)
    return dx_AD, dw_EDF.astype(w_EDF.dtype), None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def visits(bm: int, n_tiles: int, group_sizes_E):
    """The visits of rows sorted by group over tiles of bm rows, each nonempty group visiting the tiles
    it overlaps in tile order (this module's plan and models.moe's tiled form alike): (group_V, tile_V,
    starts_E, ends_E, used) for V = n_tiles + E - 1 visits (consecutive groups share at most one tile);
    visit v multiplies tile tile_V[v] by group group_V[v], whose rows are starts_E[g] .. ends_E[g] - 1;
    visits from `used` on are unused (their tile_V for the caller to place)."""
    E = group_sizes_E.shape[0]
    ends_E = jnp.cumsum(group_sizes_E)
    starts_E = ends_E - group_sizes_E
    spans_E = jnp.where(group_sizes_E > 0, (ends_E - 1) // bm - starts_E // bm + 1, 0)  # tiles a group
    v_V = jnp.arange(n_tiles + E - 1)
    group_V = jnp.repeat(jnp.arange(E), spans_E, total_repeat_length=v_V.shape[0])
    tile_V = starts_E[group_V] // bm + v_V - (jnp.cumsum(spans_E) - spans_E)[group_V]
    return group_V, tile_V, starts_E, ends_E, jnp.sum(spans_E)


def _plan(A: int, bm: int, group_sizes_E):
    """(first_T1, group_V, starts_E, ends_E): tile t's visits are first_T1[t] .. first_T1[t + 1] - 1,
    visit v multiplies by group group_V[v], whose rows are starts_E[g] .. ends_E[g] - 1."""
    T = pl.cdiv(A, bm)
    group_V, tile_V, starts_E, ends_E, used = visits(bm, T, group_sizes_E)
    tile_V = jnp.where(jnp.arange(tile_V.shape[0]) < used, tile_V, T)  # the unused visits: past every tile
    first_T1 = jnp.searchsorted(tile_V, jnp.arange(T + 1), side="left")
    return (a.astype(jnp.int32) for a in (first_T1, group_V, starts_E, ends_E))


def _swizzle(pid, n_m: int, n_n: int):
    """Program pid -> (row block, column block), GROUP_M row blocks by every column block at a time."""
    size = GROUP_M * n_n
    first_m = (pid // size) * GROUP_M
    rows = jnp.minimum(n_m - first_m, GROUP_M)
    return first_m + (pid % size) % rows, (pid % size) // rows


def _params(tiles, interpret):
    return None if interpret else plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def _call_gmm(x_AK, w, group_sizes_E, tiles, interpret, transpose: bool, scale_1=None, out_dtype=None):
    """x [A, K] times w [E, K, N], or (transpose) w [E, N, K] read as its transpose -> [A, N] in
    out_dtype (x's when None); times scale_1 [1] (float32) in the epilogue when given."""
    A, K = x_AK.shape
    N = w.shape[1] if transpose else w.shape[2]
    bm, bn, bk = _fit(tiles.block_m, A), _fit(tiles.block_n, N), _fit(tiles.block_k, K)
    first_T1, group_V, starts_E, ends_E = _plan(A, bm, group_sizes_E)
    n_m, n_n = pl.cdiv(A, bm), pl.cdiv(N, bn)
    kernel = functools.partial(_gmm_kernel, A, K, N, bm, bn, bk, n_m, n_n, transpose, scale_1 is not None)
    call = pl.pallas_call(
        kernel,
        grid=(n_m * n_n,),
        out_shape=jax.ShapeDtypeStruct((A, N), out_dtype or x_AK.dtype),
        compiler_params=_params(tiles, interpret),
        interpret=interpret,
        name="gmm_t" if transpose else "gmm",
    )
    scales = () if scale_1 is None else (scale_1,)
    return call(first_T1, group_V, starts_E, ends_E, *scales, x_AK, w)


def _dot(a, b, **trans):
    """pl.dot (float32 sums); float8 tiles of two kinds (the backward's e5m2 x e4m3) widened to
    bfloat16 first, exactly (bf16 holds every e4m3 and e5m2 value): jax 0.10's Pallas refuses them
    (pl.dot promotes the two dtypes, an error for float8; its Triton lowering wants one element type),
    so those products run at bf16's tensor-core rate, their operands still read as float8."""
    if a.dtype != b.dtype:
        a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    return plgpu.dot(a, b, **trans)


def _gmm_kernel(A, K, N, bm, bn, bk, n_m, n_n, transpose, scaled, first_ref, group_ref, starts_ref,
                ends_ref, *refs):  # fmt: skip
    scale_ref, x_ref, w_ref, o_ref = refs if scaled else (None, *refs)
    t, j = _swizzle(pl.program_id(0), n_m, n_n)
    rows_b, cols_b = t * bm + jnp.arange(bm), j * bn + jnp.arange(bn)

    def visit(v, acc):
        g = group_ref[v]
        mine_b = (rows_b >= starts_ref[g]) & (rows_b < ends_ref[g])  # this group's rows of the tile

        def step(s, acc):
            ks_k = s * bk + jnp.arange(bk)
            x = plgpu.load(x_ref.at[pl.ds(t * bm, bm), pl.ds(s * bk, bk)],
                           mask=mine_b[:, None] & (ks_k < K)[None, :], other=0.0)  # fmt: skip
            if transpose:  # w[g] is [N, K]: its [bn, bk] tile, multiplied transposed
                w_nk = w_ref.at[g, pl.ds(j * bn, bn), pl.ds(s * bk, bk)]
                w = plgpu.load(w_nk, mask=(cols_b < N)[:, None] & (ks_k < K)[None, :], other=0.0)
                return acc + _dot(x, w, trans_b=True)
            w_kn = w_ref.at[g, pl.ds(s * bk, bk), pl.ds(j * bn, bn)]
            w = plgpu.load(w_kn, mask=(ks_k < K)[:, None] & (cols_b < N)[None, :], other=0.0)
            return acc + _dot(x, w)

        return jax.lax.fori_loop(0, pl.cdiv(K, bk), step, acc)

    acc = jax.lax.fori_loop(first_ref[t], first_ref[t + 1], visit, jnp.zeros((bm, bn), jnp.float32))
    if scaled:  # the float8 GEMM's epilogue: one scalar for the whole product
        acc = acc * scale_ref[0]
    out = o_ref.at[pl.ds(t * bm, bm), pl.ds(j * bn, bn)]
    plgpu.store(out, acc.astype(o_ref.dtype), mask=(rows_b < A)[:, None] & (cols_b < N)[None, :])


def tgmm(x_AD, g_AF, group_sizes_E, tiles: Tiles | None = None, interpret: bool = False, scale=None,
         out_dtype=None):  # fmt: skip
    """gmm's weight gradient [E, D, F] in float32: group e's rows of x, transposed, times its rows of g;
    the scaled form (float8 x and g, fp8_grouped's dW): times the scalar `scale`, in out_dtype."""
    (A, D), F, E = x_AD.shape, g_AF.shape[1], group_sizes_E.shape[0]
    tiles = tiles or Tiles()
    bm, bn, bk = _fit(tiles.block_m, D), _fit(tiles.block_n, F), _fit(tiles.block_k, A)
    ends_E = jnp.cumsum(group_sizes_E).astype(jnp.int32)
    n_m, n_n = pl.cdiv(D, bm), pl.cdiv(F, bn)
    scales = () if scale is None else (jnp.reshape(jnp.asarray(scale, jnp.float32), (1,)),)
    call = pl.pallas_call(
        functools.partial(_tgmm_kernel, D, F, bm, bn, bk, n_m, n_n, bool(scales)),
        grid=(n_m * n_n, E),  # axis 0 launches first: one expert's tiles resident together
        out_shape=jax.ShapeDtypeStruct((E, D, F), out_dtype or jnp.float32),
        compiler_params=_params(tiles, interpret),
        interpret=interpret,
        name="tgmm",
    )
    return call(ends_E - group_sizes_E.astype(jnp.int32), ends_E, *scales, x_AD, g_AF)


def _tgmm_kernel(D, F, bm, bn, bk, n_m, n_n, scaled, starts_ref, ends_ref, *refs):
    scale_ref, x_ref, g_ref, o_ref = refs if scaled else (None, *refs)
    (i, j), e = _swizzle(pl.program_id(0), n_m, n_n), pl.program_id(1)
    start, end = starts_ref[e], ends_ref[e]
    ds_m, fs_n = i * bm + jnp.arange(bm), j * bn + jnp.arange(bn)

    def step(s, acc):
        rows_k = start + s * bk + jnp.arange(bk)
        mine_k = rows_k < end
        x = plgpu.load(x_ref.at[pl.ds(start + s * bk, bk), pl.ds(i * bm, bm)],
                       mask=mine_k[:, None] & (ds_m < D)[None, :], other=0.0)  # fmt: skip
        g = plgpu.load(g_ref.at[pl.ds(start + s * bk, bk), pl.ds(j * bn, bn)],
                       mask=mine_k[:, None] & (fs_n < F)[None, :], other=0.0)  # fmt: skip
        return acc + _dot(x, g, trans_a=True)

    acc = jax.lax.fori_loop(0, pl.cdiv(end - start, bk), step, jnp.zeros((bm, bn), jnp.float32))
    if scaled:
        acc = acc * scale_ref[0]
    plgpu.store(o_ref.at[e, pl.ds(i * bm, bm), pl.ds(j * bn, bn)], acc.astype(o_ref.dtype),
                mask=(ds_m < D)[:, None] & (fs_n < F)[None, :])  # fmt: skip
