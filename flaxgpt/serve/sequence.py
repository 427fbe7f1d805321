"""A sequence the scheduler runs (its prompt, settings, what it has generated and sent) and what it
emits (Delta, then Finish or Failed), with the refusals of `Scheduler.submit` (serve/scheduler.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from flaxgpt.decode.sampling import Rows


class TokenLogprob(NamedTuple):
    """A token of a reply (or of an echoed prompt) with its float32 logprob and the top alternatives
    [(id, logprob)] the request asked for (None: the first prompt token, which has none)."""

    id: int
    logprob: float | None
    top: list

    @classmethod
    def of(cls, k: int | None, token: int, chosen, top_ids_K, top_K) -> TokenLogprob:
        """From the device's logprob arrays: the token's, and the first `k` alternatives."""
        return cls(
            token, float(chosen), [(int(i), float(v)) for i, v in zip(top_ids_K[: k or 0], top_K[: k or 0])]
        )


class Delta(NamedTuple):
    text: str
    logprobs: list = []  # TokenLogprob of the tokens behind this delta (requests with logprobs)
    prompt: list | None = None  # the first delta of an echo request: TokenLogprob per prompt token


class Finish(NamedTuple):
    reason: str  # "stop" (EOS or a stop string) | "length" (max_new_tokens)
    completion_tokens: int


class Failed(NamedTuple):
    message: str


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"every slot is busy and the queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


class Draining(Exception):
    pass


class TooManySequences(ValueError):
    """A request that could never be queued, however idle the server: more sequences than slots + queue."""


class TooManyTokens(TooManySequences):
    """A request asking for more new tokens than the server's limit (serve.py --max_tokens)."""

    param = "max_tokens"


@dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    rows: Rows
    stop: list[str] = field(default_factory=list)
    emit: object = print
    ids: list[int] = field(default_factory=list)  # generated so far
    sent: int = 0  # characters of text already emitted
    cancelled: bool = False
    finished: bool = False
    submitted: float = 0.0  # perf_counter at submit (time to first token counts the queue)
    adapter: object = None  # an adapters.Adapter (None: the base)
    adapter_slot: int = 0  # the engine's adapter slot it holds while it runs
    last_at: float | None = None  # when its latest tokens were handed over
    logprobs: int | None = None  # report each token's logprob and this many alternatives (None: no)
    echo: bool = False  # report the prompt's tokens with their logprobs first
    grammar: object = None  # a serve.grammar Matcher: its bitmask constrains each token
    stop_ids: frozenset = frozenset()  # token ids that end it (not part of the text)
    special: bool = False  # its text keeps special tokens (a tool-call marker such as [TOOL_CALLS])
    detok: object = None  # its Detokenizer (serve/detokenize.py), made at its first token

    def cancel(self):
        self.cancelled = True  # read by the engine thread (a plain bool is atomic enough)
