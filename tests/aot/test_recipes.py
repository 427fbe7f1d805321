"""Every recipe in configs/ compiles for the smallest target its docstring names and fits with 10%
headroom, its model reduced so that CI's 2 cores compile each in seconds.

Reduced (and only this): 2 layers (encoder-decoder: 1 encoder + 1 decoder layer), block_size at most
64, grad_accum at most 2 and one row per device per micro-batch; the train step only (the
optimizer, donation, dtypes, remat, attention and mesh settings are the recipe's). The full-size
recipes on their targets are benchmarks/aot_targets.py's (docs/aot.md).
"""

import dataclasses
from pathlib import Path

import pytest

from flaxgpt.aot import compile as aot
from flaxgpt.aot import programs, targets
from flaxgpt.models import registry as models

RECIPES = sorted(str(p) for p in Path("configs").glob("*.py"))


def reduced(config, n_devices: int):
    mc, _ = programs.model_config(config)
    layers = {"n_layer": 2} if models.kind_of(mc) == "gpt" else {"n_enc_layer": 1, "n_dec_layer": 1}
    mc = dataclasses.replace(mc, block_size=min(mc.block_size, 64), **layers)
    config.grad_accum = min(config.grad_accum, 2)
    config.batch_size = config.grad_accum * n_devices
    return mc


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES, ids=[Path(r).stem for r in RECIPES])
def test_recipe_fits_its_smallest_target(recipe):
    target = targets.smallest(targets.recipe_targets(recipe))
    if target.platform == "tpu":
        pytest.importorskip("libtpu", reason="TPU targets need libtpu: pip install 'jax[tpu]==<jax version>'")
    if target.platform == "cuda":
        pytest.importorskip("jax_cuda12_plugin", reason="GPU targets need the CUDA plugin (flaxgpt[gpu-aot])")
    config, _ = aot.load_config(["--config", recipe])
    devices = target.devices()
    mc = reduced(config, len(devices))
    (row,) = aot.run(config, target, ("train",), mc=mc, print_fn=lambda *_: None)[0]
    assert row.fits(0.1), (
        f"{recipe} on {target.name}: {row.total / 1e9:.2f} GB of {row.memory / 1e9:.2f} {row.error}"
    )
    assert row.total > row.parameters > 0
