"""One prepared run on a lent GPU: training, decoding, the side-by-side references and the GPU tests.

    python benchmarks/gpu_lease.py --out $OUT                # on one H100: every part, one table at the end
    python benchmarks/gpu_lease.py --dry_run --out out/lease  # CPU, tiny shapes: checks the script itself
    python benchmarks/gpu_lease.py --parts recipe,decode_gpt2 --out $OUT

Each part runs in its own process group under its own time limit (a part that fails or runs out of
time costs its rows only). PARTS holds the limits, from what each part took on 2026-11-26 and -27;
GROUPS the parts that fit one device call of 10 minutes. Every part ran in one 15-minute session on
2026-11-27 (H200): `--parts decode_llama8b,tests,hf_generate` (465 s), then at once on the warm machine
`decode_gpt2`, `recipe,nanogpt` and `step` (58, 89 and 31 s): 797 s of device time with the start.
The parts' limits now add up to ~35 minutes, and a session has 15 minutes of device time, the start
included. The next lease: first `--parts targets` (kernel_sweep, then the parts that take its
tilings in the same call, decode_llama8b_pallas and decode_gpt2_kernels, then decode_gpt2; limits
530 s: issue #54's int8 / int4 and GPT-2 targets measured at the card's own tilings, not the paper
defaults, and GPT-2's float rows with the attention kernel beside XLA's path), then on the warm
machine `--parts decode_llama8b --llama_batches 1` (the 8B shape's bf16 target, the attention kernel
alone beside XLA's path; limit 270 s: the start and the first call leave about this much of the 15
minutes), then whatever time is left for `--parts decode_attention,fp8_moe,grouped_moe` (what the
group `sweep` adds to kernel_sweep), `--parts decode_gpt2_profile,step_profile` (the profiles: why
GPT-2's token and the step stop where they do), then `fp8`, `step`, `fused_loss`, `epilogues`. The parts:
- kernel_sweep: `benchmarks/kernel_sweep.py` (its docstring: the method): the decoding GEMV kernels
  (kernels/pallas_decode.py bf16, kernels/pallas_qgemv.py int8 and int4) over a grid of tilings
  against XLA's products, for Llama-3-8B's and GPT-2's weight shapes at 1 row (Llama's at 4 too): us
  a call, GB/s and % of a measured copy ceiling; Mixtral-8x7B's expert product by the tiled grouped
  matmul, jax.lax.ragged_dot and dense dots. Rows: the ceiling, the best tiling per (kernel, shape)
  against the default and XLA, the MoE rows; every row in OUT/kernel_sweep.json, the best tilings as
  kernels.tuned's file in WORK/gemv_tiles.json (--gemv_tiles) and OUT, which decode_gpt2_kernels,
  decode_llama8b_pallas and the profile parts then take (FLAXGPT_GEMV_TILES; their rows say "swept
  tiles")
- decode_attention: `benchmarks/decode_attention.py`: a decoding row's attention over its cache, XLA's
  path against kernels/pallas_decode_attention.py, per call (32 layers' buffers a program), for the
  Llama-3-8B and GPT-2 shapes at caches of 192-8192 positions: where the kernel (a program a key/value
  head and range of 1,024 positions) gains and where it falls behind
- recipe: `train.py --config configs/gpt2_124m_1gpu.py` on random tokens, a few steps, read back from
  metrics.jsonl (the trainer's own figures; steps after the first)
- step: flaxgpt's train step alone (`benchmarks/train_throughput.py --step gpu`), GPT-2 124M, T 1024,
  batch 16; step_profile: the same, then 3 steps under JAX's profiler (`--profile`)
- fused_loss: the same step (the recipe's micro-batch) with the loss from the logits, then through the
  fused linear + cross-entropy (`--loss_impl fused`, train/losses.py), then that with its Triton kernels
  (FLAXGPT_XENT=pallas, kernels/pallas_xent.py; on the CPU the XLA form again): step time and peak memory
- decode_gpt2: greedy decoding, 16-token prompts, 256 new tokens, float weights in bf16 (sample.py's
  param_dtype=bfloat16; batch 1's products GEMMs since 2026-11-30, models.linear.product: 1,606 tok/s
  before, on 2026-11-29, with XLA's multiply-and-sum; "float+attention": those with
  FLAXGPT_DECODE_KERNELS=attention, the attention kernel alone, at batch 1), bf16 and int8 weights
  (quantize_params) at batch 1 and 64, the token loop as one CUDA graph (sampling.GPU_LOOP_OPTIONS), on the
  default path (XLA's since the 2026-11-29 lease); decode_gpt2_plain: the same without (`graphs=False`);
  decode_gpt2_kernels: the float and bf16 rows at batch 1 with FLAXGPT_DECODE_KERNELS=on (each layer's norms
  and residual adds in its GEMVs and the cache writes in the attention, kernels/pallas_decode*.py), for the
  side by side (the GPT-2 >= 4,000 tok/s target; slower than XLA's path on 2026-11-29): "float" reads flax's
  [K, N] kernels cast to bf16, 32 channels a program; "bf16" (quantize_params' rows [N, K]) reads them as
  rows, 8 channels a program (since 2026-11-30; on 2026-11-29 its products were XLA's)
- decode_llama8b: the same for Llama-3-8B's shape, random bf16 weights made on the device (16 GB;
  "bf16+attention" at batch 1: the attention kernel alone, the products XLA's, 13 kernels a layer
  where XLA's path takes 18, compiled; int8 8 GB; int4, groups of 128, 4.3 GB), 128 new tokens
- decode_llama8b_pallas: its batch-1 int8 and int4 rows with FLAXGPT_QMATMUL=pallas (the weight products
  through kernels/pallas_qgemv.py's Triton GEMV, each weight byte read once): the int8 >= 1.6x and
  int4 >= 2.0x bf16 targets against decode_llama8b's XLA rows
- decode_llama8b_reduce: its batch-1 rows with FLAXGPT_QMATMUL=reduce (the weight products as a multiply
  and a row reduction reading int8 / bf16 directly, instead of XLA's GEMM fusion): an experiment for
  the int8 target (int8 read 2.0 TB/s on the H200, bf16 3.47)
- fp8: one Llama-3-8B layer's forward and backward (4 x 2048 tokens) in bf16, then with model.fp8
  (benchmarks/fp8_layer.py): tokens/s and the ratio (issue #54's target: >= 1.3x; a prediction until
  a lease runs it)
- fp8_moe: the same for one Mixtral-8x7B layer (attention and 8 experts, top 2; `fp8_layer.py --preset
  mixtral-8x7b`, 4 x 2048 tokens): bf16, model.fp8 (its routed experts in bf16) and model.fp8 +
  fp8_experts (their grouped products in float8 too: 0.77x bf16 on 2026-11-29, 1.30x predicted)
- epilogues: the step (batch 16) with the MLP's bias + GELU as one pass the backward recomputes and
  q, k, v as products of their own for cuDNN (models/linear.py, the default), then without
  (FLAXGPT_EPILOGUES=off: autodiff's GELU, which keeps its tanh, and one q|k|v product split): step
  time and peak memory side by side (compiled for h100-1 the bound falls 23.56 -> 22.57 ms, a
  prediction until a lease runs it; docs/accelerators.md)
- nanogpt: nanoGPT's model.py (torch.compile, bf16 autocast, fused AdamW, clip 1.0), batch 16; its file
  is carried to the lease (--nanogpt_model), never committed
- hf_generate: transformers' generate on GPT-2 124M (bf16; the default cache, then a static cache,
  which generate compiles itself on a GPU)
- grouped_moe: fp8_moe's layer with FLAXGPT_GROUPED=pallas (its experts' grouped products through
  kernels/pallas_grouped.py's Triton GEMM reading the weights in place; compiled for h100-1 the bf16
  layer's HBM traffic 101.3 -> 55.9 GB): its rows beside fp8_moe's tiled ones
- tests: `pytest tests/kernels tests/models tests/decode tests/train` (--test_paths) on the GPU (last:
  it takes whatever time is left); tests marked `devices(8)` skip on one GPU
The profile parts (group `profile`: decode_gpt2_profile, decode_llama8b_profile, step_profile) time
batch-1 rows again and then run each under JAX's profiler (--profile_tokens, 33 tokens;
benchmarks/device_profile.py): a "profile" row each, the token loop's kernels a token (or the step's)
and the device's busy time against the timed figure (what the compiled kernel count cannot say:
whether a token waits on its kernels or between them), every profile's heaviest ops in
OUT/profiles.json. Parts of their own, after the timings: a profiler that fails or hangs on the
image (CUPTI) costs their rows only. decode_gpt2_profile: float, float+attention and the decode
kernels (float+on, bf16+on, at kernel_sweep's tilings where it wrote them); decode_llama8b_profile:
bf16, bf16+attention, int8 and int4.
MFU is against 989 TFLOP/s (H100 SXM / H200 dense bf16) with the trainer's FLOPs per token; the
decoding rows' HBM percentage against the card's bandwidth (BANDWIDTH, by device kind). Results: a
table on stdout, every row as JSON in OUT/lease.json, the parts' logs in OUT/logs.txt, the test run's
output in OUT/tests_output.txt (data, runs and logs under --work).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness  # first: the benchmarks' one sys.path rule, see harness.py

ROOT = Path(__file__).resolve().parents[1]
PEAK = 989e12  # dense bf16 FLOP/s, H100 SXM and H200 alike
# HBM bytes/s by device kind (the percentages of the decoding rows); the lease may give either card
BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12}
# part -> seconds it may take on one H100 / H200 (compiling included), from the 2026-11-26 and -27 leases
PARTS = {
    "kernel_sweep": 180,  # 178 s predicted by its count: it stops starting programs at 155 s
    "recipe": 90,
    "step": 60,
    "step_profile": 70,  # the step, then 3 steps under the profiler (--profile)
    "fused_loss": 150,  # three compiles and runs of the step (~30 s each on 2026-11-27's `step`)
    "fp8": 120,  # two compiles and 10 steps each of one 8B layer (24 s on 2026-11-29)
    "fp8_moe": 150,  # the same for one Mixtral-8x7B layer, three sides (two took 30 s on 2026-11-29)
    "grouped_moe": 90,  # fp8_moe's layer with FLAXGPT_GROUPED=pallas (not yet run on a lease)
    "epilogues": 110,  # two compiles and runs of the step; on 2026-11-29 killed at 80 s as the second ended
    "nanogpt": 70,
    "decode_gpt2": 150,  # 58 s on 2026-11-27 with bf16 and int8; float rows added, then float+attention
    "decode_gpt2_plain": 100,
    "decode_gpt2_kernels": 70,  # float and bf16 at batch 1, FLAXGPT_DECODE_KERNELS=on (float: 31 s, 11-29)
    # 137 s on 2026-11-27; on 2026-11-29 batch 1's rows took 143 s and batch 64's bf16 compile ran out at
    # 170; bf16+attention (batch 1) added since
    "decode_llama8b": 270,
    "decode_attention": 90,  # 6 (shape, cache, position) cases x 2 forms, 32 layers' calls a program
    "decode_llama8b_reduce": 110,  # batch 1, FLAXGPT_QMATMUL=reduce: the int8 products as row reductions
    "decode_llama8b_pallas": 130,  # batch 1, int8 and int4, FLAXGPT_QMATMUL=pallas (not yet run on a lease)
    # batch 1 timed again, then 33 tokens under the profiler, a row each (four modes; not yet run)
    "decode_gpt2_profile": 100,
    "decode_llama8b_profile": 200,
    "hf_generate": 150,
    "tests": 270,  # 204 s on 2026-11-27 with 12 workers and no autotuning
}
# what one call of at most 10 minutes holds
GROUPS = {
    # the next lease's first call (limits: 530 s): the GEMV tilings, then the decoding targets
    # that take them (FLAXGPT_GEMV_TILES) while the machine holds them, then GPT-2's XLA rows
    "targets": ("kernel_sweep", "decode_llama8b_pallas", "decode_gpt2_kernels", "decode_gpt2"),
    # the tilings, the attention per call and the Mixtral layer's float8 and grouped rows (limits: 510 s)
    "sweep": ("kernel_sweep", "decode_attention", "fp8_moe", "grouped_moe"),
    "train": ("recipe", "step", "fused_loss", "epilogues", "fp8", "nanogpt"),  # ~7.5 min (limits: 600 s)
    # batch-1 decoding and the step timed again, then under JAX's profiler (limits: 370 s)
    "profile": ("decode_gpt2_profile", "decode_llama8b_profile", "step_profile"),
    "decode": ("decode_gpt2", "decode_llama8b", "hf_generate"),  # ~6 min (limits: 570 s)
    # ~6.5 min: the int8 / int4 GEMV kernels and the mixture's float8 layer (limits: 390 s; train has
    # no room left for it; fp8_moe is in `sweep` too: a part named twice runs once)
    "gemv": ("decode_llama8b_pallas", "decode_llama8b_reduce", "fp8_moe"),
    "tests": ("tests",),  # ~3.5 min
}


def emit(**row) -> None:
    """A result row: the parent collects every `ROW {...}` line its parts print (`rows_in`)."""
    print("ROW " + json.dumps(row), flush=True)


def rows_in(output: str) -> list[dict]:
    """The rows `emit` printed into a part's output."""
    return [json.loads(x[4:]) for x in output.splitlines() if x.startswith("ROW ")]


