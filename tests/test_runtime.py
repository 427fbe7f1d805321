"""runtime.keep_cpu_step_memory: repeated steps stop page-faulting their temporaries in again.

Each case runs in a fresh process (the setting must come before JAX starts its backends) and counts
the minor page faults of three LoRA train steps, after two uncounted ones, on a tiny Llama-style GPT
whose temporaries (the activations kept for the backward, over glibc's 32 MB mmap ceiling) XLA
allocates at every call.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.procs import xla_flags

PROBE = textwrap.dedent(
    """
    import json, resource, sys
    import jax, optax
    from flaxgpt import runtime
    took = runtime.keep_cpu_step_memory() if sys.argv[1] == "keep" else False
    from flaxgpt.models import gpt, lora
    from flaxgpt.train.losses import cross_entropy

    config = gpt.GPTConfig(vocab_size=256, block_size=256, n_layer=2, n_head=2, n_embd=128, glu=True,
                           norm="rmsnorm", pos_embedding="rope", bias=False, mlp_hidden=256)
    base = gpt.init_params(config, jax.random.key(0))
    spec = lora.LoraSpec.make(config, 8, 16.0)
    tokens_BT = jax.random.randint(jax.random.key(2), (16, 257), 0, 256)
    tx = optax.adamw(1e-3)

    def step(adapters, opt):
        def loss_fn(a):
            logits = lora.apply(config, spec, base, a, tokens_BT[:, :-1])
            loss_sum, n = cross_entropy(logits, tokens_BT[:, 1:])
            return loss_sum / n
        loss, grads = jax.value_and_grad(loss_fn)(adapters)
        updates, opt = tx.update(grads, opt, adapters)
        return optax.apply_updates(adapters, updates), opt, loss

    step = jax.jit(step, donate_argnums=(0, 1))
    adapters = lora.init_adapters(config, spec, jax.random.key(1))
    state = (adapters, tx.init(adapters))
    temp = step.lower(*state).compile().memory_analysis().temp_size_in_bytes
    # two steps before counting: the first finds the heap as compiling left it (a fresh CI machine's
    # compile once filled the hole the first step's block left, so the next step grew the heap anew)
    for _ in range(2):
        state = step(*state[:2])
    jax.block_until_ready(state)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        state = step(*state[:2])
    jax.block_until_ready(state)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(json.dumps({"took": took, "faults": faults, "temp": temp, "devices": jax.device_count(),
                      "async": jax.config.read("jax_cpu_enable_async_dispatch")}))
    """
)


def probe(mode: str, devices: int) -> dict:
    # not conftest's 8 devices (XLA_FLAGS' device count): this process sets its own
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices),
           "XLA_FLAGS": xla_flags()}  # fmt: skip
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
    assert kept["temp"] > 64 * 2**20  # the step's temporaries: over glibc's 32 MB mmap ceiling
    # each step maps them afresh (a fault per 4 KB page touched) unless they are kept
    assert plain["faults"] > 3 * kept["temp"] / 4096 / 2, plain
    assert kept["faults"] < plain["faults"] / 10, (kept, plain)


def test_left_alone_on_a_cpu_split_into_devices():
    split = probe("keep", devices=2)
    assert not split["took"] and split["async"] and split["devices"] == 2


PATIENCE = textwrap.dedent(
    """
    import os, sys
    from flaxgpt import sharding
    n = sharding.configure_cpu_devices(int(sys.argv[1]), 4)
    import jax
    print(n, len(jax.devices()), os.environ.get("XLA_FLAGS", ""))
    """
)


@pytest.mark.parametrize(
    "requested, env, devices, flags",
    [
        (2, {}, 2, "--xla_cpu_collective_call_terminate_timeout_seconds=600"),  # split: patient
        (1, {}, 1, ""),  # one device: no collectives, flags untouched
        (0, {"JAX_NUM_CPU_DEVICES": "4"}, 4, "--xla_cpu_collective_call_terminate_timeout_seconds=600"),
        # the user's own timeout stays as written
        (2, {"XLA_FLAGS": "--xla_cpu_collective_call_terminate_timeout_seconds=5"}, 2,
         "--xla_cpu_collective_call_terminate_timeout_seconds=5"),
    ],
)  # fmt: skip
def test_simulated_devices_wait_for_stragglers(requested, env, devices, flags):
    """sharding.configure_cpu_devices: several simulated CPU devices get XLA:CPU's collective timeout
    raised to 10 minutes (a loaded machine's straggling device thread ended the CPU recipe's process
    at the default 40 s), before the backend reads its flags; one device, or a timeout the user set,
    is left alone."""
    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    p = subprocess.run(
        [sys.executable, "-c", PATIENCE, str(requested)], env={**base, "JAX_PLATFORMS": "cpu", **env},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-1500:]
    n, count, got = (p.stdout.strip().split(" ", 2) + [""])[:3]
    assert int(count) == devices and got == flags


def test_a_cpu_device_count_the_environment_overrides_is_said():
    """mesh.cpu_devices=4 under JAX_NUM_CPU_DEVICES=2: the environment's count wins, now with a warning
    (the config's count was dropped without a word)."""
    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env = {**base, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2"}
    p = subprocess.run(
        [sys.executable, "-c", PATIENCE, "4"], env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0 and p.stdout.split()[:2] == ["0", "2"], p.stderr[-1500:]
    assert "mesh.cpu_devices=4 gives way to JAX_NUM_CPU_DEVICES=2" in p.stderr
