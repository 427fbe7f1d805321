"""The decoding GEMV kernels' tilings against XLA's products on one GPU: the data to choose their tiles.

    python benchmarks/kernel_sweep.py --json $OUT/kernel_sweep.json   # one H100 / H200, <= ~165 s
    python benchmarks/kernel_sweep.py --dry_run --json out/sweep.json  # CPU, tiny shapes, interpreted
    python benchmarks/kernel_sweep.py --compile_for h100-1             # CPU: does every program compile?
    python benchmarks/kernel_sweep.py --tiles_out tiles.json  # the GPU's fastest tilings, for the kernels
                                                              # to take: FLAXGPT_GEMV_TILES=tiles.json

A lease on 2026-11-29 (H200) measured kernels/pallas_decode.py and kernels/pallas_qgemv.py slower than
XLA's products at batch 1, with tiles (BLOCK_N 32, BLOCK_K 128 / 256, 4 warps, 3 stages) never tuned
on a GPU. This times, for Llama-3-8B's four products (qkv 4096 -> 6144, o 4096 -> 4096, gate|up 4096 ->
28672, down 14336 -> 4096) and GPT-2 124M's four (768 -> 2304, 768 -> 768, 768 -> 3072, 3072 -> 768),
at 1 row (then 4 for the Llama shapes): (a) XLA's product as the model's decode path does it (bf16
weights: x @ w; int8: kernels.qmatmul's XLA form, pinned with FLAXGPT_QMATMUL=xla whatever its
default; int4 groups of 128: kernels.int4.matmul); (b) pallas_decode.gemv with bf16 weights and (c)
pallas_qgemv.gemv with int8 and int4 weights, each over a grid of `Tiles` (GRID, bf16's: block_n 16-128,
block_k 128-2048, 4 or 8 warps, 3 stages; QGRID, int8's and int4's: split-K first, K in 2-8 ranges (2 x
32x512, 4 x 32x256, 8 x 16x512, 4 x 64x512 over 8 warps), then 3 unsplit tilings; pruned to at most 128
weights a thread, which otherwise spill registers, and >= 64 programs; GPT-2's shapes take 1-2 tilings
besides the default, the 4-row cases the best 1-row one), and GPT-2's bf16 weights also as their rows
[N, K] (`bf16_rows`, as `--quantize bf16` lays them: pallas_decode.gemv(rows_w=True) against XLA's dot
over w's K, the rows' default tiling of 8 channels a program, 4 channels x 512, and 32 x 128 (the
default before 2026-11-30): 96-768 programs reading 512-byte runs, where flax's [K, N] at 4 channels
reads 8-byte runs). Each default tiling runs again at 1 stage (the kernels' loop as the 2026-11-29
lease timed it: no loads queued ahead) and 4 (three steps ahead; 3, the default, queues two), rounds 1
and 2. The plan: 201 + 12 Triton programs, 40 XLA ones, 3 MoE: ~244 s predicted at ~0.8 s a Triton
compile (the 2026-11-29 lease's estimate) and ~1 s an XLA one; --budget_s (155) then cuts the 1-row
grid's last rounds (the MoE and 4-row rows keep 30 s of it): by that estimate XLA's round and the
kernels' rounds 0-4 (of 11) run: the defaults at 3, 1 and 4 stages, then int8's and int4's first
split-K tiling and their default at 8 warps, two of bf16's and the rows' grid. Then (d) Mixtral-8x7B's
expert product, 16384 rows sorted into 8 groups of ~2048, D 4096 -> F 14336, bf16, forward:
models.moe.tiled_grouped_matmul, jax.lax.ragged_dot (a real grouped GEMM, or each group's matrix over
every row?) and 8 dense dots over the same static groups; milliseconds and TFLOP/s.

Method (the workplace's METHOD.md): each timing is one jitted program of n calls, unrolled (no
while-loop round trip to the host, no kernels between the calls), each call on its own x and on one
of several weight copies (together >= 3x a 50 MB L2, so weights stream from HBM as in decoding: the
`l2x` column; GPT-2's smallest int4 weights fall short and say so); the n outputs are the program's
results, so none is dead and no two calls share operands to be merged. After a compile and a warm
run, 7 repeats of 3 back-to-back runs (dispatch overlaps the device), the median over n: us a call;
GB/s = the weights' bytes (scales included) a call / its time, and its share of a measured copy
ceiling (a 1 GiB device-to-device pass: bytes read + written). Each tiling's first output is checked
against the float32 product of the same inputs (`err`, relative; a wrong tiling is never "best").
The rounds go XLA, each kernel's default tiling, then the grid, across all shapes at once, so a
budget that runs out cuts the grid's tail, not a shape. Rows as they come on stdout; every row as
JSON (--json, rewritten after each); last, the best tiling per (kernel, shape) against XLA's.

--compile_for h100-1 compiles the whole plan on this machine for a `flaxgpt aot` target instead (256
programs in 149 s on the 2-core AVX2 machine on 2026-11-30, none failed, split-K's 32 and the rows' 16 among
them: every tiling lowers through Triton), and for the MoE forms the compiled matmul FLOPs over the
product's own: with jaxlib 0.10.2's XLA, ragged_dot is one GEMM over x widened to every group (8.0x;
15.9 ms bound on an H100), the tiled form 1.88x (5.5 ms), the dense dots 1.0x (2.2 ms): compiled, not
measured; the lease runs jax 0.11.2's.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import time
from pathlib import Path

import harness  # first: the benchmarks' one sys.path rule, see harness.py
import jax
import jax.numpy as jnp
import numpy as np

from flaxgpt.kernels import int4, pallas_decode, pallas_qgemv, qmatmul, tuned
from flaxgpt.kernels.pallas_decode import Tiles
from flaxgpt.models import moe

L2_BYTES = 50e6  # H100 / H200
PROGRAM_BYTES = 1.5e9  # weight bytes a timed program reads: ~0.3 ms at 4.8 TB/s, dispatch hidden
MAX_CALLS = 64  # calls a program (each a custom call in the compiled program)
GROUP = 128  # int4's group (quantize's default)
TOL = 2e-2  # relative error of a tiling's output against the float32 product (bf16 outputs: ~4e-3)
LLAMA = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate|up", 4096, 28672), ("down", 14336, 4096)]
GPT2 = [("c_attn", 768, 2304), ("attn c_proj", 768, 768), ("c_fc", 768, 3072), ("mlp c_proj", 3072, 768)]
DRY = [("tiny", 256, 64)]
KINDS = ("bf16", "int8", "int4")
# GPT-2's (and the dry run's) bf16 weights also as their rows [N, K] (rows_w, as a tied head's table
# lies): a program's tile then reads bn whole rows of contiguous inputs, so a few channels a program
# (GPT-2's 768 outputs: 192 programs at 4) still read 512-byte runs, where flax's [K, N] gives them
# bn * 2 bytes; the layout a decode-only copy of the weights could take
ROWS = "bf16_rows"
# (block_n, block_k, warps[, split_k]) in the order run after the default: the tile's bytes (4-64 KiB)
# and the programs (N / block_n) spread first, then warps; 3 stages (STAGES: the defaults at 1 and 4
# too, first). bf16 (pallas_decode):
GRID = [(16, 512, 4), (32, 1024, 8), (64, 128, 4), (16, 2048, 8), (32, 256, 8), (64, 512, 8), (16, 1024, 4)]
GRID += [(128, 128, 4)]
# int8 / int4 (pallas_qgemv): split-K first, the lease's fix for 128 programs walking K alone (29% / 12%
# of an H200's bandwidth at batch 1): 256-2048 programs of 1-4 steps for K = 4096; then 3 unsplit
# tilings (more programs or a tile twice the default's). The budget cuts the late rounds (~2 of 8 run
# after the stages): the quantized grid keeps 8 points (bf16's 8; the unsplit 64x128, 64x512, 16x1024,
# 128x128 gone); second, the default at 8 warps: int8's whole-tile sums fit there
# (pallas_decode.tile_sums_fit: no shuffle a step in its PTX)
QGRID = [(32, 256, 4, 4), (32, 256, 8), (32, 512, 4, 2), (16, 512, 4, 8), (64, 512, 8, 4), (16, 512, 4)]
QGRID += [(32, 1024, 8), (16, 2048, 8)]
SMALL_GRID = {"bf16": [(16, 256, 4), (16, 512, 8)], "int8": [(16, 256, 4)], "int4": [(16, 256, 4)]}  # GPT-2
SMALL_GRID[ROWS] = [(4, 512, 4), (32, 128, 4)]  # the default is ROWS_BLOCK_N x ROWS_BLOCK_K
DRY_GRID = {"bf16": [(16, 128, 4)], "int8": [(16, 128, 4, 2)], "int4": [(16, 128, 4, 2)]}  # K 256: 2 steps
DRY_GRID[ROWS] = [(4, 128, 4)]
# the default tiling again at these num_stages (the kernels' own: num_stages - 1 steps' loads in flight
# ahead of the step using them, 2 by default): 1 is the loop as the 2026-11-29 lease timed it, each
# step's loads asked for at its top and waited on by its own sums
STAGES = (1, 4)
MIN_PROGRAMS = 64  # fewer (N / block_n * split_k) leave over half an H100's / H200's 132 SMs idle
# shares of the budget kept from the 1-row grid for the MoE and 4-row rows (30 s of 155), for the 4-row (15 s)
RESERVE = (0.19, 0.1)


def default_tiles(kind: str, K: int, N: int) -> Tiles:
    """The kernel's own default for this shape (what it takes when given no tiles)."""
    if kind in ("int8", "int4"):
        return pallas_qgemv.default_tiles(K, GROUP * (kind == "int4"))
    return pallas_decode.default_tiles(N, K, rows_w=kind == ROWS)