# ---------------------------------------------------------------- parts (each in its own process)


def _train_step(a, part: str, label: str, what: str, args=(), env=None, result=None) -> None:
    """One run of benchmarks/train_throughput.py (the GPU step; the dry run: 3 CPU steps) as a row."""
    out = a.work / f"step_{label}.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/train_throughput.py"), "--json", str(out)]
    cmd += ["--step", "cpu", "--steps", "3"] if a.dry_run else ["--step", "gpu"]
    out.unlink(missing_ok=True)  # --work stays between a lease's calls: never an earlier call's figures
    failed = None
    try:
        subprocess.run(cmd + list(args), check=True, cwd=ROOT, env=env)
    except subprocess.CalledProcessError as e:
        if not out.exists():
            raise
        failed = e  # after its timing (written first): the profile's; the timed row stands
    r = json.loads(out.read_text())
    emit(
        part=part,
        what=f"train step, batch {r['batch_size']}, {what}",
        tokens_per_s=r["tokens_per_s"],
        mfu=r["mfu"],
        step_ms=r["step_ms"],
        peak_gib=r["peak_memory_gib"],
        result=result and result(r),
    )
    if "profile" in r:  # step_profile: 3 steps again under JAX's profiler (benchmarks/device_profile.py)
        what = f"train step, batch {r['batch_size']}, {what}"
        _profile_row(a, part, what, r["profile"], 1000 * r["step_ms"], "a step")
    if failed:
        raise SystemExit(f"train_throughput.py exited {failed.returncode} after its timing")


