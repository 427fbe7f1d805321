"""GRPO's reward functions: the shipped ones and a user's, called as TRL's reward_funcs are, combined
with weights, every bad result a one-line error naming the function and the row.

    rewards = Rewards.make(["answer", "format=<think>.*</think>.*", "length=200", "mymod:score"],
                           weights=[1.0, 0.5, 0.1, 1.0])
    total_N, per_func_NK = rewards(prompts, completions, rows)   # rows: each completion's data row

A reward function is called once for a batch: f(prompts=[...], completions=[...], completion_ids=[...]
(when given), **{field: [row[field] for row in rows]}) -> one float (or None: "does not apply",
TRL's convention) per completion; prompts and completions are strings or chat messages (the
completion's text is its last message's content). Specs:
- answer: 1.0 when the completion's final answer equals the row's `answer` field, else 0.0. A final
  answer is the last GSM8K `#### 42` or `\\boxed{42}` in the text (the row's answer may itself be a
  GSM8K solution: its `####` part is taken); numbers compare as numbers (`1,000` = `1000.0`), the rest
  as stripped strings;
- format=REGEX: 1.0 when the whole completion (stripped) matches REGEX (re.DOTALL), else 0.0;
- length=N: 0 up to N characters, then -(excess / N), at most -1 (a length penalty);
- module:function: a user's function (the module importable, e.g. from the working directory).
The total is the weighted sum (weights default to 1); a completion every function skipped (None) gets
NaN, which the advantages leave out (train.grpo_task.group_advantages). Errors: a function that raises
(rerun one row at a time to name the row), returns the wrong count, a NaN or a non-number, or
reads a field a row lacks (the shipped ones check first; a user's raises and is named).
"""

from __future__ import annotations

import math
import re

import numpy as np

from flaxgpt.envs.base import import_object

_GSM8K = re.compile(r"####\s*([^\n]+)")
_NUMBER = re.compile(r"^[-+]?\$?\s*[\d,]*\.?\d+(?:[eE][-+]?\d+)?$")


def _text(x) -> str:
    """A completion or prompt as text: a string, or chat messages' last content."""
    if isinstance(x, str):
        return x
    if isinstance(x, list) and x and isinstance(x[-1], dict):
        return str(x[-1].get("content", ""))
    return str(x)


