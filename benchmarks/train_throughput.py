"""Training throughput: the shakespeare_char_cpu recipe beside nanoGPT, or flaxgpt's train step alone.

    flaxgpt prepare --dataset shakespeare_char --out_dir data/shakespeare_char
    python benchmarks/train_throughput.py --nanogpt_dir ~/nanoGPT --torch_python VENV/bin/python
    python benchmarks/train_throughput.py --iters 20 --pause 1     # a smoke run, flaxgpt alone
    python benchmarks/train_throughput.py --step gpu      # the step alone: GPT-2 124M, T 1024, bf16, one H100
    python benchmarks/train_throughput.py --step cpu      # the step alone: the recipe's model on the CPU
    python benchmarks/train_throughput.py --step gpu --batch_size 32 --remat dots --json out.json
    python benchmarks/train_throughput.py --step gpu --check_attention   # cuDNN == XLA (bf16) first
    python benchmarks/train_throughput.py --step gpu --loss_impl fused   # the fused linear + cross-entropy

The recipe (the default) is what a user runs: train.py with its data loading, logging and evaluation.
Each implementation runs once per round in its own process (benchmarks/harness.py: the order
alternates every round, --pause seconds of rest before each run, at least 4 rounds; round r trains
seed r), and the harness prints the median and the per-round ratios.

Both runs log every iteration; ms/iter is the median over iterations (evaluation and the first
compile excluded), tokens/s = batch x block / median, "val @N" is the evaluation at the last
iteration (eval_iters=20 random batches, as nanoGPT's recipe: noisy, about +-0.015), and
"full val" is the final model's mean loss over every token of val.bin (non-overlapping windows
of block_size, the same windows for both implementations). Seeds: flaxgpt's config.seed, nanoGPT's
torch seed offset; the table shows the median ms/iter and the mean losses over rounds.
nanoGPT is run from its own checkout (python train.py
config/train_shakespeare_char.py --device=cpu --compile=False ...) on the same train.bin /
val.bin, with a meta.pkl written for it; nothing of nanoGPT is part of flaxgpt.

The step alone (--step gpu | cpu) is the ceiling the recipe's loop is measured against: the jitted
flaxgpt.train.trainer step, sharded as the trainer shards it, on one batch of random tokens (throughput
does not depend on them), with nothing else in the loop: tokens/s, MFU, compile time and peak device
memory. MFU = (6 N + 12 L H Q T) FLOPs per token x tokens/s / (peak FLOP/s per device x devices), with N
the non-embedding parameters (flaxgpt.runs.metrics, nanoGPT's and llm.c's formula); gpu states the H100
SXM dense bf16 peak, 989 TFLOP/s (--peak_flops for another device).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness  # the benchmarks' one sys.path rule (see harness.py): this checkout's flaxgpt, configs/

ROOT = harness.ROOT
RECIPE = dict(block_size=64, batch_size=12, n_layer=4, n_head=4, n_embd=128)  # shakespeare_char_cpu
TORCH_PYTHON = sys.executable  # --torch_python: the interpreter with the torch nanoGPT runs under
STEP_MODES = {
    # GPT-2 124M as llm.c and nanoGPT train it
    "gpu": dict(preset="gpt2", block_size=1024, dtype="bfloat16", batch_size=16, steps=20, peak=989e12),
    # the recipe's model (nanoGPT's shakespeare_char CPU model), 65 characters
    "cpu": dict(RECIPE, vocab_size=65, dtype="float32", steps=10, peak=0.0),
}


def val_windows(data_dir: Path):
    """([n, T] inputs, [n, T] targets): every token of val.bin once, in non-overlapping windows."""
    import numpy as np

    T = RECIPE["block_size"]
    val = np.fromfile(data_dir / "val.bin", dtype=np.uint16).astype(np.int64)
    n = (len(val) - 1) // T
    return val[: n * T].reshape(n, T), val[1 : n * T + 1].reshape(n, T)


def flaxgpt_full_val(out: Path, data_dir: Path, quantize: str | None = None) -> float:
    """Mean loss over val.bin; `quantize` ("int8" | "bf16"): with the weights decoding would use."""
    import jax
    import numpy as np

    from flaxgpt.loader import load
    from flaxgpt.models import gpt

    _, cfg, params, _ = load(out, quantize=quantize)

    @jax.jit  # quantized weights go through qmatmul (models/linear.py); float32 ones as they are
    def token_losses(p, x, y):
        logp = jax.nn.log_softmax(gpt.GPT(cfg).apply({"params": p}, x), axis=-1)
        return -np.take_along_axis(logp, y[..., None], axis=-1)[..., 0]

    x, y = val_windows(data_dir)
    rows = x.shape[0] // 64 * 64  # full batches: one compile; the few tokens left over are skipped
    losses = [token_losses(params, x[i : i + 64], y[i : i + 64]) for i in range(0, rows, 64)]
    return float(np.mean(np.concatenate([np.asarray(v).ravel() for v in losses])))


NANOGPT_FULL_VAL = """
import sys, numpy as np, torch
sys.path.insert(0, sys.argv[1])
from model import GPT, GPTConfig
ck = torch.load(sys.argv[2], map_location="cpu")
m = GPT(GPTConfig(**ck["model_args"]))
m.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ck["model"].items()})
m.eval()
x, y = np.load(sys.argv[3]), np.load(sys.argv[4])
rows = x.shape[0] // 64 * 64
with torch.no_grad():
    means = [m(torch.from_numpy(x[i:i+64]), torch.from_numpy(y[i:i+64]))[1].item()
             for i in range(0, rows, 64)]