def part_step(a) -> None:
    _train_step(a, "step", "step", "attention auto")


def part_step_profile(a) -> None:
    _train_step(a, "step_profile", "step_profile", "attention auto", ["--profile"])


def _fp8_layer(a, part: str, preset: str, name: str, args=()) -> None:
    """benchmarks/fp8_layer.py's step for one layer of `preset` (its default 4 x 2048 tokens; the dry
    run: a tiny layer of the same kind), bf16 then model.fp8 (and a mixture's fp8_experts): a row each,
    the ratios to bf16."""
    out = a.work / f"{part}_layer.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/fp8_layer.py"), "--preset", preset, "--json", str(out)]
    subprocess.run(cmd + list(args) + (["--dry_run"] if a.dry_run else []), check=True, cwd=ROOT)
    r = json.loads(out.read_text())
    speedups = {"fp8": r["speedup"], "fp8_experts": r.get("speedup_fp8_experts")}
    for side in [s for s in ("bf16", "fp8", "fp8_experts") if s in r]:
        emit(
            part=part,
            what=f"{name} layer fwd+bwd, {r['tokens_per_step']} tokens, {side}",
            tokens_per_s=r[side]["tokens_per_s"],
            step_ms=r[side]["step_ms"],
            result=f"{speedups[side]}x bf16 (target >= 1.3x)" if side != "bf16" else None,
        )


def part_fp8(a) -> None:
    _fp8_layer(a, "fp8", "llama-3-8b", "Llama-3-8B")


