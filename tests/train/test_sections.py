"""flaxgpt.train.sections: the data, mesh, lora, dpo and grpo sections are typed dataclasses whose
types are the checker (unknown keys, wrong types, choices, ranges: one line each), whose defaults are
configs/default.py's, and whose refusals are each written once in the package."""

import dataclasses
import re
from pathlib import Path

import ml_collections
import pytest

from flaxgpt.train import config_check, sections
from flaxgpt.train.sections import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def recipe(name="default", **changes):
    """A recipe with `section__key=value` changes, the section rebuilt so a wrong type gets through
    (ml_collections itself refuses to retype a field)."""
    c = config_check.load_recipe(str(ROOT / "configs" / f"{name}.py"))
    c.unlock()
    for k, v in changes.items():
        section, _, key = k.partition("__")
        c[section] = ml_collections.ConfigDict({**c[section].to_dict(), key: v})
    return c


def test_the_defaults_are_the_recipes_and_the_types_hold():
    s = sections.of(recipe())
    assert s == sections.Sections(**{n: cls() for n, cls in sections.SECTIONS.items()})
    assert sections.of(ml_collections.ConfigDict()) == s  # a section left out: its defaults
    for name, cls in sections.SECTIONS.items():
        assert cls.name == name and dataclasses.is_dataclass(cls)
        assert all(f.metadata.get("why") for f in dataclasses.fields(cls)), name  # each says why
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(getattr(s, name), dataclasses.fields(cls)[0].name, None)
    for path in sorted((ROOT / "configs").glob("*.py")):  # every recipe reads as typed sections
        sections.of(config_check.load_recipe(str(path)))
    typed = sections.of(recipe("grpo_toy", grpo__reward_weights=[1, 2], lora__alpha=8))
    assert typed.grpo.reward_weights == (1.0, 2.0) and isinstance(typed.lora.alpha, float)


BAD = {  # change -> the one-line message
    "lora__rnak": (4, "unknown config key 'lora.rnak'; did you mean lora.rank?"),
    "grpo__zzz": (1, "unknown config key 'grpo.zzz'; grpo has loss_type, epsilon, epsilon_high,"),
    "lora__rank": ("4", "--config.lora.rank='4' must be an integer (adapter rank r"),
    "lora__alpha": (True, "--config.lora.alpha=True must be a number"),
    "lora__targets": (3, "--config.lora.targets=3 must be a string"),
    "data__align_to_bos": (1, "--config.data.align_to_bos=1 must be True or False"),
    "grpo__reward_weights": (("a",), "--config.grpo.reward_weights=('a',) must be a tuple of numbers"),
    "grpo__reward_funcs": ("answer", "--config.grpo.reward_funcs='answer' must be a tuple of strings"),
    "data__format": ("tokenz", "--config.data.format='tokenz'; choose one of tokens, shards, packed, pairs,"),
    "grpo__top_p": (0.0, "--config.grpo.top_p=0.0 must be in (0, 1]"),
    "grpo__temperature": (float("nan"), "--config.grpo.temperature=nan must be > 0"),
    "lora__dropout": (1.0, "--config.lora.dropout=1.0 must be in [0, 1)"),
    "mesh__expert": (0, "--config.mesh.expert=0 must be >= 1"),
    "mesh__cpu_devices": (-1, "--config.mesh.cpu_devices=-1 must be >= 0"),
    "grpo__delta": (0.5, "--config.grpo.delta=0.5 caps the ratio: > 1, or 0 for off"),
}


@pytest.mark.parametrize("change", sorted(BAD))
def test_the_checker_reads_the_types(change):
    value, message = BAD[change]
    with pytest.raises(ConfigError) as e:
        config_check.check(recipe(**{change: value}))
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


REFUSALS = {  # a combination that cannot train -> where it is refused (the one place), its message
    "smooths the sigmoid loss": ({"dpo__loss": "ipo", "dpo__label_smoothing": 0.1}, "sections.py"),
    "only one of --config.mesh.data and": ({"mesh__data": -1, "mesh__fsdp": -1}, "sections.py"),
    "with LoRA: the reference is the base": (
        {"data__format": "pairs", "lora__rank": 4, "dpo__reference": "ref"}, "sections.py"
    ),
}  # fmt: skip


@pytest.mark.parametrize("message", sorted(REFUSALS))
def test_each_refusal_is_written_once(message):
    changes, owner = REFUSALS[message]
    with pytest.raises(ConfigError, match=re.escape(message)):
        sections.of(recipe(**changes))  # what a task reads its sections with: the same refusal
    sources = {p: p.read_text() for p in (ROOT / "flaxgpt").rglob("*.py")}
    where = [p.name for p, text in sources.items() if message in " ".join(text.replace('"', "").split())]
    assert where == [owner], where
