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
# one on-disk compilation cache for the run, shared by both workers and every train.py / serve.py /
# sample.py process the tests start: those processes compile the same tiny programs again and again
# (a resumed run, a second CLI call), and reading them back took a fifth off the CLI tests' time.
# JAX keys each entry by the program, the compiler options and the flags, so a hit is the program.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"flaxgpt-tests-xla-{os.getuid()}")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(1 << 30))  # oldest entries go past 1 GiB

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