def part_fp8_moe(a) -> None:
    _fp8_layer(a, "fp8_moe", "mixtral-8x7b", "Mixtral-8x7B")


def part_grouped_moe(a) -> None:
    name = "Mixtral-8x7B (Pallas grouped GEMM)"
    _fp8_layer(a, "grouped_moe", "mixtral-8x7b", name, ("--grouped", "pallas"))


def part_epilogues(a) -> None:
    # the fused forms (the default), then the plain ones: FLAXGPT_EPILOGUES is read when the step is traced
    for label, mode in (("fused", "on"), ("plain", "off")):
        env = {**os.environ, "FLAXGPT_EPILOGUES": mode}
        loss = lambda r: f"loss {r['loss']}"  # noqa: E731
        _train_step(
            a, "epilogues", f"epilogues_{label}", f"MLP and q/k/v epilogues {label}", env=env, result=loss
        )


def part_fused_loss(a) -> None:
    # the loss from the logits; the fused linear + cross-entropy's XLA form; its Triton kernels (opt-in)
    for label, impl, kernels in (
        ("logits", "logits", "xla"),
        ("fused", "fused", "xla"),
        ("pallas", "fused", "pallas"),
    ):
        env = {**os.environ, "FLAXGPT_XENT": kernels}
        loss = lambda r: f"loss {r['loss']}"  # noqa: E731
        _train_step(a, "fused_loss", label, f"loss {label}", ["--loss_impl", impl], env, loss)


def part_kernel_sweep(a) -> None:
    """benchmarks/kernel_sweep.py under its own budget (so its summary comes back before the part's
    limit): every row into OUT/kernel_sweep.json, here the copy ceiling, each best tiling and the MoE."""
    from kernel_sweep import summary  # benchmarks/ is on sys.path (this script's folder); no device yet

    out = a.out / "kernel_sweep.json"
    budget = 60 if a.dry_run else PARTS["kernel_sweep"] - 25  # its start, the last program's compile
    cmd = [sys.executable, str(ROOT / "benchmarks/kernel_sweep.py"), f"--json={out}", f"--budget_s={budget}"]
    # the best tilings, which the kernels' decode parts take (FLAXGPT_GEMV_TILES) in this call or a later
    # one on the warm machine (--work stays), and which come back in OUT for the defaults' next choice
    cmd += [f"--tiles_out={a.gemv_tiles}"]
    try:
        subprocess.run(cmd + (["--dry_run"] if a.dry_run else []), check=True, cwd=ROOT, timeout=budget + 15)
    except subprocess.TimeoutExpired:
        progress("kernel_sweep: out of time, its rows so far")
    rows = json.loads(out.read_text()) if out.exists() else []
    for r in rows:
        if r["section"] == "copy":
            emit(part="kernel_sweep", what=f"copy ceiling: {r['what']}", result=f"{r['gbps']} GB/s")
    gemv = [r for r in rows if r["section"] == "gemv"]
    for s in summary(gemv):
        what = f"{s['model']} {s['shape']} {s['weights']} M={s['M']}: best of {s['tilings']} tilings"
        result = (f"{s['best']} {s['best_gbps']} GB/s ({s['best_pct']}% of copy), "
                  f"default {s['default_gbps']}, XLA {s['xla_gbps']}: {s['best_vs_xla']}x XLA")  # fmt: skip
        emit(part="kernel_sweep", what=what, result=result, **{k: s[k] for k in ("best_gbps", "xla_gbps")})
    for r in rows:
        if r["section"] == "moe":
            result = r.get("error") or f"{r['ms']} ms, {r['tflops']} TFLOP/s"
            emit(part="kernel_sweep", what=f"MoE {r['what']}", result=result, step_ms=r.get("ms"))
    skipped = sum("budget" in r.get("error", "") for r in gemv)
    emit(part="kernel_sweep", what=f"{len(gemv)} GEMV rows, {skipped} skipped by the budget", result=out.name)
    if a.gemv_tiles.exists():
        (a.out / "gemv_tiles.json").write_text(a.gemv_tiles.read_text())


def part_decode_attention(a) -> None:
    """benchmarks/decode_attention.py: a decoding row's attention, XLA's path against the Pallas kernel
    (FLAXGPT_DECODE_KERNELS=attention's), per call, at the lease's cache lengths and longer; a row per
    (shape, S, pos), every row into OUT/decode_attention.json."""
    out = a.out / "decode_attention.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/decode_attention.py"), f"--json={out}"]
    try:  # its rows so far come back before the part's own limit (the file is rewritten after each case)
        args = cmd + (["--dry_run"] if a.dry_run else [])
        rc = subprocess.run(args, cwd=ROOT, timeout=PARTS[a.part] - 10).returncode
    except subprocess.TimeoutExpired:
        rc = "out of time"
    rows = json.loads(out.read_text()) if out.exists() else []
    xla = {(r["shape"], r["S"], r["pos"]): r for r in rows if r["form"] == "xla"}
    for r in (r for r in rows if r["form"] == "kernel"):
        x = xla[r["shape"], r["S"], r["pos"]]
        emit(part="decode_attention", what=f"{r['shape']} attention, cache {r['S']}, position {r['pos']}",
             result=f"XLA {x['us']} us, kernel {r['us']} us a layer: {r['speedup']}x (err {r['err']})",
             us=r["us"], xla_us=x["us"])  # fmt: skip
    if rc:
        emit(part="decode_attention", what="decode_attention.py", result=f"exit {rc}")