print(f"FULL_VAL {np.mean(means):.6f} ITER {ck['iter_num']}")
"""


def nanogpt_full_val(nanogpt_dir: Path, ckpt: Path, data_dir: Path) -> float:
    """nanoGPT's own model class on its own checkpoint, in a subprocess (torch and JAX apart)."""
    import numpy as np

    x, y = val_windows(data_dir)
    np.save(ckpt.parent / "x.npy", x)
    np.save(ckpt.parent / "y.npy", y)
    cmd = [TORCH_PYTHON, "-c", NANOGPT_FULL_VAL, str(nanogpt_dir), str(ckpt)]
    r = subprocess.run(
        cmd + [str(ckpt.parent / "x.npy"), str(ckpt.parent / "y.npy")], capture_output=True, text=True
    )
    if r.returncode:
        sys.exit(f"nanoGPT evaluation failed:\n{r.stderr[-3000:]}")
    return float(re.search(r"FULL_VAL ([\d.]+)", r.stdout).group(1))


def run_flaxgpt(data_dir: Path, iters: int, work: Path, extra: list[str], seed: int = 0) -> dict:
    out = work / f"flaxgpt-{seed}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        f"--config={ROOT}/configs/shakespeare_char_cpu.py",
        f"--config.data.dir={data_dir}",
        f"--config.out_dir={out}",
        f"--config.max_iters={iters}",
        "--config.log_interval=1",
        "--config.init_from=scratch",
        f"--config.seed={seed}",
        *extra,
    ]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode:
        sys.exit(f"flaxgpt failed:\n{r.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = [x["step_time"] for x in rows if "step_time" in x and x["step"] > 1]
    evals = {x["step"]: x["val_loss"] for x in rows if "val_loss" in x}
    compile_s = float(re.search(r"compiled the train step in ([\d.]+) s", r.stdout).group(1))
    devices = re.search(r"mesh (\{.*?\})", r.stdout).group(1)
    return {
        "name": f"flaxgpt (mesh {devices})",
        "ms": 1000 * statistics.median(times),
        "compile": compile_s,
        "val": evals.get(iters),
        "full_val": flaxgpt_full_val(out, data_dir),
        "wall": wall,
    }


# nanoGPT seeds torch with a constant (1337 + a DDP rank offset); another seed without editing it
SEEDED_LAUNCH = """
import os, runpy, sys, torch
seed, set_seed = int(sys.argv[1]), torch.manual_seed
torch.manual_seed = lambda s: set_seed(s + seed)
sys.argv = sys.argv[2:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_nanogpt(
    nanogpt_dir: Path, data_dir: Path, iters: int, work: Path, eval_interval: int, seed: int = 0
) -> dict:
    """nanoGPT's README CPU command, on our token files (same split, same char vocabulary)."""
    nd = work / f"nanogpt-{seed}"
    shutil.rmtree(nd, ignore_errors=True)
    (nd / "data/shakespeare_char").mkdir(parents=True)
    for name in ("train.bin", "val.bin"):
        shutil.copyfile(data_dir / name, nd / "data/shakespeare_char" / name)
    meta = json.loads((data_dir / "meta.json").read_text())
    chars = meta["tokenizer"]["chars"]
    with open(nd / "data/shakespeare_char/meta.pkl", "wb") as f:
        pickle.dump(
            {
                "vocab_size": len(chars),
                "itos": dict(enumerate(chars)),
                "stoi": {c: i for i, c in enumerate(chars)},
            },
            f,
        )
    # nanoGPT's train.py reads configurator.py from the working directory
    shutil.copyfile(nanogpt_dir / "configurator.py", nd / "configurator.py")
    recipe = nanogpt_dir / "config/train_shakespeare_char.py"
    cmd = [
        TORCH_PYTHON,
        "-c",
        SEEDED_LAUNCH,
        str(seed),
        str(nanogpt_dir / "train.py"),
        str(recipe),
        "--device=cpu",
        "--compile=False",
        "--eval_iters=20",
        "--log_interval=1",
        *(f"--{k}={v}" for k, v in RECIPE.items()),
        f"--max_iters={iters}",
        f"--lr_decay_iters={iters}",
        "--dropout=0.0",
        f"--eval_interval={eval_interval}",
        "--always_save_checkpoint=True",  # the final model, not the best one, for the full val loss
    ]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=nd)
    wall = time.perf_counter() - t0
    if r.returncode:
        sys.exit(f"nanoGPT failed:\n{r.stderr[-3000:]}")
    found = re.findall(r"iter (\d+): loss [\d.]+, time ([\d.]+)ms", r.stdout)
    iters_ms = {int(i): float(t) for i, t in found}
    evals = {
        int(s): float(v) for s, v in re.findall(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)", r.stdout)
    }
    # iteration 0 includes start-up; iterations right after an evaluation include the evaluation
    times = [t for i, t in iters_ms.items() if i > 1 and i % eval_interval != 0]
    return {
        "name": "nanoGPT (PyTorch, eager)",
        "ms": statistics.median(times),
        "compile": 0.0,
        "val": evals.get(iters),
        "full_val": nanogpt_full_val(nanogpt_dir, nd / "out-shakespeare-char/ckpt.pt", data_dir),
        "wall": wall,
    }


