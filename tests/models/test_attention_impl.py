"""Attention implementations: `auto` resolution per accelerator and dtype, and every branch equal to XLA.

cuDNN cannot run on CPU: its branch is checked by standing in jax.nn.dot_product_attention's XLA
implementation for the cuDNN call and checking what the branch asks the kernel for. The Pallas
splash kernel runs for real, in interpret mode.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flaxgpt.kernels import pallas_attention
from flaxgpt.models import attention
from flaxgpt.models.attention import attend, resolve_attention_impl
from flaxgpt.models.cache import KVCache
from flaxgpt.models.gpt import GPT, GPTConfig, init_params

BF16_TOL = dict(atol=2e-2, rtol=2e-2)


def qkv(B=2, T=128, H=2, K=32, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.normal(k, (B, T, H, K), jnp.float32).astype(dtype) for k in keys]


def tril(T):
    return jnp.tril(jnp.ones((T, T), bool))[None, None]


@pytest.mark.parametrize(
    "where, dtype, want",
    [
        ("nvidia", jnp.bfloat16, "cudnn"),
        ("nvidia", jnp.float16, "cudnn"),
        ("nvidia", jnp.float32, "xla"),  # cuDNN's flash kernel has no float32 path
        ("tpu", jnp.bfloat16, "pallas"),
        ("tpu", jnp.float32, "pallas"),
        ("cpu", jnp.bfloat16, "xla"),
        ("gpu", jnp.bfloat16, "xla"),  # a non-NVIDIA GPU (ROCm) has no cuDNN
    ],
)
def test_auto_resolution(monkeypatch, where, dtype, want):
    monkeypatch.setattr(attention, "accelerator", lambda: where)
    assert resolve_attention_impl("auto", dtype) == want
    for explicit in ("xla", "cudnn", "pallas"):
        assert resolve_attention_impl(explicit, dtype) == explicit


def test_accelerator_here_and_bad_name():
    backend = jax.default_backend()  # the suite also runs on a GPU (JAX_PLATFORMS=cuda)
    here = {"cpu": ("cpu", "xla"), "gpu": ("nvidia", "cudnn"), "tpu": ("tpu", "pallas")}[backend]
    assert (attention.accelerator(), resolve_attention_impl("auto", jnp.bfloat16)) == here
    assert resolve_attention_impl("auto", jnp.float32) == ("pallas" if backend == "tpu" else "xla")
    with pytest.raises(ValueError, match="unknown attention_impl 'flash'"):
        resolve_attention_impl("flash", jnp.float32)
    with pytest.raises(ValueError, match="attention_impl='flash'"):
        GPTConfig(attention_impl="flash")
    GPTConfig(attention_impl="pallas")


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, dict(atol=2e-6, rtol=2e-6)), (jnp.bfloat16, BF16_TOL)])
def test_xla_equals_jax_dot_product_attention(dtype, tol):
    q, k, v = qkv(T=48, dtype=dtype)
    got = attend(q, k, v, tril(48), impl="xla", is_causal=True)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    assert got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)


@pytest.fixture
def fake_cudnn(monkeypatch):
    """jax.nn.dot_product_attention with implementation="cudnn" answered by the XLA implementation."""
    real, calls = jax.nn.dot_product_attention, []

    def fake(q, k, v, *args, implementation=None, **kw):
        assert implementation == "cudnn"
        calls.append(kw)
        return real(q, k, v, *args, implementation="xla", **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", fake)
    return calls


def test_cudnn_branch_asks_for_causal_and_equals_xla(fake_cudnn):
    q, k, v = qkv(T=64, dtype=jnp.bfloat16)
    want = attend(q, k, v, tril(64), impl="xla", is_causal=True)
    got = attend(q, k, v, tril(64), impl="cudnn", is_causal=True)
    assert fake_cudnn == [{"mask": None, "is_causal": True}]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **BF16_TOL)
    # a padding mask [B, 1, 1, S] goes to the kernel as an explicit mask with every query's row
    pad = jnp.arange(64)[None, None, None, :] < jnp.array([40, 64])[:, None, None, None]
    got = attend(q, k, v, pad, impl="cudnn")
    want = attend(q, k, v, pad, impl="xla")
    assert fake_cudnn[-1]["is_causal"] is False and fake_cudnn[-1]["mask"].shape == (2, 1, 64, 64)
    assert (fake_cudnn[-1]["mask"] == jnp.broadcast_to(pad, (2, 1, 64, 64))).all()
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **BF16_TOL)


def test_cudnn_takes_padding_masks_of_encoders_and_cross_attention():
    """jax's own cuDNN entry point (traced, not run: its shape checks are Python) accepts what the
    encoder-decoder hands it: a padding mask [B, 1, 1, S] over self-attention and over a source of
    another length (cross-attention). On the 2026-11-27 GPU run wmt14_ende_base failed here ("Bias
    must have same seq length as QKV, got 1 and 8")."""
    pytest.importorskip("jax_cuda12_plugin", reason="jax's cuDNN attention traces only with the CUDA plugin")
    q = jax.ShapeDtypeStruct((2, 8, 4, 16), jnp.bfloat16)
    for S in (8, 6):
        kv = jax.ShapeDtypeStruct((2, S, 4, 16), jnp.bfloat16)
        pad = jnp.arange(S)[None, None, None, :] < jnp.array([5, S])[:, None, None, None]
        out = jax.eval_shape(lambda q, k, v, pad=pad: attend(q, k, v, pad, impl="cudnn"), q, kv, kv)
        assert out.shape == (2, 8, 4, 16)


def small_gpt(impl, T=128, **kw):
    return GPTConfig(vocab_size=61, block_size=T, n_layer=1, n_head=2, n_embd=32, attention_impl=impl, **kw)


@pytest.mark.parametrize("impl", ["cudnn", "pallas"])
def test_gpt_forward_and_grads_equal_xla(fake_cudnn, impl, monkeypatch):
    # pallas: also inside nn.scan with remat (the TPU recipe's layout), where a kernel built in one
    # trace and reused in another would leak tracers. cudnn: with the GPU's forms of c_attn (q, k, v
    # as three products) and of the MLP (bias + GELU recomputed in the backward), models/linear.py
    monkeypatch.setenv("FLAXGPT_EPILOGUES", "on")
    dtype, T, kw = (
        ("bfloat16", 32, {}) if impl == "cudnn" else ("float32", 128, dict(scan_layers=True, remat="dots"))
    )
    cfg = small_gpt(impl, T, dtype=dtype, **kw)
    ref = small_gpt("xla", T, dtype=dtype, **kw)
    params = jax.jit(init_params, static_argnums=0)(ref, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, T), 0, 61)

    def loss(p, c):
        logits = GPT(c).apply({"params": p}, tokens).astype(jnp.float32)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    grad_fn = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    (l_got, g_got), (l_want, g_want) = (grad_fn(params, c) for c in (cfg, ref))
    tol = BF16_TOL if impl == "cudnn" else dict(atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(l_got, l_want, **tol)
    for a, b in zip(jax.tree_util.tree_leaves(g_got), jax.tree_util.tree_leaves(g_want)):
        np.testing.assert_allclose(a, b, atol=tol["atol"] * 0.1, rtol=tol["rtol"] * 10)
    assert len(fake_cudnn) == (1 if impl == "cudnn" else 0)  # one layer, traced once


def test_pallas_matches_xla_bf16_and_only_on_its_path(monkeypatch):
    q, k, v = qkv(B=1, T=128, H=1, dtype=jnp.bfloat16, seed=3)
    got = attend(q, k, v, tril(128), impl="pallas", is_causal=True)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **BF16_TOL)

    def refuse(*a):
        raise AssertionError("the splash kernel must not run here")

    monkeypatch.setattr(pallas_attention, "causal_attention", refuse)
    q, k, v = qkv(T=48)  # not a multiple of the kernel's 128-token blocks
    np.testing.assert_allclose(
        attend(q, k, v, tril(48), impl="pallas", is_causal=True),
        attend(q, k, v, tril(48), impl="xla"),
        atol=1e-6,
    )
    # cached decoding keeps the explicit-mask path: one new token at position 5 of a 128-slot cache
    cfg = small_gpt("pallas")
    params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 6), 0, 61)
    full = jax.jit(lambda t: GPT(cfg).apply({"params": params}, t))(tokens)
    cache = KVCache.init(cfg.n_layer, 1, 128, cfg.n_head, cfg.head_dim, jnp.float32)
    pos = jnp.arange(6)[None]
    step = jax.jit(lambda t, p, c: GPT(cfg).apply({"params": params}, t, positions=p, cache=c))
    _, cache = step(tokens[:, :5], pos[:, :5], cache)
    last, _ = step(tokens[:, 5:], pos[:, 5:], cache)
    np.testing.assert_allclose(last[:, 0], full[:, 5], atol=1e-5)


