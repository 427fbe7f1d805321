"""Decoding's fused kernels in the GPT (models.layers.sublayer_input, models.linear, kernels.pallas_decode):
with FLAXGPT_DECODE_KERNELS=on (the kernels interpreted on the CPU) a cached decode gives the logits
of XLA's path (off), float32 tightly and bfloat16 within its rounding, for GPT-2's block and a
Llama-style one; a prefill's rows, and auto on a CPU, keep XLA's path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxgpt.models.cache import KVCache
from flaxgpt.models.gpt import GPT, GPTConfig, init_params, quantize_params

GPT2 = dict(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=32)
LLAMA = dict(GPT2, norm="rmsnorm", glu=True, activation="silu", bias=False, qkv_bias=False, n_kv_head=1)
UNTIED = dict(LLAMA, tie_embeddings=False)  # ln_f in lm_head's product (models.linear's pre_norm)


def decode(cfg, params, tokens_BT, steps: int):
    """Prefill, then `steps` one-token calls: the logits of each call and the jaxprs' text."""
    model = GPT(cfg)
    B, T = tokens_BT.shape
    apply = jax.jit(lambda p, t, pos, c: model.apply({"params": p}, t, positions=pos, cache=c))
    cache = KVCache.for_config(cfg, batch=B, max_len=cfg.block_size)
    pos_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
    texts = [str(jax.make_jaxpr(apply)(params, tokens_BT, pos_BT, cache))]
    logits, cache = apply(params, tokens_BT, pos_BT, cache)
    out = [logits[:, -1]]
    for i in range(steps):
        tok = jnp.argmax(out[-1], axis=-1)[:, None].astype(jnp.int32)
        pos = jnp.full((B, 1), T + i, jnp.int32)
        texts.append(str(jax.make_jaxpr(apply)(params, tok, pos, cache)))
        logits, cache = apply(params, tok, pos, cache)
        out.append(logits[:, -1])
    return [np.asarray(o, np.float32) for o in out], texts


@pytest.mark.parametrize("arch", ["gpt2", "llama", "untied"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_with_kernels_equals_xla(arch, dtype, monkeypatch):
    kw = {"gpt2": GPT2, "llama": LLAMA, "untied": UNTIED}[arch]
    cfg = GPTConfig(**kw, dtype=dtype, param_dtype=dtype)
    params = init_params(GPTConfig(**kw), jax.random.key(0))
    params = jax.tree_util.tree_map(lambda a: (a + 0.02 * jnp.sign(a)).astype(dtype), params)  # biases not 0
    tokens = jax.random.randint(jax.random.key(1), (2, 5), 0, 61)
    monkeypatch.setenv("FLAXGPT_DECODE_KERNELS", "off")
    want, texts = decode(cfg, params, tokens, 2)
    assert not any("pallas_call" in t for t in texts)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == "float32" else dict(atol=1e-2, rtol=1e-2)  # bf16: ~2 ulps
    # on: each step's blocks take 5 kernels a layer (ln_1 + c_attn, attention + cache writes, c_proj + x,
    # ln_2 + c_fc, c_proj + x), and ln_f + the head (tied or not) one; attention: the attention and
    # cache writes alone, the norms and products XLA's; the prefill's 10 rows (> MAX_ROWS 8) keep
    # XLA's path either way
    for mode, gemvs in (("on", 4 * cfg.n_layer + 1), ("attention", 0)):
        monkeypatch.setenv("FLAXGPT_DECODE_KERNELS", mode)
        got, texts = decode(cfg, params, tokens, 2)
        assert [t.count("pallas_call") for t in texts] == [0] + [cfg.n_layer + gemvs] * 2
        assert [t.count("name=decode_gemv") for t in texts] == [0, gemvs, gemvs]
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, **tol)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_bf16_rows_take_the_kernels_and_equal_xla(arch, monkeypatch):
    """`--quantize bf16` (every weight as its rows [N, K], the tied head an lm_head over the table):
    with the kernels on, each product reads the rows as they lie (pallas_decode.gemv(rows_w=True)),
    5 kernels a layer and ln_f + the head one, as float weights; the logits within bf16's rounding of
    XLA's quantized path. int8 rows keep kernels.qmatmul's products (only the attention kernel a layer)."""
    kw = {"gpt2": GPT2, "llama": LLAMA}[arch]
    cfg = GPTConfig(**kw, dtype="bfloat16")
    params = init_params(GPTConfig(**kw), jax.random.key(0))
    params = jax.tree_util.tree_map(lambda a: a + 0.02 * jnp.sign(a), params)  # biases not 0
    tokens = jax.random.randint(jax.random.key(1), (2, 5), 0, 61)
    qcfg, qparams = quantize_params(cfg, params, "bf16")
    monkeypatch.setenv("FLAXGPT_DECODE_KERNELS", "off")
    want, _ = decode(qcfg, qparams, tokens, 2)
    monkeypatch.setenv("FLAXGPT_DECODE_KERNELS", "on")
    from flaxgpt.kernels import pallas_decode

    asked, gemv = [], pallas_decode.gemv
    monkeypatch.setattr(pallas_decode, "gemv", lambda *a, **k: asked.append(k["rows_w"]) or gemv(*a, **k))
    got, texts = decode(qcfg, qparams, tokens, 2)
    L = cfg.n_layer
    assert [t.count("pallas_call") for t in texts] == [0, 5 * L + 1, 5 * L + 1]
    assert asked == [True] * (4 * L + 1)  # every product but the attention's, as rows (traced once)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-2, rtol=1e-2)
    qcfg, qparams = quantize_params(cfg, params, "int8")
    _, texts = decode(qcfg, qparams, tokens, 1)
    assert texts[1].count("pallas_call") == L


def test_auto_is_xla_on_a_cpu_and_bad_modes_are_one_line(monkeypatch):
    cfg = GPTConfig(**GPT2)
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 3), 0, 61)
    monkeypatch.delenv("FLAXGPT_DECODE_KERNELS", raising=False)
    _, texts = decode(cfg, params, tokens, 1)
    assert "pallas_call" not in texts[1]
    monkeypatch.setenv("FLAXGPT_DECODE_KERNELS", "yes")
    with pytest.raises(ValueError, match="FLAXGPT_DECODE_KERNELS='yes': use auto .*, on, attention or off"):
        decode(cfg, params, tokens, 1)