def grid(kind: str, K: int, N: int, small: bool, dry: bool) -> list[Tiles]:
    """The default tiling, then the grid's that fit the shape, at most 128 weights a thread
    (block_n * block_k / (32 * warps)): more spill registers, the kernel holds its tile as float32; and
    (not GPT-2's, 24-96 programs at most) MIN_PROGRAMS programs; the kernels' own rules (why_not:
    int4's whole groups, split_k at most K's steps)."""
    out = [default_tiles(kind, K, N)]
    out += [] if dry else [out[0]._replace(num_stages=n) for n in STAGES]
    big = QGRID if kind in ("int8", "int4") else GRID
    for bn, bk, warps, *split in DRY_GRID[kind] if dry else SMALL_GRID[kind] if small else big:
        t = Tiles(bn, bk, warps, 3, *split)
        quantized = kind in ("int8", "int4")
        why = pallas_qgemv.why_not(1, N, K, GROUP * (kind == "int4"), t) if quantized else t.why_not(N, K)
        fits = not why and bn * bk <= 128 * 32 * warps
        fits = fits and (small or dry or N // bn * t.split_k >= MIN_PROGRAMS)
        if fits and t not in out:
            out.append(t)
    return out


class Case:
    """One product's operands on the device: weight copies and an x a call, made once, timed by every
    implementation and tiling."""

    def __init__(self, model, name, K, N, kind, M, dry, key, like: Case | None = None):
        self.model, self.name, self.K, self.N, self.kind, self.M = model, name, K, N, kind, M
        if like is None:
            k = jax.random.split(key, 2)
            make = jax.jit(lambda k: weights(kind, K, N, k))
            one = make(k[0])
            self.bytes = sum(a.nbytes for a in one)
            self.n, copies = calls_and_copies(self.bytes, dry)
            self.ws = [one] + [make(c) for c in jax.random.split(k[1], copies - 1)]
        else:  # `like`'s weights (another M)
            self.bytes, self.n, self.ws, copies = like.bytes, like.n, like.ws, len(like.ws)
        xs = jax.random.normal(jax.random.key(M), (self.n, M, K), jnp.float32)
        self.xs = [x.astype(jnp.bfloat16) for x in xs]  # the model's compute dtype
        self.l2x = round(copies * self.bytes / L2_BYTES, 2)
        self.ref = reference(kind, self.xs[0], *self.ws[0])


def calls_and_copies(nbytes: int, dry: bool) -> tuple[int, int]:
    """Calls a timed program (~PROGRAM_BYTES of weights read) and the weight copies they take in turn
    (>= 3x L2 together, where MAX_CALLS allows)."""
    n = 2 if dry else max(4, min(MAX_CALLS, math.ceil(PROGRAM_BYTES / nbytes)))
    return n, 2 if dry else min(n, max(2, math.ceil(3 * L2_BYTES / nbytes)))


def program(kind: str, impl: str, tiles, interpret: bool):
    """The timed program: call j on x j and weight copy j mod copies, every output returned."""
    call = jax.jit(product(kind, impl, tiles, interpret))  # one lowering for the n calls

    def run(xs, ws):
        return tuple(call(x, *ws[j % len(ws)]) for j, x in enumerate(xs))

    return run


def weights(kind, K, N, key):
    """Random weights (never zeros: they hide unwritten outputs and run fast): bf16 [K, N] as flax's
    kernel lies (ROWS: [N, K]); int8 [N, K] and a scale a row; int4 packed [N, K/2] and a scale a group."""
    if kind in ("bf16", ROWS):
        shape = (N, K) if kind == ROWS else (K, N)
        return ((jax.random.normal(key, shape) / math.sqrt(K)).astype(jnp.bfloat16),)
    k = jax.random.split(key)
    if kind == "int8":
        w = jax.random.randint(k[0], (N, K), -127, 128, jnp.int32).astype(jnp.int8)
        return w, jax.random.uniform(k[1], (N,), jnp.float32, 0.5, 1.5) / (127 * math.sqrt(K))
    w = jax.random.randint(k[0], (N, K // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    return w, jax.random.uniform(k[1], (N, K // GROUP), jnp.float32, 0.5, 1.5) / (8 * math.sqrt(K))


def reference(kind, x, w, scale=None):
    """The float32 product of the same inputs, at full float32 precision (not the GPU's tf32)."""
    x, hi = x.astype(jnp.float32), jax.lax.Precision.HIGHEST
    if kind in ("bf16", ROWS):
        return jnp.matmul(x, (w.T if kind == ROWS else w).astype(jnp.float32), precision=hi)
    return jnp.matmul(x, qmatmul.dequantize(w, scale).T, precision=hi)


def product(kind: str, impl: str, tiles: Tiles | None, interpret: bool):
    """One call: XLA's form as the model's decode path traces it, or a kernel with a tiling."""
    if impl == "xla":
        if kind == "bf16":
            return lambda x, w: x @ w
        if kind == ROWS:  # a dot contracting both operands' K: no transposed copy of w
            return lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())))
        return int4.matmul if kind == "int4" else qmatmul.qmatmul
    if kind in ("bf16", ROWS):
        return lambda x, w: pallas_decode.gemv(x, w, rows_w=kind == ROWS, tiles=tiles, interpret=interpret)
    return lambda x, w, s: pallas_qgemv.gemv(x, w, s, tiles=tiles, interpret=interpret)


