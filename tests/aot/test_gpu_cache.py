"""`flaxgpt aot` for a GPU target beside a persistent compilation cache (JAX_COMPILATION_CACHE_DIR): the
programs, compiled for devices this machine lacks, are not written there, so the next run does not warn
a program that it cannot read them back ("PjRtCompiler must be constructed with a Client")."""

import os
import subprocess
import sys

import pytest

from tests.procs import xla_flags


def test_a_gpu_targets_programs_stay_out_of_the_persistent_cache(tmp_path):
    pytest.importorskip("jax_cuda12_plugin", reason="the GPU targets need the CUDA plugin (not in CI)")
    cache = tmp_path / "jax-cache"
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags())
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # every program would be written
    cmd = [sys.executable, "-m", "flaxgpt.aot.compile", "--config", "configs/shakespeare_char_cpu.py"]
    cmd += ["--config.model.n_layer=1", "--target", "h100-1", "--programs", "eval"]
    for _ in range(2):
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        assert "compiled eval in" in p.stdout and "PjRtCompiler" not in p.stderr, p.stderr[-2000:]
    assert not cache.exists() or not any(cache.iterdir())
