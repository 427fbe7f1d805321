"""Gemma's attention options against a float64 reference, and on every attention path.

`scale` (1/sqrt(query_pre_attn_scalar)), `softcap` (Gemma 2) and a sliding window: the XLA path equals
numpy in float64; the Pallas splash kernel (interpret mode, its local mask and soft-cap) and the cuDNN
branch (answered by XLA, as in test_attention_impl) give the same, and cuDNN never gets a soft-cap.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxgpt.kernels import pallas_attention
from flaxgpt.models.attention import attend, causal_mask
from flaxgpt.models.gpt import GPT, GPTConfig, init_params
from tests.models.test_attention_impl import fake_cudnn, qkv, tril  # noqa: F401  (a fixture)


def reference(q, k, v, scale, softcap, window):
    """softmax(cap * tanh(q k^T * scale / cap) + causal window mask) v, float64 numpy."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    logits = np.einsum("bthk,bshk->bhts", q, k) * scale
    if softcap:
        logits = softcap * np.tanh(logits / softcap)
    t, s = np.arange(q.shape[1])[:, None], np.arange(k.shape[1])[None, :]
    visible = (s <= t) & ((s > t - window) if window else True)
    logits = np.where(visible, logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return np.einsum("bhts,bshk->bthk", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("softcap, window", [(0.0, 0), (2.0, 0), (0.0, 7), (2.0, 7)])
def test_xla_equals_float64(softcap, window):
    q, k, v = qkv(T=24, K=16)
    mask = causal_mask(jnp.arange(24)[None], 24, window)
    got = attend(q, k, v, mask, impl="xla", scale=0.3, softcap=softcap)
    np.testing.assert_allclose(got, reference(q, k, v, 0.3, softcap, window), atol=1e-5)


def test_pallas_with_a_scale_equals_xla():
    q, k, v = qkv(B=1, T=128, H=1)
    want = attend(q, k, v, tril(128), impl="xla", scale=0.3)
    np.testing.assert_allclose(
        attend(q, k, v, tril(128), impl="pallas", is_causal=True, scale=0.3), want, atol=1e-5
    )
    # a shape the kernel does not tile falls back to XLA, scaled once
    q48, k48, v48 = qkv(B=1, T=48, H=1)
    np.testing.assert_allclose(
        attend(q48, k48, v48, tril(48), impl="pallas", is_causal=True, scale=0.3),
        reference(q48, k48, v48, 0.3, 0.0, 0),
        atol=1e-5,
    )


def test_cudnn_gets_the_scale_and_the_window_mask(fake_cudnn):  # noqa: F811
    q, k, v = qkv(T=32)
    mask = causal_mask(jnp.arange(32)[None], 32, 7)
    got = attend(q, k, v, mask, impl="cudnn", scale=0.3)
    np.testing.assert_allclose(got, reference(q, k, v, 0.3, 0.0, 7), atol=1e-5)
    assert len(fake_cudnn) == 1 and fake_cudnn[0]["scale"] == 0.3 and fake_cudnn[0]["mask"] is not None
    attend(q, k, v, mask, impl="cudnn", scale=0.3, softcap=2.0)
    assert len(fake_cudnn) == 1  # soft-capped: XLA


@pytest.mark.parametrize("impl", ["cudnn", "pallas"])
def test_a_gemma2_model_on_the_fused_paths_equals_xla(fake_cudnn, impl, monkeypatch):  # noqa: F811
    pallas_calls, real = [], pallas_attention.causal_attention
    monkeypatch.setattr(pallas_attention, "causal_attention", lambda *a: pallas_calls.append(a) or real(*a))
    base = dict(GPTConfig.PRESETS["gemma-2-2b"], vocab_size=61, block_size=128, n_layer=2, n_head=2)
    base.update(
        n_kv_head=1, n_embd=32, head_size=16, mlp_hidden=48, sliding_window=9, query_pre_attn_scalar=12.0
    )
    ref = GPTConfig(**base, attention_impl="xla")
    params = init_params(ref, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 128), 0, 61)
    for extra in ({}, {"attn_softcap": 0.0}):  # Gemma 2's soft-cap (XLA), then without (a fused kernel)
        want = GPT(GPTConfig(**{**base, **extra}, attention_impl="xla")).apply({"params": params}, tokens)
        got = GPT(GPTConfig(**{**base, **extra}, attention_impl=impl)).apply({"params": params}, tokens)
        np.testing.assert_allclose(got, want, atol=1e-4)
    # cuDNN ran both layers (the window layer with its explicit mask) without the soft-cap, none with it
    assert len(fake_cudnn) == (2 if impl == "cudnn" else 0)
    assert len(pallas_calls) == (4 if impl == "pallas" else 0)  # both layers, both times


@pytest.mark.parametrize("softcap, window", [(2.0, 0), (0.0, 7), (2.0, 7)])
def test_splash_kernel_does_the_window_and_the_softcap(monkeypatch, softcap, window):
    """The splash kernel (interpret mode) with its local mask and soft-cap equals float64; it ran."""
    calls, real = [], pallas_attention.causal_attention

    def spy(*a):
        calls.append(a[-2:])
        return real(*a)

    monkeypatch.setattr(pallas_attention, "causal_attention", spy)
    q, k, v = qkv(B=1, T=128, H=2, K=16)
    mask = causal_mask(jnp.arange(128)[None], 128, window)
    got = attend(q, k, v, mask, impl="pallas", is_causal=True, scale=0.3, softcap=softcap, window=window)
    np.testing.assert_allclose(got, reference(q, k, v, 0.3, softcap, window), atol=1e-5)
    assert calls == [(window, softcap)]