def time_program(run, args, repeats: int, back_to_back: int = 3):
    """(compile seconds, median seconds a run, the first run's output)."""
    t0 = time.perf_counter()
    compiled = jax.jit(run).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    out = jax.block_until_ready(compiled(*args))  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = [compiled(*args) for _ in range(back_to_back)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t0) / back_to_back)
    return compile_s, statistics.median(times), out


def time_case(case: Case, impl: str, tiles, a, ceiling: float) -> dict:
    ws, run = case.ws, program(case.kind, impl, tiles, a.interpret)
    row = dict(section="gemv", model=case.model, shape=case.name, K=case.K, N=case.N, M=case.M)
    row.update(weights=case.kind, impl=impl, tiles=None if tiles is None else list(tiles))
    row.update(default=tiles == default_tiles(case.kind, case.K, case.N), calls=case.n, copies=len(ws))
    row.update(l2x=case.l2x)
    try:
        compile_s, seconds, out = time_program(run, (case.xs, ws), a.repeats)
    except Exception as e:  # a tiling Triton cannot compile (shared memory, registers) is a row, not the end
        return dict(row, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}" if str(e) else repr(e))
    per_call = seconds / case.n
    got = out[0].astype(jnp.float32)
    err = float(jnp.linalg.norm(got - case.ref) / jnp.linalg.norm(case.ref))
    gbps = case.bytes / per_call / 1e9
    row.update(compile_s=round(compile_s, 2), us=round(1e6 * per_call, 2), gbps=float(f"{gbps:.4g}"))
    row.update(pct_copy=round(100 * gbps * 1e9 / ceiling, 1) if ceiling else None, err=float(f"{err:.2e}"))
    row["ok"] = err < TOL
    return row


