"""Training throughput and quality on the shakespeare_char_cpu recipe, optionally beside nanoGPT.

    python -m flaxgpt.prepare --dataset shakespeare_char --out_dir data/shakespeare_char
    python benchmarks/train_throughput.py                        # flaxgpt, 2000 iters (~2-3 min on 2 cores)
    python benchmarks/train_throughput.py --iters 200            # a quick throughput sample
    python benchmarks/train_throughput.py --nanogpt_dir ~/nanoGPT   # also nanoGPT's CPU recipe, same data

Both runs log every iteration; ms/iter is the median over iterations (evaluation and the first
compile excluded), tokens/s = batch x block / median, val loss is the evaluation at the last
iteration (eval_iters=20 batches, as nanoGPT's recipe). nanoGPT is run from its own checkout
(python train.py config/train_shakespeare_char.py --device=cpu --compile=False ...) on the same
train.bin / val.bin, with a meta.pkl written for it; nothing of nanoGPT is part of flaxgpt.
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

ROOT = Path(__file__).resolve().parents[1]
RECIPE = dict(block_size=64, batch_size=12, n_layer=4, n_head=4, n_embd=128)  # shakespeare_char_cpu


def run_flaxgpt(data_dir: Path, iters: int, work: Path, extra: list[str]) -> dict:
    out = work / "flaxgpt"
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
        "wall": wall,
    }


def run_nanogpt(nanogpt_dir: Path, data_dir: Path, iters: int, work: Path, eval_interval: int) -> dict:
    """nanoGPT's README CPU command, on our token files (same split, same char vocabulary)."""
    nd = work / "nanogpt"
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
        sys.executable,
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
        "wall": wall,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data_dir", default=str(ROOT / "data/shakespeare_char"))
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--nanogpt_dir", help="a nanoGPT checkout: also run its CPU recipe")
    p.add_argument("--skip_flaxgpt", action="store_true")
    p.add_argument("--work_dir", help="where runs go (default: a temporary folder)")
    p.add_argument("--flaxgpt_args", nargs="*", default=[], help="extra --config.key=value for flaxgpt")
    args = p.parse_args()
    data_dir = Path(args.data_dir)
    if not (data_dir / "meta.json").exists():
        sys.exit(
            f"error: no dataset in {data_dir}; run: python -m flaxgpt.prepare "
            f"--dataset shakespeare_char --out_dir {data_dir}"
        )
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="flaxgpt-bench-"))
    eval_interval = 250 if args.iters >= 250 else args.iters
    results = []
    if not args.skip_flaxgpt:
        extra = [f"--config.eval_interval={eval_interval}", *args.flaxgpt_args]
        results.append(run_flaxgpt(data_dir, args.iters, work, extra))
    if args.nanogpt_dir:
        results.append(
            run_nanogpt(Path(args.nanogpt_dir).expanduser(), data_dir, args.iters, work, eval_interval)
        )
    tokens = RECIPE["batch_size"] * RECIPE["block_size"]
    print(
        f"\nshakespeare_char_cpu recipe, {args.iters} iters, {os.cpu_count()} CPU cores, load "
        f"{os.getloadavg()[0]:.1f}"
    )
    header = f"| {'implementation':34} | ms/iter (median) | tokens/s | compile s | val loss @{args.iters} |"
    print(header + " wall s |")
    print(f"|{'-' * 36}|-----------------:|---------:|----------:|-------------:|-------:|")
    for r in results:
        val = "n/a" if r["val"] is None else f"{r['val']:.4f}"
        print(
            f"| {r['name']:34} | {r['ms']:16.1f} | {tokens / r['ms'] * 1000:8,.0f} | {r['compile']:9.1f} | "
            f"{val:>12} | {r['wall']:6.0f} |"
        )
    if len(results) == 2:
        print(f"\nflaxgpt / nanoGPT throughput: {results[1]['ms'] / results[0]['ms']:.2f}x")


if __name__ == "__main__":
    main()
