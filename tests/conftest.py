"""8 simulated CPU devices for every test, set before JAX starts; compiled programs dropped after each
file; `@pytest.mark.devices(n)` for a test that needs n devices (always there on the CPU; on one GPU
such a test is skipped, saying why)."""

import os
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
if os.environ["JAX_PLATFORMS"].split(",")[0] in ("cpu", ""):
    # tiny models: compiling costs more than running, and LLVM's optimization passes were ~40% of a
    # training test's time; XLA's graph passes (fusion, memory planning) still run. Inherited by the
    # train.py / serve.py processes tests start.
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    # XLA's older LLVM emitters for the CPU's fusions compile a tiny model's train step ~1/3 faster than
    # the MLIR fusion emitters (4.97-6.23 s -> 3.25-4.28 s for four, the 2-core AVX2 machine) and run
    # it as fast: the test suite is mostly compiling. Inherited by the processes tests start.
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
    # the tiny models' programs recur across files (each file's are dropped, below) and in the train.py /
    # serve.py processes tests start: a compile cache on disk, shared by the workers and inherited by
    # those processes, serves them again (tests/serve/test_engine.py + tests/models/test_paged.py from an
    # empty cache: 181 s -> 143 s on the 2-core AVX2 machine). Entries are keyed by the program, jax's
    # version and the flags, so an old directory is never wrong, only fuller.
    os.environ.setdefault(
        "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"flaxgpt-tests-jax-{os.getuid()}")
    )
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    # imports jax: after every JAX_* setting above, which jax reads as it is imported
    from flaxgpt.sharding import patient_cpu_collectives

    patient_cpu_collectives()  # 8 device threads on a loaded 2-core machine: stragglers, not hangs

if os.environ["JAX_PLATFORMS"].split(",")[0] in ("cuda", "gpu"):
    # bit-identical resumes (tests/train/test_resume.py, test_muon.py) need the same sums in the same
    # order every run: on a GPU, scatter-adds and some reductions use atomics unless asked not to (the
    # 2026-11-27 GPU run's resumed parameters were 1e-6 off the straight run's without this)
    os.environ["XLA_FLAGS"] += " --xla_gpu_deterministic_ops=true"

if os.environ["JAX_PLATFORMS"].split(",")[0] not in ("cpu", ""):  # read, not asked: JAX stays unstarted
    import jax

    # the tests check float32 math against float64 references; GPUs (and TPUs) run float32 matmuls
    # at reduced precision by default (TF32 on an H100: ~3e-4 relative), which is a speed setting
    jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    """Every compiled CPU program keeps its machine code in its own memory mappings until JAX drops it:
    a worker running hundreds of test files reached Linux's limit (vm.max_map_count, 65,530) and
    segfaulted inside XLA. Programs are shared within a file, never across files."""
    yield
    import jax

    jax.clear_caches()


def pytest_configure(config):
    config.addinivalue_line("markers", "devices(n): needs n devices (the CPU simulates 8)")


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("devices")
    if marker is not None:
        import jax

        need, have = marker.args[0], jax.device_count()
        if have < need:
            pytest.skip(f"needs {need} devices; this {jax.default_backend()} backend has {have}")
