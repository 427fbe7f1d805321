"""Failures outside the config: a damaged checkpoint, a full disk while training, the hub offline.
Each is one line, the last on screen, with none of orbax's, asyncio's or TensorStore's noise after it."""

import logging
import os
import re
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxgpt import runtime
from flaxgpt.data import prepare
from flaxgpt.hf import files as hf_files
from flaxgpt.runs import checkpoint
from tests.procs import xla_flags

ROOT = Path(__file__).resolve().parents[1]
NOISE = ("Traceback", "Event loop is closed", "<bound method", "pybind11")


def saved_run(tmp_path):
    ckpt = checkpoint.Checkpointer(tmp_path, keep=3, async_save=False)
    for step in (1, 2):
        w = jax.random.normal(jax.random.key(step), (64, 32))  # random: incompressible, one big file
        state = {"params": {"w": w, "b": jnp.zeros(32)}}
        ckpt.save(step, state, extra={"data_step": step})
    ckpt.close()
    return tmp_path / "checkpoints"


def test_truncated_checkpoint_is_one_line_naming_the_damage(tmp_path, caplog):
    runtime.setup(verbosity=None)  # what every entry point does first
    directory = saved_run(tmp_path)
    with caplog.at_level(logging.INFO):
        params = checkpoint.load_for_inference(tmp_path)
    np.testing.assert_array_equal(params["w"], jax.random.normal(jax.random.key(2), (64, 32)))
    # orbax's "read only" notes on every load carry nothing for the user
    assert not [r for r in caplog.records if "read only" in r.getMessage()], caplog.text
    data = directory / "2" / "state" / "ocdbt.process_0" / "d"
    biggest = max(data.iterdir(), key=lambda p: p.stat().st_size)
    os.truncate(biggest, 100)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.load_for_inference(tmp_path)
    msg = str(e.value)
    assert msg.startswith(f"checkpoint {directory / '2'} cannot be read (") and "\n" not in msg
    assert "resume from step 1" in msg and not any(n in msg for n in NOISE), msg
    assert "is not valid for value of size 100" in msg  # TensorStore's own reason, not its spec dump


def test_closed_event_loop_stragglers_are_dropped():
    """tensorstore callbacks that outlive a failed read report the closed loop as unraisable."""
    seen = []
    hook = runtime.quiet_closed_loop(seen.append)
    straggler = types.SimpleNamespace(exc_value=RuntimeError("Event loop is closed"))
    other = types.SimpleNamespace(exc_value=RuntimeError("something else"))
    hook(straggler)
    hook(other)
    assert seen == [other]


# runs a command with writes past N bytes per file failing (EFBIG), without forking this threaded process
LIMITED = (
    "import os, resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), "
    "resource.RLIM_INFINITY)); os.execv(sys.executable, [sys.executable, *sys.argv[2:]])"
)


def on_a_small_disk(args: list[str], mnt: Path):
    """The command with `mnt` a 120 KiB tmpfs (in a user namespace), or where that is not allowed,
    with writes past 64 KiB per file failing (RLIMIT_FSIZE): either way no checkpoint fits."""
    ns = ["unshare", "--user", "--map-root-user", "--mount"]
    probe = shutil.which("unshare") and subprocess.run([*ns, "true"], capture_output=True).returncode == 0
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), JAX_NUM_CPU_DEVICES="2")
    env["XLA_FLAGS"] = xla_flags(2)
    if probe:
        script = f'mount -t tmpfs -o size=120k tmpfs "{mnt}" && exec "$@"'
        cmd = [*ns, "sh", "-c", script, "sh", sys.executable, *args]
    else:
        cmd = [sys.executable, "-c", LIMITED, str(64 * 1024), *args]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    return r, bool(probe)


def test_full_disk_while_training_is_the_last_line(tmp_path):
    (tmp_path / "t.txt").write_text("".join(f"{i % 9} ducks crossed the road.\n" for i in range(300)))
    prepare.main(
        ["--dataset", "text", "--tokenizer", "char", "--input", str(tmp_path / "t.txt")]
        + ["--out_dir", str(tmp_path / "data")]
    )
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    tiny = "n_layer=1 n_head=2 n_embd=32 block_size=16".split()
    run = "batch_size=4 max_iters=4 eval_interval=4 eval_iters=1 log_interval=2 ckpt_interval=2 plot=False"
    args = [str(ROOT / "train.py"), f"--config={ROOT}/configs/shakespeare_char_cpu.py"]
    args += [f"--config.data.dir={tmp_path / 'data'}", f"--config.out_dir={mnt / 'out'}"]
    args += [f"--config.model.{a}" for a in tiny] + [f"--config.{a}" for a in run.split()]
    r, tmpfs = on_a_small_disk(args, mnt)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and lines, r.stderr[-3000:]
    assert lines[-1].startswith("error: saving"), r.stderr[-3000:]
    assert "run the same command to resume" in lines[-1]
    if tmpfs:
        assert "no space left on device; free disk space" in lines[-1]
    assert not any(n in r.stderr for n in NOISE), r.stderr[-3000:]
    assert not re.search(r"^[EW]\d{4} ", r.stderr, re.M), r.stderr[-3000:]  # orbax's thread logs


def test_hub_names_fail_at_once_offline(tmp_path, monkeypatch, capsys):
    pytest.importorskip("huggingface_hub")
    from huggingface_hub import constants

    from flaxgpt import hf_cli

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: refused at once
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # whatever another test in this process set
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    t0 = time.perf_counter()
    with pytest.raises(ConnectionError, match="127.0.0.1:9 cannot be reached"):
        hf_files.resolve("no-such-model-xyz", cache_dir=str(tmp_path))
    assert hf_cli.main(["info", "no-such-model-xyz"]) == 1
    assert time.perf_counter() - t0 < 10  # was 24 s of retries
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: 'no-such-model-xyz' is not a local directory")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConnectionError, match="HF_HUB_OFFLINE is set"):
        hf_files.resolve("no-such-model-xyz", cache_dir=str(tmp_path))
