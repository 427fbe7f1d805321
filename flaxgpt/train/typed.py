"""Typed, frozen dataclasses whose fields check themselves: the machinery under the recipe's sections
(train/sections.py) and the objectives' options that a section extends (grpo_task.GRPOOptions), so a
field's type, range and why are written once, where the field is.

    name: ClassVar[str] = "grpo"        # a Section subclass's key in a recipe, then its fields:
    epsilon: float = opt(0.2, "the ratio's clip range starts at 1 - epsilon", 0)
    loss_type: Literal[LOSS_TYPES] = opt("dapo", "how token losses are averaged")

Made with epsilon=-1, such a class raises ConfigError "--config.grpo.epsilon=-1.0 must be >= 0 (the
ratio's clip range starts at 1 - epsilon)". A value of the wrong type names the key, the type and
the value; a `Literal` lists its choices; a number outside its range says the range. A rule between
fields is the class's `check`.
"""

import dataclasses
import math
import typing
from typing import ClassVar, Literal

import numpy as np

PLURALS = {str: "strings", int: "integers", float: "numbers", bool: "booleans"}  # a tuple's items


class ConfigError(ValueError):
    """A run config or recipe file that cannot be used; the message is one line."""


def opt(default, why: str, low=None, high=None, *, low_in: bool = True, high_in: bool = False):
    """A section's field: its default, why it is there (said in its errors) and, for a number, its
    range (`low` / `high`, None: unbounded; included or not)."""
    return dataclasses.field(default=default, metadata={"why": why, "range": (low, high, low_in, high_in)})


def describe_range(low, high, low_in: bool, high_in: bool) -> str:
    """ ">= 0", "> 0", "in [0, 1)", "in (0, 1]": a range as an error names it."""
    left = f">= {low:g}" if low_in else f"> {low:g}"
    if high is None or math.isinf(high):
        return left
    return f"in {'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"


def _is_number(value, kind) -> bool:
    if isinstance(value, bool | np.bool_):
        return False
    return isinstance(value, int | np.integer) or (kind is float and isinstance(value, float | np.floating))


def typed(key: str, value, kind, meta: dict):
    """`value` of the field `key` as its type `kind` says (int, float, bool, str, a Literal's choices,
    a tuple of one of them) and inside its range, or a one-line ConfigError naming the key, what it
    must be and the value."""
    why = f" ({meta['why']})" if meta.get("why") else ""
    if typing.get_origin(kind) is Literal:
        choices = typing.get_args(kind)
        if not isinstance(value, str) or value not in choices:
            raise ConfigError(f"--config.{key}={value!r}; choose one of {', '.join(choices)}")
        return value
    if typing.get_origin(kind) is tuple:
        item, items = typing.get_args(kind)[0], None
        try:
            items = tuple(typed(key, v, item, {}) for v in value) if isinstance(value, tuple | list) else None
        except ConfigError:
            pass
        if items is None:
            raise ConfigError(f"--config.{key}={value!r} must be a tuple of {PLURALS[item]}{why}")
        return items
    if kind is bool:
        if not isinstance(value, bool | np.bool_):
            raise ConfigError(f"--config.{key}={value!r} must be True or False{why}")
        return bool(value)
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"--config.{key}={value!r} must be a string{why}")
        return value
    if not _is_number(value, kind):
        raise ConfigError(
            f"--config.{key}={value!r} must be {'an integer' if kind is int else 'a number'}{why}"
        )
    value = kind(value)
    low, high, low_in, high_in = meta.get("range", (None, None, True, False))
    ok = math.isfinite(value) and (low is None or (value >= low if low_in else value > low))
    ok = ok and (high is None or (value <= high if high_in else value < high))
    if not ok:
        where = describe_range(-math.inf if low is None else low, high, low_in, high_in)
        raise ConfigError(f"--config.{key}={value} must be {where}{why}")
    return value


class Section:
    """A typed section: its fields are checked (and normalized) by their types when it is made, then
    the section's own `check`."""

    name: ClassVar[str]  # its key in a recipe

    def __post_init__(self):
        kinds = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = typed(f"{self.name}.{f.name}", getattr(self, f.name), kinds[f.name], f.metadata)
            object.__setattr__(self, f.name, value)
        self.check()

    def check(self) -> None:
        """The rules between this section's fields (none by default)."""
