"""Training throughput: tokens/s, MFU, compile time and peak device memory of the real train step.

MFU = (6 N + 12 L H Q T) FLOPs per token x tokens/s / (peak FLOP/s per device x devices), with N the
non-embedding parameters (flaxgpt.runs.metrics, nanoGPT's and llm.c's formula). Tokens are random
(throughput does not depend on them). The step is flaxgpt.train.trainer's, sharded as the trainer does.

    python benchmarks/train_throughput_gpu.py --mode gpu      # GPT-2 124M, T 1024, bf16, one H100
    python benchmarks/train_throughput_gpu.py --mode cpu      # 4-layer 128-wide model on the CPU
    python benchmarks/train_throughput_gpu.py --mode gpu --batch_size 32 --remat dots --json out.json
    python benchmarks/train_throughput_gpu.py --mode gpu --check_attention   # cuDNN == XLA (bf16) first

gpu mode states the H100 SXM dense bf16 peak, 989 TFLOP/s (--peak_flops for another device).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the configs/ package

MODES = {
    # GPT-2 124M as llm.c and nanoGPT train it
    "gpu": dict(preset="gpt2", block_size=1024, dtype="bfloat16", batch_size=16, steps=20, peak=989e12),
    # nanoGPT's shakespeare_char CPU model
    "cpu": dict(
        n_layer=4,
        n_head=4,
        n_embd=128,
        vocab_size=65,
        block_size=64,
        dtype="float32",
        batch_size=12,
        steps=10,
        peak=0.0,
    ),
}


def build(args):
    import jax
    import jax.numpy as jnp
    from compile_time import SyntheticTask

    from configs import default
    from flaxgpt import sharding
    from flaxgpt.models import gpt
    from flaxgpt.runs import metrics
    from flaxgpt.tools import summary
    from flaxgpt.train import trainer
    from flaxgpt.train.optim import make_optimizer

    m = MODES[args.mode]
    common = dict(
        block_size=m["block_size"],
        dtype=m["dtype"],
        pad_vocab_multiple=64,
        attention_impl=args.attention_impl,
        scan_layers=args.scan_layers,
        remat=args.remat,
    )
    if "preset" in m:
        config = gpt.GPTConfig.preset(m["preset"], **common)
    else:
        config = gpt.GPTConfig(
            vocab_size=m["vocab_size"], n_layer=m["n_layer"], n_head=m["n_head"], n_embd=m["n_embd"], **common
        )
    tx, schedule = make_optimizer(default.get_config().optim, max_iters=600_000)
    mesh = sharding.make_mesh(-1, args.fsdp)
    boxed = gpt.abstract_params(config)

    def init(rng):
        params = gpt.init_params(config, rng)
        return trainer.TrainState(step=jnp.int32(0), params=params, opt_state=tx.init(params), rng=rng)

    abstract = jax.eval_shape(init, jax.random.key(0))
    p_shardings = sharding.param_shardings(boxed, mesh)
    s_shardings = sharding.state_shardings(abstract, abstract.params, p_shardings, mesh)
    batch_sharding = sharding.batch_sharding(mesh, leading_axes=1)
    train_step = trainer.make_train_step(SyntheticTask(config), tx, schedule, grad_accum=1)
    step = jax.jit(
        train_step,
        in_shardings=(s_shardings, batch_sharding),
        out_shardings=(s_shardings, sharding.replicated(mesh)),
        donate_argnums=0,
    )
    state = jax.jit(init, out_shardings=s_shardings)(jax.random.key(0))
    B = args.batch_size or m["batch_size"]
    sharding.check_batch(B, mesh)
    tokens = jax.random.randint(jax.random.key(1), (1, B, config.block_size + 1), 0, config.vocab_size)
    batch = jax.device_put({"inputs": tokens[..., :-1], "targets": tokens[..., 1:]}, batch_sharding)
    fpt = summary.flops_per_token(config)["train"]  # as the trainer's MFU
    return config, mesh, step, state, batch, fpt, metrics.peak_flops_per_device(args.peak_flops or m["peak"])


def check_attention(impl: str) -> None:
    """The fused kernel against the XLA path on GPT-2 shapes in bf16 (forward and gradients)."""
    import jax
    import jax.numpy as jnp

    from flaxgpt.models.attention import attend, resolve_attention_impl

    impl = resolve_attention_impl(impl, jnp.bfloat16)
    q, k, v = (jax.random.normal(jax.random.key(i), (4, 1024, 12, 64), jnp.bfloat16) for i in range(3))
    mask = jnp.tril(jnp.ones((1024, 1024), bool))[None, None]

    def loss(q, k, v, impl):
        return jnp.sum(attend(q, k, v, mask, impl=impl, is_causal=True).astype(jnp.float32) ** 2)

    grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    (l_fused, g_fused), (l_xla, g_xla) = grads(q, k, v, impl), grads(q, k, v, "xla")
    loss_rel = abs(float(l_fused) / float(l_xla) - 1)
    # bf16 tolerance: each gradient's largest difference relative to its largest entry
    grad_rel = [
        float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) / jnp.max(jnp.abs(b)))
        for a, b in zip(g_fused, g_xla)
    ]
    print(
        f"attention {impl} vs xla on {jax.devices()[0].device_kind}: loss rel. diff {loss_rel:.1e}, "
        f"grad rel. diffs q {grad_rel[0]:.1e} k {grad_rel[1]:.1e} v {grad_rel[2]:.1e}"
    )
    assert loss_rel < 1e-2 and max(grad_rel) < 2e-2, (loss_rel, grad_rel)


def peak_memory_bytes():
    import jax

    stats = jax.local_devices()[0].memory_stats()  # None on CPU
    return None if not stats else stats.get("peak_bytes_in_use")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=list(MODES), default="gpu")
    ap.add_argument("--batch_size", type=int, default=0, help="sequences per step (0 = the mode's)")
    ap.add_argument("--steps", type=int, default=0, help="timed steps (0 = the mode's)")
    ap.add_argument("--attention_impl", default="auto")
    ap.add_argument("--scan_layers", action="store_true")
    ap.add_argument("--remat", default="none")
    ap.add_argument("--fsdp", type=int, default=1)
    ap.add_argument("--peak_flops", type=float, default=0.0, help="per-device peak (0 = the mode's)")
    ap.add_argument("--json", default="", help="also write the results here")
    ap.add_argument("--compile_only", action="store_true", help="check the set-up: compile, print, exit")
    ap.add_argument(
        "--check_attention",
        action="store_true",
        help="first compare --attention_impl (auto: cuDNN on GPU) with XLA in bf16",
    )
    args = ap.parse_args()
    if args.mode == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if args.check_attention:
        check_attention(args.attention_impl)
    config, mesh, step, state, batch, fpt, peak = build(args)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):  # as the trainer does: Pallas attention (TPU) splits per device
        step = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    if args.compile_only:
        print(f"{config.n_layer} layers, {config.dtype}: compiled in {compile_s:.1f} s on {jax.devices()[0]}")
        return
    for _ in range(2):  # warm up: first runs allocate and autotune
        state, out = step(state, batch)
    jax.block_until_ready(out)
    steps = args.steps or MODES[args.mode]["steps"]
    t0 = time.perf_counter()
    for _ in range(steps):
        state, out = step(state, batch)
    loss = float(jax.device_get(out["loss"]))  # waits for the last step
    dt = (time.perf_counter() - t0) / steps
    B, T = batch["inputs"].shape[1:]
    tok_s = B * T / dt
    mfu = fpt * tok_s / (peak * jax.device_count()) if peak else None
    mem = peak_memory_bytes()
    result = dict(
        device=jax.devices()[0].device_kind,
        devices=jax.device_count(),
        jax=jax.__version__,
        model=f"L{config.n_layer} H{config.n_head} D{config.n_embd} T{T}",
        dtype=config.dtype,
        attention_impl=args.attention_impl,
        scan_layers=args.scan_layers,
        remat=args.remat,
        batch_size=B,
        tokens_per_s=round(tok_s),
        step_ms=round(1000 * dt, 2),
        flops_per_token=f"{fpt:.4g}",
        peak_flops=peak,
        mfu=None if mfu is None else round(mfu, 4),
        compile_s=round(compile_s, 2),
        peak_memory_gib=None if mem is None else round(mem / 2**30, 2),
        loss=round(loss, 4),
    )
    print("| " + " | ".join(result) + " |")
    print("|" + " --- |" * len(result))
    print("| " + " | ".join("n/a" if v is None else str(v) for v in result.values()) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