@pytest.mark.devices(8)
def test_pallas_on_several_tpu_chips_needs_a_mesh(monkeypatch):
    monkeypatch.setattr(pallas_attention.target, "platform", lambda: "tpu")
    assert not pallas_attention.fits(128, 128, 8)  # 8 devices, no mesh context: XLA's path
    assert not pallas_attention.fits(96, 96, 8) and not pallas_attention.fits(128, 256, 8)
    mesh = Mesh(np.asarray(jax.devices()).reshape(4, 2), ("data", "fsdp"))
    with jax.set_mesh(mesh):
        assert pallas_attention.fits(128, 128, 8) and pallas_attention.fits(1024, 1024, 16)
        assert not pallas_attention.fits(128, 128, 4)  # rows cannot be split over 8 devices


@pytest.mark.devices(8)
def test_pallas_under_a_mesh_runs_per_device_rows():
    mesh = Mesh(np.asarray(jax.devices()).reshape(4, 2), ("data", "fsdp"))
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    q, k, v = (jax.device_put(a, rows) for a in qkv(B=8, T=128, H=1, K=16, seed=5))
    with jax.set_mesh(mesh):
        fn = jax.jit(lambda q, k, v: attend(q, k, v, None, impl="pallas", is_causal=True))
        assert "shard_map" in str(jax.make_jaxpr(fn)(q, k, v))
        got = fn(q, k, v)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    np.testing.assert_allclose(got, want, atol=2e-6)