def print_table(header: list[str], rows: list[list[str]], align: str) -> None:
    """A markdown table, each column padded to its widest cell; `align`: "l" or "r" per column."""
    widths = [max(map(len, column)) for column in zip(header, *rows)]

    def line(cells):
        padded = (c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(cells, widths, align))
        return "| " + " | ".join(padded) + " |"

    print(line(header))
    print("|" + "|".join("-" * (w + 1) + (":" if a == "r" else "-") for w, a in zip(widths, align)) + "|")
    for row in rows:
        print(line(row))


def combine(runs: list[dict]) -> dict:
    """One row from several rounds (seed = round): median time, mean losses, the full val loss's spread."""
    full = [r["full_val"] for r in runs]
    vals = [r["val"] for r in runs if r["val"] is not None]
    return {
        "name": runs[0]["name"],
        "ms": statistics.median(r["ms"] for r in runs),
        "compile": statistics.median(r["compile"] for r in runs),
        "val": statistics.mean(vals) if vals else None,
        "full_val": statistics.mean(full),
        "full_val_sd": statistics.stdev(full) if len(full) > 1 else 0.0,
        "full_vals": full,
        "wall": sum(r["wall"] for r in runs),
    }


def side_by_side(args) -> None:
    """The recipe through train.py, flaxgpt and (with --nanogpt_dir) nanoGPT, on the harness."""
    global TORCH_PYTHON
    # nanoGPT runs in its own folder: a relative interpreter (../benchvenv/bin/python) made absolute, not
    # resolved (a venv's python is a symlink whose target would lose the venv)
    TORCH_PYTHON = os.path.abspath(args.torch_python) if os.sep in args.torch_python else args.torch_python
    data_dir = Path(args.data_dir)
    if not (data_dir / "meta.json").exists():
        sys.exit(
            f"error: no dataset in {data_dir}; run: flaxgpt prepare "
            f"--dataset shakespeare_char --out_dir {data_dir}"
        )
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="flaxgpt-bench-"))
    eval_interval = 250 if args.iters >= 250 else args.iters
    if args.side == "flaxgpt":
        extra = [f"--config.eval_interval={eval_interval}", *args.flaxgpt_args]
        return harness.print_result(run_flaxgpt(data_dir, args.iters, work, extra, args.seed))
    if args.side == "nanogpt":
        nanogpt_dir = Path(args.nanogpt_dir).expanduser().absolute()  # run from its own folder
        return harness.print_result(
            run_nanogpt(nanogpt_dir, data_dir, args.iters, work, eval_interval, args.seed)
        )

    common = [sys.executable, __file__, "--data_dir", str(data_dir), "--iters", str(args.iters)]
    common += ["--work_dir", str(work), "--torch_python", args.torch_python]
    if args.nanogpt_dir:
        common += ["--nanogpt_dir", args.nanogpt_dir]
    if args.flaxgpt_args:
        common += ["--flaxgpt_args", *args.flaxgpt_args]
    sides = [harness.Side("flaxgpt", lambda r: [*common, "--side", "flaxgpt", "--seed", str(r)])]
    figures = []
    if args.nanogpt_dir:  # nanoGPT's process is launched from this venv but runs under --torch_python
        argv = lambda r: [*common, "--side", "nanogpt", "--seed", str(r)]
        sides.append(harness.Side("nanoGPT", argv, python=args.torch_python))
        figures.append(
            harness.Figure("ms/iter, shakespeare_char_cpu", "flaxgpt", "ms", "nanoGPT", "ms", False)
        )
    report = harness.compare(sides, figures, rounds=args.rounds, pause=args.pause)
    results = [combine([r[s.name] for r in report.results]) for s in sides]
    tokens = RECIPE["batch_size"] * RECIPE["block_size"]
    print(
        f"\nshakespeare_char_cpu recipe, {args.iters} iters, {args.rounds} rounds (seed = round), "
        f"{os.cpu_count()} CPU cores, load {os.getloadavg()[0]:.1f}"
    )
    header = ["implementation", "ms/iter (median)", "tokens/s", "compile s"]
    header += [f"val @{args.iters} (20 batches)", "full val (mean +- sd)", "wall s"]
    rows = [
        [
            r["name"],
            f"{r['ms']:.1f}",
            f"{tokens / r['ms'] * 1000:,.0f}",
            f"{r['compile']:.1f}",
            "n/a" if r["val"] is None else f"{r['val']:.4f}",
            f"{r['full_val']:.4f} +- {r['full_val_sd']:.4f}",
            f"{r['wall']:.0f}",
        ]
        for r in results
    ]
    print_table(header, rows, "lrrrrrr")
    for r in results:
        print(f"{r['name']}: full val loss per seed {', '.join(f'{v:.4f}' for v in r['full_vals'])}")
    print("\n" + report.table())
    if args.quantized_ppl:
        import math

        base = report.results[0]["flaxgpt"]["full_val"]
        print("\nweight-only quantization, flaxgpt seed 0's model: full val loss / perplexity")
        print(f"  float32  {base:.4f} / {math.exp(base):.4f}")
        for mode in ("bf16", "int8"):
            loss = flaxgpt_full_val(work / "flaxgpt-0", data_dir, mode)
            print(
                f"  {mode:7}  {loss:.4f} / {math.exp(loss):.4f} ({math.exp(loss - base) - 1:+.3%} perplexity)"
            )


