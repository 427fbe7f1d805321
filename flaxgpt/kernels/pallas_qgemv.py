"""x @ w^T for decoding's few rows with int8 or int4 weights, a Pallas kernel for GPUs (the Triton backend).

    y_MN = gemv(x_MK, w_NK, scale_N)             # int8 rows, one scale a row
    y_MN = gemv(x_MK, w_NH, scale_NG)            # int4 packed two a byte, a scale per group (kernels.int4)
    y_MN = gemv(..., interpret=True)             # the same program run by Pallas on the CPU (the tests)

Decoding multiplies M <= MAX_ROWS rows by each weight once: the step reads every weight byte and does
two FLOPs per byte, so it runs at the speed weights stream from HBM. XLA's int8 fusions read 2.0 TB/s on
an H200 (of 4.8: docs/accelerators.md), and an int4 weight must be unpacked before XLA's dot. Here a
program owns BLOCK_N output channels and walks K once: each weight tile is loaded once, widened
(int4: split into its two nibbles, each multiplied by the even or odd inputs, so nothing is
interleaved) and multiplied by every row of x held in registers, the products summed along K; int8's
row scale, and int4's scale per group, multiply the partial sums, not the weights. The loop loads
num_stages - 1 steps ahead itself (`pallas_decode.pipelined`; Triton is told 1 stage); int8 sums whole
tiles along K once where they fit (pallas_decode.tile_sums_fit: not 32 x 256 at 4 warps); int4 sums a
group at a time and queues only weights and scales (its x halves queued too spilled registers: ptxas,
sm_90a).

Tiles never read past the arrays: the last block of channels (of K) starts at N - BLOCK_N (K - its
block) and the part another block covered is masked (channels written twice carry equal values), so
Triton's and the interpreter's views agree; it needs N >= BLOCK_N, int8's K >= BLOCK_K and int4's K a
multiple of its group (quantize's rule). `why_not` says why a shape does not tile ("" when it
does); `gemv` refuses in one line the shapes that do not, naming XLA's form (kernels.qmatmul), which
kernels.qmatmul then uses. `tiles=Tiles(block_n, block_k, num_warps, num_stages)` (kernels.pallas_decode's
type) overrides the tiling, int4's block_k whole groups; None takes the tiling kernel_sweep measured
fastest for the shape on the card where FLAXGPT_GEMV_TILES names its file (kernels.tuned), else
`default_tiles` (BLOCK_N, BLOCK_K; INT4_BLOCK_K at most K), 4 warps and 3 stages, which no GPU has yet
compared with others: benchmarks/kernel_sweep.py times a grid of tilings and writes that file.

Split-K (tiles.split_k = S > 1): at batch 1 a program per BLOCK_N channels is 128 programs for N = 4096,
one an SM, each with a few KiB in flight: an H200 lease measured int8 at 29% of its bandwidth, int4 at
12%, latency-bound. With S the grid is (N / block_n, S): the cdiv(K, block_k) steps of K (whole int4
groups) are cut into S contiguous ranges of near-equal steps (range s: steps s * n // S up to
(s + 1) * n // S), program (i, s) walks range s and writes its float32 partial to out[s] of [S, M, N],
and XLA sums the S partials (then int8's row scale: a linear factor, applied once). An S above the
steps would leave a range empty and is refused. The sum is a second, tiny XLA kernel a call (the
sweep's timings include it; atomics into one output would avoid it but sum in a run-to-run order).
S = 1 is the same program as without (out [M, N], the scale in the kernel).

Why Triton rather than Mosaic GPU: the kernel is loads, converts and row sums with no matrix-unit
product, which the Triton backend compiles for every NVIDIA card JAX supports (A100, H100, H200
alike) in jax 0.10 and 0.11 both, and which Pallas runs in interpret mode on a CPU (how
tests/kernels checks it); Mosaic GPU targets Hopper's warpgroups, and its API moved between those
jax versions.

Opt-in (FLAXGPT_QMATMUL=pallas, kernels.qmatmul) until a lease measures it against XLA's fusion.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flaxgpt.kernels import tuned
from flaxgpt.kernels.pallas_decode import Tiles, pipelined, tile_sums_fit

MAX_ROWS = 8  # decoding rows the kernel takes; more are prefill, where XLA's dot is compute-bound
BLOCK_N = 32  # output channels a program: an 8B layer's 4096 make 128 programs, about an H100's 132 SMs
BLOCK_K = 256  # int8 inputs a step: a [32, 256] tile, 8 KiB
INT4_BLOCK_K = 256  # int4 inputs a step (whole groups: 2 of 128, 4 of 64, 8 of 32)


def default_tiles(K: int, group: int = 0) -> Tiles:
    """The tiling `gemv` takes when given none (group: int4's group size; 0: int8): BLOCK_N channels a
    program; int4 steps over whole groups, at most K (the default steps over as many as there are)."""
    return Tiles(BLOCK_N, max(group, min(INT4_BLOCK_K, K)) if group else BLOCK_K)


def why_not(M: int, N: int, K: int, group: int = 0, tiles: Tiles | None = None) -> str:
    """'' when the kernel tiles the shape, else why not (group: int4's group size; 0: int8; tiles:
    another tiling than the default's)."""
    if tiles is not None:
        why = why_not(M, N, K, group) if M > MAX_ROWS or (group and K % group) else tiles.why_not(N, K)
        if not why and group and tiles.block_k % group:
            why = f"block_k={tiles.block_k} is not whole int4 groups of {group}"
        steps = -(-K // tiles.block_k)  # int4's too: K and block_k whole groups
        if not why and tiles.split_k > steps:
            why = f"K={K} has {steps} steps of block_k={tiles.block_k}: split_k={tiles.split_k} would leave"
            why += f" a range with none; use split_k <= {steps}"
        return why
    if M > MAX_ROWS:
        return f"{M} rows > MAX_ROWS {MAX_ROWS} (prefill: a compute-bound dot)"
    if N < BLOCK_N:
        return f"N={N} output channels < BLOCK_N {BLOCK_N}"
    if group and K % group:
        return f"K={K} is not a multiple of the int4 group {group}"
    if not group and K < BLOCK_K:
        return f"K={K} < BLOCK_K {BLOCK_K}"
    return ""


def gemv(x_MK, w, scale, tiles: Tiles | None = None, interpret: bool = False) -> jax.Array:
    """x @ dequantize(w)^T -> [M, N] float32; w int8 [N, K] with scale [N], or int4 uint8 [N, K/2] with
    scale [N, G] (group K / G); `tiles` another tiling than the default's (None: the one measured for
    the shape on the card, kernels.tuned's FLAXGPT_GEMV_TILES, else `default_tiles`)."""
    M, K = x_MK.shape
    N = w.shape[0]
    int4 = w.dtype == jnp.uint8
    group = K // scale.shape[1] if int4 else 0
    if int4 and K != 2 * w.shape[1]:
        raise ValueError(f"int4 weights {w.shape} hold {2 * w.shape[1]} inputs, x has K={K}")
    measured = None if tiles else tuned.lookup(tuned.kernel_name(w.dtype, group=group), N, K, M)
    tiles = Tiles(*measured) if measured else tiles
    why = why_not(M, N, K, group, tiles)
    if why and tiles is not None:
        where = tuned.source() if measured else ""
        shape = f"x {x_MK.shape} @ w [{N}, {K}]"
        raise ValueError(f"qgemv: tiles {tuple(tiles)}{where} do not fit {shape}: {why}")
    if why:
        raise ValueError(f"qgemv cannot tile x {x_MK.shape} @ w [{N}, {K}]: {why}; use XLA's form "
                         "(kernels.qmatmul, FLAXGPT_QMATMUL unset)")  # fmt: skip
    tiles = tiles or default_tiles(K, group)
    x_MK = x_MK.astype(jnp.float32)
    scale = scale.astype(jnp.float32)
    out = jax.ShapeDtypeStruct((M, N), jnp.float32)
    # the stages are the kernel's own (`ahead` steps' loads in flight): Triton's pipeliner adds none here
    params = plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1)
    ahead = tiles.num_stages - 1
    bn, bk, S = tiles.block_n, tiles.block_k, tiles.split_k
    grid = (pl.cdiv(N, bn),) if S == 1 else (pl.cdiv(N, bn), S)
    out = out if S == 1 else jax.ShapeDtypeStruct((S, M, N), jnp.float32)  # a partial a range of K
    if int4:  # the even and odd inputs apart: each nibble multiplies its own half of x, no interleave
        kernel = functools.partial(_int4_kernel, M, N, K, group, bn, bk // group, S, ahead)
        args = (x_MK[:, 0::2], x_MK[:, 1::2], w, scale)
    else:
        sums = tile_sums_fit(M, tiles)  # each row's [bn, bk] products kept whole
        kernel, args = functools.partial(_int8_kernel, M, N, K, bn, bk, S, ahead, sums), (x_MK, w, scale)
    call = pl.pallas_call(
        kernel, grid=grid, out_shape=out, compiler_params=params, interpret=interpret, name="qgemv"
    )
    y = call(*args)
    if S == 1:
        return y
    return y.sum(0) if int4 else y.sum(0) * scale  # XLA's epilogue: one fusion over [S, M, N]


def _channels(N, bn):
    """This program's channels: bn from min(i * bn, N - bn), in bounds."""
    return pl.ds(jnp.minimum(pl.program_id(0) * bn, N - bn), bn)


def _steps(n, S):
    """This program's steps of K's n: all of them (S == 1, static bounds: today's loop), else range
    program_id(1) of S near-equal contiguous ones (dynamic bounds: Triton's loop takes them)."""
    if S == 1:
        return 0, n
    s = pl.program_id(1)
    return s * n // S, (s + 1) * n // S


def _store(o_ref, accs, rows, S, scale=None):
    """Each row's sums: times `scale` into out [M, N] (S == 1), else unscaled into partial s of [S, M, N]."""
    for m, acc in enumerate(accs):
        if S == 1:
            o_ref[m, rows] = acc if scale is None else acc * scale
        else:
            o_ref[pl.program_id(1), m, rows] = acc


def _int8_kernel(M, N, K, bn, bk, S, ahead, tile_sums, x_ref, w_ref, s_ref, o_ref):
    rows = _channels(N, bn)

    def loads(j):
        ks = pl.ds(jnp.minimum(j * bk, K - bk), bk)  # the last step ends at K
        return w_ref[rows, ks], tuple(x_ref[m, ks] for m in range(M))

    def step(j, inputs, accs):
        w, xs = inputs
        fresh = jnp.minimum(j * bk, K - bk) + jnp.arange(bk) >= j * bk  # inputs no earlier step summed
        w = jnp.where(fresh[None, :], w.astype(jnp.float32), 0.0)
        xw = [w * x[None, :] for x in xs]
        # whole tiles summed along K once after the loop, where they fit the registers (a sum a step
        # crosses threads every step)
        return tuple(acc + (p if tile_sums else jnp.sum(p, axis=1)) for acc, p in zip(accs, xw))

    init = tuple(jnp.zeros((bn, bk) if tile_sums else (bn,), jnp.float32) for _ in range(M))
    accs = pipelined(*_steps(pl.cdiv(K, bk), S), ahead, loads, step, init)
    accs = [jnp.sum(acc, axis=1) for acc in accs] if tile_sums else accs
    _store(o_ref, accs, rows, S, s_ref[rows] if S == 1 else None)  # split: XLA scales the sum


def _int4_kernel(M, N, K, group, bn, step_groups, S, ahead, xe_ref, xo_ref, w_ref, s_ref, o_ref):
    rows = _channels(N, bn)
    half = group // 2  # bytes of a group: its even inputs in the low nibbles, its odd in the high
    n_groups = K // group
    per_step = max(1, min(step_groups, n_groups))

    def first(j):  # the step's first group: the last step ends at the last group
        return jnp.minimum(j * per_step, n_groups - per_step)

    def loads(j):  # the weights and scales (x, from L2, at its step: queued, its copies spilled registers)
        groups = [first(j) + i for i in range(per_step)]
        return tuple((w_ref[rows, pl.ds(g * half, half)], s_ref[rows, pl.ds(g, 1)][:, 0]) for g in groups)

    def step(j, inputs, accs):
        for i, (packed, s) in enumerate(inputs):  # whole groups: a partial sum each, times its scale
            cols = pl.ds((first(j) + i) * half, half)
            xs = [(xe_ref[m, cols], xo_ref[m, cols]) for m in range(M)]
            s = s * (first(j) + i >= j * per_step).astype(jnp.float32)
            lo = (packed & 0xF).astype(jnp.float32) - 8.0
            hi = (packed >> 4).astype(jnp.float32) - 8.0
            # summed a group at a time: whole [bn, group / 2] sums kept across steps spilled registers
            accs = tuple(
                acc + s * jnp.sum(lo * xe[None, :] + hi * xo[None, :], axis=1)
                for acc, (xe, xo) in zip(accs, xs, strict=True)
            )
        return accs

    init = tuple(jnp.zeros((bn,), jnp.float32) for _ in range(M))
    accs = pipelined(*_steps(pl.cdiv(n_groups, per_step), S), ahead, loads, step, init)
    _store(o_ref, accs, rows, S)
