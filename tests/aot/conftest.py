"""Programs compiled for other targets (TPU topologies, CUDA GPUs) stay out of the tests' compile cache
(tests/conftest.py): jax writes them, but reading one back needs that target's client, so each read was a
warning and a second compile."""

import pytest


@pytest.fixture(autouse=True)
def _no_cache_writes(monkeypatch):
    import jax

    before = jax.config.jax_persistent_cache_min_compile_time_secs
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1e9")  # flaxgpt aot's processes
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
    yield
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before)
