"""Training metrics: metrics.jsonl, TensorBoard events, console lines, tokens/s and MFU.

MFU = achieved FLOP/s / peak FLOP/s, with the training FLOPs per token of models.flops.flops_per_token
(nanoGPT's / PaLM appendix B's 6 N + 12 L H Q T; the trainer multiplies it by the tokens per step).
The peak is per device (config.peak_flops, or a guess from the device kind) times the device count.
On CPU there is no meaningful peak, so MFU is left out of the console lines.

The console shows progress as the field's tools do: `step 250/2000 | loss ... | 17,512 tok/s | 43.9 ms |
1m16s left` (the time left is the steps left times the row's step_time: evaluations not counted), and
`closing_lines` sums a run up at its end (steps, time, best val loss, checkpoint, the sample command).
"""

from __future__ import annotations

import json
import math
import shlex
import time
from pathlib import Path

import jax

from flaxgpt.extras import install_command

# bf16 dense peak FLOP/s per device (per chip for TPU), matched against jax's device_kind
PEAK_FLOPS = {
    "h200": 989e12,
    "h100": 989e12,
    "a100": 312e12,
    "l4": 121e12,
    "a10": 125e12,
    "tpu v6": 918e12,
    "tpu v5p": 459e12,
    "tpu v5 lite": 197e12,
    "tpu v5e": 197e12,
    "tpu v5": 459e12,
    "tpu v4": 275e12,
    "tpu v3": 123e12,
    "tpu v2": 46e12,
}


def peak_flops_per_device(configured: float = 0.0) -> float | None:
    """The configured peak, else a guess from the device kind; None when unknown (e.g. CPU)."""
    if configured > 0:
        return configured
    kind = jax.devices()[0].device_kind.lower()
    for key, peak in PEAK_FLOPS.items():
        if key in kind:
            return peak
    return None