def test_one_decision_a_step(monkeypatch):
    """A decoding step asks linear.decode_kernels once (the GPT), and its blocks' products and cache
    layers follow that answer: forced off there, the step has no kernel although the mode is on."""
    from flaxgpt.models import gpt

    cfg = GPTConfig(**GPT2)
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 3), 0, 61)
    monkeypatch.setenv("FLAXGPT_DECODE_KERNELS", "on")
    asked = []
    monkeypatch.setattr(gpt, "decode_kernels", lambda rows: asked.append(rows) or gpt.NO_KERNELS)
    _, texts = decode(cfg, params, tokens, 1)
    assert asked == [3, 1]  # the prefill's 3 rows, then the step's 1: once each, not per layer
    assert not any("pallas_call" in t for t in texts)


def test_hidden_with_a_cache_is_ln_fs_output_whichever_path(monkeypatch):
    """GPT(hidden=True) with a cache (evaluation's scoring: a context cached, then each continuation's
    few rows) returns ln_f's output and the cache: with the decode kernels on (where ln_f goes into the
    head's product) as off, and head_logits of it are the step's logits. Scoring read ln_f's output
    from captured intermediates before, which the kernels' fused ln_f never produces."""
    from flaxgpt.models.gpt import head_logits

    cfg = GPTConfig(**GPT2)
    params = init_params(cfg, jax.random.key(0))
    model, pos_13 = GPT(cfg), jnp.arange(3)[None]
    out = {}
    for mode in ("off", "on"):
        monkeypatch.setenv("FLAXGPT_DECODE_KERNELS", mode)
        cache = KVCache.for_config(cfg, batch=1, max_len=cfg.block_size)
        h_13D, cache = model.apply(
            {"params": params}, jnp.array([[3, 7, 9]]), positions=pos_13, cache=cache, hidden=True
        )
        logits, _ = model.apply({"params": params}, jnp.array([[5]]), positions=jnp.array([[3]]), cache=cache)
        h_11D, _ = model.apply(
            {"params": params}, jnp.array([[5]]), positions=jnp.array([[3]]), cache=cache, hidden=True
        )
        assert h_13D.shape == (1, 3, 32) and h_11D.shape == (1, 1, 32)
        np.testing.assert_allclose(head_logits(cfg, params, h_11D), logits, atol=2e-5, rtol=2e-5)
        out[mode] = np.asarray(h_11D)
    np.testing.assert_allclose(out["on"], out["off"], atol=2e-5, rtol=2e-5)
