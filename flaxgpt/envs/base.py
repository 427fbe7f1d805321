"""The environment interface, its checks, and one episode played out in text.

    class MyEnv(Environment):                        # in a user's file, named "myfile:MyEnv" in the recipe
        max_turns = 4
        stop = None                                  # text that ends a reply early (a call's closing marker)
        def reset(self, prompt, **row) -> str | None  # row: the prompt's data fields (its answer, ...)
        def step(self, action) -> Step                # Step(observation, reward, done)

    env = load("flaxgpt.envs.calculator:Calculator")
    episode = run_episode(env, prompt, row, policy)   # policy(messages) -> the model's next reply

A step's `observation` goes back to the model as a tool message and `reward` adds up over the episode
(the recipe's reward functions still score the final reply on top). ToolEnvironment is the usual
kind: actions are tool calls in a family's format, read with serve.tools' parsers (what serve.py
returns as tool_calls is what the environment runs), each call answered by `call(name, arguments)`;
a reply without a call is the final answer and ends the episode. A call the parser cannot read, or
one that fails, is an observation the model sees ("error: ..."), never an exception, as vLLM answers
a malformed call. What the environment does wrong (raises, returns a reward that is not a finite
number, or an observation over the limit) is an EnvError of one line naming the environment and the
prompt: the trainer drops that episode's group and keeps the step's others.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import numbers
import os
import sys

from flaxgpt.serve import tools as tool_calls

MAX_OBSERVATION_CHARS = 8000  # an observation longer than this is the environment's fault (cut it there)


class EnvError(ValueError):
    """An environment that misbehaved; the message is one line naming it and the prompt."""


@dataclasses.dataclass(frozen=True)
class Step:
    observation: str | None  # the tool message the model reads next (None: nothing to say)
    reward: float = 0.0
    done: bool = False


class Environment:
    """The interface (subclassing is optional: any object with reset / step / max_turns will do)."""

    max_turns: int = 4  # replies per episode; then it ends, truncated
    stop: str | None = None  # a reply ends at its end of sequence, or after this text (None: EOS only)

    def reset(self, prompt: str, **row) -> str | None:
        """Start an episode for `prompt`; row: its data fields. Returns a first observation or None."""
        return None

    def step(self, action: str) -> Step:
        raise NotImplementedError


class ToolEnvironment(Environment):
    """Actions are tool calls in `family`'s format (serve.tools.FAMILIES) over `tools` (OpenAI schemas)."""

    family: str = "hermes"
    tools: list = []

    @property
    def stop(self) -> str | None:
        """The family's closing marker (hermes' </tool_call>): a reply ends there, the call's result
        follows; families without one (mistral, llama3_json) put the call in a whole reply."""
        return tool_calls.CLOSERS.get(self.family)  # a reply that closes a call ends there

    def call(self, name: str, arguments: dict) -> str:
        raise NotImplementedError

    def final_reward(self, reply: str) -> float:
        """The reward of the reply that ends the episode (default 0: the recipe's reward functions
        score it)."""
        return 0.0

    def step(self, action: str) -> Step:
        _, calls = tool_calls.parse(self.family, action, self.tools)
        if not calls:
            marker = tool_calls.OPENERS.get(self.family)  # opened but unreadable: the model tried
            tried = marker in action if marker else False
            if tried or (self.family == "llama3_json" and action.lstrip().startswith("{")):
                return Step("error: the tool call could not be read (malformed JSON or an unknown tool)")
            return Step(None, self.final_reward(action), True)
        answers = []
        for c in calls:
            f = c["function"]
            try:
                answers.append(str(self.call(f["name"], json.loads(f["arguments"]))))
            except Exception as e:  # a bad argument is the model's mistake: it reads why and tries again
                answers.append(f"error: {type(e).__name__}: {e}")
        return Step(fit("\n".join(answers), MAX_OBSERVATION_CHARS))


@dataclasses.dataclass
class Episode:
    messages: list[dict]  # the prompt, then the model's replies and the observations, in order
    reward: float  # the environment's rewards summed
    turns: int  # the model's replies
    truncated: bool  # max_turns reached before the environment said done


