"""flaxgpt.runs.checkpoint: exact round trips, any device count, retention, atomicity, one-line errors."""

import functools
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from flaxgpt.models.gpt import GPT, GPTConfig, init_params
from flaxgpt.runs.checkpoint import (
    Checkpointer,
    CheckpointError,
    load_for_inference,
)
from flaxgpt.runs.checksum import all_finite
from flaxgpt.runs.run_dir import resume_step
from tests.procs import xla_flags

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def _make_train_state(cfg, key):
    """A train-state-like pytree: params, AdamW state after one update, step, typed PRNG key."""
    params = init_params(cfg, key)
    tx = optax.adamw(1e-2)
    opt_state = tx.init(params)
    grads = jax.tree_util.tree_map(lambda p: jnp.full_like(p, 0.5), params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return {
        "params": optax.apply_updates(params, updates),
        "opt_state": opt_state,
        "step": jnp.int32(1),
        "rng": jax.random.fold_in(key, 1),
    }


@functools.cache
def train_state(seed=0):
    # jitted: one compile instead of hundreds of eager ops
    return jax.jit(functools.partial(_make_train_state, CFG))(jax.random.key(seed))


def train_state_shapes(cfg):
    """ShapeDtypeStructs of another config's train state, without computing it."""
    return jax.eval_shape(functools.partial(_make_train_state, cfg), jax.random.key(0))


def mesh_sharding(n_devices):
    """Shard dim 0 over a 1-D mesh of the first n devices when it divides, else replicate."""
    mesh = Mesh(np.array(jax.devices()[:n_devices]), ("data",))

    def for_leaf(x):
        spec = PartitionSpec("data") if x.ndim and x.shape[0] % n_devices == 0 else PartitionSpec()
        return NamedSharding(mesh, spec)

    return for_leaf


def abstract(tree, sharding_fn):
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_fn(x)), tree
    )


def place(tree, sharding_fn):
    return jax.tree_util.tree_map(lambda x: jax.device_put(x, sharding_fn(x)), tree)


def as_numpy(tree):
    """Host copies; typed PRNG keys as their key data."""

    def host(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    return jax.tree_util.tree_map(host, tree)


def assert_identical(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(as_numpy(a)), jax.tree_util.tree_leaves(as_numpy(b))):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)  # bit-identical, not close


def one_device(_):
    return SingleDeviceSharding(jax.devices()[0])


def test_round_trip_is_exact(tmp_path):
    state = train_state()
    ckpt = Checkpointer(tmp_path, keep=2)
    config = {"model": CFG.to_dict(), "lr": 1e-2}
    assert ckpt.save(1, state, extra={"data_step": 1, "config": config}, val_loss=2.5)
    ckpt.wait()
    restored, extra = ckpt.restore(abstract_state=abstract(state, one_device))
    assert_identical(restored, state)
    assert jax.dtypes.issubdtype(restored["rng"].dtype, jax.dtypes.prng_key)  # typed key comes back typed
    assert type(restored["opt_state"][0]) is type(state["opt_state"][0])  # optax NamedTuples, not dicts
    assert extra == {"data_step": 1, "config": config, "step": 1, "val_loss": 2.5}
    assert ckpt.latest_step() == 1 and ckpt.all_steps() == [1]
    ckpt.close()


def test_relative_out_dir(tmp_path, monkeypatch):
    """Run directories are usually relative (out/<run>); orbax itself takes only absolute paths."""
    monkeypatch.chdir(tmp_path)
    state = train_state()
    ckpt = Checkpointer("out/run", keep=2)
    assert ckpt.save(3, state, extra={"data_step": 3})
    ckpt.close()
    again = Checkpointer(Path("out") / "run", keep=2)
    restored, _ = again.restore(abstract_state=abstract(state, one_device))
    assert_identical(restored, state)
    again.close()
    params = load_for_inference("out/run")
    assert_identical(params, state["params"])


