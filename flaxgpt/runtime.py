"""Process-wide settings an entry point applies once, before it does anything else:

    from flaxgpt import runtime
    runtime.setup()            # train.py, sample.py, serve.py and the flaxgpt command call this

Importing a flaxgpt module changes nothing global; `setup()` is where the quieting lives: orbax's log
lines that carry nothing for the user, tensorstore's unraisable "Event loop is closed" stragglers, and
absl's verbosity (orbax logs every save and load at INFO through absl).
"""

from __future__ import annotations

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


def quiet_closed_loop(hook):
    """tensorstore's callbacks that finish after a failed read or save closed orbax's event loop
    report `RuntimeError: Event loop is closed` as unraisable: drop those, pass on the rest to `hook`."""

    def unraisable(args):
        e = args.exc_value
        if not (isinstance(e, RuntimeError) and str(e) == "Event loop is closed"):
            hook(args)

    unraisable.flaxgpt_quiet = True
    return unraisable


def setup(verbosity: str | None = "warning") -> None:
    """Installs the filters above (once per process) and sets absl's verbosity (None: leave it)."""
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, QuietOrbax) for f in logger.filters):
            logger.addFilter(QuietOrbax())
    if not getattr(sys.unraisablehook, "flaxgpt_quiet", False):
        sys.unraisablehook = quiet_closed_loop(sys.unraisablehook)
    if verbosity is not None:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(verbosity)
