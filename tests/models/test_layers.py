"""Attention and position encodings against float64 NumPy references."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from flaxgpt.models.attention import (
    CrossAttention,
    attend,
    attend_cached,
    causal_mask,
    padding_mask,
    resolve_attention_impl,
)
from flaxgpt.models.layers import (
    sinusoidal_positions,
    swiglu,
)
from flaxgpt.models.rope import RoPE


def np_attention(q, k, v, mask):
    q, k, v = (np.asarray(a, np.float64).transpose(0, 2, 1, 3) for a in (q, k, v))  # [B, H, T, K]
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1])
    s = np.where(mask, s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True) @ v).transpose(0, 2, 1, 3)


def test_attend_matches_float64_with_masks():
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    B, T, S, H, K = 2, 5, 9, 3, 8
    q = jax.random.normal(kq, (B, T, H, K))
    k = jax.random.normal(kk, (B, S, H, K))
    v = jax.random.normal(kv, (B, S, H, K))
    pos = jnp.array([[0, 1, 2, 3, 4], [4, 5, 6, 7, 8]])  # per-row query positions into a cache
    for mask in (causal_mask(pos, S), padding_mask(jnp.array([9, 3]), S)):
        got = attend(q, k, v, mask, impl="xla")
        np.testing.assert_allclose(got, np_attention(q, k, v, np.asarray(mask)), atol=1e-5)


def test_masks():
    m = np.asarray(causal_mask(jnp.array([[2]]), 4))[0, 0, 0]
    np.testing.assert_array_equal(m, [True, True, True, False])
    p = np.asarray(padding_mask(jnp.array([1, 3]), 4))[:, 0, 0]
    np.testing.assert_array_equal(p, [[1, 0, 0, 0], [1, 1, 1, 0]])


def test_cross_attention_ignores_padding_and_precomputed_kv():
    B, T, S, D = 2, 3, 6, 16
    mod = CrossAttention(d_model=D, n_head=4)
    x = jax.random.normal(jax.random.key(0), (B, T, D))
    mem = jax.random.normal(jax.random.key(1), (B, S, D))
    lengths = jnp.array([6, 2])
    params = mod.init(jax.random.key(2), x, mem, lengths)
    y = mod.apply(params, x, mem, lengths)
    # changing padded memory positions of row 1 changes nothing
    mem2 = mem.at[1, 2:].set(100.0)
    np.testing.assert_allclose(mod.apply(params, x, mem2, lengths), y, atol=1e-6)
    kv = mod.apply(params, mem, method=CrossAttention.project_kv)
    np.testing.assert_allclose(mod.apply(params, x, kv, lengths), y, atol=1e-6)


def np_sinusoids(n_pos: int, d: int) -> np.ndarray:
    """The paper's formula as written, in float64: PE(pos, 2i) = sin(pos / 10000^(2i/d)),
    PE(pos, 2i+1) = cos(pos / 10000^(2i/d)) (the Annotated Transformer's loop)."""
    pe = np.zeros((n_pos, d))
    for pos in range(n_pos):
        for i in range(0, d, 2):
            pe[pos, i] = math.sin(pos / 10000 ** (i / d))
            if i + 1 < d:
                pe[pos, i + 1] = math.cos(pos / 10000 ** (i / d))
    return pe


def test_sinusoidal_positions_are_the_papers_interleaved_layout():
    for d in (10, 7, 64):
        got = np.asarray(sinusoidal_positions(jnp.arange(50), d))
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, np_sinusoids(50, d), atol=2e-5)
    with jax.enable_x64(True):  # computed in the model's dtype: exact in float64
        got = np.asarray(sinusoidal_positions(jnp.arange(50), 64, dtype=jnp.float64))
        assert got.dtype == np.float64
        np.testing.assert_allclose(got, np_sinusoids(50, 64), rtol=0, atol=1e-12)


def test_sinusoidal_positions_old_halves_layout_is_kept():
    """Runs saved before the layout field read it as "halves": all sines, then all cosines."""
    got = np.asarray(sinusoidal_positions(jnp.arange(7), 10, layout="halves"))
    i = np.arange(5)
    ang = np.arange(7)[:, None] / 10000 ** (i / 5)
    np.testing.assert_allclose(got, np.concatenate([np.sin(ang), np.cos(ang)], -1), atol=1e-5)


