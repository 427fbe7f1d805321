"""One-line errors on the command line: sample.py, train.py's run, `flaxgpt prepare`, `prepare-seq2seq`,
`eval`, `hf`, `peft` and `python -m flaxgpt.data.fineweb` run their main through `run_cli`, so bad input
reads

    error: data/x/meta.json cannot be read (FileNotFoundError); prepare the dataset first

on stderr with exit status 1, and never a traceback. The exceptions that mean bad input are the
command's `errors` (default ERRORS); anything else is a bug and keeps its traceback.

The one "did you mean" of every such error lives here too: `nearest` finds the option a mistyped name
most likely means (difflib's similarity ratio, at least `cutoff`), `suggest` words it, and
`did_you_mean` does both (a mistyped choice, config key, section field or model name).

May import: nothing of flaxgpt (every folder may import it).
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Iterable, Mapping

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


def nearest(value: str, options: Iterable[str] | Mapping[str, str], cutoff: float = 0.6) -> str | None:
    """The option most like `value` (difflib's ratio >= `cutoff`), or None.
    `options` may map each spelling to what to suggest for it (a field's name to its dotted key)."""
    close = difflib.get_close_matches(value, list(options), n=1, cutoff=cutoff)
    if not close:
        return None
    return options[close[0]] if isinstance(options, Mapping) else close[0]


def suggest(name: str) -> str:
    """The words of every suggestion: 'did you mean optim.learning_rate?'."""
    return f"did you mean {name}?"


def did_you_mean(value: str, options: Iterable[str] | Mapping[str, str], cutoff: float = 0.6) -> str:
    """'did you mean X?' for the option `nearest` finds, '' when none is close enough."""
    near = nearest(value, options, cutoff)
    return suggest(near) if near is not None else ""


def parser(**kwargs):
    """An argparse.ArgumentParser whose usage errors are one line with a did-you-mean for a mistyped
    choice (`error: --dataset 'shakespear' is not one of shakespeare_char, ...; did you mean
    shakespeare?`), exit status 2; --help still prints the whole usage."""
    import argparse
    import re

    class OneLine(argparse.ArgumentParser):
        def error(self, message):
            m = re.match(
                r"argument (\S+?)(?:/\S+)?: invalid choice: '([^']*)' \(choose from (.*)\)$", message
            )
            if m:
                flag, value, options = m.group(1), m.group(2), re.findall(r"'([^']*)'", m.group(3))
                hint = did_you_mean(value, options)
                message = f"{flag} {value!r} is not one of {', '.join(options)}" + (hint and f"; {hint}")
            self.exit(2, f"error: {message} (see {self.prog} --help)\n")

    return OneLine(**kwargs)
