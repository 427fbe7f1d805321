"""Checkpoints in the training loop: exact resume, SIGTERM, NaN stop, init_from, other device counts."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flaxgpt.data import prepare  # noqa: E402
from flaxgpt.runs.checkpoint import Checkpointer, CheckpointError  # noqa: E402
from flaxgpt.runs.run_dir import RunError, load_run  # noqa: E402
from flaxgpt.train import trainer  # noqa: E402
from tests.procs import xla_flags
from tests.train.test_trainer import TEXT, data_dir, tiny_config  # noqa: E402,F401

ROOT = Path(__file__).resolve().parents[2]
QUIET = dict(print_fn=lambda *a: None)


class PreemptedAt(trainer.Trainer):
    """Sends itself SIGTERM after dispatching update `k`, as a TPU VM's preemption notice would."""

    k = None

    def after_step(self, step, state):
        if step == self.k:
            os.kill(os.getpid(), signal.SIGTERM)


def losses(out_dir) -> dict:
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(state.params)]


def test_stopped_then_resumed_is_bit_identical(data_dir):  # noqa: F811
    cfg = tiny_config(data_dir, max_iters=8, eval_interval=4, ckpt_interval=4, model__dropout=0.1)
    t = PreemptedAt(cfg, devices=jax.devices()[:1], **QUIET)
    t.k = 3
    cut = t.run(t.init_state())
    assert int(cut["state"].step) == 3 and t.ckpt.all_steps() == [3]
    cut_losses = losses(cfg.out_dir)
    t.k = None
    resumed = t.run(t.init_state())  # the same compiled trainer restores step 3 and goes on
    assert int(resumed["state"].step) == 8 and t.ckpt.all_steps() == [3, 4, 8]
    resumed_losses = losses(cfg.out_dir)
    assert sorted(cut_losses) == [1, 2, 3] and sorted(resumed_losses) == list(range(1, 9))

    # the uninterrupted run: a fresh state, the same compiled program (saving nothing new)
    cfg.ckpt_interval, cfg.out_dir = 0, str(Path(cfg.out_dir) / "full")
    full = t.run(jax.jit(t._init_state_fn, out_shardings=t.state_shardings)(jax.random.key(cfg.seed)))
    for a, b in zip(leaves(full["state"]), leaves(resumed["state"])):
        np.testing.assert_array_equal(a, b)
    assert losses(cfg.out_dir) == resumed_losses and full["val_loss"] == resumed["val_loss"]
    t.close()


@pytest.fixture(scope="module")
def three_steps(data_dir):  # noqa: F811
    """A run trained for 3 steps (checkpoint 3); tests work on copies of it."""
    cfg = tiny_config(data_dir, max_iters=3, eval_interval=100)
    trainer.train(cfg, devices=jax.devices()[:1], **QUIET)
    return Path(cfg.out_dir)


def copy_of(run: Path, tmp_path: Path) -> str:
    shutil.copytree(run, tmp_path / "run")
    return str(tmp_path / "run")


def test_divergence_stops_at_the_last_good_checkpoint_and_init_from_errors(data_dir, three_steps, tmp_path):  # noqa: F811
    one = jax.devices()[:1]
    out = copy_of(three_steps, tmp_path)
    cfg = tiny_config(data_dir, max_iters=3, eval_interval=100, out_dir=out)
    bad = tiny_config(data_dir, out_dir=out, max_iters=40, ckpt_interval=2, optim__learning_rate=1e6)
    # step 4's weights are finite but diverged (its recorded loss ~1e13): "good" is step 3
    # ... and a resume takes the latest: the error names the diverged ones to move away first
    good = rf"at step \d+.*last good checkpoint is {out}/checkpoints/3 "
    good += rf"\(move {out}/checkpoints/4[^)]* away first\);"
    with pytest.raises(FloatingPointError, match=good) as e:
        trainer.train(bad, devices=one, **QUIET)
    t = trainer.Trainer(cfg, devices=one, **QUIET)
    steps = t.ckpt.all_steps()
    assert steps[:2] == [3, 4]
    recorded = {s: t.ckpt.restore_extra(s) for s in steps}
    assert recorded[3]["loss"] < 4 < 1e6 < recorded[4]["loss"] and recorded[4]["best_loss"] < 4
    assert recorded[4]["config"]["optim"]["learning_rate"] == 1e6  # the settings each step trained with
    assert recorded[3]["config"]["optim"]["learning_rate"] == cfg.optim.learning_rate
    for step in steps:  # whatever was saved is finite
        state, _ = t.ckpt.restore(step, abstract_state=t.restore_target)
        assert all(np.isfinite(x).all() for x in leaves(state))

    with pytest.raises(CheckpointError, match=f"init_from=scratch but {out} already has checkpoints up to"):
        trainer.train(tiny_config(data_dir, out_dir=out, init_from="scratch"), devices=one, **QUIET)
    wider = tiny_config(data_dir, out_dir=out, model__n_embd=48)
    with pytest.raises(RunError, match=r"step \d+ was trained with another model .*model.n_embd \(32 in the"):
        trainer.train(wider, devices=one, **QUIET)
    assert t.ckpt.all_steps() == steps  # failed runs delete nothing
    with pytest.raises(CheckpointError, match="init_from=resume but .* has no checkpoint"):
        trainer.train(tiny_config(data_dir, init_from="resume"), devices=one, **QUIET)
    t.close()
    # the advice, followed: the diverged checkpoints moved away, a lower rate resumes from step 3
    moved = re.search(r"\(move (.*) away first\)", str(e.value)).group(1).split(", ")
    for path in moved:
        shutil.move(path, tmp_path / Path(path).name)
    again = tiny_config(data_dir, out_dir=out, max_iters=5, eval_interval=100)
    assert int(trainer.train(again, devices=one, **QUIET)["state"].step) == 5