def import_object(module: str, name: str):
    """module.name of a user's file (an environment, a reward function), with the working directory
    importable as `python -m` has it: train.py's own directory is sys.path[0], not where the command
    runs, where such a file sits. The one importer of user code for GRPO's plugins."""
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        return getattr(importlib.import_module(module), name)
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def load(spec: str, **kwargs) -> Environment:
    """`module:Class` (importable: a shipped one, or a file in the working directory) -> an instance."""
    module, _, name = spec.partition(":")
    if not module or not name:
        example = "flaxgpt.envs.calculator:Calculator"
        raise EnvError(f"environment {spec!r}: write it as module:Class (e.g. {example})")
    try:
        cls = import_object(module, name)
    except Exception as e:  # not found, or its own code failing at import (a SyntaxError, a NameError)
        raise EnvError(f"environment {spec!r} cannot be loaded ({type(e).__name__}: {e})") from None
    try:
        env = cls(**kwargs)
    except Exception as e:
        raise EnvError(f"environment {spec!r} could not be made ({type(e).__name__}: {e})") from None
    for attr in ("reset", "step"):
        if not callable(getattr(env, attr, None)):
            raise EnvError(f"environment {spec!r} has no {attr}() method (see flaxgpt.envs.base.Environment)")
    return env


def where(env, prompt: str) -> str:
    """How an EnvError names an episode: the environment and the prompt."""
    return f"environment {type(env).__name__} on prompt {prompt[:60]!r}"


def checked_reset(env, prompt: str, row: dict, max_observation_chars: int = MAX_OBSERVATION_CHARS):
    """env.reset(prompt, **row), its first observation checked (None or text within the limit)."""
    try:
        first = env.reset(prompt, **row)
    except Exception as e:
        raise EnvError(f"{where(env, prompt)}: reset raised {type(e).__name__}: {e}") from None
    return None if first is None else _checked_text(first, where(env, prompt), max_observation_chars)


def checked_step(
    env, prompt: str, action: str, turn: int, max_observation_chars: int = MAX_OBSERVATION_CHARS
) -> Step:
    """env.step(action) for the episode's `turn`-th reply, as a Step whose reward is a finite float and
    whose observation is None or text within the limit; anything else an EnvError of one line."""
    at = f"{where(env, prompt)}: step {turn}"
    try:
        step = env.step(action)
    except Exception as e:
        raise EnvError(f"{at} raised {type(e).__name__}: {e}") from None
    if not isinstance(step, Step):
        try:
            step = Step(*step)
        except TypeError:
            raise EnvError(f"{at} returned {step!r}, not (observation, reward, done)") from None
    reward = step.reward
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise EnvError(f"{at} returned the reward {reward!r}, not a finite number")
    text = None if step.observation is None else _checked_text(step.observation, at, max_observation_chars)
    return Step(text, float(reward), bool(step.done))


def turns_of(env, max_turns: int = 0) -> int:
    """Replies an episode at most: `max_turns` (the recipe's) when > 0, else the environment's own."""
    return int(max_turns) if max_turns > 0 else int(getattr(env, "max_turns", Environment.max_turns))


def stop_of(env) -> str | None:
    """The text that ends a reply early, before the end of sequence (a tool call's closing marker)."""
    return getattr(env, "stop", None)


def run_episode(
    env, prompt: str, row: dict, policy, max_observation_chars: int = MAX_OBSERVATION_CHARS
) -> Episode:
    """Play one episode: the model (`policy(messages) -> reply text`) against `env`."""
    messages = [{"role": "user", "content": prompt}]
    first = checked_reset(env, prompt, row, max_observation_chars)
    if first is not None:
        messages.append({"role": "tool", "content": first})
    total, turns, max_turns = 0.0, 0, turns_of(env)
    while turns < max_turns:
        reply = policy(messages)
        messages.append({"role": "assistant", "content": reply})
        turns += 1
        step = checked_step(env, prompt, reply, turns, max_observation_chars)
        total += step.reward
        if step.observation is not None:
            messages.append({"role": "tool", "content": step.observation})
        if step.done:
            return Episode(messages, total, turns, truncated=False)
    return Episode(messages, total, turns, truncated=True)


def fit(text: str, limit: int) -> str:
    """Text cut to `limit` characters, its head and tail kept (a traceback's last line says what went
    wrong): tools' answers joined (a sandbox caps stdout and stderr apiece) may pass the limit."""
    if len(text) <= limit:
        return text
    mark = f"\n[... {len(text) - limit} characters cut ...]\n"
    keep = max(0, limit - len(mark) - 8)  # (the mark's own count may be a digit longer)
    return (
        text[: keep // 2]
        + f"\n[... {len(text) - keep} characters cut ...]\n"
        + text[len(text) - (keep - keep // 2) :]
    )


def _checked_text(observation, where: str, limit: int) -> str:
    if not isinstance(observation, str):
        raise EnvError(f"{where}: an observation must be text, not {type(observation).__name__}")
    if len(observation) > limit:
        raise EnvError(
            f"{where}: an observation of {len(observation)} characters is over the limit of {limit}; "
            "cut it in the environment"
        )
    return observation
