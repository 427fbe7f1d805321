"""A request being prefilled (its host side: prompt, settings, how far it has gone in), the owner key of
a slot's pages, and the prompt buckets a prefill pads to (serve/engine.py runs them)."""

from __future__ import annotations

import itertools

import numpy as np

from flaxgpt.decode.sampling import Rows
from flaxgpt.serve.runner import Logprobs


def prompt_buckets(max_len: int, smallest: int = 16) -> tuple[int, ...]:
    """Powers of two from `smallest` and the midpoints between them (16, 24, 32, 48, 64, 96, ...)
    up to max_len, and max_len itself."""
    # prefill is compute-bound: with midpoints a prompt is padded by under a third (powers of two
    # alone: up to half), for two compiled programs per doubling
    out, b = [], smallest
    while b < max_len:
        out += [b] + ([b * 3 // 2] if b * 3 // 2 < max_len else [])
        b *= 2
    return (*out, max_len)


def slot_owner(slot: int):
    return ("slot", slot)


class PrefillJob:
    """A request being prefilled (host side): its pages (the block manager's, as owner `self`) and how
    far its prompt has gone in."""

    _ids = itertools.count()

    def __init__(self, prompt_ids, rows: Rows, adapter: int, hit: int, last: int, hold: bool):
        self.prompt_ids, self.rows, self.adapter, self.hold = list(prompt_ids), rows, adapter, hold
        self.mask = None  # the first token's structured-output bitmask (int32 [W]; None: any token)
        self.echo = False  # each prompt token's logprobs wanted: every chunk runs, none from the cache
        self.echoed: list[Logprobs] = []  # per chunk, [size] ... each
        self.hit = hit  # prompt tokens whose keys and values came from the prefix cache
        self.done_upto = hit  # positions < done_upto are in its pages
        self.last = last  # the last position it may write (prompt + max_new - 1)
        self.owner = ("job", next(self._ids))

    def seen(self, vocab: int) -> np.ndarray | None:
        """Its prompt's tokens (bool [vocab]) when its draws read them (penalties), else None."""
        if not self.rows.penalized:
            return None
        seen = np.zeros(vocab, bool)
        seen[self.prompt_ids] = True
        return seen

    @property
    def left(self) -> int:
        return len(self.prompt_ids) - self.done_upto
