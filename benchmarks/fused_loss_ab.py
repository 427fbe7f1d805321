"""The fused linear + cross-entropy vs the logits' loss on the CPU: the train step of the Tiny
Shakespeare recipe's model, each side its own process, the order alternating (benchmarks/harness.py).

    python benchmarks/fused_loss_ab.py                  # 4 rounds, 20 s pauses
    python benchmarks/fused_loss_ab.py --rounds 6 --pause 10 --steps 30

A side is `benchmarks/train_throughput.py --step cpu --loss_impl {logits,fused}` (the jitted trainer
step alone, float32, the recipe's model: 4 layers, 128 wide, 65 characters, batch 12 x 64), run as a
child: its median step time, and the child's peak resident memory (getrusage: the whole process,
compiling included, as the CPU has no device memory statistics). Both sides start from the same
weights and batch, so their losses after the same steps agree (to float32 rounding).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import ROOT, Figure, Side, add_arguments, compare, print_result


def side(impl: str, steps: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "step.json"
        cmd = [sys.executable, str(ROOT / "benchmarks/train_throughput.py"), "--step", "cpu"]
        cmd += ["--loss_impl", impl, "--steps", str(steps), "--json", str(out)]
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        r = json.loads(out.read_text())
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # Linux: KiB
    print_result(dict(step_ms=r["step_ms"], peak_rss_mib=round(peak_kib / 1024, 1), loss=r["loss"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--side", choices=["logits", "fused"], help=argparse.SUPPRESS)
    add_arguments(p)
    a = p.parse_args()
    if a.side:
        return side(a.side, a.steps)
    me = [sys.executable, __file__, "--steps", str(a.steps), "--side"]
    sides = [Side("fused", me + ["fused"]), Side("logits", me + ["logits"])]
    figures = [
        Figure("step time (ms)", "fused", "step_ms", "logits", "step_ms", higher_is_better=False),
        Figure("peak RSS (MiB)", "fused", "peak_rss_mib", "logits", "peak_rss_mib", higher_is_better=False),
    ]
    report = compare(sides, figures, rounds=a.rounds, pause=a.pause)
    print(report.table())
    losses = {s: [r[s]["loss"] for r in report.results] for s in ("fused", "logits")}
    print(f"\nlosses after the timed steps, per round: {json.dumps(losses)}")


if __name__ == "__main__":
    main()
