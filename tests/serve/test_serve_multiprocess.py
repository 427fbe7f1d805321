"""serve.py under a multi-process launcher: one line saying to start one server per host (each with
--mesh over its own devices, behind a load balancer), before any weight is read; a single-process
job of the same engine (srun -N1 -n1 on each node) serves."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flaxgpt.serve import launch
from tests.test_cluster import OMPI, SKYPILOT, SLURM
from tests.train.test_multihost import engine_env

ROOT = Path(__file__).resolve().parents[2]


def test_each_engine_s_multi_process_job_is_refused_in_one_line():
    launch.check_one_process({})  # no launcher
    launch.check_one_process({**SLURM, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"})  # srun -N1 -n1
    for env, where in ((SLURM, "slurm started it as process 5 of 8"), (OMPI, "ompi"), (SKYPILOT, "skypilot")):
        with pytest.raises(ValueError, match="one server per host") as e:
            launch.check_one_process(env)
        assert where in str(e.value) and "--mesh" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow  # a python process that imports the server
def test_serve_py_under_srun_n2_says_so_before_loading():
    """serve.py started by srun -n 2 (task 1's variables): exit 1, one line, the model never read."""
    pytest.importorskip("starlette")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "SKYPILOT_"))}
    env.update(engine_env("slurm", 1, 12345))
    cmd = [sys.executable, "serve.py", "--out_dir", str(ROOT / "no-such-run")]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1, p.stderr
    assert lines[0].startswith(
        "error: serve.py serves from one process, and slurm started it as process 1 of 2"
    )
