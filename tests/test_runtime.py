"""runtime.keep_cpu_step_memory: repeated steps stop page-faulting their temporaries in again.

Each case runs in a fresh process (the setting must come before JAX starts its backends) and counts
the minor page faults of three calls of a jitted gradient whose temporaries (activations kept for
the backward, 64 MB: over glibc's 32 MB mmap ceiling) XLA allocates at every call.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent(
    """
    import json, resource, sys
    import jax, jax.numpy as jnp
    from flaxgpt import runtime
    took = runtime.keep_cpu_step_memory() if sys.argv[1] == "keep" else False

    def loss(w1, w2, x):
        h_BF = jnp.tanh(x @ w1)  # [16384, 1024] float32: 64 MB kept for the backward
        return ((h_BF @ w2) ** 2).mean()

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    x, w1, w2 = jnp.ones((16384, 32)), jnp.full((32, 1024), 0.01), jnp.full((1024, 8), 0.01)
    jax.block_until_ready(step(w1, w2, x))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        jax.block_until_ready(step(w1, w2, x))
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(json.dumps({"took": took, "faults": faults, "devices": jax.device_count(),
                      "async": jax.config.read("jax_cpu_enable_async_dispatch")}))
    """
)


def probe(mode: str, devices: int) -> dict:
    # not conftest's 8 devices (XLA_FLAGS' device count): this process sets its own
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices), "XLA_FLAGS": ""}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator is Linux's")
def test_steps_reuse_their_memory_on_one_cpu_device():
    kept = probe("keep", devices=1)
    plain = probe("plain", devices=1)
    assert kept["took"] and not kept["async"] and kept["devices"] == 1
    # each call maps its temporaries afresh (~33,000 faults a call here) unless they are kept
    assert plain["faults"] > 3 * 20_000, plain
    assert kept["faults"] < plain["faults"] / 2, (kept, plain)


def test_left_alone_on_a_cpu_split_into_devices():
    split = probe("keep", devices=2)
    assert not split["took"] and split["async"] and split["devices"] == 2
