"""A GRPO recipe over several seeds: each seed's held-out reward curve, the mean and the worst of the
final figures, with the CPU kind beside them (learning curves differ between seeds and between CPU
kinds, AVX-512 and AVX2: the project publishes the mean and the worst of 3 seeds with the kind).

    # the counting recipe (docs/grpo.md): its data and SFT run first, then
    python benchmarks/grpo_seeds.py --config configs/grpo_count.py               # seeds 0, 1, 2
    python benchmarks/grpo_seeds.py --config configs/grpo_count.py --set grpo.beta=0 --out_prefix out/beta0
    python benchmarks/grpo_seeds.py --config configs/grpo_count.py --report_only # tabulate runs made before

Run from the directory the recipe's relative paths name (the repository root for docs/grpo.md's
commands). Seed S runs `python train.py --config CONFIG --config.seed=S --config.out_dir=PREFIX_sS`
(PREFIX: --out_prefix, else out/ and the config's file name), one seed after the other, its output in
PREFIX_sS.log; while it runs, each evaluation's val_reward is printed as it lands in the run's
metrics.jsonl. A run directory that exists already is not overwritten (train.py would resume it):
remove it, pick another --out_prefix, or tabulate it with --report_only. Prints a markdown table (a
row a seed, val_reward every --every steps, the last in bold) and a line: mean, worst, seconds a run,
CPU (model, vector width, cores), jax.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METRIC = "val_reward"


def cpu_kind(cpuinfo: str | None = None) -> str:
    """'AMD EPYC, AVX-512, 2 cores' from /proc/cpuinfo's text: AVX-512 where the flags hold avx512f,
    AVX2 where they hold avx2 only (what this project's curves differ by)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return f"{platform.processor() or platform.machine()}, vector width unknown"
    fields = [line.partition(":") for line in cpuinfo.splitlines()]
    model = next((v.strip() for k, _, v in fields if k.strip() == "model name"), "unknown CPU")
    flags = set(next((v.split() for k, _, v in fields if k.strip() == "flags"), []))
    width = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    cores = sum(k.strip() == "processor" for k, _, _ in fields)
    return f"{model}, {width}, {cores} cores"


def read_curve(run_dir: Path) -> dict[int, float]:
    """{step: val_reward} from a run's metrics.jsonl (lines without it skipped)."""
    path = run_dir / "metrics.jsonl"
    curve = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line) if line.strip() else {}
            except json.JSONDecodeError:  # the line train.py is writing now: read at the next poll
                continue
            if METRIC in row:
                curve[int(row["step"])] = float(row[METRIC])
    return curve


def report(curves: dict[int, dict[int, float]], every: int = 0) -> tuple[str, dict]:
    """(the markdown table, {mean, worst, finals}) of each seed's curve: columns every `every` steps
    (0: about 8 columns) and each seed's last evaluation, the finals in bold."""
    empty = [s for s, c in curves.items() if not c]
    if empty:
        raise ValueError(f"seed(s) {empty} logged no {METRIC}: did the runs evaluate (eval_interval)?")
    last = max(max(c) for c in curves.values())
    if not every:  # about 8 columns, each an evaluation step: a multiple of the evaluations' interval
        interval = math.gcd(*{s for c in curves.values() for s in c}) or 1
        every = max(1, round(last / 8 / interval)) * interval
    steps = sorted({s for c in curves.values() for s in c if s % every == 0} | {last})
    lines = ["| step | " + " | ".join(map(str, steps)) + " |", "| --- |" + " ---: |" * len(steps)]
    finals = {}
    for seed, curve in curves.items():
        finals[seed] = curve[max(curve)]
        cells = [f"{curve[s]:.3g}" if s in curve else "" for s in steps]
        cells[-1] = f"**{finals[seed]:.3g}**"
        lines.append(f"| {METRIC}, seed {seed} | " + " | ".join(cells) + " |")
    summary = {"mean": statistics.mean(finals.values()), "worst": min(finals.values()), "finals": finals}
    return "\n".join(lines), summary