class MetricsWriter:
    """Writes on process 0 only: one JSON object per line, TensorBoard scalars, a console line."""

    def __init__(
        self,
        out_dir: str | Path,
        tensorboard: bool = True,
        enabled: bool | None = None,
        print_fn=print,
        total_steps: int | None = None,
        start_step: int | None = None,
        reevaluate: bool = False,
    ):
        """start_step: a run resumed at this step; rows past it (steps a killed run logged after its
        last checkpoint, which the run does again) leave metrics.jsonl, so no step is there twice;
        `reevaluate` (eval_only): its evaluation rows at start_step too (the new one replaces them)."""
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self.print = print_fn
        self.total_steps = total_steps  # the console's `step N/total` and time left
        self.jsonl = None
        self.tb = None
        if not self.enabled:
            return
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        if start_step is not None:
            _drop_rows_after(out_dir / "metrics.jsonl", start_step, reevaluate)
        self.jsonl = open(out_dir / "metrics.jsonl", "a", buffering=1)  # line-buffered
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter

                self.tb = SummaryWriter(str(out_dir / "tensorboard"))
            except ImportError:  # optional: said once, the run goes on
                self.tb = None
                self.print(
                    f"no TensorBoard events: tensorboardX is not installed ({install_command('tensorboard')})"
                )

    def write(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        row = {"step": int(step), "time": round(time.time(), 3)}
        row.update({k: _plain(v) for k, v in metrics.items()})
        # strict JSON: a value that is not finite (GRPO's best_val_loss before any eval, a diverged
        # loss) is null, which every parser reads; json.dumps' Infinity / NaN are rejected by many
        finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
        self.jsonl.write(json.dumps(finite, allow_nan=False) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                # a diverged run: the trainer reports it; tensorboardX would only warn
                if k not in ("step", "time") and isinstance(v, int | float) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
        self.print(format_line(row, self.total_steps))

    def close(self) -> None:
        """Closes the files. A failure here (a full disk) is never the news: the save that failed
        too is the one-line error, and TensorBoard's atexit hook must not retry (and print a traceback)."""
        try:
            if self.jsonl is not None:
                self.jsonl.close()
        except OSError:
            pass
        if self.tb is not None:
            try:
                self.tb.close()
            except OSError:  # mark its event files closed, so no later flush retries the full disk
                for file_writer in (self.tb.all_writers or {}).values():
                    events = file_writer.event_writer
                    events._closed = True
                    # its close stopped at the flush, before its flusher thread: stopped here, or that
                    # thread flushes the full disk again and prints a traceback minutes later
                    if events._worker is not None:
                        events._worker.stop()
                        events._worker = None
                self.tb.file_writer = self.tb.all_writers = None


def _plain(v):
    v = v.item() if hasattr(v, "item") else v
    return round(v, 6) if isinstance(v, float) else v


def duration(seconds: float) -> str:
    """`42s`, `3m05s`, `2h07m`."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_line(row: dict, total: int | None = None) -> str:
    """`step 250/2000 | loss 1.8123 | lr 9.6e-04 | 17,512 tok/s | 43.9 ms | 1m16s left`, or an eval
    line; GRPO's `reward`, `reward_std`, `kl` and `entropy` follow the loss (TRL's names; entropy:
    the completion tokens' mean, the first sign of a collapsing policy). Without `total`:
    `step    250` and no time left; MFU only where a peak is known."""
    width = len(str(total)) if total else 6
    parts = [f"step {row['step']:>{width}}" + (f"/{total}" if total else "")]
    if "val_loss" in row:
        if "train_loss" in row:  # a task may evaluate val only (speedrun shards)
            parts.append(f"train loss {row['train_loss']:.4f}")
        parts += [
            f"val loss {row['val_loss']:.4f}",
            f"best val {row.get('best_val_loss', row['val_loss']):.4f}",
        ]
        known = {"step", "time", "train_loss", "val_loss", "best_val_loss"}
        parts += [f"{k} {v:.4g}" for k, v in row.items() if k not in known and isinstance(v, int | float)]
        return "eval " + " | ".join(parts)
    if "loss" not in row:  # e.g. flaxgpt.eval.evaluate's results, GRPO's val_reward: every number as
        # it is, but a best val loss where no val loss was ever taken (GRPO: inf)
        skip = ("step", "time", "best_val_loss")
        parts += [f"{k} {v:.4g}" for k, v in row.items() if k not in skip and isinstance(v, int | float)]
        return "eval " + " | ".join(parts)
    parts.append(f"loss {row['loss']:.4f}")
    for key in ("reward", "reward_std", "kl", "entropy"):  # GRPO's, named as TRL logs them
        if isinstance(row.get(key), int | float):
            parts.append(f"{key} {row[key]:.4f}")
    if "lr" in row:
        parts.append(f"lr {row['lr']:.2e}")
    if "tokens_per_sec" in row:
        parts.append(f"{row['tokens_per_sec']:,.0f} tok/s")
    if "step_time" in row:
        parts.append(f"{1000 * row['step_time']:.1f} ms")
    if row.get("mfu") is not None:
        parts.append(f"mfu {100 * row['mfu']:.1f}%")
    if total and "step_time" in row and row["step"] < total:
        parts.append(f"{duration((total - row['step']) * row['step_time'])} left")
    return " | ".join(parts)


def closing_lines(steps: int, seconds: float, best_val_loss: float, checkpoint, out_dir) -> list[str]:
    """The end of a run, `done: 2000 steps in 4m12s | best val loss 1.9053 | checkpoint
    out/x/checkpoints/2000`, and the command that samples from it."""
    parts = [f"done: {steps} steps in {duration(seconds)}"]
    if math.isfinite(best_val_loss):
        parts.append(f"best val loss {best_val_loss:.4f}")
    if checkpoint and Path(checkpoint).is_absolute() and Path(checkpoint).is_relative_to(Path.cwd()):
        checkpoint = Path(checkpoint).relative_to(Path.cwd())  # as the user named out_dir, usually
    parts.append(f"checkpoint {checkpoint}" if checkpoint else "no checkpoint saved")
    lines = [" | ".join(parts)]
    if checkpoint:
        lines.append(f"sample from it: python sample.py --out_dir {shlex.quote(str(out_dir))}")
    return lines


def _drop_rows_after(path: Path, step: int, evals_at_step: bool = False) -> None:
    """metrics.jsonl without its rows past `step` (and its evaluation rows at `step` when
    `evals_at_step`), nor a last line the kill cut short (the next row would have been written onto
    it), replaced whole (a crash leaves the old file)."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)

    def past(line: str) -> bool:
        try:
            row = json.loads(line)
            at = row.get("step", 0)
            return at > step or (evals_at_step and at == step and "val_loss" in row and "loss" not in row)
        except (ValueError, AttributeError):  # cut by the kill, or not a row: not a step to keep
            return True

    kept = [line for line in lines if not past(line)]
    if len(kept) < len(lines):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)
