"""Training curves from a run directory's metrics.jsonl.

    flaxgpt plot out/shakespeare_char                # -> out/shakespeare_char/metrics.png
    flaxgpt plot out/shakespeare_char --out curves.png

Three panels against the step: train and val loss, learning rate, tokens/s; a fourth with the
benchmark tasks' accuracies (and perplexities, log scale) when the run logged config.eval_tasks; one
of GRPO's rewards (each step's rollout, and val_reward on held-out prompts) when it logged them.
Lines of metrics.jsonl are JSON objects; keys the run did not log are skipped,
so a file with only a loss still plots. In a training loop call
`plot_metrics(out_dir, out_dir / "metrics.png")`; it never touches pyplot's
global state. Needs matplotlib (pip install -e '.[plot]').
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from flaxgpt import extras

# the names each series may have been logged under (first match wins); flaxgpt's trainer writes
# per-step rows {"loss", "lr", "tokens_per_sec", ...} and eval rows {"train_loss", "val_loss", ...}
SERIES = {
    "train_loss": ("loss", "train/loss"),  # the loss of each logged training step
    "train_eval_loss": ("train_loss",),  # the train split evaluated like val (in eval rows)
    "val_loss": ("val_loss", "eval_loss", "val/loss", "eval/loss"),
    "lr": ("lr", "learning_rate", "train/lr"),
    "tokens_per_sec": ("tokens_per_sec", "tokens_per_s", "tok_per_sec", "tok/s", "train/tokens_per_sec"),
}
LOSS_LABELS = {"train_loss": "train (step)", "train_eval_loss": "train (eval)", "val_loss": "val"}
STEP_KEYS = ("step", "iter", "iteration")
REWARDS = {"reward": "train (rollout)", "val_reward": "val (held out)"}  # GRPO (train.grpo_online)


def _series_keys(name: str, record: dict) -> tuple[str, ...]:
    is_eval = any(k in record for k in SERIES["val_loss"]) or record.get("split") in ("val", "eval")
    if name == "train_loss" and not is_eval and "loss" not in record:
        return ("train_loss",)  # a logger that calls the step loss train_loss
    if name == "train_loss" and is_eval:
        return ()  # an eval row's losses are averages over eval batches, not a step's loss
    if name == "train_eval_loss" and not is_eval:
        return ()
    if name == "val_loss" and record.get("split") in ("val", "eval"):
        return ("loss", *SERIES[name])
    return SERIES[name]


TASK_PREFIXES = ("hellaswag_", "lambada_", "perplexity_")  # config.eval_tasks' rows (flaxgpt.eval.evaluate)
TASK_SERIES = ("_acc", "_acc_norm", "_acc_nanogpt", "_acc_norm_nanogpt", "_ppl")  # what is drawn of them


def _is_task_series(key: str) -> bool:
    return key.startswith(TASK_PREFIXES) and key.endswith(TASK_SERIES) and "tokens" not in key


def read_metrics(path) -> dict[str, tuple[list[float], list[float]]]:
    """{series: (steps, values)} from a metrics.jsonl (or the run directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"no metrics file at {path}; pass a run directory or its metrics.jsonl")
    series = {name: ([], []) for name in SERIES}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            # the last line of a run that is still writing may be cut short
            print(f"flaxgpt.runs.plot: skipping unreadable line {lineno} of {path}", file=sys.stderr)
            continue
        step = next((record[k] for k in STEP_KEYS if k in record), lineno)
        extra = [k for k in record if _is_task_series(k) or k in REWARDS]
        for key in extra:
            series.setdefault(key, ([], []))
        for name in [*SERIES, *extra]:
            keys = _series_keys(name, record) if name in SERIES else (name,)
            value = next((record[k] for k in keys if k in record), None)
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                series[name][0].append(float(step))
                series[name][1].append(float(value))
    return series


