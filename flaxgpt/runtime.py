"""Process-wide settings an entry point applies once, before it does anything else:

    from flaxgpt import runtime
    runtime.setup()            # train.py, sample.py, serve.py and the flaxgpt command call this

Importing a flaxgpt module changes nothing global; `setup()` is where the quieting lives: orbax's log
lines that carry nothing for the user, tensorstore's unraisable "Event loop is closed" stragglers,
absl's verbosity (orbax logs every save and load at INFO through absl) and libtpu's warnings on a
machine without a TPU (`skip_absent_tpu`). `keep_cpu_step_memory()` is
the trainer's: how XLA:CPU's per-step buffers are allocated.

May import: flaxgpt.sharding.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import sys


class QuietOrbax(logging.Filter):
    """orbax's log lines that carry nothing for the user: a warning on each save without metrics
    (steps without an eval are normal), "read only" notes on every load for inference, and the
    tracebacks its background threads (and asyncio, for its tasks) log when a save fails: the
    failure reaches the caller as one CheckpointError."""

    def filter(self, record):
        msg = record.getMessage()
        if "did not provide metrics" in msg or "read only" in msg or "read_only=True" in msg:
            return False
        return not (record.levelno >= logging.ERROR and "/orbax/" in record.pathname + msg)


class OneLinePluginError(logging.Filter):
    """jax logs a PJRT plugin that cannot start (the CUDA plugin on a machine without a usable GPU)
    as an error with its whole traceback, then runs on the CPU: keep it to one line naming the cause."""

    def filter(self, record):
        if "plugin configuration error" in record.getMessage() and record.exc_info:
            e = record.exc_info[1]
            cause = (str(e).strip().splitlines() or [""])[0][:160]
            record.msg, record.args = f"{record.getMessage()}: {type(e).__name__}: {cause}", ()
            record.exc_info = record.exc_text = None
        return True


def quiet_closed_loop(hook):
    """tensorstore's callbacks that finish after a failed read or save closed orbax's event loop
    report `RuntimeError: Event loop is closed` as unraisable: drop those, pass on the rest to `hook`."""

    def unraisable(args):
        e = args.exc_value
        if not (isinstance(e, RuntimeError) and str(e) == "Event loop is closed"):
            hook(args)

    unraisable.flaxgpt_quiet = True
    return unraisable


def skip_absent_tpu() -> bool:
    """Lets jax's TPU backend fail at once, without starting libtpu, when no TPU chip is on this
    machine; returns whether it did. Call it before JAX starts its backends.

    Why: with JAX_PLATFORMS unset jax starts every platform it has a plugin for and keeps those that
    work. With libtpu installed (the tpu-aot extra) on a machine without a TPU, libtpu starts anyway
    and writes five lines to stderr (its accelerator type and worker hostnames cannot be found)
    before jax falls back to the CPU, on every train.py / sample.py run. jax already skips CUDA when
    no NVIDIA device is visible; this is the same test for the TPU, with jax's own PCI check
    (hardware_utils, as jax's cloud_tpu_init uses). Nothing is skipped when JAX_PLATFORMS names the
    platforms (asking for the TPU still fails loudly), under JAX_FORCE_TPU_INIT, once a backend has
    started, or when a TPU chip is present: libtpu's messages are then about a real TPU. Compiling
    for a TPU (flaxgpt aot) loads libtpu through its topology, not the backend, so still works.
    Where libtpu is installed this imports jax, which a command that never uses it (`flaxgpt prepare`)
    then pays for (~2 s on the 2-core AVX2 machine); elsewhere it returns before importing anything.
    """
    import importlib.util
    import os

    if importlib.util.find_spec("libtpu") is None:  # nothing would start: jax not even imported
        return False
    import jax
    from jax._src import hardware_utils, xla_bridge

    if jax.config.jax_platforms or "JAX_FORCE_TPU_INIT" in os.environ:
        return False
    factories = getattr(xla_bridge, "_backend_factories", None)  # private: another jax, no change
    if not isinstance(factories, dict) or "tpu" not in factories or xla_bridge.backends_are_initialized():
        return False
    if hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0:
        return False
    factories["tpu"] = dataclasses.replace(factories["tpu"], factory=_no_tpu)  # still a known platform
    return True


def _no_tpu():
    # raised where libtpu would have started: jax notes it (at INFO) and goes on with the other platforms
    raise RuntimeError("no TPU chip on this machine (flaxgpt.runtime.skip_absent_tpu)")


def setup(verbosity: str | None = "warning") -> None:
    """Installs the filters above (once per process), skips an absent TPU (`skip_absent_tpu`) and
    sets absl's verbosity (None: leave it)."""
    skip_absent_tpu()
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, QuietOrbax) for f in logger.filters):
            logger.addFilter(QuietOrbax())
    if not getattr(sys.unraisablehook, "flaxgpt_quiet", False):
        sys.unraisablehook = quiet_closed_loop(sys.unraisablehook)
    if verbosity is not None:  # not verbose: a plugin that cannot start is one line, not a traceback
        bridge = logging.getLogger("jax._src.xla_bridge")
        if not any(isinstance(f, OneLinePluginError) for f in bridge.filters):
            bridge.addFilter(OneLinePluginError())
        from absl import logging as absl_logging

        absl_logging.set_verbosity(verbosity)


# glibc mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4


def keep_cpu_step_memory() -> bool:
    """On the CPU backend run as one device, lets each training step reuse the previous step's
    pages. Call it before JAX starts its backends and after the CPU device count is set (as `train`
    does); returns whether it took effect.

    Why: XLA:CPU allocates a step's temporaries (the activations kept for the backward pass: 124 MB
    in benchmarks/lora_train.py's step) as one block at every call and frees it after. glibc serves a
    block over 32 MB with a fresh mmap and unmaps it on free, so every step page-faults its whole
    working set in again (32,000 faults a step there, a third of its time). Running the program on
    the calling thread (no async dispatch: the block comes from the main heap, not from a worker
    thread's arena, which would mmap it anyway) and keeping freed memory in that heap (no mmap for
    large blocks, no trimming of its top) makes the next step find the block where the last one left
    it: 97 -> 65 ms a step there (docs/fine_tuning.md). Left alone on GPU and TPU (their buffers are
    device memory; the host heap shrinks as usual), on a CPU split into several devices (their
    programs run on worker threads), and where glibc is not the allocator.
    """
    import jax
    from jax._src import xla_bridge

    from flaxgpt.sharding import xla_flags_set_cpu_devices

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to change
        return False
    one_device = jax.config.jax_num_cpu_devices in (-1, 1) and not xla_flags_set_cpu_devices()
    if one_device and not xla_bridge.backends_are_initialized():
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    if jax.config.read("jax_cpu_enable_async_dispatch") or jax.default_backend() != "cpu":
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