def copy_ceiling(a) -> dict:
    """A large device-to-device pass (~a, uint32: a load and a store a word): bytes read + written / s."""
    words = (1 << 21) if a.dry_run else (1 << 28)  # 8 MiB / 1 GiB
    x = jax.random.bits(jax.random.key(0), (words,), jnp.uint32)
    compile_s, seconds, _ = time_program(lambda x: ~x, (x,), a.repeats)
    bps = 2 * x.nbytes / seconds
    return dict(
        section="copy", what=f"~x over {x.nbytes / 2**30:.3g} GiB uint32", gbps=float(f"{bps / 1e9:.4g}")
    )


def moe_problem(dry: bool):
    """Mixtral-8x7B's expert product: (A, E, D, F) and the 8 groups' sizes (~2048 each, unequal)."""
    A, E, D, F = (64, 4, 32, 64) if dry else (16384, 8, 4096, 14336)
    return (A, E, D, F), [
        A // E + d for d in ((8, -8, 0, 0) if dry else (-256, 256, 0, -128, 128, 0, -384, 384))
    ]


def moe_ways(sizes) -> list:
    """(name, f(x_AD, w_EDF, group_sizes_E)): dense dots over the groups' static sizes (what a grouped
    GEMM at best does), the tiled grouped matmul, jax.lax.ragged_dot."""
    bounds = np.cumsum([0, *sizes])

    def dense(x, w, gs):
        return jnp.concatenate([x[lo:hi] @ w[e] for e, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))])

    return [
        ("dense dots over static groups", dense),
        ("moe.tiled_grouped_matmul", moe.tiled_grouped_matmul),
        ("jax.lax.ragged_dot", lambda x, w, gs: jax.lax.ragged_dot(x, w, gs)),
    ]


