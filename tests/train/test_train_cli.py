"""train.py end to end in a subprocess on generated text, and its one-line errors for bad input."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import xla_flags

ROOT = Path(__file__).resolve().parents[2]
TEXT = "".join(f"{i % 9} ducks crossed the road, and {i % 4} geese followed them.\n" for i in range(400))
TINY = [
    "--config.model.n_layer=1",
    "--config.model.n_head=2",
    "--config.model.n_embd=32",
    "--config.model.block_size=16",
    "--config.batch_size=4",
    "--config.max_iters=6",
    "--config.eval_interval=3",
    "--config.eval_iters=2",
    "--config.log_interval=2",
]


def run(args, cwd):
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=xla_flags(2),
        JAX_NUM_CPU_DEVICES="2",
    )
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "ducks.txt").write_text(TEXT)
    r = run(
        [
            "-m",
            "flaxgpt.data.prepare",
            "--dataset",
            "text",
            "--tokenizer",
            "char",
            "--input",
            "ducks.txt",
            "--out_dir",
            "data/ducks",
        ],
        tmp,
    )
    assert r.returncode == 0, r.stderr
    return tmp / "data/ducks"


def train(tmp_path, data_dir, *extra):
    return run(
        [
            str(ROOT / "train.py"),
            f"--config={ROOT}/configs/shakespeare_char_cpu.py",
            f"--config.data.dir={data_dir}",
            f"--config.out_dir={tmp_path}/out",
            *TINY,
            *extra,
        ],
        tmp_path,
    )


def test_train_end_to_end(tmp_path, data_dir):
    r = train(tmp_path, data_dir)
    assert r.returncode == 0, r.stderr[-2000:]
    out = tmp_path / "out"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [x for x in rows if "loss" in x]
    eval_rows = [x for x in rows if "val_loss" in x]
    assert [x["step"] for x in train_rows] == [2, 4, 6] and [x["step"] for x in eval_rows] == [0, 3, 6]
    for x in train_rows:
        assert {"lr", "tokens_per_sec", "step_time", "mfu"} <= x.keys() and x["tokens_per_sec"] > 0
    assert eval_rows[-1]["val_loss"] < eval_rows[0]["val_loss"]
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["kind"] == "gpt" and config["model"]["vocab_size"] == len(set(TEXT))
    assert config["model"]["n_embd"] == 32 and config["max_iters"] == 6
    assert json.loads((out / "meta.json").read_text()) == json.loads((data_dir / "meta.json").read_text())
    assert "val loss" in r.stdout and "tok/s" in r.stdout
    # 6 steps of the recipe's 100 warmup steps: said once, at the start
    (note,) = [line for line in r.stdout.splitlines() if line.startswith("note: ")]
    assert note.startswith("note: max_iters 6 ends inside the warmup (optim.warmup_steps 100)"), note
    # progress as step N/total with the time left, then the closing summary naming the checkpoint
    assert re.search(r"^step 2/6 \| loss .* \| \d+s left$", r.stdout, re.M), r.stdout
    assert "mfu" not in r.stdout.lower().replace("mfu n/a (", "")  # no per-line "mfu n/a" on CPU
    done = [line for line in r.stdout.splitlines() if line.startswith("done: ")]
    assert len(done) == 1 and done[0].startswith("done: 6 steps in ") and "best val loss" in done[0]
    assert done[0].endswith("checkpoint out/checkpoints/6"), done  # relative to the working directory
    assert r.stdout.rstrip().endswith(f"sample from it: python sample.py --out_dir {out}")
    # a checkpoint at the end (the recipe's ckpt_interval is 0), the plot, no absl INFO lines from orbax
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["6"]
    assert (out / "metrics.png").stat().st_size > 0
    assert not re.search(r"^I\d{4} ", r.stderr, re.M), r.stderr[-2000:]


def test_without_config_it_names_the_recipe_it_uses(tmp_path):
    r = run([str(ROOT / "train.py"), "--config.max_iters=lots"], tmp_path)
    assert r.stdout.startswith("no --config: using ") and "shakespeare_char_cpu.py" in r.stdout
    assert r.returncode == 1 and "--config.max_iters=lots" in r.stderr
    help_text = run([str(ROOT / "train.py"), "--help"], tmp_path).stdout
    assert "Without --config, train.py uses configs/shakespeare_char_cpu.py" in help_text
    assert "no --config: using" not in help_text


def test_help_is_short_and_points_at_the_options(tmp_path):
    """--help: the docstring and the kinds of option, not absl's dump of the whole recipe (#55)."""
    r = run([str(ROOT / "train.py"), "--config", str(ROOT / "configs" / "grpo_toy.py"), "--help"], tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("usage: python train.py [--config FILE]"), r.stderr
    assert len(r.stdout.splitlines()) < 40 and "reward_funcs" not in r.stdout
    assert "configs/default.py, docs/training.md" in r.stdout and "--helpfull" in r.stdout


def test_recipes_are_locked_and_complete():
    sys.path.insert(0, str(ROOT))
    from configs import default, gpt2_124m, shakespeare_char, shakespeare_char_cpu

    for recipe in (default, shakespeare_char, shakespeare_char_cpu, gpt2_124m):
        c = recipe.get_config()
        assert c.is_locked and c.model.kind == "gpt" and c.model.pad_vocab_multiple == 64
        with pytest.raises(AttributeError):
            c.optim.lerning_rate = 1.0
    c = gpt2_124m.get_config()
    assert c.batch_size * c.model.block_size == 524288 and c.model.dtype == "bfloat16"
    assert (c.optim.learning_rate, c.optim.min_lr, c.optim.warmup_steps) == (6e-4, 6e-5, 2000)
    c = shakespeare_char_cpu.get_config()
    assert (c.model.n_layer, c.model.n_embd, c.model.block_size, c.batch_size, c.max_iters) == (
        4,
        128,
        64,
        12,
        2000,
    )


BAD = {
    "unknown key": (["--config.optim.lerning_rate=1"], "unknown config key 'optim.lerning_rate'; did you"),
    "flat key": (["--config.learning_rate=1"], "did you mean optim.learning_rate?"),
    "wrong type": (["--config.max_iters=lots"], "--config.max_iters=lots must be an integer"),
    "not a number": (["--config.optim.learning_rate=fast"], "learning_rate=fast must be a number"),
    "not a bool": (["--config.tensorboard=yes"], "--config.tensorboard=yes must be True or False"),
    "no data": (["--config.data.dir=nowhere"], "flaxgpt prepare"),
    "short data": (["--config.model.block_size=8000"], "fewer than block_size + 1"),
    "batch vs devices": (["--config.batch_size=3"], "not divisible by the 2 data-parallel devices"),
    "vocab too big": (["--config.model.vocab_size=10"], "larger than the model's vocab_size (10)"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, data_dir, case):
    args, message = BAD[case]
    out = tmp_path / "out"
    out.mkdir()
    precious = '{"model": "a run\'s, to keep"}'  # (a run's: another directory's is refused for itself)
    (out / "config.json").write_text(precious)
    r = train(tmp_path, data_dir, *args)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
    assert (out / "config.json").read_text() == precious
