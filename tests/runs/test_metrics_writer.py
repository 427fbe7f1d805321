"""MetricsWriter on a full disk: closing never raises, and nothing retries the write afterwards."""

import errno
import json
import sys

import pytest

from flaxgpt.runs.metrics import MetricsWriter


def test_close_on_a_full_disk_is_quiet(tmp_path):
    pytest.importorskip("tensorboardX")
    w = MetricsWriter(tmp_path, print_fn=lambda line: None)
    w.write(1, {"loss": 2.5})
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == 2.5

    def full(*args, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    (file_writer,) = w.tb.all_writers.values()
    file_writer.event_writer._ev_writer.flush = full  # the event file's next flush hits a full disk
    worker = file_writer.event_writer._worker  # the thread that flushes the event file every 2 minutes
    w.close()  # the save that failed too is the error the user sees; this must not raise
    assert file_writer.event_writer._closed and not worker.is_alive()  # no flush left to retry later
    w.close()  # and again (TensorBoard's own exit path): a no-op
    file_writer.event_writer.flush()  # a closed event file no longer touches the disk


def test_progress_lines_show_step_of_total_and_the_time_left():
    from flaxgpt.runs.metrics import duration, format_line

    row = {
        "step": 250,
        "loss": 1.81234,
        "lr": 9.6e-4,
        "tokens_per_sec": 17512.0,
        "step_time": 0.0439,
        "mfu": None,
    }
    assert (
        format_line(row, 2000)
        == "step  250/2000 | loss 1.8123 | lr 9.60e-04 | 17,512 tok/s | 43.9 ms | 1m17s left"
    )
    assert format_line({**row, "step": 2000}, 2000).endswith("43.9 ms")  # the last step: nothing left
    assert format_line({**row, "mfu": 0.412}).endswith("43.9 ms | mfu 41.2%")  # no total: no time left
    assert format_line({"step": 15, "train_loss": 3.6, "val_loss": 3.65}, 30).startswith("eval step 15/30 |")
    assert [duration(s) for s in (0.4, 42, 185, 7620)] == ["0s", "42s", "3m05s", "2h07m"]
    grpo = {"step": 5, "loss": 0.01, "reward": 0.625, "reward_std": 0.25, "kl": 0.0012, "lr": 1e-3}
    grpo["entropy"] = 0.8125  # the completion tokens' mean: a collapsing policy shows here (#52)
    assert format_line(grpo) == (  # GRPO's progress, named as TRL logs it (#55)
        "step      5 | loss 0.0100 | reward 0.6250 | reward_std 0.2500 | kl 0.0012 | entropy 0.8125 | "
        "lr 1.00e-03"
    )
    grpo_eval = {"step": 10, "val_reward": 0.75, "best_val_loss": float("inf")}  # no val loss ever taken
    assert format_line(grpo_eval, 100) == "eval step  10/100 | val_reward 0.75"


def test_the_closing_summary_names_the_checkpoint_and_the_sample_command():
    from flaxgpt.runs.metrics import closing_lines

    done, how = closing_lines(2000, 252.4, 1.90531, "out/x/checkpoints/2000", "out/x")
    assert done == "done: 2000 steps in 4m12s | best val loss 1.9053 | checkpoint out/x/checkpoints/2000"
    assert how == "sample from it: python sample.py --out_dir out/x"
    assert closing_lines(5, 3, float("inf"), None, "out/x") == ["done: 5 steps in 3s | no checkpoint saved"]


def test_missing_tensorboardx_is_said_once_and_the_run_goes_on(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # an import of it fails
    lines = []
    w = MetricsWriter(tmp_path, tensorboard=True, enabled=True, print_fn=lines.append, total_steps=10)
    w.write(1, {"loss": 2.5, "step_time": 0.5})
    w.close()
    assert w.tb is None and lines[0] == (
        "no TensorBoard events: tensorboardX is not installed (pip install -e '.[tensorboard]')"
    )
    assert lines[1] == "step  1/10 | loss 2.5000 | 500.0 ms | 4s left" and len(lines) == 2
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == 2.5


def test_metrics_jsonl_is_strict_json_with_null_for_values_that_are_not_finite(tmp_path):
    """GRPO runs log best_val_loss inf before any evaluation; a diverged loss is nan: both are null in
    the file (json.dumps would write Infinity / NaN, which strict parsers reject), as printed on the
    console they stay inf / nan."""
    import json

    import numpy as np

    lines = []
    w = MetricsWriter(tmp_path, enabled=True, print_fn=lines.append)
    w.write(1, {"loss": np.float32(np.nan), "reward": 0.5, "lr": 1e-3})
    w.write(2, {"val_loss": 2.0, "best_val_loss": float("inf")})
    w.close()

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    rows = [
        json.loads(line, parse_constant=refuse)
        for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    assert rows[0]["loss"] is None and rows[0]["reward"] == 0.5
    assert rows[1]["best_val_loss"] is None and rows[1]["val_loss"] == 2.0
    assert "loss nan" in lines[0] and "best val inf" in lines[1]


def test_a_resumed_run_logs_each_step_once(tmp_path):
    """Killed after logging steps 4 and 5 past its checkpoint at 3, a run resumes at 3 and logs 4 and 5
    again: the first ones leave metrics.jsonl (they were there twice, and plots drew back over them)."""
    w = MetricsWriter(tmp_path, tensorboard=False, print_fn=lambda *a: None)
    for step in range(1, 6):
        w.write(step, {"loss": 1.0 / step})
    w.write(3, {"val_loss": 0.5})
    w.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # the line the kill cut
    w = MetricsWriter(tmp_path, tensorboard=False, print_fn=lambda *a: None, start_step=3)
    for step in (4, 5):
        w.write(step, {"loss": 0.1})
    w.close()
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 3, 4, 5]  # every line a row: the cut one gone too
