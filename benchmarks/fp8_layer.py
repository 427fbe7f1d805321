"""One Llama-3-8B transformer layer trained in bf16, then with model.fp8 (kernels/fp8.py): tokens/s.

    python benchmarks/fp8_layer.py --json out.json               # one H100 / H200: 4 x 2048 tokens a step
    python benchmarks/fp8_layer.py --dry_run --json out.json     # CPU, a tiny layer: checks the script
    python benchmarks/fp8_layer.py --compile_for h100-1          # on a CPU: the compiled programs' figures
    python benchmarks/fp8_layer.py --preset mixtral-8x7b --batch 1 --compile_for h100-1   # a sparse layer

The step is the layer's forward and backward (models.gpt.Block, the 8B shape: D 4096, 32 heads over 8
key/value heads, SwiGLU F 14336, RoPE, bf16 compute and float32 weights), the gradient of a sum of
squares of its output with respect to its weights and input: the four projections a layer of the 8B
model trains, without the embedding and head (which model.fp8 leaves in bf16 anyway). The same jitted
function is timed for fp8 False and True in one process, after a warm-up call each; tokens/s = tokens a
step / median step time. issue #54's target: fp8 >= 1.3x bf16 (torchtitan measured 1.28x on a whole 8B
model with per-tensor current scaling).

--compile_for TARGET compiles the same two steps for a `flaxgpt aot` GPU target instead of running
them, and prints per program its dots by operand types, kernels, HBM bytes and the kernel bound of
flaxgpt/aot/hlo_cost.py (every matmul at the bf16 peak), and that bound again with the float8 GEMMs'
FLOPs at twice the peak (Hopper's dense float8 rate): compiled, not measured.

--preset mixtral-8x7b or qwen3-30b-a3b takes that model's layer instead: attention and a mixture of
experts (models/moe.py). model.fp8 leaves its routed experts in bf16 (measured 0.77x bf16 with them in
float8 on an H200, 2026-11-29); a third side, `fp8_experts`, times model.fp8 + model.fp8_experts (the
grouped expert products in float8 too: kernels.fp8.fp8_grouped over the tiled grouped matmul).
--grouped pallas sets FLAXGPT_GROUPED=pallas: every side's expert products through
kernels.pallas_grouped's Triton grouped GEMM (weights read in place) instead of the tiled form, the
fp8_experts side's float8 ones included (scaled in the kernels' epilogues).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from flaxgpt.models.gpt import Block, GPTConfig  # noqa: E402

PRESETS = ("llama-3-8b", "mixtral-8x7b", "qwen3-30b-a3b")  # a dense layer, two sparse ones


def layer_config(dry_run: bool, preset: str = "llama-3-8b") -> GPTConfig:
    if dry_run:
        tiny = dict(n_embd=64, n_head=4, n_kv_head=2, mlp_hidden=128, block_size=32, dtype="bfloat16")
        if GPTConfig.PRESETS[preset].get("num_experts"):
            tiny.update(num_experts=4, experts_per_token=2, expert_hidden=64)
        return GPTConfig.preset(preset, **tiny)
    return GPTConfig.preset(preset, dtype="bfloat16", block_size=2048)


def time_layer(cfg: GPTConfig, batch: int, steps: int) -> dict:
    """Median seconds of one forward + backward of the layer on [batch, block_size] tokens."""
    block, T = Block(cfg), cfg.block_size
    x_BTD = jax.random.normal(jax.random.key(0), (batch, T, cfg.n_embd), jnp.dtype(cfg.dtype))
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (batch, T))
    params = jax.jit(lambda x: block.init(jax.random.key(1), x, positions_BT)["params"])(x_BTD)

    def loss(params, x_BTD):
        y_BTD, _ = block.apply({"params": params}, x_BTD, positions_BT)
        return jnp.sum(jnp.square(y_BTD.astype(jnp.float32)))

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    t0 = time.perf_counter()
    jax.block_until_ready(step(params, x_BTD))
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(step(params, x_BTD))
        times.append(time.perf_counter() - t0)
    dt = statistics.median(times)
    return {
        "step_ms": round(1000 * dt, 2),
        "tokens_per_s": round(batch * T / dt),
        "compile_s": round(compile_s, 1),
    }


def compiled_figures(cfg: GPTConfig, batch: int, target_name: str) -> dict:
    """The step compiled for an aot target (abstract devices, nothing allocated): dots by operand types,
    kernels, HBM GB and kernel bounds (ms) at the bf16 peak and with float8 GEMMs at twice it."""
    from flaxgpt.aot import targets

    target = targets.get(target_name)
    device = target.devices()[0]
    block, T = Block(cfg), cfg.block_size
    one = jax.sharding.SingleDeviceSharding(device)
    x_BTD = jax.ShapeDtypeStruct((batch, T, cfg.n_embd), jnp.dtype(cfg.dtype), sharding=one)
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (batch, T))
    shapes = jax.eval_shape(lambda x: block.init(jax.random.key(1), x, positions_BT)["params"], x_BTD)
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one), shapes)

    def loss(params, x_BTD):
        pos_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), x_BTD.shape[:2])
        y_BTD, _ = block.apply({"params": params}, x_BTD, pos_BT)
        return jnp.sum(jnp.square(y_BTD.astype(jnp.float32)))

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x_BTD).compile().as_text()
    return figures_of(hlo, target)


def figures_of(hlo: str, target) -> dict:
    """An optimized GPU program's dots by operand types and hlo_cost's figures, the float8 GEMM fusions'
    FLOPs also at twice the peak (flaxgpt aot --dump's files too: python -c, figures_of(text, target))."""
    import re

    from flaxgpt.aot import hlo_cost

    dots = {}
    for comp in re.split(r"\n(?=\S)", hlo):
        types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", comp))
        types.update(re.findall(r"([\w.\-]+): (\w+)\[", comp.split("\n", 1)[0]))
        for a, b in re.findall(r"= \w+\[[\d,]*\][^ ]* dot\(%([\w.\-]+), %([\w.\-]+)\)", comp):
            key = f"{types.get(a)} x {types.get(b)}"
            dots[key] = dots.get(key, 0) + 1
    # the fusions whose computation multiplies float8 operands: their FLOPs run at the float8 rate
    f8_comps = {
        m.group(1)
        for m in re.finditer(r"^%?([\w.\-]+) \(([^)]*)\) -> .*\{$", hlo, re.M)
        if "f8e" in m.group(2)
    }
    f8_calls = set(re.findall(r"%([\w.\-]+) = [^\n]* fusion\([^\n]*calls=%([\w.\-]+)", hlo))
    f8_kernels = {name for name, comp in f8_calls if comp in f8_comps}
    cost = hlo_cost.estimate(hlo, target.peak_flops, target.bandwidth)
    fast = sum(
        k.count * max(k.flops / (2 * target.peak_flops), k.bytes / target.bandwidth)
        if k.name in f8_kernels and k.flops
        else k.count * k.seconds
        for k in cost.by_kernel
    )
    return {
        "dots": dots,
        "kernels": cost.kernels,
        "hbm_gb": round(cost.hbm_bytes / 1e9, 2),
        "bound_ms": round(1000 * cost.bound_s, 2),
        "bound_ms_f8_rate": round(1000 * fast, 2),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry_run", action="store_true", help="a tiny layer on the CPU")
    ap.add_argument("--batch", type=int, default=4, help="rows of block_size tokens a step")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per side")
    ap.add_argument("--json", type=Path, help="write the result here")
    ap.add_argument("--compile_for", help="a flaxgpt aot GPU target (h100-1): compile, do not run")
    ap.add_argument("--preset", default="llama-3-8b", choices=PRESETS, help="whose layer")
    ap.add_argument(
        "--grouped", default="tiled", choices=("tiled", "pallas"), help="the experts' grouped matmul"
    )
    a = ap.parse_args(argv)
    if a.grouped == "pallas":  # read by models.moe.grouped_matmul when the step is traced
        os.environ["FLAXGPT_GROUPED"] = "pallas"
    cfg = layer_config(a.dry_run, a.preset)
    # side -> the config: bf16, model.fp8, and for a mixture model.fp8 with its routed experts too
    sides = {"bf16": cfg, "fp8": dataclasses.replace(cfg, fp8=True)}
    if cfg.num_experts:
        sides["fp8_experts"] = dataclasses.replace(cfg, fp8=True, fp8_experts=True)
    if a.compile_for:
        for side, c in sides.items():
            figures = compiled_figures(c, a.batch, a.compile_for)
            row = {"preset": a.preset, "side": side, "grouped": a.grouped, "target": a.compile_for, **figures}
            print(json.dumps(row), flush=True)
        return 0
    batch, steps = (2, 2) if a.dry_run else (a.batch, a.steps)
    out = {"device": jax.devices()[0].device_kind, "preset": a.preset, "grouped": a.grouped}
    out["tokens_per_step"] = batch * cfg.block_size
    for side, c in sides.items():
        out[side] = time_layer(c, batch, steps)
    for side in sides:  # "speedup" (model.fp8), "speedup_fp8_experts"
        if side != "bf16":
            key = "speedup" if side == "fp8" else f"speedup_{side}"
            out[key] = round(out[side]["tokens_per_s"] / out["bf16"]["tokens_per_s"], 3)
    print(json.dumps(out))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
