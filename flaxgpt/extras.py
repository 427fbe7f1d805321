"""Optional dependencies: which extra of pyproject.toml provides what, and the one-line error when one
is missing. Entry points check before they load anything, so a missing package is never a traceback:

    extras.require("serve", "python serve.py")
    # error: python serve.py needs the serve extra (starlette is not installed): pip install -e '.[serve]'

COMMANDS says which extras each documented command needs (tests/readme_extras.py reads the README's
command lines with it). Checks use importlib.util.find_spec: nothing is imported.

May import: nothing of flaxgpt (every folder may import it).
"""

from __future__ import annotations

import importlib.util
import os

# extra -> the modules it provides ("a|b": either one will do); the extras of pyproject.toml
EXTRAS = {
    "serve": ("starlette", "uvicorn", "prometheus_client"),
    "hf": ("huggingface_hub", "tokenizers"),
    "eval": ("lm_eval", "accelerate"),
    "plot": ("matplotlib",),
    "tensorboard": ("tensorboardX",),
    "data": ("datasets",),
    "tpu-aot": ("libtpu",),
    "gpu-aot": ("jax_cuda12_plugin|jax_cuda13_plugin",),
}

# a command (script, or `flaxgpt <subcommand>`) -> the extras it always needs
COMMANDS = {
    "serve.py": ("serve",),
    "flaxgpt plot": ("plot",),
    "flaxgpt attention-map": ("plot",),
}
# these load weights through flaxgpt.load: --init_from a GPT-2 name or a Hugging Face directory needs hf
LOADERS = ("sample.py", "serve.py", "flaxgpt eval", "flaxgpt attention-map")
RUN_NAMES = ("resume", "scratch", "auto", "random")  # --init_from values that name no weights
PLATFORM_EXTRAS = {"tpu": "tpu-aot", "cuda": "gpu-aot"}  # what `flaxgpt aot` needs to compile for one


def install_command(extras) -> str:
    names = ",".join([extras] if isinstance(extras, str) else extras)
    return f"pip install -e '.[{names}]'"


def installed(module: str) -> bool:
    """Whether one of `module`'s alternatives ("a|b") can be imported (a module hidden by a None
    entry in sys.modules or refused by an import hook counts as missing)."""
    for name in module.split("|"):
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):  # a blocked parent, or sys.modules[name] without a spec
            continue
    return False


def missing(extra: str) -> str | None:
    """The first module of `extra` that is not installed, or None."""
    return next((m.replace("|", " or ") for m in EXTRAS[extra] if not installed(m)), None)


def message(extra: str, what: str, module: str) -> str:
    return f"error: {what} needs the {extra} extra ({module} is not installed): {install_command(extra)}"


def require(extra: str, what: str) -> None:
    """A one-line SystemExit (exit status 1) naming the install command when `extra` is missing."""
    module = missing(extra)
    if module is not None:
        raise SystemExit(message(extra, what, module))


def hf_source(init_from: str | None) -> bool:
    """--init_from names Hugging Face weights (a GPT-2 name or an HF directory), not a training run."""
    if not init_from or init_from in RUN_NAMES:
        return False
    run = os.path.isfile(os.path.join(init_from, "meta.json")) or os.path.isdir(
        os.path.join(init_from, "checkpoints")
    )
    return not run


def require_hf(init_from: str | None, what: str) -> None:
    """require("hf") when `init_from` names Hugging Face weights (what loads them: `what`)."""
    if hf_source(init_from):
        require("hf", f"{what} {init_from}")
