"""One harness for side-by-side benchmarks: each side in its own process, the order alternated every round.

A side is a command that prints one line `RESULT {json}` on stdout (`print_result` writes it). The
harness runs every side once per round, reverses the order every other round (A-B, B-A, A-B, ...),
pauses between runs (the machine cools down: PyTorch's OpenMP workers spin on after a process, and
a run that follows another on a busy machine is slower), and compares each figure per round. With a
fixed order the side that runs second pays for the first: nanoGPT right after flaxgpt took 49-60
ms/iter against 43 ms when it ran first, which made a 1.17x median look like 1.58x.

    from harness import Figure, Side, add_arguments, compare

    sides = [Side("flaxgpt", [sys.executable, __file__, "--side", "flaxgpt"]),
             Side("hf", [torch_python, __file__, "--side", "hf"])]
    report = compare(sides, [Figure("tok/s, batch 1", "flaxgpt", "b1", "hf", "b1")], rounds=4, pause=20)
    print(report.table())

A side's argv may be a function of the round (seeds: `lambda r: [..., f"--seed={r}"]`).

The benchmarks' one sys.path rule lives here: each benchmark runs as `python benchmarks/NAME.py`, so
Python puts benchmarks/ first on sys.path and its first import, `import harness`, finds this file;
importing it puts the repository root next (this checkout's flaxgpt and configs/, not an installed
copy). No benchmark edits sys.path itself. Starting serve.py for a benchmark: serve_process.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))  # after benchmarks/: this checkout's flaxgpt and configs/

MIN_ROUNDS = 4
RESULT = "RESULT "
PACKAGES = ("torch", "transformers", "peft", "trl", "lm_eval", "jax", "flax")
VERSIONS = (  # run under each side's interpreter: versions without importing anything heavy
    "import json, importlib.metadata as m\n"
    "def v(n):\n"
    "    try:\n"
    "        return m.version(n)\n"
    "    except m.PackageNotFoundError:\n"
    "        return '-'\n"
    f"print(json.dumps({{n: v(n) for n in {PACKAGES!r}}}))"
)


@dataclass(frozen=True)
class Side:
    """One side: `argv` (or argv_of(round)) runs it; `python` is the interpreter whose versions count
    (default argv[0]: set it when a launcher in this venv runs the side under another one)."""

    name: str
    argv: Sequence[str] | Callable[[int], Sequence[str]]
    python: str | None = None
    env: dict | None = None
    cwd: str | None = None

    def argv_of(self, round_: int) -> list[str]:
        return list(self.argv(round_) if callable(self.argv) else self.argv)

    def interpreter(self) -> str:
        return self.python or self.argv_of(0)[0]


@dataclass(frozen=True)
class Figure:
    """`side`'s result[key] against `ref`'s result[ref_key]; the ratio is side / ref, or ref / side
    when lower is better (times), so > 1 always means `side` is faster."""

    label: str
    side: str
    key: str
    ref: str
    ref_key: str
    higher_is_better: bool = True

    def ratio(self, value: float, ref_value: float) -> float:
        return value / ref_value if self.higher_is_better else ref_value / value


@dataclass
class Report:
    figures: list[Figure]
    orders: list[list[str]]  # the order the sides ran in, per round
    results: list[dict[str, dict]]  # per round: side name -> its RESULT
    versions: dict[str, dict[str, str]] = field(default_factory=dict)  # side name -> package -> version

    def values(self, side: str, key: str) -> list[float]:
        return [float(r[side][key]) for r in self.results]

    def ratios(self, f: Figure) -> list[float]:
        return [f.ratio(a, b) for a, b in zip(self.values(f.side, f.key), self.values(f.ref, f.ref_key))]

    def median_ratio(self, f: Figure) -> float:
        return statistics.median(self.ratios(f))

    def table(self) -> str:
        lines = [f"{len(self.results)} rounds, orders: " + ", ".join("-".join(o) for o in self.orders), ""]
        if self.figures:
            lines.append(
                "| figure | side (median) | reference (median) | ratio (median) | ratios per round | spread |"
            )
            lines.append("| --- | ---: | ---: | ---: | --- | ---: |")
        for f in self.figures:
            rs = self.ratios(f)
            side, ref = (
                statistics.median(self.values(f.side, f.key)),
                statistics.median(self.values(f.ref, f.ref_key)),
            )
            lines.append(
                f"| {f.label} | {f.side} {side:.4g} | {f.ref} {ref:.4g} | **{statistics.median(rs):.2f}x** | "
                f"{' '.join(f'{r:.2f}' for r in rs)} | {min(rs):.2f}-{max(rs):.2f}x |"
            )
        lines.append("")
        for name, v in self.versions.items():
            lines.append(f"{name}: " + ", ".join(f"{p} {v.get(p, '-')}" for p in PACKAGES))
        return "\n".join(lines)


def markdown(rows: Sequence[dict], cols: Sequence[str], fmt: Callable = lambda col, v: str(v)) -> str:
    """rows as a markdown table of `cols` (a missing or None cell empty; fmt(col, value) writes a
    cell, its '|' made '/')."""
    cell = lambda c, r: "" if r.get(c) is None else fmt(c, r[c]).replace("|", "/")  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(cell(c, r) for c in cols) + " |" for r in rows])


def order(names: Sequence[str], round_: int) -> list[str]:
    """The sides' order in round `round_`: as given in even rounds, reversed in odd ones."""
    return list(names) if round_ % 2 == 0 else list(reversed(names))