def _random_data(path: Path, vocab: str, tokens: int) -> None:
    import numpy as np

    from flaxgpt.data import prepare

    tok = prepare.make_tokenizer(vocab, "abcdefghijklmnopqrstuvwxyz \n" if vocab == "char" else None)
    rs = np.random.RandomState(0)
    ids = rs.randint(0, tok.vocab_size, tokens)
    prepare.write_dataset(path, ids[: tokens * 9 // 10], ids[tokens * 9 // 10 :], tok, "random", True)


def part_recipe(a) -> None:
    data, out = a.work / "data", a.work / "run"
    if a.dry_run:
        _random_data(data, "char", 200_000)
        recipe, steps = "configs/shakespeare_char_cpu.py", 8
        extra = ["--config.model.n_layer=2", "--config.batch_size=8", "--config.grad_accum=2"]
    else:
        _random_data(data, "gpt2", 20_000_000)
        recipe, steps, extra = "configs/gpt2_124m_1gpu.py", 6, []
    cmd = [
        sys.executable,
        "train.py",
        f"--config={recipe}",
        f"--config.data.dir={data}",
        f"--config.out_dir={out}",
        f"--config.max_iters={steps}",
        "--config.log_interval=1",
        "--config.eval_interval=100000",
        "--config.eval_iters=1",
        "--config.tensorboard=False",
        "--config.plot=False",
        *extra,
        *a.recipe_args,
    ]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in rows if "step_time" in r and r["step"] > 1]  # the first holds autotuning
    import statistics

    tok = statistics.median(r["tokens_per_sec"] for r in steps_)
    mfu = [r["mfu"] for r in steps_ if r.get("mfu") is not None]
    emit(
        part="recipe",
        what=f"train.py {recipe} {' '.join(a.recipe_args)}".strip(),
        tokens_per_s=round(tok),
        mfu=round(statistics.median(mfu), 4) if mfu else None,
        step_ms=round(1000 * statistics.median(r["step_time"] for r in steps_), 1),
        last_step_mfu=steps_[-1].get("mfu"),
        wall_s=round(wall, 1),
    )


def progress(msg: str) -> None:
    """A timestamped line on stderr (the part's log): where a part that ran out of time was."""
    print(f"{time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


def _random_params(cfg):
    """Random weights straight in bfloat16 on the device (no model trace, no float32 copy: an 8B
    model's float32 parameters alone would be 32 GB): N(0, 0.02), norms' scales 1."""
    import jax
    import jax.numpy as jnp
    from flax import linen as nn

    from flaxgpt.models import gpt

    shapes = nn.unbox(gpt.abstract_params(cfg))
    leaves, tree = jax.tree.flatten(shapes)

    @jax.jit
    def make(key):
        keys = jax.random.split(key, len(leaves))
        return tree.unflatten([
            jnp.ones(s.shape, jnp.bfloat16) if len(s.shape) == 1 else
            (0.02 * jax.random.normal(k, s.shape, jnp.float32)).astype(jnp.bfloat16)
            for k, s in zip(keys, leaves)
        ])  # fmt: skip

    return make(jax.random.key(0))


def _decode(a, cfg, label: str, batches, quantize_modes, new_tokens: int) -> None:
    graphs = a.part != "decode_gpt2_plain"
    label += "" if graphs else " (plain loop)"
    if a.part.endswith("_reduce"):  # read when the products are traced (flaxgpt.kernels.qmatmul)
        os.environ["FLAXGPT_QMATMUL"] = "reduce"
        label += " (multiply-reduce products)"
    if a.part.endswith("_pallas"):
        os.environ["FLAXGPT_QMATMUL"] = "pallas"
        label += " (Pallas GEMV)"
    if a.part.endswith("_kernels"):  # read when the blocks are traced (flaxgpt.models.linear.decode_kernels)
        os.environ["FLAXGPT_DECODE_KERNELS"] = "on"  # interpreted on a CPU (the dry run)
        label += " (decode kernels)"
    if a.part.endswith(("_pallas", "_kernels", "_profile")) and a.gemv_tiles.exists():
        # kernel_sweep's fastest tilings on this card, where it timed the shape (kernels.tuned); its
        # table has each against the default's, so these rows need not time the defaults again
        os.environ["FLAXGPT_GEMV_TILES"] = str(a.gemv_tiles)
        label = label[:-1] + ", swept tiles)" if label.endswith(")") else label + " (swept tiles)"
    import jax
    import jax.numpy as jnp
    import numpy as np

    from flaxgpt.decode import sampling
    from flaxgpt.kernels import pallas_decode
    from flaxgpt.models import gpt
    from flaxgpt.models.cache import KVCache

    device = jax.devices()[0].device_kind
    bandwidth = a.bandwidth or next((b for k, b in BANDWIDTH.items() if k in device), 3.35e12)
    progress(f"{label}: random weights")
    params = _random_params(cfg)
    prompt_len = 16
    quantized = {}  # by weight type; "bf16+attention" decodes "bf16"'s weights with the attention kernel
    for weights in dict.fromkeys(m.partition("+")[0] for m in quantize_modes):
        progress(f"{label}: {weights} weights")
        if weights == "float":  # float weights cast to bf16, as sample.py's param_dtype=bfloat16
            bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
            quantized[weights] = (dataclasses.replace(cfg, param_dtype="bfloat16"), bf16)
        else:
            quantized[weights] = gpt.quantize_params(cfg, params, weights)
    del params
    kernels_mode = os.environ.get("FLAXGPT_DECODE_KERNELS", "auto")  # the part's
    for B in batches:  # batch 1 of every weight type first: what matters most if time runs out
        if a.part.endswith("_kernels") and B > 1:  # the decode kernels take batch 1's rows only
            continue
        prompt = np.random.RandomState(B).randint(0, cfg.vocab_size, (B, prompt_len)).astype(np.int32)
        W = sampling.cache_length(cfg.block_size, prompt_len, new_tokens)
        for mode in quantize_modes:
            kind, _, kernels = mode.partition("+")
            if kernels and B > pallas_decode.MAX_ROWS:  # XLA's path again: no row of its own
                continue
            qcfg, qparams = quantized[kind]
            weights = sum(x.nbytes for x in jax.tree.leaves(qparams))
            # read when the step is traced: the same config's trace (bf16, then bf16+attention) is not
            # reused across modes
            os.environ["FLAXGPT_DECODE_KERNELS"] = kernels or kernels_mode
            jax.clear_caches()
            step_fn = gpt.step_fn(qcfg, qparams)

            def run(n, step_fn=step_fn, qcfg=qcfg, B=B, W=W, prompt=prompt):
                cache = KVCache.for_config(qcfg, B, W)
                t0 = time.perf_counter()
                _, lens = sampling.generate(
                    step_fn, cache, prompt, np.full(B, prompt_len), max_new_tokens=n, rng=jax.random.key(0),
                    temperature=0, graphs=graphs,
                )  # fmt: skip
                assert (lens == n).all()
                return time.perf_counter() - t0

            progress(f"{label}: {mode} batch {B}: compiling")
            compile_s = run(new_tokens)  # the same chunking as the timed runs: nothing left to compile
            progress(f"{label}: {mode} batch {B}: timing")
            best = min(run(new_tokens) for _ in range(2))
            per_step = best / new_tokens
            emit(
                part=a.part,
                what=f"decode {label} {mode} batch {B}",
                tokens_per_s=round(B * new_tokens / best),
                ms_per_token=round(1000 * per_step, 3),
                hbm_pct=round(100 * weights / per_step / bandwidth, 1),
                device=device,
                weights_gb=round(weights / 1e9, 2),
                first_run_s=round(compile_s, 1),
            )
            if a.part.endswith("_profile") and a.profile_tokens > 1:
                n = min(a.profile_tokens, new_tokens)
                _profile(a, f"{label} {mode} batch 1", lambda n=n, run=run: run(n), n - 1, 1e6 * per_step)


def _profile(a, what: str, run, tokens: int, timed_us: float) -> None:
    """The token loop's kernels under JAX's profiler (benchmarks/device_profile.py: the decode_chunk
    program's events, `tokens` of them; the first token is the prefill's): a row with the kernels
    and the device's busy time a token against the timed `timed_us`, and the heaviest ops into
    OUT/profiles.json. What the compiled count cannot say: whether a token waits on its kernels or
    between them. A profiler that cannot start (CUPTI) costs this row only (and a profile part's
    rows only: the decode parts themselves do not profile)."""
    import device_profile

    try:
        p = device_profile.profile(run, per=tokens, module="decode_chunk")
    except Exception as e:  # the timings before it stand
        emit(part=a.part, what=f"profile {what}", result=f"{type(e).__name__}: {str(e)[:150]}")
        return
    _profile_row(a, a.part, what, p, timed_us, "a token")


def _profile_row(a, part: str, what: str, p: dict, timed_us: float, step: str) -> None:
    """A device_profile.profile result as a row (kernels and busy time a step against the timed one),
    and its heaviest ops appended to OUT/profiles.json."""
    import device_profile

    line = device_profile.summary(p, step=step, timed_us=round(timed_us, 1))
    emit(part=part, what=f"profile {what}", result=line, kernels_per_step=p["kernels_per"],
         busy_us=p["busy_us_per"], wall_us=p["wall_us_per"])  # fmt: skip
    path = a.out / "profiles.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    path.write_text(json.dumps(rows + [dict(part=part, what=what, **p)], indent=1) + "\n")


def part_decode(a, model: str) -> None:
    from flaxgpt.models.gpt import GPTConfig

    int4 = "int4_g32" if a.dry_run else "int4"  # the tiny model's 64 features take groups of 32
    modes = {
        "decode_llama8b": ("bf16", "bf16+attention", "int8", int4),
        "decode_llama8b_pallas": ("int8", int4),
        "decode_llama8b_profile": ("bf16", "bf16+attention", "int8", int4),
    }
    modes.update(
        decode_gpt2=("float", "float+attention", "bf16", "int8"), decode_gpt2_kernels=("float", "bf16"),
        decode_gpt2_profile=("float", "float+attention", "float+on", "bf16+on"),
    )  # fmt: skip
    modes = modes.get(a.part, ("bf16", "int8"))
    if a.dry_run:
        cfg = GPTConfig(vocab_size=256, n_layer=2, n_head=2, n_embd=64, block_size=128, dtype="bfloat16")
        # batch 1 only: the batch loop is tests/test_gpu_lease.py's (generate stood in for), and each
        # batch's rows here cost CI a compile per weight type
        return _decode(a, cfg, "tiny", (1,), modes, 8)
    if model == "gpt2":
        cfg = GPTConfig.preset("gpt2", dtype="bfloat16", pad_vocab_multiple=64)
        batches = (1,) if a.part.endswith("_profile") else a.gpt2_batches
        return _decode(a, cfg, "GPT-2 124M", batches, modes, 256)
    cfg = GPTConfig.preset("llama-3-8b", dtype="bfloat16", block_size=1024)
    one_row = a.part.endswith(("_reduce", "_pallas", "_profile"))  # these are for decoding rows
    return _decode(a, cfg, "Llama-3-8B shape", (1,) if one_row else a.llama_batches, modes, 128)


def part_tests(a) -> None:
    folders = ["tests/decode/test_beam_search.py"] if a.dry_run else a.test_paths.split()
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    if not a.dry_run:
        # the tests' programs are small and many: XLA's GPU autotuning (timing each matmul's candidate
        # kernels while compiling) cost more than they run; results do not depend on it
        flags = env.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0"
        # the tests' own processes (train.py, python -m flaxgpt...) import this checkout, installed or not
        path = os.pathsep.join(x for x in (str(ROOT), env.get("PYTHONPATH")) if x)
        env.update(JAX_PLATFORMS="cuda", XLA_FLAGS=flags.strip(), PYTHONPATH=path)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", *folders]
    cmd += ["-k", "beam_size_one"] if a.dry_run else ["-n", str(a.test_workers), "--timeout=120"]
    with (a.out / "tests_output.txt").open("w") as f:  # written as it runs: a cut-off run keeps its part
        subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
    out = (a.out / "tests_output.txt").read_text()
    tail = [x for x in out.splitlines() if x.strip()][-1:]
    failed = [x.split(" ")[1] for x in out.splitlines() if x.startswith(("FAILED ", "ERROR "))]
    emit(part="tests", what=" ".join(folders), result=tail[0] if tail else "", failed=failed)


def part_nanogpt(a) -> None:
    """nanoGPT's model.py as its train.py runs it on one GPU (compile, bf16 autocast, fused AdamW)."""
    import importlib.util

    import torch

    if not a.nanogpt_model.is_file():
        raise SystemExit(f"no nanoGPT model.py at {a.nanogpt_model}: fetch nanoGPT's, pass --nanogpt_model")
    spec = importlib.util.spec_from_file_location("nanogpt_model", a.nanogpt_model)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cuda = torch.cuda.is_available() and not a.dry_run
    dev = "cuda" if cuda else "cpu"
    if a.dry_run:
        conf, B, steps = mod.GPTConfig(block_size=64, vocab_size=256, n_layer=2, n_head=2, n_embd=64), 4, 3
    else:
        conf, B, steps = mod.GPTConfig(), 16, 20
    model = mod.GPT(conf).to(dev)
    opt = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), dev)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        model = torch.compile(model)
    ctx = torch.autocast(dev, dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    x, y = (torch.randint(0, conf.vocab_size, (B, conf.block_size), device=dev) for _ in range(2))

    def step():
        with ctx:
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(3):
        step()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    dt = (time.perf_counter() - t0) / steps
    tok = B * conf.block_size / dt
    fpt = _flops_per_token(conf.n_layer, conf.n_head, conf.n_embd, conf.block_size, conf.vocab_size)
    emit(
        part="nanogpt",
        what=f"nanoGPT model.py, torch {torch.__version__}, compile, batch {B}",
        tokens_per_s=round(tok),
        mfu=round(fpt * tok / PEAK, 4) if cuda else None,
        step_ms=round(1000 * dt, 1),
        peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
    )


def _flops_per_token(L, H, D, T, V) -> float:
    """The trainer's count (flaxgpt.tools.summary) for a GPT-2-shaped model, so both MFUs compare."""
    from flaxgpt.models.gpt import GPTConfig
    from flaxgpt.tools.summary import flops_per_token

    return flops_per_token(GPTConfig(vocab_size=V, n_layer=L, n_head=H, n_embd=D, block_size=T))["train"]


def part_hf_generate(a) -> None:
    import torch
    import transformers

    cuda = torch.cuda.is_available() and not a.dry_run
    dev = "cuda" if cuda else "cpu"
    if a.dry_run:
        conf, batches, n = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256), (1,), 8
    else:
        conf, batches, n = transformers.GPT2Config(), (1, 64), 256
    model = transformers.GPT2LMHeadModel(conf).to(dev, torch.bfloat16 if cuda else torch.float32).eval()
    for cache in ("dynamic", "static"):
        # a static cache on a GPU: generate compiles the forward itself (torch.compile, CUDA graphs);
        # wrapping it in torch.compile too failed on 2026-11-27 (a CUDA graph's output overwritten)
        for B in batches if cache == "dynamic" else batches[:1]:
            ids = torch.randint(0, conf.vocab_size, (B, 16), device=dev)
            kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            if cache == "static":
                kw["cache_implementation"] = "static"
            with torch.no_grad():
                model.generate(ids, **kw)  # warm-up (and compilation)
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                model.generate(ids, **kw)
                if cuda:
                    torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            emit(
                part="hf_generate",
                what=f"transformers {transformers.__version__} generate GPT-2 bf16 batch {B}, "
                f"{cache} cache" + (" (generate's own torch.compile)" if cache == "static" and cuda else ""),
                tokens_per_s=round(B * n / dt),
                ms_per_token=round(1000 * dt / n, 3),
            )


