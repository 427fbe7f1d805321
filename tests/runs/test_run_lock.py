"""flaxgpt.runs.run_lock: one training run per out_dir; the holder is named, stale locks are taken over."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import jax
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flaxgpt.runs import run_lock  # noqa: E402
from flaxgpt.runs.run_lock import LOCK_FILE, RunLocked  # noqa: E402
from flaxgpt.train import trainer  # noqa: E402
from tests.procs import xla_flags  # noqa: E402
from tests.train.test_trainer import data_dir, tiny_config  # noqa: E402,F401

ROOT = Path(__file__).resolve().parents[2]
# the holder loads run_lock.py alone (no jax): it holds the lock within a fraction of a second
HOLDER = f"""
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("run_lock", {str(ROOT / "flaxgpt" / "runs" / "run_lock.py")!r})
run_lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_lock)
lock = run_lock.acquire(sys.argv[1])
print("held", flush=True)
time.sleep(120)
"""


def holder(out_dir) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(out_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_second_run_refuses_and_a_killed_holders_lock_is_taken_over(data_dir, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    proc = holder(out)
    try:
        who = rf"in use by another training run \(pid {proc.pid} on host {socket.gethostname()}, since "
        with pytest.raises(RunLocked, match=who):
            run_lock.acquire(out)
        cfg = tiny_config(data_dir, out_dir=str(out))
        with pytest.raises(RunLocked, match=who):  # before the Trainer: nothing deleted or written
            trainer.train(cfg, devices=jax.devices()[:1], print_fn=lambda *a: None)
        assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]
        # train.py: one line, exit code 1
        args = [sys.executable, "train.py", "--config", "configs/default.py", f"--config.out_dir={out}"]
        args += [f"--config.data.dir={data_dir}"]
        env = {**os.environ, "XLA_FLAGS": xla_flags(), "JAX_NUM_CPU_DEVICES": "1"}
        r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1, r.stderr[-2000:]
        assert lines[0].startswith(f"error: {out} is in use by another training run (pid {proc.pid} on host")
    finally:
        proc.send_signal(signal.SIGKILL)  # kill -9: no chance to clean up
        proc.wait()
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == proc.pid  # left behind, stale
    lock = run_lock.acquire(out)  # the kernel dropped the dead holder's flock: taken over
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
    with pytest.raises(RunLocked, match=f"pid {os.getpid()}"):  # held: even this process is refused
        run_lock.acquire(out)
    lock.release()
    assert not (out / LOCK_FILE).exists()


def test_lock_files_of_dead_processes_and_other_hosts(tmp_path):
    path = tmp_path / LOCK_FILE
    for stale in (
        {"host": socket.gethostname(), "pid": dead_pid()},  # no flock (e.g. a file system without it)
        {"host": socket.gethostname(), "pid": os.getppid(), "start": "0"},  # a reused pid
        "not json",
    ):
        path.write_text(json.dumps(stale) if isinstance(stale, dict) else stale)
        run_lock.acquire(tmp_path).release()
        assert not path.exists()
    path.write_text(json.dumps({"host": "node-7", "pid": 4242, "since": "2026-01-01T00:00:00"}))
    with pytest.raises(RunLocked) as e:  # another host's pid cannot be checked: never taken over
        run_lock.acquire(tmp_path)
    assert str(e.value) == (
        f"{tmp_path} is in use by another training run (pid 4242 on host node-7, since "
        f"2026-01-01T00:00:00); if that run is gone, delete {path}"
    )
    fresh = tmp_path / "new" / "run"
    run_lock.acquire(fresh).release()  # a run refused before writing anything leaves no empty out_dir
    assert not fresh.exists()
    (tmp_path / "afile").write_text("notes")  # out_dir a file: the fix named, the file untouched
    with pytest.raises(ValueError, match="afile is a file; point out_dir at a directory"):
        run_lock.acquire(tmp_path / "afile")
    assert (tmp_path / "afile").read_text() == "notes"


def test_released_when_training_fails_or_finishes(data_dir, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    bad = tiny_config(data_dir, out_dir=str(out), model__vocab_size=3)  # refused inside the Trainer
    with pytest.raises(ValueError, match="vocab_size"):
        trainer.train(bad, devices=jax.devices()[:1], print_fn=lambda *a: None)
    assert not out.exists()
    with run_lock.hold(out) as lock:
        assert lock.path == out / LOCK_FILE and lock.path.exists()
    assert not lock.path.exists()