def test_float64_attention_is_exact():
    """Logits in promote_types(dtype, float32): a float64 model is not cut to float32 inside."""
    with jax.enable_x64(True):
        kq, kk, kv = jax.random.split(jax.random.key(0), 3)
        B, T, S, H, K = 2, 5, 9, 3, 8
        q = jax.random.normal(kq, (B, T, H, K), jnp.float64)
        k = jax.random.normal(kk, (B, S, H, K), jnp.float64)
        v = jax.random.normal(kv, (B, S, H, K), jnp.float64)
        mask = causal_mask(jnp.array([[0, 1, 2, 3, 4], [4, 5, 6, 7, 8]]), S)
        want = np_attention(q, k, v, np.asarray(mask))
        got = attend(q, k, v, mask, impl="xla")
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
        k_NSK, v_NSK = (jnp.swapaxes(x, 1, 2).reshape(B * H, S, K) for x in (k, v))  # cache layout
        np.testing.assert_allclose(attend_cached(q, k_NSK, v_NSK, mask), want, rtol=0, atol=1e-12)


def test_resolve_attention_impl_on_cpu(monkeypatch):
    from flaxgpt.models import attention

    monkeypatch.setattr(attention, "accelerator", lambda: "cpu")  # the tests may run on a GPU
    assert resolve_attention_impl("auto", jnp.bfloat16) == "xla"
    assert resolve_attention_impl("cudnn", jnp.float32) == "cudnn"


def test_swiglu_value_and_gradient_equal_autodiff_of_the_plain_expression():
    h = jax.random.normal(jax.random.key(0), (6, 10)) * 3.0  # columns gate | up, F = 5
    w = jax.random.normal(jax.random.key(1), (6, 5))  # a cotangent that is not all ones

    def plain(h):
        gate, up = jnp.split(h, 2, axis=-1)
        return jax.nn.silu(gate) * up

    np.testing.assert_array_equal(swiglu(h), plain(h))
    got = jax.grad(lambda h: jnp.sum(swiglu(h) * w))(h)
    want = jax.grad(lambda h: jnp.sum(plain(h) * w))(h)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_rope_matches_float64_rotate_half():
    B, T, H, K = 2, 7, 3, 8
    x = jax.random.normal(jax.random.key(0), (B, T, H, K))
    pos = jnp.array([[0, 1, 2, 3, 4, 5, 6], [9, 3, 4, 5, 6, 7, 100]])
    rope = RoPE(K, theta=10000.0)
    angles = np.asarray(pos, np.float64)[..., None] * rope.inv_freq()  # [B, T, K/2]
    cos, sin = (np.concatenate([f(angles)] * 2, -1)[:, :, None] for f in (np.cos, np.sin))
    x64 = np.asarray(x, np.float64)
    rotated_half = np.concatenate([-x64[..., K // 2 :], x64[..., : K // 2]], -1)
    np.testing.assert_allclose(rope.apply(x, pos), x64 * cos + rotated_half * sin, atol=1e-5)


def test_rope_gradient_equals_the_float64_inverse_rotation():
    # rope's custom backward rotates the cotangent by minus the angle: d/dx sum(w * R x) = R^T w
    B, T, H, K = 2, 5, 3, 8
    x = jax.random.normal(jax.random.key(0), (B, T, H, K))
    w = jax.random.normal(jax.random.key(1), (B, T, H, K))
    pos = jnp.array([[0, 1, 2, 3, 4], [9, 3, 4, 70, 6]])
    rope = RoPE(K, theta=10000.0)
    got = jax.grad(lambda x: jnp.sum(rope.apply(x, pos) * w))(x)
    angles = np.asarray(pos, np.float64)[..., None, None] * rope.inv_freq()  # [B, T, 1, K/2]
    w1, w2 = np.split(np.asarray(w, np.float64), 2, axis=-1)
    c, s = np.cos(angles), np.sin(angles)
    want = np.concatenate([w1 * c + w2 * s, w2 * c - w1 * s], axis=-1)
    np.testing.assert_allclose(got, want, atol=1e-5)