# ---------------------------------------------------------------- the parent


def run_part(a, name: str, limit: float) -> list[dict]:
    env = dict(os.environ)
    if a.dry_run:
        env.setdefault("JAX_PLATFORMS", "cpu")
    cmd = [
        sys.executable,
        __file__,
        "--part",
        name,
        "--out",
        str(a.out),
        "--work",
        str(a.work),
        "--nanogpt_model",
        str(a.nanogpt_model),
    ]
    cmd += ["--dry_run"] if a.dry_run else []
    cmd += [f"--recipe_arg={x}" for x in a.recipe_args]
    cmd += [f"--gpt2_batches={','.join(map(str, a.gpt2_batches))}"]
    cmd += [f"--llama_batches={','.join(map(str, a.llama_batches))}"]
    cmd += [f"--test_paths={a.test_paths}", f"--test_workers={a.test_workers}"]
    cmd += [f"--gemv_tiles={a.gemv_tiles}", f"--profile_tokens={a.profile_tokens}"]
    log = (a.work / f"{name}.log").open("w")
    t0 = time.perf_counter()
    rows, status = [], "ok"
    # its own process group: a part out of time is ended with everything it started (a test run's
    # workers too), so nothing of it holds the GPU while the next part is timed
    p = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True
    )
    try:
        out, _ = p.communicate(timeout=limit)
        status = "ok" if p.returncode == 0 else f"exit {p.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        status = f"time limit {limit:.0f} s"
    log.close()
    err = [x for x in (a.work / f"{name}.log").read_text().splitlines() if x.strip()][-1:]  # stderr's last
    with (a.work / f"{name}.log").open("a") as log:
        log.write(out)
    rows = rows_in(out)
    seconds = time.perf_counter() - t0
    if status != "ok" or not rows:
        rows.append(dict(part=name, what=f"{status}: {err[0][:160] if err else ''}"))
    for r in rows:
        r["part_s"] = round(seconds, 1)
    return rows