# ---------------------------------------------------------------- the train step alone (--step)


def build_step(args):
    """(config, mesh, jitted step, state, batch, FLOPs per token, peak FLOP/s) for --step's mode."""
    import jax
    import jax.numpy as jnp
    from compile_time import SyntheticTask  # after jax: it sets JAX_PLATFORMS=cpu when first imported

    from configs import default
    from flaxgpt import sharding
    from flaxgpt.models import gpt
    from flaxgpt.runs import metrics
    from flaxgpt.tools import summary
    from flaxgpt.train import trainer
    from flaxgpt.train.optim import make_optimizer

    m = STEP_MODES[args.step]
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
    task = SyntheticTask(config) if args.loss_impl == "logits" else FusedLossTask(config)
    train_step = trainer.make_train_step(task, tx, schedule, grad_accum=1)
    step = jax.jit(
        train_step,
        in_shardings=(s_shardings, batch_sharding),
        out_shardings=(s_shardings, sharding.replicated(mesh)),
        donate_argnums=0,
    )
    state = jax.jit(init, out_shardings=s_shardings)(jax.random.key(0))
    B = args.batch_size or m["batch_size"]
    sharding.check_batch(B, mesh)
    # [grad_accum 1, B, T + 1]: inputs and targets are the same tokens shifted by one
    tokens_1BT = jax.random.randint(jax.random.key(1), (1, B, config.block_size + 1), 0, config.vocab_size)
    batch = jax.device_put({"inputs": tokens_1BT[..., :-1], "targets": tokens_1BT[..., 1:]}, batch_sharding)
    fpt = summary.flops_per_token(config)["train"]  # as the trainer's MFU
    return config, mesh, step, state, batch, fpt, metrics.peak_flops_per_device(args.peak_flops or m["peak"])


