"""GRPO's rewards: GSM8K and \\boxed{} answers, the format regex, the length penalty, a user's
module:function called as TRL calls reward_funcs, weights; each bad result a one-line error naming
the function and the row."""

import sys
import textwrap

import numpy as np
import pytest

from flaxgpt.train import rewards as R


def test_final_answer_forms():
    assert R.final_answer("so 6 * 7 = 42.\n#### 42") == "42"
    assert R.final_answer("the answer is \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert R.final_answer("#### 5 then \\boxed{7}") == "7"  # the later one
    assert R.final_answer("\\boxed{7} then\n#### 1,000") == "1,000"
    assert R.final_answer("no answer here") is None
    assert R.final_answer("\\boxed{unclosed") is None


def test_answer_match_numbers_strings_chat_and_gsm8k_solutions():
    chat = [{"role": "assistant", "content": "#### $12."}]
    completions = ["#### 1,000", "\\boxed{1000.0}", "#### 999", "x", chat, "\\boxed{Paris}"]
    answers = ["1000", "Natalia sold 1000 clips.\n#### 1000", "1000", "1000", "12", "Paris"]
    got = R.answer_match(["p"] * 6, completions, answers)
    assert got == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]


def test_format_length_and_weights():
    fmt = R.format_regex(r"<think>.*</think>\s*#### \d+")
    assert fmt([], ["<think>a\nb</think> #### 3", "#### 3", " <think></think>#### 3 "]) == [1.0, 0.0, 1.0]
    assert R.length_penalty(4)([], ["abcd", "abcdef", "a" * 100]) == [0.0, -0.5, -1.0]
    rewards = R.Rewards.make(["answer", "format=#### \\d+", "length=4"], weights=[1.0, 0.5, 2.0])
    rows = [{"prompt": "q", "answer": "12"}, {"prompt": "q", "answer": "12"}]
    total, per = rewards(["q", "q"], ["#### 12", "#### 13 and more"], rows)
    np.testing.assert_allclose(per, [[1, 1, -0.75], [0, 0, -1]])
    np.testing.assert_allclose(total, [1 + 0.5 - 1.5, -2.0])


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            def by_field(prompts, completions, target, completion_ids=None, **kw):
                return [float(c.count(t)) for c, t in zip(completions, target)]

            def raises_on_b(prompts, completions, **kw):
                return [1 / 0 if c == "b" else 1.0 for c in completions]

            def short(prompts, completions, **kw):
                return [1.0]

            def nan_second(prompts, completions, **kw):
                return [1.0, float("nan")]

            def skip_first(prompts, completions, **kw):
                return [None, 2.0]

            def huge(prompts, completions, **kw):
                return [1.0, 10 ** 400]

            not_a_function = 3
            """
        )
    )
    (tmp_path / "broken_rewards.py").write_text("def f(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("my_rewards", None)


def test_user_function_called_as_trl(user_module):
    rewards = R.Rewards.make(["my_rewards:by_field", "my_rewards:skip_first"])
    rows = [{"prompt": "p", "target": "a"}, {"prompt": "p", "target": "b"}]
    total, per = rewards(["p", "p"], ["aab", "bbb"], rows, completion_ids=[[1], [2]])
    np.testing.assert_allclose(per, [[2, np.nan], [3, 2]])
    np.testing.assert_allclose(total, [2, 5])
    total, _ = R.Rewards.make(["my_rewards:skip_first"])(["p", "p"], ["a", "b"], [{}, {}])
    assert np.isnan(total[0]) and total[1] == 2  # skipped by every function: no reward (advantage 0)


def test_a_reward_module_in_the_working_directory_loads(tmp_path, monkeypatch):
    """train.py's own directory is sys.path[0]: a reward file beside the command imports all the same."""
    (tmp_path / "here_rewards.py").write_text(
        "def one(prompts, completions, **kw):\n    return [1.0] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    try:
        assert R.load_function("here_rewards:one")([], ["a"]) == [1.0]
        assert str(tmp_path) not in sys.path  # added for the import only
    finally:
        sys.modules.pop("here_rewards", None)


@pytest.mark.parametrize(
    "spec, rows, message",
    [
        ("my_rewards:raises_on_b", None, "reward my_rewards:raises_on_b raised on row 1: ZeroDivisionError"),
        ("my_rewards:short", None, "reward my_rewards:short returned 1 values for 2 completions"),
        ("my_rewards:nan_second", None, "reward my_rewards:nan_second returned nan for row 1"),
        (
            "my_rewards:by_field",
            [{"target": "a"}, {}],
            "reward my_rewards:by_field raised on row 1: TypeError",
        ),
        ("answer", [{"answer": "1"}, {}], "reward answer reads field 'answer', which row 1 lacks"),
        ("my_rewards:missing", None, "reward my_rewards:missing: cannot load it (AttributeError"),
        ("no_such_module_xyz:f", None, "reward no_such_module_xyz:f: cannot load it (ModuleNotFoundError"),
        ("my_rewards:not_a_function", None, "my_rewards.not_a_function is not callable"),
        ("length=abc", None, "the length limit 'abc' is not an integer"),
        # tracebacks once: an int too large for a float, a regex that does not compile, a module whose
        # own code fails at import
        ("my_rewards:huge", None, "reward my_rewards:huge returned 1000"),
        ("format=(", None, "reward format=(: not a regular expression (missing ), unterminated subpattern"),
        ("broken_rewards:f", None, "reward broken_rewards:f: cannot load it (SyntaxError"),
        ("bleu", None, "reward 'bleu': choose answer, format=REGEX, length=N or module:function"),
    ],
)
def test_bad_rewards_are_one_line(user_module, spec, rows, message):
    rows = rows or [{}, {}]
    with pytest.raises(ValueError) as e:
        R.Rewards.make([spec])(["p", "p"], ["a", "b"], rows)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
