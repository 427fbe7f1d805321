"""Every recipe in configs/ compiles for the smallest target its docstring names and fits with 10%
headroom, its model reduced so that CI's 2 cores compile each in seconds.

A recipe that starts from another recipe's run takes that recipe's model. Reduced (and only this):
2 layers (encoder-decoder: 1 encoder + 1 decoder layer), block_size at most 64, 16 channels per head
(the head count is the recipe's, so GQA and sharding divisibility are kept), MLP and expert widths
scaled with it, a vocabulary of at most 512, grad_accum at most 2 and one row per device per
micro-batch; the train step only (the optimizer, donation, dtypes, remat, attention and mesh settings
are the recipe's). Width matters to CI: TPU compile time grows with it (a 768-wide speedrun took 18 s
to compile, 6 s at 128 wide). The full-size recipes on their targets are benchmarks/aot_targets.py's
(docs/aot.md).
"""

import dataclasses
import functools
from pathlib import Path

import pytest

from flaxgpt.aot import compile as aot
from flaxgpt.aot import programs, targets
from flaxgpt.models import registry as models

RECIPES = sorted(str(p) for p in Path("configs").glob("*.py"))


@functools.cache
def run_makers() -> dict:
    """{out_dir: the recipe that writes it}."""
    return {aot.load_config(["--config", r])[0].out_dir: r for r in RECIPES}


def start_from_run(config) -> None:
    """A recipe whose init_from is another recipe's run (configs/grpo_count.py: configs/count_sft.py's
    out_dir, made by training that one first) compiles with that recipe's model, from scratch."""
    makers = run_makers()
    if config.init_from in makers and not Path(config.init_from).exists():
        maker, _ = aot.load_config(["--config", makers[config.init_from]])
        with config.unlocked():
            config.model, config.init_from = maker.model, "scratch"


def reduced(config, n_devices: int):
    mc, _ = programs.model_config(config)
    layers = {"n_layer": 2} if models.kind_of(mc) == "gpt" else {"n_enc_layer": 1, "n_dec_layer": 1}
    width = mc.n_head * 16
    hidden = {f: 4 * width for f in ("mlp_hidden", "d_ff") if getattr(mc, f, 0)}
    hidden |= {f: 2 * width for f in ("expert_hidden", "shared_expert_hidden") if getattr(mc, f, 0)}
    if getattr(mc, "head_size", 0):
        hidden["head_size"] = 16
    mc = dataclasses.replace(
        mc,
        block_size=min(mc.block_size, 64),
        n_embd=width,
        vocab_size=min(mc.vocab_size, 512),
        **hidden,
        **layers,
    )
    config.grad_accum = min(config.grad_accum, 2)
    config.batch_size = config.grad_accum * n_devices
    return mc


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES, ids=[Path(r).stem for r in RECIPES])
def test_recipe_fits_its_smallest_target(recipe):
    """The smallest of the recipe's targets this machine can compile for (CI has libtpu, not the CUDA
    plugin: a recipe that names a TPU target is compiled for it even when a GPU target is smaller)."""
    import importlib.util

    plugins = {"tpu": "libtpu", "cuda": "jax_cuda12_plugin"}
    names = targets.recipe_targets(recipe)
    usable = [n for n in names if targets.get(n).platform not in plugins
              or importlib.util.find_spec(plugins[targets.get(n).platform])]  # fmt: skip
    if not usable:
        pytest.skip(f"{Path(recipe).name} names only {names}: their compiler plugin is not installed here")
    target = targets.smallest(usable)
    config, _ = aot.load_config(["--config", recipe])
    start_from_run(config)
    devices = target.devices()
    mc = reduced(config, len(devices))
    (row,) = aot.run(config, target, ("train",), mc=mc, print_fn=lambda *_: None)[0]
    assert row.fits(0.1), (
        f"{recipe} on {target.name}: {row.total / 1e9:.2f} GB of {row.memory / 1e9:.2f} {row.error}"
    )
    assert row.total > row.parameters > 0