class FusedLossTask:
    """compile_time.SyntheticTask's loss through the fused linear + cross-entropy (train/losses.py):
    the hidden states and the unembedding, no [B, T, V] logits."""

    def __init__(self, config):
        from flaxgpt.models import gpt

        self.config, self.model = config, gpt.GPT(config)

    def loss(self, params, batch, rng, train: bool, frozen=None):
        from flaxgpt.models import gpt
        from flaxgpt.train import losses

        hidden_BTD = self.model.apply(
            {"params": params}, batch["inputs"], deterministic=not train, hidden=True
        )
        return losses.fused_cross_entropy(hidden_BTD, gpt.unembedding(self.config, params), batch["targets"])


def check_attention(impl: str) -> None:
    """The fused kernel against the XLA path on GPT-2 shapes in bf16 (forward and gradients)."""
    import jax
    import jax.numpy as jnp

    from flaxgpt.models.attention import attend, resolve_attention_impl

    impl = resolve_attention_impl(impl, jnp.bfloat16)
    qkv_BTHD = [jax.random.normal(jax.random.key(i), (4, 1024, 12, 64), jnp.bfloat16) for i in range(3)]
    mask_11TT = jnp.tril(jnp.ones((1024, 1024), bool))[None, None]

    def loss(q, k, v, impl):
        return jnp.sum(attend(q, k, v, mask_11TT, impl=impl, is_causal=True).astype(jnp.float32) ** 2)

    grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    (l_fused, g_fused), (l_xla, g_xla) = grads(*qkv_BTHD, impl), grads(*qkv_BTHD, "xla")
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