def test_a_nan_loss_checkpoint_is_not_saved(data_dir, three_steps, tmp_path):  # noqa: F811
    """Finite weights whose loss is NaN were saved: "lower the learning rate and resume" took them back."""
    out = copy_of(three_steps, tmp_path)
    lr = dict(optim__learning_rate=1e30, optim__min_lr=1e29, optim__decay_steps=40)
    bad = tiny_config(data_dir, out_dir=out, max_iters=10, ckpt_interval=1, eval_interval=100, **lr)
    with pytest.raises(FloatingPointError, match=r"loss is nan at step \d+ \(not saved\); the last good"):
        trainer.train(bad, devices=jax.devices()[:1], **QUIET)
    t = Checkpointer(out, read_only=True)
    assert all(np.isfinite(t.restore_extra(s)["loss"]) for s in t.all_steps())


def test_sigterm_during_setup_stops_cleanly_and_releases_the_lock(
    data_dir,  # noqa: F811
    three_steps,
    tmp_path,
    monkeypatch,
):
    """A preemption notice while the state is restored (setup can take minutes): it killed the run
    (exit 143) and left train.lock, which another host never takes over."""
    out = copy_of(three_steps, tmp_path)
    init_state = trainer.Trainer.init_state

    def noticed(self):
        os.kill(os.getpid(), signal.SIGTERM)
        return init_state(self)

    monkeypatch.setattr(trainer.Trainer, "init_state", noticed)
    lines = []
    summary = trainer.train(
        tiny_config(data_dir, out_dir=out, max_iters=6), devices=jax.devices()[:1], print_fn=lines.append
    )
    assert int(summary["state"].step) == 3 and "SIGTERM during setup: nothing trained" in lines[-1]
    assert not (Path(out) / "train.lock").exists() and Checkpointer(out, read_only=True).all_steps() == [3]


def test_an_out_dir_holding_a_models_files_is_refused(data_dir, tmp_path):  # noqa: F811
    """out_dir = a Hugging Face model's directory (or init_from's): its config.json was replaced by
    the run's, and transformers could no longer read the model."""
    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "gpt2"}')
    for init_from, says in (("auto", "is not a flaxgpt run's"), (str(model), "is init_from's directory")):
        with pytest.raises(RunError, match=says):
            trainer.train(
                tiny_config(data_dir, out_dir=str(model), init_from=init_from),
                devices=jax.devices()[:1],
                **QUIET,
            )
    assert sorted(p.name for p in model.iterdir()) == ["config.json"]
    assert json.loads((model / "config.json").read_text()) == {"model_type": "gpt2"}