def plot_metrics(out_dir_or_file, png_path=None) -> str:
    """Draw loss, learning rate and tokens/s into a PNG (default: metrics.png beside the file)."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no global backend, safe inside train loops
    except ImportError:
        raise ImportError(f"plots need matplotlib: {extras.install_command('plot')}") from None
    series = read_metrics(out_dir_or_file)
    src = Path(out_dir_or_file)
    if png_path is None:
        png_path = (src if src.is_dir() else src.parent) / "metrics.png"
    tasks = sorted(k for k in series if k not in SERIES and k not in REWARDS and series[k][1])
    rewards = [k for k in REWARDS if series.get(k, ((), ()))[1]]
    panels = 3 + bool(tasks) + bool(rewards)
    fig = Figure(figsize=(5 * panels, 4.2), layout="constrained")
    ax_loss, ax_lr, ax_tps, *ax_more = fig.subplots(1, panels)
    if tasks:
        _plot_tasks(ax_more.pop(0), series, tasks)
    if rewards:
        ax = ax_more.pop(0)
        for name in rewards:
            evals = name == "val_reward"  # few points: mark each
            ax.plot(*series[name], label=REWARDS[name], marker="o" if evals else None, markersize=3)
        ax.set_title(
            f"reward (last val {series['val_reward'][1][-1]:.3f})" if "val_reward" in rewards else "reward"
        )
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    for name, label in LOSS_LABELS.items():
        steps, values = series[name]
        if values:
            step_curve = name == "train_loss"  # noisy: thin; evals are few: mark each point
            ax_loss.plot(
                steps,
                values,
                label=label,
                lw=1 if step_curve else 1.5,
                alpha=0.7 if step_curve else 1,
                marker=None if step_curve and len(values) > 30 else "o",
                markersize=3,
            )
    ax_loss.set_title("loss")
    for name in ("val_loss", "train_loss", "train_eval_loss"):  # quote the newest val loss, else train
        if series[name][1]:
            ax_loss.legend()
            ax_loss.set_title(f"loss (last {LOSS_LABELS[name]} {series[name][1][-1]:.4f})")
            break
    for ax, name, title in ((ax_lr, "lr", "learning rate"), (ax_tps, "tokens_per_sec", "tokens / s")):
        steps, values = series[name]
        if values:
            ax.plot(steps, values, color="tab:green" if name == "lr" else "tab:purple")
        ax.set_title(title)
    for ax in (ax_loss, ax_lr, ax_tps):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if not ax.lines:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    fig.suptitle(os.fspath(src))
    # write then rename, so a viewer never sees a half-written PNG mid-training
    tmp = Path(png_path).with_name(Path(png_path).name + ".tmp")
    fig.savefig(tmp, dpi=100, format="png")
    os.replace(tmp, png_path)
    return os.fspath(png_path)


def _plot_tasks(ax, series, names):
    """Accuracies on the left axis, perplexities (log scale) on a right one."""
    ppl = [n for n in names if n.endswith("_ppl")]
    ax_ppl = ax.twinx() if ppl else None
    for name in names:
        target = ax_ppl if name in ppl else ax
        target.plot(*series[name], marker="o", markersize=3, label=name, ls="--" if name in ppl else "-")
    ax.set_title("eval tasks")
    ax.set_xlabel("step")
    ax.set_ylabel("accuracy")
    ax.grid(alpha=0.3)
    if ax_ppl is not None:
        ax_ppl.set_yscale("log")
        ax_ppl.set_ylabel("perplexity")
    handles = [h for a in (ax, ax_ppl) if a is not None for h in a.get_lines()]
    ax.legend(handles, [h.get_label() for h in handles], fontsize="small")


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(
        prog="flaxgpt plot",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run", nargs="?", help="a run directory (holding metrics.jsonl) or a metrics.jsonl file")
    p.add_argument("--out_dir", help="the run directory, as every other command takes it (or give it first)")
    p.add_argument("--out", default=None, help="PNG path (default: metrics.png in the run directory)")
    args = p.parse_args(argv)
    if args.run and args.out_dir and args.run != args.out_dir:
        p.error(f"two runs given ({args.run} and --out_dir {args.out_dir}); give one")
    args.run = args.run or args.out_dir
    if not args.run:
        p.error("give the run: flaxgpt plot --out_dir out/RUN (or flaxgpt plot out/RUN)")
    extras.require("plot", "flaxgpt plot")
    try:
        if not any(values for _, values in read_metrics(args.run).values()):  # an empty or foreign file
            raise FileNotFoundError(f"{args.run} holds no metrics to plot (no line of a run's metrics.jsonl)")
        path = plot_metrics(args.run, args.out)
    except (OSError, ImportError) as e:  # (a read-only run directory: write elsewhere with --out)
        p.exit(2, f"{p.prog}: error: {e}\n")
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main(sys.argv[1:])