def step_alone(args) -> None:
    """Compile the step, run 2 warm-up steps and args.steps timed ones; print a table row (and --json)."""
    if args.step == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if args.check_attention:
        check_attention(args.attention_impl)
    config, mesh, step, state, batch, fpt, peak = build_step(args)
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
    steps = args.steps or STEP_MODES[args.step]["steps"]
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
        loss_impl=args.loss_impl,
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
    print_table(list(result), [["n/a" if v is None else str(v) for v in result.values()]], "l" * len(result))
    if args.json:  # before a profile: a profiler that fails takes nothing timed with it
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.profile:  # a few steps again under JAX's profiler: the kernels a step and the device's idle share
        import device_profile

        def run(n=3):
            s, o = state, None
            for _ in range(n):
                s, o = step(s, batch)
            return o

        result["profile"] = device_profile.profile(run, per=3)
        print(device_profile.summary(result["profile"], step="a step", timed_us=round(1e6 * dt, 1)))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


def given(args, group) -> list[str]:
    """The flags of an argument group that the command line set (away from their defaults)."""
    return [a.option_strings[0] for a in group._group_actions if getattr(args, a.dest) != a.default]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    recipe = p.add_argument_group("the recipe beside nanoGPT (the default)")
    recipe.add_argument("--data_dir", default=str(ROOT / "data/shakespeare_char"))
    recipe.add_argument("--iters", type=int, default=2000)
    recipe.add_argument("--nanogpt_dir", help="a nanoGPT checkout: also run its CPU recipe")
    recipe.add_argument("--work_dir", help="where runs go (default: a temporary folder)")
    recipe.add_argument("--flaxgpt_args", nargs="*", default=[], help="extra --config.key=value for flaxgpt")
    recipe.add_argument("--torch_python", default=sys.executable, help="interpreter for nanoGPT (its torch)")
    recipe.add_argument(
        "--quantized_ppl", action="store_true", help="val perplexity with int8 / bf16 weights"
    )
    harness.add_arguments(recipe)
    recipe.add_argument("--side", choices=["flaxgpt", "nanogpt"], help=argparse.SUPPRESS)  # internal: one run
    recipe.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    alone = p.add_argument_group("the train step alone (--step)")
    alone.add_argument("--step", choices=list(STEP_MODES), help="measure the jitted train step alone")
    alone.add_argument("--batch_size", type=int, default=0, help="sequences per step (0 = the mode's)")
    alone.add_argument("--steps", type=int, default=0, help="timed steps (0 = the mode's)")
    alone.add_argument("--attention_impl", default="auto")
    alone.add_argument("--loss_impl", choices=["logits", "fused"], default="logits", help="the loss's path")
    alone.add_argument("--scan_layers", action="store_true")
    alone.add_argument("--remat", default="none")
    alone.add_argument("--fsdp", type=int, default=1)
    alone.add_argument("--peak_flops", type=float, default=0.0, help="per-device peak (0 = the mode's)")
    alone.add_argument("--json", default="", help="also write the results here")
    alone.add_argument("--compile_only", action="store_true", help="check the set-up: compile, print, exit")
    alone.add_argument(
        "--profile", action="store_true", help="then 3 steps under JAX's profiler: kernels, busy time, ops"
    )
    alone.add_argument(
        "--check_attention",
        action="store_true",
        help="first compare --attention_impl (auto: cuDNN on GPU) with XLA in bf16",
    )
    args = p.parse_args()
    # a flag of the other measurement would be ignored without a word: refuse it instead
    misplaced = given(args, recipe) if args.step else given(args, alone)
    if misplaced:
        p.error(f"{', '.join(misplaced)} only with{'out' if args.step else ''} --step")
    return step_alone(args) if args.step else side_by_side(args)


if __name__ == "__main__":
    main()
