"""Preemption: a SIGTERM (or Ctrl-C) becomes a flag the training loop checks, so the run saves
before it stops. A second Ctrl-C interrupts at once (KeyboardInterrupt), as Python's default would.

stop = StopSignal(every=log_interval)
...  # after each step:
if stop.requested(step): save, then return
stop.close()                                   # the previous handlers are back
"""

from __future__ import annotations

import signal
import threading

import jax
import numpy as np


class StopSignal:
    """Remembers a SIGTERM (what TPU VMs and schedulers send before preempting) or a SIGINT (Ctrl-C)
    instead of dying.

    The loop checks `stop.requested(step)` after each step: finish the step, save, exit 0. With several
    processes they all agree (one small host all-gather every `every` steps), so all save the same step.
    """

    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT), every: int = 1):
        self.received: str | None = None
        self.every = max(1, every)
        self._previous = {}
        if threading.current_thread() is threading.main_thread():  # Python only allows it there
            self._previous = {s: signal.signal(s, self._handler) for s in signals}

    def _handler(self, signum, frame):
        if signum == signal.SIGINT and self.received == "SIGINT":  # pressed twice: stop now
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def requested(self, step: int) -> bool:
        if jax.process_count() == 1:
            return self.received is not None
        if step % self.every:
            return False
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(self.received is not None))
        return bool(np.any(flags))

    def close(self):
        """Puts the previous handlers back."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def __enter__(self):  # `with StopSignal() as stop:` handles the signals for the block
        return self

    def __exit__(self, *exc):
        self.close()
