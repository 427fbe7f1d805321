"""Multi-host training on one machine: 2 processes x 4 CPU devices, joined by jax.distributed
(gloo collectives), train exactly like one process with 8 devices; only process 0 writes files.

The test starts this file twice as a script (`python tests/test_multihost.py PROCESS PORT DATA OUT`),
each process a worker that calls `flaxgpt.train.trainer.train` with the config.distributed flags.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the configs/ package

TEXT = "".join(f"{i % 6} cats and {i % 11} mice met at noon.\n" for i in range(250))
PROCESSES, LOCAL_DEVICES, STEPS = 2, 4, 3


def config(data_dir, out_dir):
    from configs import default

    c = default.get_config()
    c.data.dir, c.out_dir, c.init_from = str(data_dir), str(out_dir), "scratch"
    c.model.n_layer, c.model.n_head, c.model.n_embd, c.model.block_size = 1, 2, 32, 16
    c.model.pad_vocab_multiple = 8
    c.mesh.data, c.mesh.fsdp = 2, 4  # data across the hosts, parameters split within each
    c.batch_size, c.max_iters, c.eval_interval, c.eval_iters, c.log_interval = 16, STEPS, 100, 1, 1
    c.optim.warmup_steps, c.optim.learning_rate = 1, 3e-3
    c.tensorboard = False
    return c


def worker(process_id: int, port: int, data_dir: str, out_dir: str) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU cross-process collectives
    from flaxgpt.train import trainer

    cfg = config(data_dir, out_dir)
    cfg.distributed.coordinator_address = f"localhost:{port}"
    cfg.distributed.num_processes, cfg.distributed.process_id = PROCESSES, process_id
    summary = trainer.train(cfg, print_fn=lambda *a: None)
    facts = dict(
        process=jax.process_index(),
        processes=jax.process_count(),
        devices=jax.device_count(),
        local_devices=jax.local_device_count(),
        loss=summary["loss"],
    )
    print("RESULT " + json.dumps(facts), flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def reference_losses(cfg) -> list[float]:
    """One process, 8 devices, fed the global batch the two processes assemble from their shares."""
    import jax
    import numpy as np

    from flaxgpt.data import batches as data_lib
    from flaxgpt.train import trainer

    t = trainer.Trainer(cfg, print_fn=lambda *a: None)
    state, losses = t.init_state(), []
    rows = cfg.batch_size // PROCESSES
    for step in range(STEPS):
        shares = [t.task.batch("train", step, rows, p) for p in range(PROCESSES)]  # process 0's rows first
        local = {k: np.concatenate([s[k] for s in shares]) for k in shares[0]}
        batch = data_lib.to_global(data_lib.split_micro(local, cfg.grad_accum), t.train_batch_sharding, 1)
        state, m = t.train_step(state, batch)
        losses.append(float(jax.device_get(m["loss"])))
    return losses


@pytest.mark.devices(8)  # the one-process reference
def test_two_processes_train_like_one(tmp_path):
    import numpy as np

    from flaxgpt.data import prepare

    data_dir, out_dir = tmp_path / "data", tmp_path / "run"
    prepare.prepare_text(TEXT, data_dir, "char", 0.1, "generated")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(
        JAX_PLATFORMS="cpu",
        JAX_NUM_CPU_DEVICES=str(LOCAL_DEVICES),
        XLA_FLAGS=f"--xla_force_host_platform_device_count={LOCAL_DEVICES}",
    )
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(i), str(port), str(data_dir), str(out_dir)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(PROCESSES)
    ]
    try:
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-3000:]}"
    facts = [
        json.loads(line[7:]) for out in outputs for line in out.splitlines() if line.startswith("RESULT ")
    ]
    assert [f["process"] for f in facts] == [0, 1]
    assert all(f["processes"] == 2 and f["devices"] == 8 and f["local_devices"] == 4 for f in facts)

    # only process 0 wrote: one metrics line per step, no duplicates from process 1
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert sorted(logged) == list(range(1, STEPS + 1)) and len(logged) == sum("loss" in r for r in rows)
    assert {"config.json", "meta.json", "metrics.jsonl"} <= {p.name for p in out_dir.iterdir()}

    want = reference_losses(config(data_dir, tmp_path / "unused"))
    np.testing.assert_allclose([logged[s] for s in range(1, STEPS + 1)], want, atol=1e-5, rtol=1e-5)
    assert facts[0]["loss"] == facts[1]["loss"]  # every process saw the same (global) loss
    assert abs(facts[0]["loss"] - logged[STEPS]) < 1e-6  # metrics.jsonl rounds to 6 decimals


def test_tpu_pod_detection(monkeypatch):
    """initialize() runs on TPU VMs of a multi-host slice: GKE's variable or the GCE metadata server."""
    import importlib.util
    import io
    import urllib.request

    from flaxgpt import sharding

    monkeypatch.delenv("TPU_WORKER_HOSTNAMES", raising=False)
    assert not sharding._on_tpu_pod()  # no libtpu on this machine
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "t1k-w-0,t1k-w-1,t1k-w-2,t1k-w-3")
    assert sharding._on_tpu_pod()
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "t1k-w-0")
    assert not sharding._on_tpu_pod()

    monkeypatch.delenv("TPU_WORKER_HOSTNAMES")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: object() if name == "libtpu" else find_spec(name)
    )
    asked = []

    def metadata(request, timeout):
        asked.append((request.full_url, request.get_header("Metadata-flavor")))
        return io.BytesIO(endpoints)

    monkeypatch.setattr(urllib.request, "urlopen", metadata)
    endpoints = b"10.130.0.2,10.130.0.3,10.130.0.4,10.130.0.5"
    assert sharding._on_tpu_pod()
    assert asked[0] == (sharding.TPU_WORKERS_URL, "Google")
    endpoints = b"10.130.0.2"  # a single-host TPU VM
    assert not sharding._on_tpu_pod()


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