def print_result(result: dict) -> None:
    """What a side prints last: the harness reads this line."""
    print(RESULT + json.dumps(result), flush=True)


def run_side(side: Side, round_: int) -> dict:
    """Run one side in its own process and return its RESULT (stderr's tail on failure)."""
    env = {**os.environ, **(side.env or {})}
    r = subprocess.run(side.argv_of(round_), capture_output=True, text=True, env=env, cwd=side.cwd)
    lines = [x for x in r.stdout.splitlines() if x.startswith(RESULT)]
    if r.returncode or not lines:
        raise SystemExit(
            f"error: side {side.name} failed in round {round_} (exit {r.returncode}):\n{r.stderr[-3000:]}"
        )
    return json.loads(lines[-1][len(RESULT) :])


def hf_generate(model, prompt_BT, new_tokens: int, repeats: int, pad_token_id: int = 0):
    """transformers' greedy `generate` timed as the decoding benchmarks time it: exactly new_tokens
    tokens per row, one warm-up call first, the median of `repeats` calls. Returns (generated tokens
    per second over the batch, the last call's output [B, prompt + new_tokens])."""
    import numpy as np
    import torch

    ids = torch.from_numpy(np.asarray(prompt_BT, np.int64))
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=pad_token_id, use_cache=True)
    times = []
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            gen = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
            times.append(time.perf_counter() - t0)
    assert gen.shape[1] == ids.shape[1] + new_tokens, gen.shape
    return ids.shape[0] * new_tokens / statistics.median(times), gen


def versions(python: str) -> dict[str, str]:
    r = subprocess.run([python, "-c", VERSIONS], capture_output=True, text=True)
    return json.loads(r.stdout) if r.returncode == 0 else {}


def compare(
    sides: Sequence[Side],
    figures: Sequence[Figure],
    *,
    rounds: int = MIN_ROUNDS,
    pause: float = 20.0,
    run: Callable[[Side, int], dict] = run_side,
    sleep: Callable[[float], None] = time.sleep,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
) -> Report:
    """Every side `rounds` times, the order alternating, `pause` s of rest before each run but the first."""
    if rounds < MIN_ROUNDS:
        raise SystemExit(f"error: --rounds {rounds} is too few; at least {MIN_ROUNDS} (the order alternates)")
    if pause < 0:
        raise SystemExit(f"error: --pause {pause} must be >= 0 seconds")
    by_name = {s.name: s for s in sides}
    for f in figures:
        for name in (f.side, f.ref):
            if name not in by_name:
                raise ValueError(f"figure {f.label!r} names side {name!r}; the sides are {list(by_name)}")
    report = Report(list(figures), [], [])
    first = True
    for r in range(rounds):
        report.orders.append(order(list(by_name), r))
        results = {}
        for name in report.orders[-1]:
            if not first:
                sleep(pause)
            first = False
            t0 = time.perf_counter()
            results[name] = run(by_name[name], r)
            took = time.perf_counter() - t0
            log(f"round {r + 1}/{rounds} {name}: {took:.0f} s {json.dumps(results[name])[:300]}")
        report.results.append(results)
    if run is run_side:
        report.versions = {s.name: versions(s.interpreter()) for s in sides}
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The harness's flags, the same in every benchmark script."""
    p.add_argument("--rounds", type=int, default=MIN_ROUNDS, help=f"rounds of every side (>= {MIN_ROUNDS})")
    p.add_argument("--pause", type=float, default=20.0, help="seconds of rest before each run (default 20)")
