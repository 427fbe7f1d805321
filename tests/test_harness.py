"""benchmarks/harness.py: the order alternates, pauses come between runs, medians and ratios per round."""

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "harness", Path(__file__).resolve().parents[1] / "benchmarks/harness.py"
)
harness = sys.modules["harness"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(harness)


def test_order_alternates():
    assert [harness.order(["a", "b"], r) for r in range(4)] == [
        ["a", "b"],
        ["b", "a"],
        ["a", "b"],
        ["b", "a"],
    ]
    assert harness.order(["a", "b", "c"], 1) == ["c", "b", "a"]


def fake_run(table):
    """A side's result per round from `table[name][round]`, recording the calls."""
    calls = []

    def run(side, r):
        calls.append((side.name, r))
        return {"ms": table[side.name][r]}

    return run, calls


def test_compare_alternates_pauses_and_takes_medians():
    run, calls = fake_run({"flax": [10, 20, 10, 10, 30], "nano": [20, 30, 15, 40, 30]})
    pauses = []
    sides = [harness.Side("flax", ["x"]), harness.Side("nano", ["y"])]
    fig = harness.Figure("ms/iter", "flax", "ms", "nano", "ms", higher_is_better=False)
    rep = harness.compare(sides, [fig], rounds=5, pause=7, run=run, sleep=pauses.append, log=lambda s: None)
    assert [c[0] for c in calls] == [
        "flax",
        "nano",
        "nano",
        "flax",
        "flax",
        "nano",
        "nano",
        "flax",
        "flax",
        "nano",
    ]
    assert pauses == [7] * 9  # before every run but the first
    assert rep.ratios(fig) == [2.0, 1.5, 1.5, 4.0, 1.0]  # lower is better: reference / side
    assert rep.median_ratio(fig) == 1.5
    table = rep.table()
    assert "flax-nano, nano-flax, flax-nano, nano-flax, flax-nano" in table
    assert "**1.50x**" in table and "2.00 1.50 1.50 4.00 1.00" in table and "1.00-4.00x" in table


def test_higher_is_better_ratio_and_too_few_rounds():
    fig = harness.Figure("tok/s", "a", "t", "b", "t")
    assert fig.ratio(30.0, 10.0) == 3.0
    run, _ = fake_run({"a": [1] * 4, "b": [1] * 4})
    sides = [harness.Side("a", ["x"]), harness.Side("b", ["y"])]
    with pytest.raises(SystemExit, match="at least 4"):
        harness.compare(sides, [fig], rounds=3, pause=0, run=run)
    with pytest.raises(ValueError, match="names side 'c'"):
        harness.compare(sides, [harness.Figure("x", "a", "t", "c", "t")], pause=0, run=run)


def test_real_processes_round_argv_and_versions():
    """Two tiny sides in their own processes: RESULT lines parsed, the round reaches the argv."""
    code = "import sys, harness; print('noise'); harness.print_result({{'v': {k} * (int(sys.argv[1]) + 1)}})"
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[1] / "benchmarks")}
    sides = [
        harness.Side(name, lambda r, k=k: [sys.executable, "-c", code.format(k=k), str(r)], env=env)
        for name, k in (("a", 2), ("b", 1))
    ]
    fig = harness.Figure("v", "a", "v", "b", "v")
    rep = harness.compare(sides, [fig], rounds=4, pause=0, log=lambda s: None)
    assert rep.values("a", "v") == [2, 4, 6, 8] and rep.ratios(fig) == [2.0] * 4
    assert set(rep.versions["a"]) == set(harness.PACKAGES) and rep.versions["a"]["jax"] != "-"


def test_a_failing_side_is_one_error():
    side = harness.Side("bad", [sys.executable, "-c", "import sys; sys.exit('boom')"])
    with pytest.raises(SystemExit, match="(?s)side bad failed in round 0 .*boom"):
        harness.run_side(side, 0)
