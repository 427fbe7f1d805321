"""One-line errors on the command line: sample.py, train.py's run, `flaxgpt prepare`, `prepare-seq2seq`,
`eval`, `hf`, `peft` and `python -m flaxgpt.data.fineweb` run their main through `run_cli`, so bad input
reads

    error: data/x/meta.json cannot be read (FileNotFoundError); prepare the dataset first

on stderr with exit status 1, and never a traceback. The exceptions that mean bad input are the
command's `errors` (default ERRORS); anything else is a bug and keeps its traceback.

May import: nothing of flaxgpt (every folder may import it).
"""

from __future__ import annotations

import sys

ERRORS = (ValueError, OSError, ImportError)  # RunError, CheckpointError, ConfigError are ValueErrors


def run_cli(main, argv=None, errors=ERRORS, describe=str) -> int:
    """main(argv) with an exception of `errors` printed as "error: {describe(e)}" on stderr and exit
    status 1. main's result is the status when it is an int; any other result means 0."""
    try:
        status = main(argv)
    except errors as e:
        print(f"error: {describe(e)}", file=sys.stderr)
        return 1
    return status if isinstance(status, int) else 0
