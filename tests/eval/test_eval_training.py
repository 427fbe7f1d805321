"""config.eval_tasks: benchmark tasks scored by the trainer at evaluations, logged to metrics.jsonl and
drawn in metrics.png; a bad task file stops the run before anything is written."""

import json
import sys
import tempfile
from pathlib import Path

import jax
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the configs/ package

from configs import default  # noqa: E402
from flaxgpt.data import prepare  # noqa: E402
from flaxgpt.eval import tasks as eval_tasks  # noqa: E402
from flaxgpt.runs import plot  # noqa: E402
from flaxgpt.train import trainer  # noqa: E402

TEXT = "".join(f"Pigs: {i % 7} little pigs went To market and {i % 5} stayed home.\n" for i in range(200))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    prepare.prepare_text(TEXT, root / "pigs", "char", 0.1, "generated")
    doc = {
        "activity_label": "pigs",
        "ctx_a": "3 little pigs went",
        "ctx_b": "to",
        "ctx": "3 little pigs went to",
    }
    endings = [" market and 2.", " 4 pigs", "home went.", " little market"]
    (root / "hs.jsonl").write_text(
        "".join(json.dumps({**doc, "endings": endings, "label": i % 4}) + "\n" for i in range(3))
    )
    (root / "text.txt").write_text(TEXT[:400])
    return root


def config(data, **kw):
    c = default.get_config()
    # a fresh run directory inside pytest's managed temporary tree (cleaned with it)
    c.data.dir, c.out_dir = str(data / "pigs"), tempfile.mkdtemp(prefix="run_", dir=data)
    c.model.n_layer, c.model.n_head, c.model.n_embd, c.model.block_size = 1, 2, 32, 16
    c.batch_size, c.max_iters, c.eval_interval, c.eval_iters, c.log_interval = 8, 4, 2, 1, 2
    c.optim.warmup_steps = 2
    c.tensorboard, c.plot = False, True
    c.eval_tasks = f"hellaswag:{data / 'hs.jsonl'},perplexity:{data / 'text.txt'}"
    for k, v in kw.items():
        c[k] = v
    return c


def test_eval_tasks_logged_every_n_steps_and_plotted(data):
    pytest.importorskip("matplotlib")
    c = config(data, eval_tasks_every=4)
    t = trainer.Trainer(c, devices=jax.devices()[:1], print_fn=lambda *a: None)
    t.run(t.init_state())
    rows = [json.loads(line) for line in (Path(c.out_dir) / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in rows if "val_loss" in r}
    assert sorted(evals) == [0, 2, 4]
    assert "hellaswag_acc_norm" in evals[0] and "hellaswag_acc_norm" not in evals[2]  # every 4 steps
    assert 0 <= evals[4]["hellaswag_acc_norm"] <= 1 and evals[4]["perplexity_ppl"] > 1
    assert {"hellaswag_acc_norm_nanogpt", "perplexity_bits_per_byte"} <= set(evals[4])
    series = plot.read_metrics(c.out_dir)
    assert series["hellaswag_acc_norm"] == ([0.0, 4.0], [evals[s]["hellaswag_acc_norm"] for s in (0, 4)])
    assert (Path(c.out_dir) / "metrics.png").stat().st_size > 0


def test_bad_task_file_stops_before_anything_is_written(data, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "pigs"}\nnot json\n')
    c = config(data, eval_tasks=f"lambada:{bad}")
    with pytest.raises(eval_tasks.EvalDataError, match="bad.jsonl:2 is not valid JSON"):
        trainer.Trainer(c, devices=jax.devices()[:1], print_fn=lambda *a: None)
    bad.write_text('{"text": "pigs went to Q"}\n')  # Q: not in the run's character vocabulary
    c = config(data, eval_tasks=f"lambada:{bad}")
    with pytest.raises(ValueError, match="characters not in the vocabulary: 'Q'"):
        trainer.Trainer(c, devices=jax.devices()[:1], print_fn=lambda *a: None)
    assert not (Path(c.out_dir) / "config.json").exists()
