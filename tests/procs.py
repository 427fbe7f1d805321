"""XLA_FLAGS for the processes tests start (train.py, serve.py, several processes of a job).

A child sets its own CPU device count, but keeps the suite's compile flags (tests/conftest.py: XLA's
LLVM emitters for CPU fusions, ~1/3 less compile time for a tiny model's step; the patient collective
timeout): a child given XLA_FLAGS="" compiled every program the slow way, and most of a started
process's time is compiling.
"""

import os

DEVICES_FLAG = "--xla_force_host_platform_device_count"


def xla_flags(devices: int | None = None) -> str:
    """The suite's XLA flags without its 8 simulated devices, with `devices` of them when given."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICES_FLAG)]
    return " ".join(kept + ([f"{DEVICES_FLAG}={devices}"] if devices else []))
