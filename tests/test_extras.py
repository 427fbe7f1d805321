"""Optional dependencies (flaxgpt.extras): every entry point checks its extras before it loads anything,
and a missing one is one line naming the install command, exit status 1. Modules are hidden the way a
fresh venv lacks them: None in sys.modules in-process, an import hook refusing them in a subprocess."""

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flaxgpt import extras
from tests import readme_extras

ROOT = Path(__file__).resolve().parents[1]


def hide(monkeypatch, *modules):
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)  # `import name` now raises ImportError


def one_line_exit(fn, *args) -> str:
    with pytest.raises(SystemExit) as e:
        fn(*args)
    msg = str(e.value.code)
    assert isinstance(e.value.code, str) and "\n" not in msg, msg  # a str code: printed, exit status 1
    return msg


def test_the_table_matches_pyproject():
    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(extras.EXTRAS) <= set(declared), set(extras.EXTRAS) - set(declared)
    assert set(declared) - set(extras.EXTRAS) == {"dev"}  # every user-facing extra is known here


def test_require_names_the_missing_module_and_the_install_command(monkeypatch):
    assert extras.missing("serve") is None  # this environment has every extra
    hide(monkeypatch, "uvicorn")
    assert extras.missing("serve") == "uvicorn"
    msg = one_line_exit(extras.require, "serve", "python serve.py")
    assert msg == (
        "error: python serve.py needs the serve extra (uvicorn is not installed): pip install -e '.[serve]'"
    )
    hide(monkeypatch, "jax_cuda12_plugin", "jax_cuda13_plugin")  # either CUDA plugin would do
    assert extras.missing("gpu-aot") == "jax_cuda12_plugin or jax_cuda13_plugin"


def script(name):
    sys.path.insert(0, str(ROOT))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT))


def test_every_entry_point_checks_before_loading(monkeypatch, tmp_path):
    from flaxgpt import hf_cli
    from flaxgpt.aot import compile as aot
    from flaxgpt.eval import evaluate, reference
    from flaxgpt.runs import plot
    from flaxgpt.tools import attention_map

    data = tmp_path / "hellaswag.jsonl"
    data.write_text("")
    hide(monkeypatch, "starlette", "huggingface_hub", "matplotlib", "libtpu", "lm_eval")
    hide(monkeypatch, "jax_cuda12_plugin", "jax_cuda13_plugin")
    cases = [  # (entry point, argv, the extra its one line names)
        (script("serve").main, ["--init_from", "gpt2"], "serve"),
        (script("sample").main, ["--init_from", "gpt2"], "hf"),
        (script("sample").main, ["--out_dir", str(tmp_path), "--draft", "gpt2"], "hf"),
        (evaluate.main, ["--init_from", "gpt2", "--task", "hellaswag", "--data", str(data)], "hf"),
        (hf_cli.main, ["info", "gpt2"], "hf"),
        (plot.main, [str(tmp_path)], "plot"),
        (attention_map.main, ["--prompt", "hi"], "plot"),
        (aot.main, ["--config", "configs/shakespeare_char_cpu.py", "--target", "v5e-8"], "tpu-aot"),
        (aot.main, ["--config", "configs/shakespeare_char_cpu.py", "--target", "h100-8"], "gpu-aot"),
        (reference.run_lm_eval, ["model", {}, str(tmp_path)], "eval"),
    ]
    for fn, argv, extra in cases:
        args = argv if fn is reference.run_lm_eval else [argv]
        msg = one_line_exit(fn, *args)
        assert msg.startswith("error: ") and msg.endswith(f"pip install -e '.[{extra}]'"), (argv, msg)
    # what needs no extra does not ask for one: a run directory, random weights
    assert not extras.hf_source("resume") and not extras.hf_source("random")
    (tmp_path / "meta.json").write_text("{}")
    assert not extras.hf_source(str(tmp_path)) and extras.hf_source(str(tmp_path / "nope"))


BLOCKER = """
import importlib.abc, sys
class Blocker(importlib.abc.MetaPathFinder):  # what a venv without the extra looks like
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Blocker())
"""


@pytest.mark.parametrize(
    "argv, blocked, extra",
    [
        (["serve.py", "--init_from", "gpt2", "--random_init"], ("starlette",), "serve"),
        (["train.py", "--config.tensorboard=True", "--config.max_iters=1"], ("tensorboardX",), "tensorboard"),
    ],
)
def test_a_script_without_its_extra_is_one_line_and_exit_1(tmp_path, argv, blocked, extra):
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(BLOCKER.format(blocked=set(blocked))))
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}", JAX_PLATFORMS="cpu")
    r = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 1, r.stderr[-2000:]
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: ") and line.endswith(f"pip install -e '.[{extra}]'"), r.stderr
    assert f"({blocked[0]} is not installed)" in line


def test_needed_by_reads_a_command_line():
    assert readme_extras.needed_by("python serve.py --init_from gpt2 --slots 16") == ["serve", "hf"]
    assert readme_extras.needed_by("python serve.py --init_from gpt2 --random_init") == ["serve"]
    assert readme_extras.needed_by("python sample.py --out_dir out/x --start hi") == []
    assert readme_extras.needed_by("python sample.py --init_from=gpt2-medium --draft gpt2") == ["hf"]
    assert readme_extras.needed_by("flaxgpt aot --config configs/gpt2_124m.py --target v5e-8") == ["tpu-aot"]
    assert readme_extras.needed_by("flaxgpt aot --config configs/gpt2_124m.py --target h100-8") == ["gpu-aot"]
    assert readme_extras.needed_by("flaxgpt eval --init_from gpt2 --task hellaswag --data x") == ["hf"]
    assert readme_extras.needed_by("flaxgpt plot out/x  # metrics.png") == ["plot"]
    assert readme_extras.needed_by("python train.py --config configs/shakespeare_char_cpu.py") == []
