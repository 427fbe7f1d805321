"""Training throughput and quality on the shakespeare_char_cpu recipe, optionally beside nanoGPT.

    flaxgpt prepare --dataset shakespeare_char --out_dir data/shakespeare_char
    python benchmarks/train_throughput.py --nanogpt_dir ~/nanoGPT --torch_python VENV/bin/python
    python benchmarks/train_throughput.py --iters 20 --pause 1     # a smoke run, flaxgpt alone

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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPE = dict(block_size=64, batch_size=12, n_layer=4, n_head=4, n_embd=128)  # shakespeare_char_cpu
TORCH_PYTHON = sys.executable  # --torch_python: the interpreter with the torch nanoGPT runs under


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
    from flaxgpt.models.quantize import intercepted

    _, cfg, params, _ = load(out, quantize=quantize)

    @jax.jit
    @intercepted  # quantized weights go through qmatmul; float32 ones as they are
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


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data_dir", default=str(ROOT / "data/shakespeare_char"))
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--nanogpt_dir", help="a nanoGPT checkout: also run its CPU recipe")
    p.add_argument("--work_dir", help="where runs go (default: a temporary folder)")
    p.add_argument("--flaxgpt_args", nargs="*", default=[], help="extra --config.key=value for flaxgpt")
    p.add_argument("--torch_python", default=sys.executable, help="interpreter for nanoGPT (its torch)")
    p.add_argument("--quantized_ppl", action="store_true", help="val perplexity with int8 / bf16 weights")
    harness.add_arguments(p)
    p.add_argument("--side", choices=["flaxgpt", "nanogpt"], help=argparse.SUPPRESS)  # internal: one run
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    global TORCH_PYTHON
    TORCH_PYTHON = args.torch_python
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
        nanogpt_dir = Path(args.nanogpt_dir).expanduser()
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
        argv = lambda r: [*common, "--side", "nanogpt", "--seed", str(r)]  # noqa: E731
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
    header = f"| {'implementation':34} | ms/iter (median) | tokens/s | compile s |"
    print(header + f" val @{args.iters} (20 batches) | full val (mean +- sd) | wall s |")
    print(
        f"|{'-' * 36}|-----------------:|---------:|----------:|{'-' * (len(str(args.iters)) + 19)}:|"
        f"----------------------:|-------:|"
    )
    for r in results:
        val = "n/a" if r["val"] is None else f"{r['val']:.4f}"
        full = f"{r['full_val']:.4f} +- {r['full_val_sd']:.4f}"
        print(
            f"| {r['name']:34} | {r['ms']:16.1f} | {tokens / r['ms'] * 1000:8,.0f} | {r['compile']:9.1f} | "
            f"{val:>{len(str(args.iters)) + 19}} | {full:>21} | {r['wall']:6.0f} |"
        )
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


if __name__ == "__main__":
    main()
