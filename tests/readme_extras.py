"""Which extras a documented command line needs (tests/test_docs.py holds the README to it): the
tables of flaxgpt.extras read against a command's words, a `flaxgpt aot` target's platform and a
train.py recipe's init_from."""

from __future__ import annotations

import os
import shlex

from flaxgpt.extras import COMMANDS, EXTRAS, LOADERS, PLATFORM_EXTRAS, hf_source


def aot_extra(target: str) -> str | None:
    """tpu-aot or gpu-aot for a `flaxgpt aot --target` name (None: the host CPU)."""
    from flaxgpt.aot import targets

    return PLATFORM_EXTRAS.get(targets.get(target).platform)


def needed_by(command: str, root: str = ".") -> list[str]:
    """The extras a documented command line needs, in EXTRAS' order (`root`: where its paths are;
    a train.py line's init_from is its override's or else its recipe's)."""
    words = shlex.split(command, comments=True)
    if words[:1] == ["python"]:
        words = words[1:]
    if not words:
        return []
    name = " ".join(words[:2]) if words[0] == "flaxgpt" and len(words) > 1 else words[0]
    need = set(COMMANDS.get(name, ()))
    value = lambda flag: (
        next((w.split("=", 1)[1] for w in words if w.startswith(flag + "=")), None)
        or next((words[i + 1] for i, w in enumerate(words[:-1]) if w == flag), None)
    )
    if name in LOADERS and "--random_init" not in words and hf_source(value("--init_from")):
        need.add("hf")
    if name == "train.py":
        init_from = next((w.split("=", 1)[1] for w in words if w.startswith("--config.init_from=")), None)
        if init_from is None:
            from flaxgpt.train.config_check import load_recipe

            recipe = value("--config") or "configs/shakespeare_char_cpu.py"  # train.py's default
            init_from = load_recipe(os.path.join(root, recipe)).init_from
        if hf_source(init_from):
            need.add("hf")
    if name == "flaxgpt aot" and value("--target"):
        need.update(filter(None, [aot_extra(value("--target"))]))
    return [e for e in EXTRAS if e in need]
