"""models/lora.py on tiny random GPTs: the adapted forward equals the merged weights' forward
(fused q|k|v and gate|up column blocks, scan_layers or not), gradients reach only the adapters,
bf16 and int8 bases, dropout only in training, and the target errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from flaxgpt.models import gpt, lora
from flaxgpt.models.gpt import GPTConfig

GPT2 = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
LLAMA = dataclasses.replace(
    GPT2,
    pos_embedding="rope",
    norm="rmsnorm",
    activation="silu",
    glu=True,
    mlp_hidden=48,
    n_kv_head=2,
    bias=False,
)
TOKENS = np.random.RandomState(0).randint(0, 64, (2, 16))


def random_adapters(config, spec, seed=1):
    """Non-zero A and B (B starts at zero in training: nothing would be tested)."""
    adapters = lora.init_adapters(config, spec, jax.random.key(seed))
    leaves, tree = jax.tree_util.tree_flatten(adapters)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    return jax.tree_util.tree_unflatten(
        tree, [0.2 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)]
    )


@pytest.mark.parametrize(
    "config, targets, scan",
    [
        (LLAMA, "all-linear", False),
        (LLAMA, "k,v,up", True),
        (GPT2, "all-linear", True),
        (GPT2, "qkv,down", False),
    ],
)
def test_apply_equals_merged_weights(config, targets, scan):
    config = dataclasses.replace(config, scan_layers=scan)
    base = gpt.init_params(config, jax.random.key(0))
    spec = lora.LoraSpec.make(config, 4, 8.0, 0.0, targets)
    adapters = random_adapters(config, spec)
    got = jax.jit(lambda b, a: lora.apply(config, spec, b, a, TOKENS))(base, adapters)
    plain_fwd = jax.jit(lambda p: gpt.GPT(config).apply({"params": p}, TOKENS))
    want, plain = plain_fwd(lora.merge(config, spec, base, adapters)), plain_fwd(base)
    assert np.abs(np.asarray(got - want)).max() < 1e-5
    assert np.abs(np.asarray(got - plain)).max() > 1e-2  # the adapters do something


def test_gradients_reach_only_the_adapters_and_b_starts_at_zero():
    base = gpt.init_params(LLAMA, jax.random.key(0))
    spec = lora.LoraSpec.make(LLAMA, 4, 8.0)
    adapters = lora.init_adapters(LLAMA, spec, jax.random.key(1))
    np.testing.assert_array_equal(
        lora.apply(LLAMA, spec, base, adapters, TOKENS), gpt.GPT(LLAMA).apply({"params": base}, TOKENS)
    )
    grads = jax.grad(lambda a: lora.apply(LLAMA, spec, base, a, TOKENS).sum())(adapters)
    b_grads = [g for p, g in jax.tree_util.tree_flatten_with_path(grads)[0] if p[-1].key.endswith("_b")]
    assert all(float(jnp.abs(g).max()) > 0 for g in b_grads)


@pytest.mark.parametrize("dtype, tol", [("bfloat16", 0.05), ("int8", 0.05)])
def test_quantized_bases_stay_close_and_train(dtype, tol):
    config = dataclasses.replace(LLAMA, scan_layers=True)
    base = gpt.init_params(config, jax.random.key(0))
    spec = lora.LoraSpec.make(config, 4, 8.0)
    adapters = random_adapters(config, spec)
    qbase = lora.quantize_base(base, dtype)
    fwd = jax.jit(lambda b, a: lora.apply(config, spec, b, a, TOKENS))
    got, want = fwd(qbase, adapters), fwd(base, adapters)
    assert np.abs(np.asarray(got - want)).max() < tol * np.abs(np.asarray(want)).max()
    grads = jax.jit(jax.grad(lambda a: lora.apply(config, spec, qbase, a, TOKENS).sum()))(adapters)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree_util.tree_leaves(grads))


def test_dropout_only_when_training():
    base = gpt.init_params(LLAMA, jax.random.key(0))
    spec = lora.LoraSpec.make(LLAMA, 4, 8.0, 0.5)
    adapters = random_adapters(LLAMA, spec)
    run = lambda det, seed: lora.apply(
        LLAMA, spec, base, adapters, TOKENS, deterministic=det, rng=jax.random.key(seed)
    )  # noqa: E731
    np.testing.assert_array_equal(run(True, 0), run(True, 1))
    assert np.abs(np.asarray(run(False, 0) - run(False, 1))).max() > 1e-3


@pytest.mark.parametrize(
    "config, kw, message",
    [
        (GPT2, dict(targets="q,v"), "this GPT-2-style model has no q, v"),
        (LLAMA, dict(targets="qkv"), "this Llama-family model has no qkv"),
        (LLAMA, dict(targets=""), "has no targets"),
        (LLAMA, dict(rank=0), "rank 0 must be > 0"),
        (LLAMA, dict(dropout=1.0), "dropout 1.0"),
    ],
)
def test_bad_specs(config, kw, message):
    args = dict(rank=4, alpha=8.0, dropout=0.0, targets="all-linear") | kw
    with pytest.raises(ValueError, match=message):
        lora.LoraSpec.make(config, **args)


def test_adapters_of_another_shape_are_named():
    spec = lora.LoraSpec.make(LLAMA, 4, 8.0)
    adapters = lora.init_adapters(
        dataclasses.replace(LLAMA, n_embd=64, mlp_hidden=96), spec, jax.random.key(0)
    )
    with pytest.raises(ValueError, match=r"adapter tensor h_0/attn/c_attn/\w+ has shape"):
        lora.check_adapters(LLAMA, spec, adapters)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_an_abstract_base_lowers_ahead_of_time(dtype):
    """What an ahead-of-time compile of a LoRA step sees: no weights, only shapes."""
    config = dataclasses.replace(LLAMA, scan_layers=True)
    spec = lora.LoraSpec.make(config, 4, 8.0)
    base = jax.eval_shape(lambda b: lora.quantize_base(b, dtype), nn.unbox(gpt.abstract_params(config)))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(base))
    adapters = jax.eval_shape(lambda: lora.init_adapters(config, spec, jax.random.key(0)))
    grad = jax.grad(lambda a, b: lora.apply(config, spec, b, a, TOKENS).sum())
    text = jax.jit(grad).lower(adapters, base).as_text()
    assert ("i8" in text) == (dtype == "int8")