def test_restore_onto_other_device_counts(tmp_path):
    state8 = place(train_state(), mesh_sharding(8))
    assert len(state8["params"]["wte"]["embedding"].sharding.device_set) == 8  # really sharded over 8
    ckpt = Checkpointer(tmp_path)
    ckpt.save(3, state8, extra={})
    for n in (1, 4):
        sharding_fn = one_device if n == 1 else mesh_sharding(n)
        target = abstract(state8, sharding_fn)
        restored, _ = ckpt.restore(abstract_state=target)
        assert_identical(restored, state8)
        emb = restored["params"]["wte"]["embedding"]
        assert emb.sharding == target["params"]["wte"]["embedding"].sharding
        assert len(emb.sharding.device_set) == n
    ckpt.close()


def small_state(value):
    return {"params": {"w": jnp.full((4, 4), float(value))}, "step": jnp.int32(value)}


def test_keeps_latest_n_plus_best_across_restarts(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=2, keep_best=True)
    for step, val_loss in [(1, 3.0), (2, 1.0), (3, None), (4, 2.0), (5, None), (6, 2.5)]:
        assert ckpt.save(step, small_state(step), extra={}, val_loss=val_loss)
    ckpt.wait()
    assert ckpt.all_steps() == [2, 5, 6]  # latest two + the lowest val_loss
    assert ckpt.best_step() == 2
    ckpt.close()
    again = Checkpointer(tmp_path, keep=2, keep_best=True)  # val losses are read back from disk
    for step in (7, 8):
        again.save(step, small_state(step), extra={}, val_loss=5.0)
    again.wait()
    assert again.all_steps() == [2, 7, 8]
    state, extra = again.restore(2, abstract_state=abstract(small_state(0), one_device))
    assert_identical(state, small_state(2)) and extra["val_loss"] == 1.0
    again.close()
    plain = Checkpointer(tmp_path / "plain", keep=1, keep_best=False)
    for step, val_loss in [(1, 0.1), (2, 9.0)]:
        plain.save(step, small_state(step), extra={}, val_loss=val_loss)
    plain.wait()
    assert plain.all_steps() == [2]
    plain.close()


def test_async_save_copies_before_returning(tmp_path):
    """Training goes on (and may donate the state) while the save writes."""
    state = jax.tree_util.tree_map(jnp.copy, train_state())  # a copy: train_state() is cached
    expected = as_numpy(state)
    ckpt = Checkpointer(tmp_path, async_save=True)
    assert ckpt.save(10, state, extra={"data_step": 10})
    for x in jax.tree_util.tree_leaves(state):  # what donate_argnums does to the old state
        x.delete()
    ckpt.wait()
    restored, _ = ckpt.restore(abstract_state=abstract(train_state(), one_device))
    assert_identical(as_numpy(restored), expected)
    ckpt.close()


def test_never_overwrites_and_never_saves_nan(tmp_path):
    ckpt = Checkpointer(tmp_path, async_save=False)
    assert ckpt.save(5, small_state(5), extra={})
    assert not ckpt.save(5, small_state(99), extra={})  # same step: existing checkpoint kept
    assert not ckpt.save(3, small_state(99), extra={})  # older step: skipped
    bad = {"params": {"w": jnp.full((4, 4), jnp.nan)}, "step": jnp.int32(6)}
    with pytest.raises(CheckpointError, match="NaN or inf.*last good checkpoint is step 5"):
        ckpt.save(6, bad, extra={})
    assert ckpt.all_steps() == [5]
    state, _ = ckpt.restore(abstract_state=abstract(small_state(0), one_device))
    assert_identical(state, small_state(5))
    ckpt.close()


def test_all_finite():
    tree = {"a": jnp.ones(3), "i": jnp.arange(3), "k": jax.random.key(0), "b": jnp.ones((2, 2), jnp.bfloat16)}
    assert all_finite(tree)
    assert not all_finite({**tree, "a": jnp.array([1.0, jnp.nan, 0.0])})
    assert not all_finite({**tree, "b": jnp.full((2, 2), jnp.inf, jnp.bfloat16)})
    assert all_finite({"i": jnp.arange(3)})


