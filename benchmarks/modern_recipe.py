"""Loss per second: the modern recipe (Muon + the speedrun's architecture) against the GPT-2 recipe.

    flaxgpt prepare --dataset shakespeare_char --out_dir data/shakespeare_char
    python benchmarks/modern_recipe.py --data_dir data/shakespeare_char --seeds 3 \
        --png docs/modern_recipe.png --json modern_recipe.json
    python benchmarks/modern_recipe.py --recipes shakespeare_char_cpu_modern --seeds 1 \
        --set optim.muon_learning_rate=0.03 --set max_iters=600     # a quick tuning run

Each recipe trains with its own config (configs/<recipe>.py) on the same data, in this process, one
run after the other (seeds interleaved: recipe A seed 0, recipe B seed 0, A seed 1, ...). Every
`--eval_every` steps the clock stops, the model is scored on the whole val split (every token of
val.bin once, in non-overlapping windows of block_size, the same windows as
benchmarks/train_throughput.py) and the clock starts again: "seconds" is training time only (the
jitted steps and their batches; the one compile is reported apart). The time to the target is that
of the first evaluation at or below it (so it is late by up to eval_every steps); a run that never
gets there reports its whole run as a lower bound (">=").
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
import harness  # noqa: E402, F401  (first: the benchmarks' one sys.path rule, see harness.py)


def load_recipe(name: str, data_dir: str, seed: int, overrides: list[str]):
    cfg = importlib.import_module(f"configs.{name}").get_config()
    cfg.data.dir, cfg.seed = data_dir, seed
    cfg.out_dir = str(Path(tempfile.gettempdir(), "flaxgpt_modern_recipe", f"{name}-{seed}"))
    cfg.init_from, cfg.tensorboard, cfg.plot = "scratch", False, False
    for item in overrides:
        key, _, value = item.partition("=")
        *sections, field = key.split(".")
        node = cfg
        for s in sections:
            node = node[s]
        node[field] = type(node[field])(json.loads(value) if not isinstance(node[field], str) else value)
    return cfg


def full_val_batches(t, data_dir: str, rows: int = 64):
    """Every token of val.bin once: [rows, T] windows, whole batches only (one compile)."""
    import numpy as np

    from flaxgpt.data import batches as data_lib

    T = t.task.model_config.block_size
    val = np.asarray(data_lib.TokenData(data_dir).splits["val"], dtype=np.int32)
    n = (len(val) - 1) // T // rows * rows
    x, y = val[: n * T].reshape(n, T), val[1 : n * T + 1].reshape(n, T)
    return [
        data_lib.to_global({"inputs": x[i : i + rows], "targets": y[i : i + rows]}, t.eval_batch_sharding)
        for i in range(0, n, rows)
    ]


def run(cfg, eval_every: int, target: float, verbose: bool = False, stop: bool = False) -> dict:
    import shutil

    import jax

    from flaxgpt.train import trainer

    shutil.rmtree(cfg.out_dir, ignore_errors=True)
    t = trainer.Trainer(cfg, print_fn=lambda *a: None)
    state = t.init_state()
    val = full_val_batches(t, cfg.data.dir)

    def full_val(state):
        parts = jax.device_get([t.eval_step(state.params, b, state.frozen) for b in val])
        return float(sum(p[0] for p in parts) / sum(p[1] for p in parts))

    batch = t.global_batch("train", 0, cfg.batch_size, micro=True)
    compile_s = t.compile(state, batch)
    curve = [(0, 0.0, full_val(state))]
    clock, previous = 0.0, None
    t0 = time.perf_counter()
    for step in range(cfg.max_iters):
        if step:
            batch = t.global_batch("train", step, cfg.batch_size, micro=True)
        state, metrics = t.train_step(state, batch)
        jax.block_until_ready(previous)  # as the trainer: at most two steps in flight
        previous = metrics["loss"]
        if (step + 1) % eval_every == 0 or step + 1 == cfg.max_iters:
            jax.block_until_ready(state)
            clock += time.perf_counter() - t0
            curve.append((step + 1, clock, full_val(state)))
            if verbose:
                print(f"  step {step + 1}: {clock:.1f} s, val {curve[-1][2]:.4f}", flush=True)
            if stop and curve[-1][2] <= target:
                break
            t0 = time.perf_counter()
    t.close()
    hit = next((p for p in curve if p[2] <= target), None)
    return {
        "curve": curve,
        "compile_s": compile_s,
        "ms_per_step": 1000 * clock / curve[-1][0],
        "reached": hit is not None,
        "steps_to_target": (hit or curve[-1])[0],
        "seconds_to_target": (hit or curve[-1])[1],
        "final_val": curve[-1][2],
        "devices": jax.device_count(),
    }


def plot(results: dict, target: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for (name, runs), color in zip(results.items(), ("tab:blue", "tab:red", "tab:green", "tab:purple")):
        for i, r in enumerate(runs):
            steps, secs, loss = zip(*r["curve"][1:])
            label = name if i == 0 else None
            axes[0].plot(secs, loss, color=color, alpha=0.8, label=label)
            axes[1].plot(steps, loss, color=color, alpha=0.8, label=label)
    for ax, xlabel in zip(axes, ("training seconds (compile and evaluation excluded)", "steps")):
        ax.axhline(target, color="gray", ls="--", lw=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("val loss (whole val split)")
        ax.set_ylim(target - 0.45, 2.8)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"Tiny Shakespeare characters: val loss against time and steps (target {target})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data_dir", default="data/shakespeare_char")
    p.add_argument("--recipes", default="shakespeare_char_cpu,shakespeare_char_cpu_modern")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--eval_every", type=int, default=25)
    p.add_argument("--target", type=float, default=1.90)
    p.add_argument("--set", action="append", default=[], help="key=value override for every recipe")
    p.add_argument("--verbose", action="store_true", help="print every evaluation")
    p.add_argument("--stop_at_target", action="store_true", help="end each run at the target (tuning)")
    p.add_argument("--png", default="")
    p.add_argument("--json", default="")
    args = p.parse_args()

    from flaxgpt.train.trainer import start_process

    recipes = args.recipes.split(",")
    start_process(load_recipe(recipes[0], args.data_dir, 0, args.set))  # as `train` does, once
    results = {name: [] for name in recipes}
    for seed in range(args.seeds):
        for name in recipes:
            cfg = load_recipe(name, args.data_dir, seed, args.set)
            r = run(cfg, args.eval_every, args.target, args.verbose, args.stop_at_target)
            results[name].append(r)
            if args.json:  # after every run: a killed benchmark keeps what it measured
                Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
            mark = "" if r["reached"] else ">="
            print(
                f"{name} seed {seed}: {mark}{r['seconds_to_target']:.1f} s, "
                f"{mark}{r['steps_to_target']} steps to {args.target}; final {r['final_val']:.4f}; "
                f"{r['ms_per_step']:.1f} ms/step; "
                f"compile {r['compile_s']:.1f} s",
                flush=True,
            )
    print("\n| recipe | seconds to target (median) | steps (median) | ms/step | final val (mean) |")
    print("|---|---:|---:|---:|---:|")
    for name, runs in results.items():
        mark = "" if all(r["reached"] for r in runs) else ">="
        secs = statistics.median(r["seconds_to_target"] for r in runs)
        steps = statistics.median(r["steps_to_target"] for r in runs)
        ms = statistics.median(r["ms_per_step"] for r in runs)
        final = statistics.mean(r["final_val"] for r in runs)
        print(f"| {name} | {mark}{secs:.1f} | {mark}{steps:.0f} | {ms:.1f} | {final:.4f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    if args.png:
        plot(results, args.target, args.png)


if __name__ == "__main__":
    main()