def _boxed(text: str) -> str | None:
    """The content of the last \\boxed{...}, braces nested."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unclosed: no answer


def final_answer(text: str) -> str | None:
    """The last GSM8K `#### x` or `\\boxed{x}` answer in text, whichever comes later; None if neither."""
    found = []
    for m in _GSM8K.finditer(text):
        found.append((m.start(), m.group(1)))
    if (b := _boxed(text)) is not None:
        found.append((text.rfind("\\boxed{"), b))
    return max(found)[1].strip() if found else None


def _normal(answer: str):
    """A number as float (commas, $ and a trailing period dropped), else the stripped string."""
    a = answer.strip().rstrip(".").strip()
    if _NUMBER.match(a):
        return float(a.replace(",", "").replace("$", "").replace(" ", ""))
    return a


def answer_match(prompts, completions, answer, **_):
    """1.0 where the completion's final answer equals the row's answer field."""
    out = []
    for c, a in zip(completions, answer, strict=True):
        ref = final_answer(str(a)) if "####" in str(a) else str(a)
        got = final_answer(_text(c))
        out.append(float(got is not None and ref is not None and _normal(got) == _normal(ref)))
    return out


def format_regex(pattern: str):
    try:
        rx = re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ValueError(f"reward format={pattern}: not a regular expression ({e})") from None

    def format_match(prompts, completions, **_):
        return [float(rx.fullmatch(_text(c).strip()) is not None) for c in completions]

    return format_match


def length_penalty(limit: int):
    if limit <= 0:
        raise ValueError(f"reward length={limit}: the limit must be > 0 characters")

    def length(prompts, completions, **_):
        return [-min(1.0, max(0, len(_text(c)) - limit) / limit) for c in completions]

    return length


SHIPPED_FIELDS = {"answer": ("answer",)}  # the row fields a shipped reward reads


def load_function(spec: str):
    """module:function -> the callable, or a one-line error."""
    module, _, name = spec.partition(":")
    try:
        fn = import_object(module, name)
    except Exception as e:  # not found, or its own code failing at import (a SyntaxError, a NameError)
        raise ValueError(f"reward {spec}: cannot load it ({type(e).__name__}: {e})") from None
    if not callable(fn):
        raise ValueError(f"reward {spec}: {module}.{name} is not callable")
    return fn


def make_reward(spec: str):
    """A spec (see the module docstring) -> (name, function, fields it reads)."""
    kind, _, arg = spec.partition("=")
    if spec == "answer":
        return spec, answer_match, SHIPPED_FIELDS["answer"]
    if kind == "format" and arg:
        return spec, format_regex(arg), ()
    if kind == "length" and arg:
        try:
            limit = int(arg)
        except ValueError:
            raise ValueError(f"reward {spec}: the length limit {arg!r} is not an integer") from None
        return spec, length_penalty(limit), ()
    if ":" in spec and "=" not in spec:
        return spec, load_function(spec), ()
    raise ValueError(f"reward {spec!r}: choose answer, format=REGEX, length=N or module:function")


class Rewards:
    """Several reward functions and their weights; calling it scores a batch of completions."""

    def __init__(self, funcs, weights=None):
        self.funcs = list(funcs)  # (name, function, fields)
        if not self.funcs:
            raise ValueError("grpo.rewards is empty: name at least one reward")
        self.weights = np.ones(len(self.funcs)) if weights is None else np.asarray(weights, np.float64)
        if self.weights.shape != (len(self.funcs),):
            raise ValueError(f"{len(self.weights)} reward weights for {len(self.funcs)} rewards")

    @classmethod
    def make(cls, specs, weights=None) -> Rewards:
        return cls([make_reward(s) for s in specs], weights)

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.funcs]

    def __call__(self, prompts, completions, rows, completion_ids=None, row_names=None):
        """(total [N], per function [N, K]) for N completions, rows[i] the data row of completion i."""
        N = len(completions)
        if len(prompts) != N or len(rows) != N:
            raise ValueError(f"{len(prompts)} prompts, {len(rows)} rows for {N} completions")
        names = row_names or [f"row {i}" for i in range(N)]
        per_NK = np.full((N, len(self.funcs)), np.nan)
        for k, (name, fn, fields) in enumerate(self.funcs):
            for f in fields:
                lacking = [i for i, r in enumerate(rows) if f not in r]
                if lacking:
                    raise ValueError(f"reward {name} reads field {f!r}, which {names[lacking[0]]} lacks")
            per_NK[:, k] = self._call(name, fn, prompts, completions, rows, completion_ids, names)
        with np.errstate(invalid="ignore"):
            total_N = np.nansum(per_NK * self.weights, axis=1)
        total_N[np.isnan(per_NK).all(axis=1)] = np.nan  # every function skipped it: no reward at all
        return total_N, per_NK

    @staticmethod
    def _call(name, fn, prompts, completions, rows, completion_ids, names):
        def call(idx):
            keys = [k for k in rows[idx[0]] if k not in ("prompt", "completion", "completion_ids")]
            kw = {k: [rows[i].get(k) for i in idx] for k in keys}
            if completion_ids is not None:
                kw["completion_ids"] = [completion_ids[i] for i in idx]
            return fn(prompts=[prompts[i] for i in idx], completions=[completions[i] for i in idx], **kw)

        try:
            out = call(list(range(len(completions))))
        except Exception as batch_error:  # rerun row by row to name the row that fails
            for i in range(len(completions)):
                try:
                    call([i])
                except Exception as e:
                    raise ValueError(f"reward {name} raised on {names[i]}: {type(e).__name__}: {e}") from None
            raise ValueError(f"reward {name} raised: {type(batch_error).__name__}: {batch_error}") from None
        try:
            out = list(out)
        except TypeError:
            raise ValueError(f"reward {name} returned {type(out).__name__}, not a list of floats") from None
        if len(out) != len(completions):
            raise ValueError(f"reward {name} returned {len(out)} values for {len(completions)} completions")
        values = []
        for i, v in enumerate(out):
            if v is None:
                values.append(math.nan)  # does not apply (TRL's None)
                continue
            try:
                v = float(v)
            except (TypeError, ValueError, OverflowError):
                raise ValueError(f"reward {name} returned {v!r} for {names[i]}, not a number") from None
            if not math.isfinite(v):
                raise ValueError(f"reward {name} returned {v} for {names[i]}")
            values.append(v)
        return values
