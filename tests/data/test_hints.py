"""flaxgpt.data.hints: the missing-data errors suggest the command each recipe's data needs (#55)."""

import ast
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from flaxgpt import loader
from flaxgpt.data import batches, hints
from flaxgpt.train import config_check

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p for p in (ROOT / "configs").glob("*.py") if p.name != "__init__.py")


def options(command: str) -> dict:
    """{option: value} of a prepare command (flags: True), the subcommand under 'command'."""
    words = shlex.split(command.replace("python -m flaxgpt.data.prepare", "flaxgpt prepare"))
    out, i = {"command": words[1]}, 2
    while i < len(words):
        if i + 1 < len(words) and not words[i + 1].startswith("--"):
            out[words[i]], i = words[i + 1], i + 2
        else:
            out[words[i]], i = True, i + 1
    return out


def documented(path: Path, out_dir: str) -> str | None:
    """The recipe docstring's prepare command for out_dir, continuation lines joined."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    doc = re.sub(r"\\\n\s*", "", doc)
    for line in doc.splitlines():
        line = line.split("#")[0].strip()
        if (
            re.match(r"(flaxgpt prepare|python -m flaxgpt.data.prepare)", line)
            and f"--out_dir {out_dir}" in line
        ):
            return line
    return None


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_is_told_its_own_prepare_command(path):
    config = config_check.load_recipe(str(path))
    want = documented(path, config.data.dir)
    if want is None:
        pytest.skip("the recipe documents no prepare command (a base recipe)")
    got, want = options(hints.prepare_command(config, loader.data_tokenizer(config.init_from))), options(want)
    assert got["command"] == want["command"]
    for key in ("--dataset", "--task", "--hf_name", "--out_dir"):
        assert got.get(key) == want.get(key), (key, got, want)
    # the model's tokenizer: the same name, or the recipe's init_from where the docs name a directory
    assert ("--hf_dir" in got) == ("--hf_dir" in want), (got, want)
    for key in ("--tokenizer", "--hf_dir"):
        if key in want and want[key] in ("char", "gpt2"):
            assert got.get(key) == want[key], (key, got, want)
        elif key in want:
            assert got[key] == config.init_from, (key, got, config.init_from)
        elif key == "--tokenizer" and key in got:  # unnamed in the docs: prepare's default
            assert got["--tokenizer"] == ("gpt2" if want["--dataset"] != "shakespeare_char" else "char")


def test_gpt2_finetune_missing_data_names_gpt2_tokens(tmp_path):
    from flaxgpt.train import lm_task

    config = config_check.load_recipe(str(ROOT / "configs" / "finetune_shakespeare.py"))
    config.data.dir = str(tmp_path / "shakespeare")
    with pytest.raises(FileNotFoundError) as e:
        lm_task.open_data(config)
    message = str(e.value)
    assert "\n" not in message
    assert (
        f"flaxgpt prepare --dataset shakespeare --tokenizer gpt2 --out_dir {tmp_path}/shakespeare" in message
    )
    assert "shakespeare_char" not in message


def test_a_missing_split_is_prepared_again_with_overwrite(tmp_path):
    (tmp_path / "meta.json").write_text('{"dtype": "uint16", "vocab_size": 65}')
    np.arange(100, dtype=np.uint16).__mod__(65).astype(np.uint16).tofile(tmp_path / "train.bin")
    with pytest.raises(FileNotFoundError, match=r"val.bin is missing; prepare it with: .* --overwrite$"):
        batches.TokenData(tmp_path, "prepare it with: flaxgpt prepare --dataset shakespeare_char --out_dir D")


def test_suggested_commands_quote_paths_with_spaces(tmp_path):
    """A data or run directory with a space: the printed command pastes as one word per path (it split)."""
    from flaxgpt.runs.metrics import closing_lines

    c = config_check.load_recipe(str(ROOT / "configs" / "shakespeare_char_cpu.py"))
    c.data.dir = str(tmp_path / "my data" / "shakespeare_char")
    assert options(hints.prepare_command(c, None))["--out_dir"] == c.data.dir
    run = str(tmp_path / "run one")
    line = closing_lines(10, 1.0, 2.0, f"{run}/checkpoints/10", run)[-1]
    assert shlex.split(line.split(": ", 1)[1])[-1] == run
