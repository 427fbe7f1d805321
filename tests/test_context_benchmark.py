"""benchmarks/context_train.py at a tiny size on the 8 simulated CPU devices: a row over context 2
trains with the loss of the same row on one device (the benchmark times the real step), reports
memory from the compiled program, and the table says why a row was skipped."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # its `import harness`, as `python benchmarks/...` finds it
_spec = importlib.util.spec_from_file_location("context_train", BENCHMARKS / "context_train.py")
context_train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(context_train)

pytestmark = pytest.mark.devices(8)


def results(capsys, *args):
    context_train.run_one(*args)
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_a_tiny_row_over_context_2_trains_as_on_one_device(capsys):
    one = results(capsys, 64, 1, "ring", 1, 8.0)[-1]
    two = results(capsys, 64, 2, "ring", 1, 8.0)[-1]
    assert two["loss"] == pytest.approx(one["loss"], abs=1e-5)
    assert 0 < two["gb"] < one["gb"] and two["tokens_s"] > 0 and 0 < two["attn_share"] < 1
    skipped = dict(length=128, context=8, gb=0.5, attn_share=0.5, skipped="over 180 s (compile and steps)")
    lines = context_train.table([one, two, skipped]).splitlines()
    assert lines[2].startswith("| 64 | 1 | ") and lines[3].endswith("| 1.0x | 1.0x |")
    assert "| 128 | 8 | 0.500 GB | skipped: over 180 s (compile and steps) | — |" in lines[4]