def run_seed(a, seed: int, run_dir: Path) -> float:
    """train.py for one seed (its output in RUN_DIR.log), each new evaluation printed; -> seconds."""
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", a.config, f"--config.seed={seed}"]
    cmd += [f"--config.out_dir={run_dir}", *(f"--config.{kv}" for kv in a.set)]
    log = run_dir.with_name(run_dir.name + ".log")
    print(f"seed {seed}: {' '.join(cmd[1:])} (log: {log})", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)  # ROOT on its path: train.py's
        try:
            _follow(proc, seed, run_dir, t0)
        finally:  # interrupted here (Ctrl-C): the run does not go on alone
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)
    if proc.returncode:
        tail = [line for line in log.read_text().splitlines() if line.strip()][-1:] or ["(no output)"]
        why = f"train.py exited {proc.returncode}: {tail[0]}"
        raise SystemExit(f"grpo_seeds: seed {seed}: {why} (log: {log})")
    return time.perf_counter() - t0


def _follow(proc, seed: int, run_dir: Path, t0: float) -> None:
    """Each evaluation of the run as it lands in its metrics.jsonl, until train.py ends."""
    shown = 0
    while True:  # bounded by the run: it ends when train.py does
        done = proc.poll() is not None
        curve = read_curve(run_dir)
        for step in sorted(curve)[shown:]:
            took = time.perf_counter() - t0
            print(f"  seed {seed} step {step}: {METRIC} {curve[step]:.3f} ({took:.0f} s)", flush=True)
        shown = len(curve)
        if done:
            break
        time.sleep(2)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="a GRPO recipe, e.g. configs/grpo_count.py")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (at least 1; publish 3)")
    p.add_argument("--out_prefix", help="run directories PREFIX_sS (default: out/ and the config's name)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an override for every run, as --config.KEY=VALUE (repeatable)")  # fmt: skip
    p.add_argument("--every", type=int, default=0, help="the table's columns every N steps (0: ~8 columns)")
    p.add_argument("--report_only", action="store_true", help="tabulate the existing runs, train nothing")
    a = p.parse_args(argv)
    try:
        seeds = [int(s) for s in a.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds {a.seeds!r}: give whole numbers separated by commas, e.g. 0,1,2")
    if not Path(a.config).is_file():
        p.error(f"--config {a.config} is not a file: name a recipe, e.g. configs/grpo_count.py")
    if any("=" not in kv for kv in a.set):
        p.error(f"--set takes KEY=VALUE (e.g. grpo.beta=0), got {[kv for kv in a.set if '=' not in kv]}")
    prefix = a.out_prefix or f"out/{Path(a.config).stem}"
    dirs = {s: Path(f"{prefix}_s{s}") for s in seeds}
    if a.report_only:
        missing = [str(d) for d in dirs.values() if not (d / "metrics.jsonl").exists()]
        if missing:
            p.error(f"--report_only: no metrics.jsonl in {', '.join(missing)}: run the seeds first")
    else:
        there = [str(d) for d in dirs.values() if d.exists()]
        if there:
            p.error(
                f"{', '.join(there)} exist(s) (train.py would resume them): remove, pick another "
                "--out_prefix, or --report_only to tabulate them"
            )
    seconds = {}
    for s, d in dirs.items():
        if not a.report_only:
            d.parent.mkdir(parents=True, exist_ok=True)
            seconds[s] = run_seed(a, s, d)
    try:
        table, summary = report({s: read_curve(d) for s, d in dirs.items()}, a.every)
    except ValueError as e:
        raise SystemExit(f"grpo_seeds: {e}") from None
    print()
    print(table)
    print()
    lo, hi = (f"{f(seconds.values()):.0f}" for f in (min, max)) if seconds else ("", "")
    took = f"{lo if lo == hi else f'{lo}-{hi}'} s a run; " if seconds else ""
    print(
        f"{a.config}{''.join(' --set ' + kv for kv in a.set)}: {METRIC} over seeds {a.seeds}: "
        f"mean {summary['mean']:.3f}, worst {summary['worst']:.3f}; {took}CPU {cpu_kind()}; "
        f"jax {version('jax')}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )


if __name__ == "__main__":
    main()
