"""Environments: the calculator computes without evaluating Python, tool calls are read with the
server's parsers (a malformed one is an observation), an episode plays out turn by turn, and an
environment that misbehaves is a one-line EnvError naming it and the prompt."""

import json
import math

import numpy as np
import pytest

from flaxgpt.envs import base
from flaxgpt.envs.calculator import Calculator, PythonExecutor, evaluate
from flaxgpt.serve import tools


def hermes_call(name, **arguments):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def scripted(*replies):
    """A policy that says `replies` in order and records what it was shown."""
    seen = []

    def policy(messages):
        seen.append([dict(m) for m in messages])
        return replies[len(seen) - 1]

    policy.seen = seen
    return policy


def test_calculator_arithmetic_and_refusals():
    assert evaluate("(1234 * 5678) - 9") == 1234 * 5678 - 9
    assert evaluate("-2 ** 3 + 7 // 2 % 5") == -(2**3) + 7 // 2 % 5
    assert math.isclose(evaluate("1 / 3"), 1 / 3)
    for bad, said in [
        ("__import__('os')", "only numbers"),
        ("2 ** 10 ** 10", "exponents are limited"),
        ("1 / 0", "division by zero"),
        ("10 ** 60 * 10 ** 60", "limited to magnitude 1e\\+60"),
        ("1e999", "limited to magnitude"),  # a written number is bounded too: it read as inf
        ("-1e999 + 1", "limited to magnitude"),
        ("9" * 80, "limited to magnitude"),
        ("1 +", "cannot read"),
        ("x" * 300, "at most 200"),
        ("True + 1", "only numbers"),
    ]:
        with pytest.raises(ValueError, match=said):
            evaluate(bad)


def test_a_calculator_episode_in_the_servers_tool_call_format():
    """Two calls and a final answer: each call's result is the next tool message; the reply that
    calls no tool ends the episode. The call is the text serve.py parses into tool_calls."""
    env = base.load("flaxgpt.envs.calculator:Calculator")
    call = hermes_call("calculator", expression="1234 * 5678")
    assert tools.parse("hermes", call, env.tools)[1][0]["function"]["name"] == "calculator"
    policy = scripted(call, hermes_call("calculator", expression="7006652 + 1"), "The answer is 7006653.")
    ep = base.run_episode(env, "What is 1234 * 5678 + 1?", {"answer": "7006653"}, policy)
    roles = [m["role"] for m in ep.messages]
    assert roles == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert [m["content"] for m in ep.messages if m["role"] == "tool"] == ["7006652", "7006653"]
    assert (ep.turns, ep.truncated, ep.reward) == (3, False, 0.0)
    assert policy.seen[1][-1] == {"role": "tool", "content": "7006652"}


def test_malformed_calls_and_bad_arguments_are_observations_not_crashes():
    env = Calculator(max_turns=3)
    policy = scripted(
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 +</tool_call>',  # bad JSON
        hermes_call("calculator", expression="2 ** 1000"),
        hermes_call("calculator", expression="6 * 7"),
    )
    ep = base.run_episode(env, "q", {}, policy)
    obs = [m["content"] for m in ep.messages if m["role"] == "tool"]
    assert obs[0].startswith("error: the tool call could not be read")
    assert obs[1] == "error: ValueError: exponents are limited to 64" and obs[2] == "42"
    assert ep.truncated and ep.turns == 3  # max_turns reached before a final answer


def test_other_families_formats():
    for family, call in [
        ("mistral", '[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "2+2"}}]'),
        ("llama3_json", '{"name": "calculator", "parameters": {"expression": "2+2"}}'),
    ]:
        assert Calculator(family=family).step(call) == base.Step("4")
    assert Calculator(family="llama3_json").step('{"name": "calc').observation.startswith("error:")


def test_python_executor_runs_the_code_in_the_sandbox():
    env = PythonExecutor(cpu_s=1, wall_s=3)
    step = env.step(hermes_call("python", code="print(sum(range(10)))"))
    assert step == base.Step("45")
    step = env.step(hermes_call("python", code="import sys; sys.exit(2)"))
    assert step.observation == "[exit code 2]" and not step.done


class Raises(base.Environment):
    def step(self, action):
        raise RuntimeError("tool server down")


class BadReward(base.Environment):
    def step(self, action):
        return "obs", float("nan"), True


class CannotStart(base.Environment):
    def __init__(self):
        raise RuntimeError("no tool server")


class Chatty(base.Environment):
    def step(self, action):
        return base.Step("x" * 100, 0.0, False)


class NoStep:
    def reset(self, prompt):
        return None


def test_misbehaving_environments_are_one_line_errors_naming_them_and_the_prompt():
    policy = lambda messages: "hi"  # noqa: E731
    for env, said in [
        (Raises(), "step 1 raised RuntimeError: tool server down"),
        (BadReward(), "returned the reward nan, not a finite number"),
        (Chatty(), "an observation of 100 characters is over the limit of 50"),
    ]:
        with pytest.raises(base.EnvError, match=said) as e:
            base.run_episode(env, "What is 2+2?", {}, policy, max_observation_chars=50)
        said = str(e.value)
        assert "\n" not in said and type(env).__name__ in said and "What is 2+2?" in said
    with pytest.raises(base.EnvError, match="write it as module:Class"):
        base.load("flaxgpt.envs.calculator")
    with pytest.raises(base.EnvError, match="cannot be loaded"):
        base.load("flaxgpt.envs.calculator:Nope")
    with pytest.raises(base.EnvError, match="has no step"):
        base.load(f"{__name__}:NoStep")
    with pytest.raises(base.EnvError, match=r"could not be made \(RuntimeError: no tool server\)"):
        base.load(f"{__name__}:CannotStart")  # (a traceback once)


def test_a_numpy_reward_is_a_number_and_long_tool_answers_are_cut_to_the_limit():
    class NumpyReward(base.Environment):
        def step(self, action):
            return base.Step(None, np.float32(0.5), True)

    step = base.checked_step(NumpyReward(), "p", "a", 1)
    assert step.reward == 0.5 and type(step.reward) is float
    cut = base.fit("h" * 9000 + "the last line", base.MAX_OBSERVATION_CHARS)
    assert len(cut) <= base.MAX_OBSERVATION_CHARS and cut.startswith("hhh") and cut.endswith("the last line")
    assert "characters cut" in cut and base.fit("short", 10) == "short"