def test_shape_mismatch_names_the_parameter_and_both_shapes(tmp_path):
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(1, train_state(), extra={})
    wider = train_state_shapes(GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32))
    with pytest.raises(CheckpointError) as err:
        ckpt.restore(abstract_state=abstract(wider, one_device))
    msg = str(err.value)
    assert "params/wte/embedding" in msg and "(64, 32)" in msg and "(96, 32)" in msg and "\n" not in msg
    deeper = train_state_shapes(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32))
    with pytest.raises(CheckpointError, match="has no params/h_2/"):
        ckpt.restore(abstract_state=abstract(deeper, one_device))
    shallower = train_state_shapes(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32))
    with pytest.raises(CheckpointError, match="has opt_state/.*h_1/.* which the model does not"):
        ckpt.restore(abstract_state=abstract(shallower, one_device))
    ckpt.close()


def test_no_checkpoint_and_init_from(tmp_path):
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(CheckpointError, match="has no checkpoint"):
        ckpt.restore(abstract_state=abstract(small_state(0), one_device))
    assert resume_step(ckpt, "auto") is None and resume_step(ckpt, "scratch") is None
    with pytest.raises(CheckpointError, match="init_from=resume but .* has no checkpoint"):
        resume_step(ckpt, "resume")
    ckpt.save(4, small_state(4), extra={})
    ckpt.wait()
    assert resume_step(ckpt, "auto") == 4 and resume_step(ckpt, "resume") == 4
    with pytest.raises(
        CheckpointError, match="init_from=scratch but .* already has checkpoints up to step 4"
    ):
        resume_step(ckpt, "scratch")
    # a fine-tune resumes only checkpoints saved with the same init_from (test_trainer: the positive case)
    with pytest.raises(CheckpointError, match="init_from=gpt2 but .* already has checkpoints up to step 4"):
        resume_step(ckpt, "gpt2")
    with pytest.raises(CheckpointError, match=r"no checkpoint for step 7; it has steps \[4\]"):
        ckpt.restore(7, abstract_state=abstract(small_state(0), one_device))
    ckpt.close()


def test_unwritable_out_dir(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointError, match="cannot write checkpoints to .*a_file/run/checkpoints"):
        Checkpointer(blocker / "run")


def test_corrupt_checkpoint_is_a_one_line_error(tmp_path):
    ckpt = Checkpointer(tmp_path, async_save=False)
    for step in (1, 2):
        ckpt.save(step, small_state(step), extra={})
    ckpt.close()
    for f in (tmp_path / "checkpoints" / "2" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(f.read_bytes()[:3])  # truncated files: a disk that filled up, a bad copy
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(CheckpointError) as err:
        ckpt.restore(abstract_state=abstract(small_state(0), one_device))
    msg = str(err.value)
    assert "checkpoints/2 cannot be read" in msg and "resume from step 1" in msg and "\n" not in msg
    state, _ = ckpt.restore(1, abstract_state=abstract(small_state(0), one_device))  # older step still fine
    assert_identical(state, small_state(1))
    # a step that vanished while read (a training run's retention, exporting mid-run): not "damaged"
    shutil.rmtree(tmp_path / "checkpoints" / "2")
    msg = str(ckpt._corrupt(2, FileNotFoundError("ocdbt manifest")))
    assert "checkpoints/2 was removed while it was read" in msg and "damaged" not in msg
    ckpt.close()


KILL_SCRIPT = """
import sys, jax, jax.numpy as jnp
from flaxgpt.runs.checkpoint import Checkpointer
ckpt = Checkpointer(sys.argv[1], keep=100)
for step in range(1, 1000):
    # 4 x 16 MiB per step: writing takes long enough to be caught mid-save
    state = {"params": {f"w{i}": jnp.full((4096, 1024), float(step)) for i in range(4)}}
    ckpt.save(step, state, extra={"data_step": step})
    print("saving", step, flush=True)
    ckpt.wait()
"""


def test_kill_9_during_save_leaves_previous_checkpoints_intact(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "XLA_FLAGS": xla_flags(), "JAX_NUM_CPU_DEVICES": "1"},
    )
    ckpt_dir = tmp_path / "checkpoints"
    deadline = time.time() + 60
    try:
        while time.time() < deadline:
            done = [p for p in ckpt_dir.glob("[0-9]*") if p.name.isdigit()]
            tmp = list(ckpt_dir.glob("*.orbax-checkpoint-tmp*"))
            if done and tmp:
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.005)
    finally:
        proc.kill()
        proc.wait()
    partial = list(ckpt_dir.glob("*.orbax-checkpoint-tmp*"))
    assert partial, "the subprocess was not killed during a save"
    partial_step = int(partial[0].name.split(".")[0])
    ckpt = Checkpointer(tmp_path)  # a new run opening the directory
    steps = ckpt.all_steps()
    assert steps and partial_step not in steps and steps[-1] == partial_step - 1
    target = {"params": {f"w{i}": jax.ShapeDtypeStruct((4096, 1024), jnp.float32) for i in range(4)}}
    state, extra = ckpt.restore(abstract_state=target)
    assert extra["data_step"] == steps[-1]
    for w in state["params"].values():
        assert np.all(np.asarray(w) == steps[-1])
    assert not list(ckpt_dir.glob("*.orbax-checkpoint-tmp*"))  # the unfinished save was cleaned up
    ckpt.close()