def table(rows: list[dict]) -> str:
    cols = ["part", "what", "tokens_per_s", "mfu", "step_ms", "ms_per_token", "hbm_pct", "peak_gib", "result"]
    cols = [c for c in cols if any(c in r for r in rows)]
    return harness.markdown(rows, cols, lambda c, v: f"{v:.1%}" if c == "mfu" else str(v))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out/gpu_lease")))
    ap.add_argument(
        "--parts",
        default="train",
        help=f"comma-separated parts ({', '.join(PARTS)}) or groups ({', '.join(GROUPS)})",
    )
    ap.add_argument("--dry_run", action="store_true", help="tiny shapes on the CPU: checks every part runs")
    ap.add_argument("--nanogpt_model", type=Path, default=ROOT / ".lease/nanogpt_model.py")
    ap.add_argument("--bandwidth", type=float, default=0, help="HBM bytes/s (0: by device kind, BANDWIDTH)")
    ap.add_argument("--recipe_arg", dest="recipe_args", action="append", default=[])
    batches = lambda text: tuple(int(b) for b in text.split(","))  # noqa: E731
    ap.add_argument("--gpt2_batches", type=batches, default=(1, 64), help="decoding batch sizes")
    ap.add_argument("--llama_batches", type=batches, default=(1, 64), help="decoding batch sizes")
    tests = "tests/kernels tests/models tests/decode tests/train"
    ap.add_argument("--test_paths", default=tests, help="what the part `tests` runs")
    ap.add_argument("--test_workers", type=int, default=12, help="pytest-xdist workers sharing the GPU")
    ap.add_argument("--limit", action="append", default=[], help="PART=SECONDS: another time limit")
    ap.add_argument(
        "--work", type=Path, default=Path(tempfile.gettempdir(), "flaxgpt_gpu_lease"), help="data, runs, logs"
    )
    ap.add_argument(
        "--gemv_tiles",
        type=Path,
        help="kernel_sweep's tilings (FLAXGPT_GEMV_TILES), written by the part kernel_sweep and taken by "
        "decode_gpt2_kernels, decode_llama8b_pallas and the profile parts where it exists (default: "
        "WORK/gemv_tiles.json)",
    )
    ap.add_argument(
        "--profile_tokens",
        type=int,
        default=33,
        help="the profile parts' rows: decode this many tokens again under JAX's profiler (0: not)",
    )
    ap.add_argument("--part", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.gemv_tiles = a.gemv_tiles or a.work / "gemv_tiles.json"
    a.out.mkdir(parents=True, exist_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)
    if a.part:  # a child: one part
        fn = {
            "decode_gpt2": lambda: part_decode(a, "gpt2"),
            "decode_gpt2_plain": lambda: part_decode(a, "gpt2"),
            "decode_gpt2_kernels": lambda: part_decode(a, "gpt2"),
            "decode_llama8b": lambda: part_decode(a, "llama8b"),
            "decode_llama8b_reduce": lambda: part_decode(a, "llama8b"),
            "decode_llama8b_pallas": lambda: part_decode(a, "llama8b"),
            "decode_gpt2_profile": lambda: part_decode(a, "gpt2"),
            "decode_llama8b_profile": lambda: part_decode(a, "llama8b"),
        }.get(a.part)
        (fn or (lambda: globals()[f"part_{a.part}"](a)))()
        return 0
    names = [p for n in a.parts.split(",") if n.strip() for p in GROUPS.get(n.strip(), (n.strip(),))]
    names = list(dict.fromkeys(names))  # a part in two groups asked for runs once
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        raise SystemExit(f"error: unknown parts {unknown}; choose from {', '.join(PARTS)}")
    limits = {**PARTS, **{k: float(v) for k, v in (x.split("=") for x in a.limit)}}
    rows = []
    for name in names:
        rows += run_part(a, name, limits[name] * (4 if a.dry_run else 1))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
        (a.out / "lease.json").write_text(json.dumps(rows, indent=1) + "\n")
        # every part's log in one file: a lease brings back only a few files
        logs = [
            f"===== {n}\n" + (a.work / f"{n}.log").read_text()
            for n in names
            if (a.work / f"{n}.log").exists()
        ]
        (a.out / "logs.txt").write_text("\n".join(logs))
    print("\n" + table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