def test_eval_only_evaluates_the_checkpoint_even_past_max_iters(data_dir, three_steps, tmp_path):  # noqa: F811
    """eval_only on a run whose step (3) is past max_iters (2) evaluated nothing and exited 0."""
    out = copy_of(three_steps, tmp_path)
    config_json = (Path(out) / "config.json").read_text()
    cfg = tiny_config(data_dir, out_dir=out, max_iters=2, eval_only=True, optim__warmup_steps=1)
    for _ in range(2):  # each evaluation replaces the step's evaluation row (they piled up)
        trainer.train(cfg, devices=jax.devices()[:1], **QUIET)
        rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if "val_loss" in r and "loss" not in r] == [0, 3], rows
    assert any("loss" in r for r in rows)  # the training rows stay
    assert Checkpointer(out, read_only=True).all_steps() == [3]  # nothing trained or saved
    assert (Path(out) / "config.json").read_text() == config_json  # (eval_only: true was written)


@pytest.mark.devices(8)
def test_restore_onto_other_device_counts(data_dir, tmp_path):  # noqa: F811
    kw = dict(max_iters=6, eval_interval=100, eval_iters=1, ckpt_interval=4, keep_checkpoints=5)
    # saved by 8 devices, 2-way data x 4-way FSDP: every parameter is split into shards
    ref = tiny_config(data_dir, mesh__data=2, mesh__fsdp=4, **kw)
    trainer.train(ref, devices=jax.devices(), **QUIET)
    for n in (4, 1):
        cfg = tiny_config(data_dir, mesh__data=n, **kw)
        shutil.copytree(Path(ref.out_dir) / "checkpoints/4", Path(cfg.out_dir) / "checkpoints/4")
        lines = []
        out = trainer.train(cfg, devices=jax.devices()[:n], print_fn=lines.append)
        assert int(out["state"].step) == 6
        # said among the changed settings: another mesh reduces in another order (not the same bits)
        mesh = f"mesh: {{'data': 2, 'fsdp': 4}} -> {{'data': {n}, 'fsdp': 1}}"
        assert any(mesh in line for line in lines), lines
        got, want = losses(cfg.out_dir), losses(ref.out_dir)
        assert sorted(got) == [5, 6]  # continued from step 4
        np.testing.assert_allclose([got[5], got[6]], [want[5], want[6]], rtol=1e-4)


def test_sigterm_saves_exits_0_and_the_next_start_resumes(data_dir, tmp_path):  # noqa: F811
    overrides = {
        "data.dir": str(data_dir),
        "out_dir": str(tmp_path),
        "max_iters": 5000,
        "log_interval": 1,
        "eval_iters": 1,
        "model.n_layer": 1,
        "model.n_embd": 32,
        "model.block_size": 16,
        "tensorboard": False,
        "plot": False,
    }
    args = [sys.executable, "train.py", "--config", "configs/shakespeare_char_cpu.py"]
    args += [f"--config.{k}={v}" for k, v in overrides.items()]
    env = {**os.environ, "XLA_FLAGS": xla_flags(), "JAX_NUM_CPU_DEVICES": "1", "PYTHONUNBUFFERED": "1"}
    pipe = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc = subprocess.Popen(args, cwd=ROOT, env=env, **pipe)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        m = re.match(r"step\s+(\d+)(?:/\d+)? \|", line)  # "step 3/5000 | ..."
        if m and int(m.group(1)) >= 3:
            proc.send_signal(signal.SIGTERM)
            break
    lines.append(proc.communicate(timeout=120)[0])
    text = "".join(lines)
    assert proc.returncode == 0, text[-2000:]
    saved = Checkpointer(tmp_path).latest_step()
    assert 3 <= saved < 5000 and f"SIGTERM: saved step {saved} to {tmp_path}/checkpoints;" in text
    assert not (tmp_path / "train.lock").exists()  # released on the way out

    from configs import shakespeare_char_cpu

    cfg = shakespeare_char_cpu.get_config()
    for k, v in {**overrides, "max_iters": saved + 2}.items():
        section, _, key = k.rpartition(".")
        (cfg[section] if section else cfg)[key] = v
    printed = []
    out = trainer.train(cfg, devices=jax.devices()[:1], print_fn=printed.append)
    assert f"resumed from {tmp_path}/checkpoints/{saved}" in printed and int(out["state"].step) == saved + 2
    assert Checkpointer(tmp_path).latest_step() == saved + 2


