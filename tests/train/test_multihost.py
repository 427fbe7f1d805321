"""Multi-host training on one machine: 2 processes x 4 CPU devices, joined by jax.distributed
(gloo collectives), train exactly like one process with 8 devices; only process 0 writes files.

Each process is started as the engine starts it: with the engine's own environment variables
(Slurm's srun, Open MPI's mpirun, SkyPilot) or the explicit --config.distributed settings, and found
by flaxgpt.cluster. The test starts this file twice as a script
(`python tests/train/test_multihost.py ENGINE PROCESS PORT DATA OUT [MAX_ITERS PACE]`), each process
a worker that calls `flaxgpt.train.trainer.train`. A SIGTERM to both (a Slurm preemption, a GKE node
drain, SkyPilot's spot recovery) saves one step on both, and the next start resumes it exactly.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the configs/ package

TEXT = "".join(f"{i % 6} cats and {i % 11} mice met at noon.\n" for i in range(250))
PROCESSES, LOCAL_DEVICES, STEPS = 2, 4, 3


def engine_env(engine: str, process_id: int, port: int) -> dict:
    """The variables `engine` gives process `process_id` of a 2-process job on this one machine
    (JAX_COORDINATOR_PORT, jax's own variable, puts the coordinator on a free port)."""
    port_env = {"JAX_COORDINATOR_PORT": str(port)}
    if engine == "slurm":  # srun -N1 -n2: what every task of the step sees
        return {
            "SLURM_JOB_ID": "4242",
            "SLURM_NTASKS": "2",
            "SLURM_PROCID": str(process_id),
            "SLURM_LOCALID": str(process_id),
            "SLURM_STEP_NODELIST": "localhost",
            "SLURM_JOB_NODELIST": "localhost",
            "SLURM_STEP_NUM_NODES": "1",
            **port_env,
        }
    if engine == "ompi":  # Open MPI 4's mpirun -np 2
        return {
            "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_RANK": str(process_id),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(process_id),
            "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://127.0.0.1:34911",
            **port_env,
        }
    if engine == "skypilot":  # num_nodes: 2
        return {
            "SKYPILOT_NUM_NODES": "2",
            "SKYPILOT_NODE_RANK": str(process_id),
            "SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.1",
            **port_env,
        }
    assert engine == "settings", engine
    return {}


def config(data_dir, out_dir, local_devices=LOCAL_DEVICES):
    from configs import default

    c = default.get_config()
    c.data.dir, c.out_dir, c.init_from = str(data_dir), str(out_dir), "scratch"
    c.model.n_layer, c.model.n_head, c.model.n_embd, c.model.block_size = 1, 2, 32, 16
    c.model.pad_vocab_multiple = 8
    c.mesh.data, c.mesh.fsdp = 2, local_devices  # data across the hosts, parameters split within each
    c.batch_size, c.max_iters, c.eval_interval, c.eval_iters, c.log_interval = 16, STEPS, 100, 1, 1
    c.optim.warmup_steps, c.optim.learning_rate = 1, 3e-3
    c.tensorboard = False
    return c


def worker(engine, process_id: int, port: int, data_dir, out_dir, max_iters, pace, local_devices) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU cross-process collectives
    from flaxgpt.train import trainer

    cfg = config(data_dir, out_dir, local_devices)
    cfg.max_iters, cfg.init_from = max_iters, "auto"  # a run started again resumes
    if engine == "settings":
        cfg.distributed.coordinator_address = f"localhost:{port}"
        cfg.distributed.num_processes, cfg.distributed.process_id = PROCESSES, process_id

    class Paced(trainer.Trainer):  # a step every `pace` seconds: a signal lands a few steps in
        def after_step(self, step, state):
            time.sleep(pace)

    trainer.Trainer = Paced  # train() builds this one
    wrote = watch_writes(out_dir)
    summary = trainer.train(cfg, print_fn=lambda *a: print(*a, flush=True))
    facts = dict(
        process=jax.process_index(),
        processes=jax.process_count(),
        devices=jax.device_count(),
        local_devices=jax.local_device_count(),
        loss=summary["loss"],
        joined=cluster_engine(),
        wrote=sorted(set(wrote)),
    )
    print("RESULT " + json.dumps(facts), flush=True)


def watch_writes(under) -> list[str]:
    """The files under `under` this process opens for writing from Python (metrics, run files, the
    lock, orbax's Python-side files), relative paths, as it goes."""
    import builtins
    import io

    wrote, real_open, real_os_open = [], io.open, os.open

    def seen(file, writing):
        if writing and isinstance(file, (str, os.PathLike)) and str(file).startswith(str(under)):
            wrote.append(os.path.relpath(file, under))

    def watched_open(file, mode="r", *args, **kwargs):
        seen(file, any(c in mode for c in "wax+"))
        return real_open(file, mode, *args, **kwargs)

    def watched_os_open(path, flags, *args, **kwargs):
        seen(path, flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        return real_os_open(path, flags, *args, **kwargs)

    builtins.open = io.open = watched_open
    os.open = watched_os_open
    return wrote


def cluster_engine() -> str | None:
    """The engine flaxgpt.cluster found in this process's environment and settings."""
    from flaxgpt import cluster

    cfg = config("", "")
    how = cluster.detect(cfg.distributed, os.environ)
    return "settings" if how is None else how.engine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def reference_losses(cfg, steps=STEPS) -> list[float]:
    """One process, 8 devices, fed its own whole batch: the two processes' shares are its halves (the
    data is the same whatever the number of processes: batches.window_starts)."""
    import jax

    from flaxgpt.data import batches as data_lib
    from flaxgpt.train import trainer

    devices = jax.devices()[: PROCESSES * cfg.mesh.fsdp]  # as many as the two processes had
    t = trainer.Trainer(cfg, devices=devices, print_fn=lambda *a: None)
    state, losses = t.init_state(), []
    for step in range(steps):
        whole = t.task.batch("train", step, cfg.batch_size, 0)
        batch = data_lib.to_global(data_lib.split_micro(whole, cfg.grad_accum), t.train_batch_sharding, 1)
        state, m = t.train_step(state, batch)
        losses.append(float(jax.device_get(m["loss"])))
    return losses


def start(engine, data_dir, out_dir, max_iters=STEPS, pace=0.0, local_devices=LOCAL_DEVICES):
    """Both processes of a training job (this file as the worker script)."""
    return launch(
        lambda port: [__file__, engine, "{i}", str(port), str(data_dir), str(out_dir), str(max_iters),
                      str(pace), str(local_devices)],
        engine, local_devices,
    )  # fmt: skip


def launch(args, engine: str, local_devices: int = 1):
    """The PROCESSES processes of a job (Popen, output piped): `python ARGS` each, with `engine`'s
    variables (none left from this process) and `local_devices` CPU devices. args(port) -> the
    arguments, where "{i}" becomes the process's index (the settings' process_id)."""
    from tests.procs import xla_flags  # here: the workers run this file as a script

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env = {k: v for k, v in env.items() if not re.match(r"(SLURM|OMPI|SKYPILOT|JOBSET)_|JAX_COORD", k)}
    env.update(
        JAX_PLATFORMS="cpu",
        JAX_NUM_CPU_DEVICES=str(local_devices),
        XLA_FLAGS=xla_flags(local_devices),
        PYTHONUNBUFFERED="1",
    )
    port = free_port()
    return [
        subprocess.Popen(
            [sys.executable, *(a.replace("{i}", str(i)) for a in args(port))],
            cwd=ROOT,
            env={**env, **engine_env(engine, i, port)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(PROCESSES)
    ]


def finish(procs, before: str = "") -> list[str]:
    """Each process's output, after checking that it exited 0."""
    try:
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    outputs[0] = before + outputs[0]
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-3000:]}"
    return outputs


def metrics_losses(out_dir) -> dict:
    """step -> loss from metrics.jsonl, checking that no step was written twice (process 1 writes none)."""
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert len(logged) == sum("loss" in r for r in rows), "a step logged twice: process 1 wrote"
    return logged


def prepared(tmp_path):
    from flaxgpt.data import prepare

    data_dir = tmp_path / "data"
    prepare.prepare_text(TEXT, data_dir, "char", 0.1, "generated")
    return data_dir


@pytest.mark.slow  # two jax processes a run; Slurm's run is test_sigterm_to_both_saves_and_resumes_exactly's
@pytest.mark.devices(8)  # the one-process reference
@pytest.mark.parametrize("engine, local", [("settings", LOCAL_DEVICES), ("skypilot", 1)])
def test_two_processes_train_like_one(engine, local, tmp_path):
    """The explicit settings with parameters split over each process's 4 devices (FSDP); SkyPilot's
    variables with one device a process (a quicker compile: the join is what is tested)."""
    import numpy as np

    data_dir, out_dir = prepared(tmp_path), tmp_path / "run"
    outputs = finish(start(engine, data_dir, out_dir, local_devices=local))
    facts = [
        json.loads(line[7:]) for out in outputs for line in out.splitlines() if line.startswith("RESULT ")
    ]
    assert [f["process"] for f in facts] == [0, 1]
    assert all(f["processes"] == 2 and f["local_devices"] == local for f in facts)
    assert all(f["devices"] == 2 * local for f in facts)
    assert facts[0]["joined"] == facts[1]["joined"] == engine

    # only process 0 wrote the run files, the metrics and the lock, and it alone printed; process 1
    # wrote (from Python) only its own files of the checkpoint: its write probe, orbax's process_1
    assert {"metrics.jsonl", ".config.json.tmp", ".meta.json.tmp", "train.lock"} <= set(facts[0]["wrote"])
    assert facts[1]["wrote"] and all(
        re.fullmatch(r"checkpoints/.*[._]1", path) for path in facts[1]["wrote"]
    ), facts[1]["wrote"]
    logged = metrics_losses(out_dir)
    assert sorted(logged) == list(range(1, STEPS + 1))
    assert {"config.json", "meta.json", "metrics.jsonl", "checkpoints"} <= {p.name for p in out_dir.iterdir()}
    assert "compiled the train step" in outputs[0] and "compiled the train step" not in outputs[1]

    want = reference_losses(config(data_dir, tmp_path / "unused", local))
    np.testing.assert_allclose([logged[s] for s in range(1, STEPS + 1)], want, atol=1e-5, rtol=1e-5)
    assert facts[0]["loss"] == facts[1]["loss"]  # every process saw the same (global) loss
    assert abs(facts[0]["loss"] - logged[STEPS]) < 1e-6  # metrics.jsonl rounds to 6 decimals


@pytest.mark.slow
@pytest.mark.devices(8)  # the one-process reference
def test_sigterm_to_both_saves_and_resumes_exactly(tmp_path):
    """Slurm's preemption (as a GKE drain and SkyPilot's spot recovery) sends SIGTERM to every
    process: both finish the same step, save it, exit 0; the same command resumes, and the losses of
    the cut-and-resumed run are the uninterrupted run's."""
    import numpy as np

    from flaxgpt.runs.checkpoint import Checkpointer

    data_dir, out_dir, steps = prepared(tmp_path), tmp_path / "run", 12
    procs = start("slurm", data_dir, out_dir, max_iters=steps, pace=0.2, local_devices=1)
    seen = []
    for line in procs[0].stdout:  # process 0 prints the step lines
        seen.append(line)
        m = re.match(r"step\s+(\d+)(?:/\d+)? \|", line)
        if m and int(m.group(1)) >= 3:
            for p in procs:
                p.send_signal(signal.SIGTERM)
            break
    out = finish(procs, "".join(seen))[0]
    saved = Checkpointer(out_dir).latest_step()
    assert 3 <= saved < steps and f"SIGTERM: saved step {saved} to {out_dir}/checkpoints;" in out
    assert sorted(metrics_losses(out_dir)) == list(range(1, saved + 1))

    out = finish(start("slurm", data_dir, out_dir, max_iters=steps, local_devices=1))[0]
    assert f"resumed from {out_dir}/checkpoints/{saved}" in out
    logged = metrics_losses(out_dir)
    assert sorted(logged) == list(range(1, steps + 1))
    reference = config(data_dir, tmp_path / "unused", 1)
    reference.max_iters = steps  # the schedule's length
    want = reference_losses(reference, steps)
    np.testing.assert_allclose([logged[s] for s in range(1, steps + 1)], want, atol=1e-5, rtol=1e-5)


if __name__ == "__main__":
    engine, process, port, data, out, max_iters, pace, local_devices = sys.argv[1:]
    worker(engine, int(process), int(port), data, out, int(max_iters), float(pace), int(local_devices))
