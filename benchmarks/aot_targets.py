"""Compile full-size recipes for their targets ahead of time and print one table (compiled, not measured).

    python benchmarks/aot_targets.py                                   # every recipe x its named targets
    python benchmarks/aot_targets.py --run "configs/gpt2_124m.py v5e-8" \
        --run "configs/gpt2_124m.py h100-1 --config.grad_accum=32" --programs train,eval
    # GPU targets need the CUDA plugin (pip install -e '.[gpu-aot]'; its own venv is fine):
    PYTHONPATH=. $CUDA_VENV/bin/python benchmarks/aot_targets.py --run "configs/gpt2_124m.py h100-8"

Each --run is "RECIPE TARGET [--config.key=value ...]"; without --run every configs/*.py is compiled for
every target its docstring names. Columns per program, per device: memory (total of the target's),
fits, the attention kernel, collectives (count in the program text), compile seconds, MFU ceiling.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import harness  # noqa: E402, F401  (first: the benchmarks' one sys.path rule, see harness.py)

from flaxgpt.aot import compile as aot  # noqa: E402
from flaxgpt.aot import report, targets  # noqa: E402


def runs_from_recipes() -> list[str]:
    out = []
    for path in sorted(Path("configs").glob("*.py")):
        if path.name == "default.py":
            continue
        out += [f"{path} {t}" for t in targets.recipe_targets(str(path)) if t != "cpu"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", action="append", default=[], help='"RECIPE TARGET [--config.k=v ...]"')
    p.add_argument("--programs", default="train,eval,sample,serve")
    a = p.parse_args(argv)
    groups = tuple(a.programs.split(","))
    lines = [
        "| recipe | target | program | memory/device GB | fits | kernel | collectives | compile s "
        "| MFU ceiling |",
        "| --- | --- | --- | ---: | --- | --- | --- | ---: | ---: |",
    ]
    for spec in a.run or runs_from_recipes():
        recipe, name, *overrides = shlex.split(spec)
        target = targets.get(name)
        config, _ = aot.load_config(["--config", recipe, *overrides])
        rows, _ = aot.run(config, target, groups, print_fn=lambda *_: None)
        label = " ".join([Path(recipe).name, *overrides])
        for r in rows:
            fits = "yes" if r.fits() else ("no (compiler: out of memory)" if r.error else "no")
            mfu = report.pct(r.mfu_ceiling) if r.mfu_ceiling else "-"
            lines.append(
                f"| {label} | {name} | {r.program} | {report.gb(r.total)} of {report.gb(r.memory)} "
                f"| {fits} | "
                f"{r.kernel or '-'} | {report.collectives_text(r.collectives)} | {r.compile_s:.1f} | {mfu} |"
            )
            print(lines[-1], flush=True)
    print(f"\n{aot.versions('tpu')}; {aot.versions('cuda')}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
