"""flaxgpt.runs.plot: metrics.jsonl -> a valid PNG of loss, learning rate, tokens/s (and GRPO's rewards)."""

import json
import sys

import matplotlib.image
import pytest

from flaxgpt.runs import plot
from flaxgpt.runs.metrics import MetricsWriter

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(out_dir, steps=40, eval_every=10):
    """A tiny run's metrics, written by the trainer's own MetricsWriter."""
    w = MetricsWriter(out_dir, tensorboard=False, enabled=True, print_fn=lambda *a: None)
    for step in range(steps + 1):
        if step % eval_every == 0:
            w.write(step, {"train_loss": 4.0 - step / 20, "val_loss": 4.1 - step / 25, "best_val_loss": 1.0})
        if step:
            w.write(
                step,
                {
                    "loss": 4.0 - step / 20,
                    "grad_norm": 1.0,
                    "lr": 1e-3 * min(1, step / 10),
                    "step_time": 0.01,
                    "tokens_per_sec": 1000.0 + step,
                    "mfu": None,
                },
            )
    w.close()


def assert_png(path, width, height):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert matplotlib.image.imread(path).shape[:2] == (height, width)


def test_reads_the_trainers_rows(tmp_path):
    write_run(tmp_path)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 41, "loss": 1.')  # a run still writing: the last line is cut short
    s = plot.read_metrics(tmp_path)
    assert s["train_loss"][0] == list(range(1, 41))  # per-step rows only, not the eval rows
    assert s["train_eval_loss"][0] == s["val_loss"][0] == [0, 10, 20, 30, 40]
    assert s["val_loss"][1][-1] == pytest.approx(4.1 - 40 / 25)
    assert s["lr"][1][9] == pytest.approx(1e-3)
    assert s["tokens_per_sec"][1][0] == 1001.0


def test_cli_writes_a_png(tmp_path, capsys):
    write_run(tmp_path)
    plot.main([str(tmp_path)])
    assert f"wrote {tmp_path / 'metrics.png'}" in capsys.readouterr().out
    assert_png(tmp_path / "metrics.png", 1500, 420)  # figsize (15, 4.2) at 100 dpi
    assert not list(tmp_path.glob("*.tmp"))


def test_cli_takes_out_dir_like_every_command(tmp_path, capsys):
    """`flaxgpt plot --out_dir RUN`, as train.py, sample.py and serve.py name a run (#55)."""
    write_run(tmp_path)
    plot.main(["--out_dir", str(tmp_path), "--out", str(tmp_path / "curves.png")])
    assert f"wrote {tmp_path / 'curves.png'}" in capsys.readouterr().out
    for argv in ([], [str(tmp_path), "--out_dir", str(tmp_path / "other")]):
        with pytest.raises(SystemExit):
            plot.main(argv)
        assert "give" in capsys.readouterr().err


def test_grpo_rewards_get_a_panel(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=False, enabled=True, print_fn=lambda *a: None)
    for step in range(1, 5):
        w.write(step, {"loss": -0.1, "lr": 1e-3, "reward": step / 10, "rewards/f/mean": 0.0})
    w.write(4, {"val_reward": 0.5})
    w.close()
    s = plot.read_metrics(tmp_path)
    assert s["reward"] == ([1.0, 2.0, 3.0, 4.0], [0.1, 0.2, 0.3, 0.4]) and s["val_reward"] == ([4.0], [0.5])
    plot.plot_metrics(tmp_path, tmp_path / "p.png")
    assert_png(tmp_path / "p.png", 2000, 420)  # a fourth panel: the rewards


def test_missing_keys_still_plot(tmp_path):
    # another logger's names: only "iter" and "loss", no lr, no tokens/s, no evals
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(json.dumps({"iter": i, "loss": 3.0 / (i + 1)}) for i in range(5)) + "\n")
    out = plot.plot_metrics(path, tmp_path / "curves.png")
    assert out == str(tmp_path / "curves.png")
    assert_png(tmp_path / "curves.png", 1500, 420)
    assert plot.read_metrics(path)["train_loss"][0] == [0, 1, 2, 3, 4]


def test_clear_errors(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit):
        plot.main([str(tmp_path)])
    assert "no metrics file at" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text("")  # a run stopped before its first log: no blank PNG, exit 2
    with pytest.raises(SystemExit) as e:
        plot.main([str(tmp_path)])
    assert e.value.code == 2 and "holds no metrics to plot" in capsys.readouterr().err
    assert not (tmp_path / "metrics.png").exists()
    write_run(tmp_path, steps=2)
    with pytest.raises(SystemExit) as e:  # a PNG it cannot write (a read-only run): one line, not a traceback
        plot.main([str(tmp_path), "--out", str(tmp_path / "no_such_dir" / "m.png")])
    assert e.value.code == 2 and "No such file or directory" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if matplotlib were not installed
    with pytest.raises(ImportError, match=r"pip install -e '\.\[plot\]'"):
        plot.plot_metrics(tmp_path)