def moe_rows(a, deadline: float) -> list[dict]:
    """Mixtral-8x7B's expert product three ways over the same sorted rows and static group sizes."""
    (A, E, D, F), sizes = moe_problem(a.dry_run)
    k = jax.random.split(jax.random.key(1))
    x = jax.random.normal(k[0], (A, D), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(k[1], (E, D, F), jnp.float32) / math.sqrt(D)).astype(jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    flops, rows, ref = 2 * A * D * F, [], None
    for what, fn in moe_ways(sizes):
        row = dict(section="moe", what=f"{what}: {A} rows in {E} groups, {D} -> {F}, bf16", ms=None)
        if time.perf_counter() > deadline:
            rows.append(dict(row, error="skipped: the budget ran out"))
            continue
        try:  # ragged_dot may expand to every group's matrix over every row: its memory, its own failure
            compile_s, seconds, out = time_program(fn, (x, w, gs), a.repeats, back_to_back=1)
            out = out.astype(jnp.float32)
            ref = out if ref is None else ref
            err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
            row.update(ms=round(1e3 * seconds, 3), tflops=float(f"{flops / seconds / 1e12:.4g}"))
            row.update(compile_s=round(compile_s, 2), err_vs_dense=float(f"{err:.2e}"))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rows.append(row)
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per (shape, weights, M): the best correct tiling, the default's and XLA's GB/s."""
    out, keys = [], []
    for r in rows:
        key = (r.get("model"), r.get("shape"), r.get("weights"), r.get("M"))
        if r.get("section") == "gemv" and key not in keys:
            keys.append(key)
    for key in keys:
        same = [r for r in rows if (r.get("model"), r.get("shape"), r.get("weights"), r.get("M")) == key]
        timed = [r for r in same if r.get("us") and r.get("ok")]
        kern = [r for r in timed if r["impl"] == "pallas"]
        xla = next((r for r in timed if r["impl"] == "xla"), None)
        dflt = next((r for r in kern if r["default"]), None)
        best = min(kern, key=lambda r: r["us"]) if kern else None
        wrong = [r["tiles"] for r in same if r.get("us") and not r.get("ok")]
        out.append(dict(
            model=key[0], shape=key[1], weights=key[2], M=key[3], K=same[0]["K"], N=same[0]["N"],
            tilings=len(kern),
            best=best and best["tiles"], best_gbps=best and best["gbps"], best_pct=best and best["pct_copy"],
            default_gbps=dflt and dflt["gbps"], xla_gbps=xla and xla["gbps"],
            best_vs_xla=round(xla["us"] / best["us"], 2) if best and xla else None, wrong=wrong,
        ))  # fmt: skip
    return out


def write_tiles(path: Path, best_rows: list[dict], device: str) -> None:
    """kernels.tuned's file (FLAXGPT_GEMV_TILES): the fastest correct tiling per (kernel, N, K, M)."""
    entries = []
    for s in best_rows:
        if s["best"]:
            w_dtype = {"int8": jnp.int8, "int4": jnp.uint8}.get(s["weights"], jnp.bfloat16)
            group = GROUP if s["weights"] == "int4" else 0
            kernel = tuned.kernel_name(w_dtype, rows_w=s["weights"] == ROWS, group=group)
            measured = {k: s[k] for k in ("best_gbps", "default_gbps", "xla_gbps")}
            entries.append(dict(kernel=kernel, N=s["N"], K=s["K"], M=s["M"], tiles=s["best"], **measured))
    tuned.write(path, entries, device, jax.__version__)


def compile_for(a) -> int:
    """--compile_for: every 1-row program of the plan (and the 4-row ones with the default tiling)
    compiled on this machine for a `flaxgpt aot` GPU target, no device: which tilings Triton and XLA
    compile, and in how long (here; a GPU's compile adds ptxas and XLA's autotuning)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from flaxgpt.aot import hlo_cost, targets

    target = targets.get(a.compile_for)
    mesh = Mesh(np.array(target.devices()[:1]), ("x",))
    one = NamedSharding(mesh, PartitionSpec())
    jobs = [(j[1], 1, j[2], j[3]) for j in plan(a)]
    fours = {j[1] for j in plan(a) if j[1][0] != "GPT-2 124M"}
    jobs += [
        (key, 4, impl, t)
        for key in fours
        for impl, t in (("xla", None), ("pallas", default_tiles(key[4], key[2], key[3])))
    ]
    failed, t_all = 0, time.perf_counter()
    for (model, name, K, N, kind), M, impl, tiles in jobs:
        w_shapes = jax.eval_shape(functools.partial(weights, kind, K, N), jax.random.key(0))
        n, copies = calls_and_copies(sum(math.prod(w.shape) * w.dtype.itemsize for w in w_shapes), a.dry_run)
        ws = [tuple(jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=one) for w in w_shapes)] * copies
        xs = [jax.ShapeDtypeStruct((M, K), jnp.bfloat16, sharding=one)] * n
        row = dict(target=a.compile_for, model=model, shape=name, weights=kind, M=M, impl=impl, calls=n)
        row["tiles"] = tiles and list(tiles)
        t0 = time.perf_counter()
        try:
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                hlo = jax.jit(program(kind, impl, tiles, False)).lower(xs, ws).compile().as_text()
            row.update(compile_s=round(time.perf_counter() - t0, 2), triton_calls=hlo.count("xla.gpu.triton"))
        except Exception as e:
            failed += 1
            row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        print(json.dumps(row), flush=True)
    (A, E, D, F), sizes = moe_problem(a.dry_run)
    args = [
        jax.ShapeDtypeStruct(s, d, sharding=one)
        for s, d in (((A, D), jnp.bfloat16), ((E, D, F), jnp.bfloat16))
    ]
    for what, fn in moe_ways(sizes):  # the compiled FLOPs over the product's own: ragged_dot's expansion?
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            compiled = jax.jit(fn).lower(*args, jax.ShapeDtypeStruct((E,), jnp.int32, sharding=one)).compile()
        cost = hlo_cost.estimate(compiled.as_text(), target.peak_flops, target.bandwidth)
        row = dict(target=a.compile_for, what=f"MoE {what}", kernels=cost.kernels)
        row.update(
            flops_x=round(cost.matmul_flops / (2 * A * D * F), 2), bound_ms=round(1e3 * cost.bound_s, 2)
        )
        row["temp_gib"] = round(compiled.memory_analysis().temp_size_in_bytes / 2**30, 2)
        print(json.dumps(row), flush=True)
    seconds = time.perf_counter() - t_all
    print(f"{len(jobs) + 3} programs compiled for {a.compile_for} in {seconds:.0f} s, {failed} failed")
    return 1 if failed else 0


def plan(a):
    """[(round, case key, impl, tiles)] for the 1-row cases: XLA's, each default, then the grid."""
    shapes = [("tiny", *s) for s in DRY] if a.dry_run else [("Llama-3-8B", *s) for s in LLAMA]
    shapes += [] if a.dry_run else [("GPT-2 124M", *s) for s in GPT2]
    jobs = []
    for model, name, K, N in shapes:
        for kind in KINDS if model == "Llama-3-8B" else (*KINDS, ROWS):
            tilings = grid(kind, K, N, model == "GPT-2 124M", a.dry_run)
            jobs += [(0, (model, name, K, N, kind), "xla", None)]
            jobs += [(1 + i, (model, name, K, N, kind), "pallas", t) for i, t in enumerate(tilings)]
    return sorted(jobs, key=lambda j: (j[0], j[1][0] != "Llama-3-8B"))  # rounds; Llama's first in each


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="every row as JSON (rewritten after each)")
    ap.add_argument("--dry_run", action="store_true", help="CPU: one tiny shape, 2 tilings, interpreted")
    ap.add_argument("--budget_s", type=float, default=155, help="start nothing after this many seconds")
    ap.add_argument("--repeats", type=int, default=7, help="timed repeats a program (the median)")
    ap.add_argument("--no_moe", action="store_true", help="skip the Mixtral expert product")
    ap.add_argument("--compile_for", help="a flaxgpt aot GPU target (h100-1): compile the plan, run nothing")
    ap.add_argument("--tiles_out", type=Path, help="the best tilings as FLAXGPT_GEMV_TILES' file (each row)")
    a = ap.parse_args(argv)
    if a.compile_for:
        return compile_for(a)
    a.repeats = min(a.repeats, 2) if a.dry_run else a.repeats
    t_start = time.perf_counter()
    deadline = t_start + a.budget_s
    device = jax.devices()[0]
    a.interpret = device.platform != "gpu"  # Pallas' interpreter off a GPU: the dry run checks values only
    # XLA's int8 form whatever qmatmul's default (read when the products are traced; int4's is int4.matmul)
    os.environ["FLAXGPT_QMATMUL"] = "xla"
    jobs = plan(a)
    m4 = len({j[1] for j in jobs if j[1][0] != "GPT-2 124M"})  # 4 rows: XLA's and the best 1-row tiling
    n_triton = sum(j[2] == "pallas" for j in jobs) + m4
    n_xla = sum(j[2] == "xla" for j in jobs) + m4
    # seconds: compiles (the lead's ~0.5-1 s a Triton one, ~1 s XLA's with its autotuning), making each
    # case's weights (~0.5 s), the MoE's three
    predicted = 0.8 * n_triton + n_xla + 0.5 * len({j[1] for j in jobs}) + 20
    print(f"{device.device_kind}, jax {jax.__version__}: {n_triton} Triton programs, {n_xla} XLA products, "
          f"MoE 3: ~{predicted:.0f} s predicted; budget {a.budget_s:.0f} s", flush=True)  # fmt: skip
    rows: list[dict] = []

    def add(row):
        row.update(
            device=device.device_kind, jax=jax.__version__, t_s=round(time.perf_counter() - t_start, 1)
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps(rows, indent=1) + "\n")
        if a.tiles_out and row.get("section") == "gemv":  # what was measured so far, if the budget ends it
            write_tiles(a.tiles_out, summary(rows), device.device_kind)

    add(copy_ceiling(a))
    ceiling = rows[0]["gbps"] * 1e9
    cases: dict = {}
    for _, (model, name, K, N, kind), impl, tiles in jobs:
        if time.perf_counter() > deadline - sum(RESERVE) * a.budget_s:
            skipped = dict(section="gemv", model=model, shape=name, K=K, N=N, weights=kind, M=1, impl=impl)
            add(dict(skipped, tiles=tiles and list(tiles), error="skipped: the budget ran out"))
            continue
        key = (model, name, K, N, kind)
        if key not in cases:
            cases[key] = Case(model, name, K, N, kind, 1, a.dry_run, jax.random.key(len(cases)))
        add(time_case(cases[key], impl, tiles, a, ceiling))
    if not a.no_moe:
        for row in moe_rows(a, deadline - RESERVE[1] * a.budget_s):
            add(row)
    best = {(s["model"], s["shape"], s["weights"]): s["best"] for s in summary(rows)}
    for model, name, K, N, kind in list(cases):  # 4 rows: the Llama shapes (dry: its one)
        if model == "GPT-2 124M" or time.perf_counter() > deadline:
            continue
        case4 = Case(model, name, K, N, kind, 4, a.dry_run, None, like=cases[model, name, K, N, kind])
        for impl, tiles in (("xla", None), ("pallas", best.get((model, name, kind)))):
            if impl == "xla" or tiles:
                add(time_case(case4, impl, tiles and Tiles(*tiles), a, ceiling))
        del case4
    cases.clear()
    cols = ["model", "shape", "weights", "M", "impl", "tiles", "us", "gbps", "pct_copy", "err", "error"]
    print(harness.markdown([r for r in rows if r.get("section") == "gemv"], cols))
    print(
        harness.markdown(
            [r for r in rows if r.get("section") != "gemv"],
            ["section", "what", "gbps", "ms", "tflops", "error"],
        )
    )
    best_rows = summary(rows)
    print(f"\nbest tiling per (kernel, shape), copy ceiling {rows[0]['gbps']} GB/s ({device.device_kind}):")
    cols = ["model", "shape", "weights", "M", "tilings", "best", "best_gbps", "best_pct", "default_gbps"]
    print(harness.markdown(best_rows, cols + ["xla_gbps", "best_vs_xla", "wrong"]))
    if a.json:
        a.json.write_text(json.dumps(rows + [dict(section="best", **r) for r in best_rows], indent=1) + "\n")
    print(f"done in {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