INFER_SCRIPT = """
import sys, numpy as np, jax, jax.numpy as jnp
from flaxgpt.runs.checkpoint import load_for_inference
from flaxgpt.models.gpt import GPT, GPTConfig
assert jax.device_count() == 1, jax.devices()
params = load_for_inference(sys.argv[1])
cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
logits = jax.jit(GPT(cfg).apply)({"params": params}, jnp.arange(8)[None] % cfg.vocab_size)
np.save(sys.argv[2], np.asarray(logits))
print(cfg.vocab_size, jax.tree_util.tree_leaves(params)[0].sharding)
"""


def test_load_for_inference_on_a_single_cpu(tmp_path):
    """Saved sharded over 8 devices; loaded by a process that has one CPU device."""
    state = place(train_state(), mesh_sharding(8))
    assert INFER_SCRIPT.count("GPTConfig(") == 1 and CFG == GPTConfig(
        vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32
    )  # the script's config is this file's
    ckpt = Checkpointer(tmp_path)
    ckpt.save(7, state, extra={})
    ckpt.close()
    out = subprocess.run(
        [sys.executable, "-c", INFER_SCRIPT, str(tmp_path), str(tmp_path / "logits.npy")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "XLA_FLAGS": xla_flags(), "JAX_NUM_CPU_DEVICES": "1", "JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("64 SingleDeviceSharding")
    params = jax.device_get(state["params"])
    expected = jax.jit(GPT(CFG).apply)({"params": params}, jnp.arange(8)[None] % 64)
    np.testing.assert_array_equal(np.load(tmp_path / "logits.npy"), np.asarray(expected))
    params1 = load_for_inference(tmp_path)  # in-process too: onto one of the 8 devices
    assert_identical(params1, state["params"])


def test_load_for_inference_errors(tmp_path):
    """Only the checkpoint's errors: config.json and meta.json are flaxgpt.runs.run_dir's (test_run_dir)."""
    with pytest.raises(CheckpointError, match="has no checkpoints directory"):
        load_for_inference(tmp_path)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, {"weights": {"w": jnp.ones(2)}}, extra={})
    ckpt.close()
    with pytest.raises(
        CheckpointError, match=r"no 'params' subtree; its top-level entries are \['weights'\]"
    ):
        load_for_inference(tmp_path)
    params = load_for_inference(tmp_path, params_path="weights")
    assert np.asarray(params["w"]).tolist() == [1.0, 1.0]
    assert Path(tmp_path / "checkpoints" / "1").is_dir()


def test_flax_train_state_round_trip(tmp_path):
    """The trainer's flax struct TrainState: stored by field names, restored as the same class."""
    from flaxgpt.train.trainer import TrainState

    raw = train_state()
    state = TrainState(step=raw["step"], params=raw["params"], opt_state=raw["opt_state"], rng=raw["rng"])
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, state, extra={})
    restored, _ = ckpt.restore(abstract_state=abstract(state, mesh_sharding(8)))
    assert isinstance(restored, TrainState)
    assert_identical(restored, state)
    params = ckpt.restore_params(abstract_params=abstract(state.params, one_device))
    assert_identical(params, state.params)
    assert "params/h_1/mlp/c_fc/kernel" in ckpt.saved_shapes(1)
    ckpt.close()


