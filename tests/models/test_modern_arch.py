"""The speedrun's architecture options: ReLU^2, zero-initialised projections, U-net skip connections
and value embeddings (each causal, each decoding from the KV cache like the full forward pass)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxgpt.models.cache import KVCache
from flaxgpt.models.gpt import GPT, GPTConfig, init_params
from flaxgpt.models.layers import activation_fn

CFG = GPTConfig(vocab_size=50, block_size=16, n_layer=4, n_head=2, n_embd=16, tie_embeddings=False)


def logits(cfg, params, tokens):
    return np.asarray(GPT(cfg).apply({"params": params}, jnp.asarray(tokens)))


def test_relu_squared():
    x = jnp.linspace(-2, 2, 9)
    np.testing.assert_allclose(activation_fn("relu2")(x), np.maximum(np.asarray(x), 0) ** 2)


def test_zero_initialised_projections():
    cfg = dataclasses.replace(CFG, zero_init_proj=True)
    p = init_params(cfg, jax.random.key(0))
    for i in range(cfg.n_layer):
        assert not p[f"h_{i}"]["attn"]["c_proj"]["kernel"].any()
        assert not p[f"h_{i}"]["mlp"]["c_proj"]["kernel"].any()
        assert p[f"h_{i}"]["mlp"]["c_fc"]["kernel"].any()  # only the outputs start at zero
    assert not p["lm_head"]["kernel"].any()
    assert not logits(cfg, p, np.ones((1, 8), np.int32)).any()  # a uniform prediction at step 0
    assert init_params(CFG, jax.random.key(0))["h_0"]["mlp"]["c_proj"]["kernel"].any()


def test_unet_and_value_embeddings_reduce_to_the_plain_model():
    cfg = dataclasses.replace(CFG, unet_skips=True, value_embeds=2)
    p = init_params(cfg, jax.random.key(0))
    assert p["skip_weights"].shape == (2,)  # blocks 2 and 3 receive blocks 1 and 0
    assert p["value_embed_0"]["embedding"].shape == p["value_embed_1"]["embedding"].shape == (50, 16)
    assert all("ve_lambdas" in p[f"h_{i}"]["attn"] for i in range(4))  # blocks 0, 1 and 2, 3
    plain = {k: v for k, v in p.items() if k != "skip_weights" and not k.startswith("value_embed")}
    for i in range(4):
        attn = {k: v for k, v in p[f"h_{i}"]["attn"].items() if k != "ve_lambdas"}
        plain[f"h_{i}"] = {**p[f"h_{i}"], "attn": attn}
    tokens = np.random.RandomState(0).randint(0, 50, (2, 16))
    want = logits(CFG, plain, tokens)
    assert np.abs(logits(cfg, p, tokens) - want).max() > 1e-3  # the options change the model ...
    p["skip_weights"] = jnp.zeros(2)  # ... and with the skips off and values unmixed, are it
    for i in range(4):
        p[f"h_{i}"]["attn"]["ve_lambdas"] = jnp.array([1.0, 0.0])
    np.testing.assert_allclose(logits(cfg, p, tokens), want, atol=1e-5)


def test_the_speedrun_architecture_is_causal_and_decodes_from_the_cache():
    speedrun = dict(pos_embedding="rope", norm="rmsnorm", qk_norm=True, logit_softcap=3.0, activation="relu2")
    cfg = dataclasses.replace(CFG, unet_skips=True, value_embeds=2, **speedrun)
    p = init_params(cfg, jax.random.key(1))
    tokens = np.random.RandomState(1).randint(0, 50, (2, 12))
    full = logits(cfg, p, tokens)
    assert "wpe" not in p and np.abs(full).max() < 3.0  # rotary positions; logits capped at 3
    changed = tokens.copy()
    changed[:, 7] = (changed[:, 7] + 1) % 50
    np.testing.assert_allclose(logits(cfg, p, changed)[:, :7], full[:, :7], atol=1e-6)
    model = GPT(cfg)
    apply = jax.jit(model.apply)  # two compiles (prefill, one token) instead of op-by-op
    cache = KVCache.for_config(cfg, batch=2, max_len=16)
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    out, cache = apply({"params": p}, jnp.asarray(tokens[:, :5]), positions=pos, cache=cache)
    np.testing.assert_allclose(out, full[:, :5], atol=1e-5)
    for t in range(5, 12):  # one token at a time
        pos = jnp.full((2, 1), t)
        out, cache = apply({"params": p}, jnp.asarray(tokens[:, t : t + 1]), positions=pos, cache=cache)
        np.testing.assert_allclose(out[:, 0], full[:, t], atol=1e-5)


def test_one_line_errors():
    from flaxgpt.hf import families

    cfg = dataclasses.replace(CFG, unet_skips=True, value_embeds=1)
    held = r"^a gpt2 checkpoint cannot hold unet_skips=True \(it would read back as False\), value_embeds=1 "
    with pytest.raises(ValueError, match=held):
        families.config_to_hf(cfg, "gpt2")
    with pytest.raises(
        ValueError, match=r"^a gpt2 checkpoint cannot hold activation='relu2' \(it has gelu, "
    ):
        families.config_to_hf(dataclasses.replace(CFG, activation="relu2"), "gpt2")
    with pytest.raises(ValueError, match="unet_skips and value_embeds need scan_layers=False"):
        dataclasses.replace(CFG, unet_skips=True, scan_layers=True)
    with pytest.raises(ValueError, match=r"value_embeds 3 must be in \[0, n_layer // 2 = 2\]"):
        dataclasses.replace(CFG, value_embeds=3)