def test_resume_refuses_another_model_or_tokenizer_and_loads_each_step_as_trained(
    data_dir,  # noqa: F811
    three_steps,
    tmp_path,
):
    one = jax.devices()[:1]
    out = Path(copy_of(three_steps, tmp_path))

    def files():
        return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}

    def refused(message, **change):
        before = files()
        with pytest.raises(RunError) as e:
            trainer.train(
                tiny_config(data_dir, out_dir=str(out), max_iters=6, **change), devices=one, **QUIET
            )
        assert str(e.value) == (
            f"checkpoint step 3 was trained with another model or data: {message}; resume with the "
            "config and data it was trained with, or use a new out_dir"
        )
        assert files() == before and Checkpointer(out).all_steps() == [3]  # nothing written

    refused("model.activation ('gelu' in the checkpoint, 'relu' now)", model__activation="relu")
    # another tokenizer with the same vocabulary size, in a run whose meta.json was relabeled already
    other = tmp_path / "other"
    prepare.prepare_text(TEXT.replace("p", "P"), other, "char", 0.1, "generated")
    (out / "meta.json").write_text((other / "meta.json").read_text())
    refused("the data's meta.json (tokenizer.chars differ)", data__dir=str(other))

    # config.json / meta.json relabeled by hand: a step loads with the model and tokenizer it was trained with
    saved = json.loads((out / "config.json").read_text())
    saved["model"]["activation"] = "relu"
    (out / "config.json").write_text(json.dumps(saved))
    run = load_run(out, step=3)
    assert run.config.activation == "gelu" and run.tokenizer.decode(run.tokenizer.encode("pigs")) == "pigs"


def test_a_fine_tunes_resume_names_its_init_from():
    """init_from=resume on a fine-tune's out_dir takes the default model, not its source's: the error
    says which init_from continues it (the same command with init_from=the source resumes)."""
    from flaxgpt.models import registry as models
    from flaxgpt.models.gpt import GPTConfig
    from flaxgpt.runs import run_dir

    saved = {
        "init_from": "out/calc_sft",
        "model": models.section_of(GPTConfig(n_layer=4, n_head=4, n_embd=128)),
    }
    with pytest.raises(
        RunError,
        match=r"model.n_layer \(4 in the checkpoint, 2 now\).*; it fine-tuned "
        r"out/calc_sft: continue it with --config.init_from=out/calc_sft, or use a new out_dir$",
    ):
        run_dir.check_resume(
            {"config": saved}, 60, GPTConfig(n_layer=2, n_head=4, n_embd=128), {}, {"init_from": "resume"}
        )


def test_a_lora_run_on_a_run_keeps_the_base_step_it_trained_on(data_dir, three_steps, tmp_path, monkeypatch):  # noqa: F811
    """Adapters over a flaxgpt run's weights: loading merged them into the base run's *latest*
    checkpoint, whatever it had become; a relative init_from failed from another directory; the same
    base spelt otherwise (a trailing slash), or init_from=resume, was refused."""
    import flaxgpt

    base = copy_of(three_steps, tmp_path)
    monkeypatch.chdir(tmp_path)  # init_from as typed: relative to here
    lora = dict(out_dir=str(tmp_path / "lora"), init_from="run", lora__rank=4, max_iters=2, eval_interval=100)
    lora.update(optim__decay_steps=20)  # (max_iters changes below; the schedule stays)
    trainer.train(tiny_config(data_dir, **lora), devices=jax.devices()[:1], **QUIET)
    assert json.loads((tmp_path / "lora" / "config.json").read_text())["init_from"] == base  # absolute
    monkeypatch.chdir(ROOT)
    before = flaxgpt.load(str(tmp_path / "lora")).params
    # the base trains on: the LoRA run still means step 3's weights ...
    trainer.train(
        tiny_config(data_dir, out_dir=base, max_iters=5, keep_checkpoints=5, eval_interval=100),
        devices=jax.devices()[:1],
        **QUIET,
    )
    after = flaxgpt.load(str(tmp_path / "lora")).params
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # ... and resuming it names the base's step to go back to
    more = {**lora, "init_from": base + "/", "max_iters": 4}
    with pytest.raises(RunError, match=r"trained on init_from's step 3, and .* is at step 5 now: move"):
        trainer.train(tiny_config(data_dir, **more), devices=jax.devices()[:1], **QUIET)
    for step in Checkpointer(base, read_only=True).all_steps()[1:]:  # as the message says
        shutil.rmtree(Path(base) / "checkpoints" / str(step))
    for init_from in (base + "/", "resume"):  # the same base spelt otherwise, or the run's own record
        more.update(init_from=init_from, max_iters=more["max_iters"] + 1)
        summary = trainer.train(tiny_config(data_dir, **more), devices=jax.devices()[:1], **QUIET)
        assert int(summary["state"].step) == more["max_iters"]