def test_checksums_catch_a_flipped_bit_and_inference_refuses_nan(tmp_path, monkeypatch):
    from flaxgpt.runs import checkpoint

    w = jax.random.normal(jax.random.key(0), (4096,))  # incompressible: stored as it is
    ckpt = Checkpointer(tmp_path, async_save=False)
    for step in (1, 2):
        ckpt.save(step, {"params": {"w": w + step, "b": jnp.ones(3)}, "step": jnp.int32(step)}, extra={})
    ckpt.close()
    data = max((p for p in (tmp_path / "checkpoints/2/state").rglob("*") if p.is_file()), key=os.path.getsize)
    flipped = bytearray(data.read_bytes())
    flipped[len(flipped) // 2] ^= 0x10  # one bit, in the middle of params/w's bytes
    data.write_bytes(bytes(flipped))
    where = tmp_path / "checkpoints" / "2"
    with pytest.raises(CheckpointError) as e:
        load_for_inference(tmp_path)
    assert str(e.value) == (
        f"checkpoint step 2 ({where}) is damaged: params/w does not match the checksum recorded when it "
        "was saved; use an earlier step: --step 1"
    )
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(
        CheckpointError, match=f"params/w does not match .*; move {where} away to resume from step 1"
    ):
        ckpt.restore(abstract_state={"params": {"w": w, "b": jnp.ones(3)}, "step": jnp.int32(0)})
    ckpt.close()
    assert np.asarray(load_for_inference(tmp_path, step=1)["w"]).tolist() == np.asarray(w + 1).tolist()

    # inf saved with its checksum (a checkpoint from before the finiteness check on save)
    monkeypatch.setattr(checkpoint, "inspect", lambda flat: (dict.fromkeys(flat, True), {}))
    ckpt = Checkpointer(tmp_path / "inf", async_save=False)
    ckpt.save(3, {"params": {"w": w.at[7].set(jnp.inf)}}, extra={})
    ckpt.close()
    monkeypatch.undo()
    with pytest.raises(
        CheckpointError, match=r"^checkpoint step 3 \(.*\) is damaged: params/w holds NaN or inf"
    ):
        load_for_inference(tmp_path / "inf")


def test_checksums_do_not_depend_on_the_sharding():
    from flaxgpt.runs.checksum import inspect

    x = jax.random.normal(jax.random.key(1), (16, 24))
    flat = {
        "f32": x,
        "bf16": x.astype(jnp.bfloat16),
        "i32": jnp.arange(16 * 3, dtype=jnp.int32).reshape(16, 3),
        "u8": (jnp.arange(16) % 256).astype(jnp.uint8),
        "mask": x[:, 0] > 0,
        "step": jnp.int32(7),
    }
    finite, one = inspect({k: jax.device_put(v, one_device(v)) for k, v in flat.items()})
    _, eight = inspect({k: jax.device_put(v, mesh_sharding(8)(v)) for k, v in flat.items()})
    assert one == eight and len(set(one.values())) == len(flat) and all(finite.values())
    _, swapped = inspect({"f32": x[::-1]})  # the same values in another order
    assert swapped["f32"] != one["f32"]


def test_the_newest_good_step_outlives_later_saves(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=1, keep_best=True)
    for step, good in [(1, True), (2, True), (3, False), (4, False)]:  # a run diverging after step 2
        ckpt.save(step, small_state(step), extra={}, good=good)
    ckpt.wait()
    assert ckpt.all_steps() == [2, 4]
    ckpt.close()
    again = Checkpointer(tmp_path, keep=1, keep_best=True)  # read back from disk after a restart
    again.save(5, small_state(5), extra={}, good=False)
    again.save(6, small_state(6), extra={}, val_loss=1.0)
    again.wait()
    assert again.all_steps() == [2, 6]
    again.close()


def test_reading_a_run_prints_no_orbax_notices(tmp_path, caplog):
    """flaxgpt.load / sample.py open the checkpoints read-only: orbax's two warnings about it (the save
    interval it sets, the directory being read-only) are not news to the user."""
    import logging

    ckpt = Checkpointer(tmp_path, async_save=False)
    assert ckpt.save(1, train_state(), extra={"data_step": 1})
    ckpt.close()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        Checkpointer(tmp_path, read_only=True, async_save=False).close()
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
