"""model.fp8 in a mixture of experts: the scaled float8 grouped product (kernels/fp8.py's fp8_grouped
over moe.py's tiled form) and its gradients against float64 within float8's rounding bound, over
groups of unequal sizes with an empty one; its dots are float8; a tiny Mixtral-style GPT with
model.fp8 + fp8_experts stays near the float32 model and trains (model.fp8 alone leaves the routed
experts in the compute dtype), and with FLAXGPT_GROUPED=pallas (kernels/pallas_grouped.py's kernels)
gives the tiled float8 form's logits, loss and gradients; adapted experts are refused in one line."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxgpt.kernels import fp8
from flaxgpt.kernels.fp8 import E4M3, E5M2, fp8_grouped
from flaxgpt.models import gpt, lora
from flaxgpt.models.gpt import GPTConfig
from flaxgpt.models.moe import tiled_grouped_matmul, tiled_weight_grad
from tests.train.test_fp8_train import _losses

GROUPS = np.array([13, 0, 20, 5], np.int32)  # unequal, one empty, 2 rows past the groups (A = 40)


def grouped(x, w, group_sizes):
    return fp8_grouped(x, w, group_sizes, tiled_grouped_matmul, tiled_weight_grad)


def element_error(a, f8, amax):
    """The largest error of one element of `a` quantized under a per-tensor scale fp8_max / amax: u |a|
    for a normal value, half a subnormal step (in a's units) below the normal range."""
    return fp8.UNIT_ROUNDOFF[f8] * np.abs(a) + fp8.SUBNORMAL_STEP[f8] / 2 * amax / float(jnp.finfo(f8).max)


def product_bound(a, ea, b, eb):
    """|ã b̃ - a b| elementwise for [M, K] @ [K, N] of rounded operands (errors ea, eb), plus float32
    accumulation over K: first- and second-order rounding terms."""
    mags = (np.abs(a) + ea) @ (np.abs(b) + eb)
    return ea @ np.abs(b) + np.abs(a) @ eb + ea @ eb + a.shape[1] * 2.0**-24 * mags


def operands(x_scale, w_scale, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((40, 24)) * x_scale).astype(np.float32)
    w = (rng.standard_normal((4, 24, 16)) * w_scale).astype(np.float32)
    return x, w


def spans():
    ends = np.cumsum(GROUPS)
    return [slice(e - n, e) for n, e in zip(GROUPS, ends)]


# large activations overflow e4m3 unscaled; tiny ones sit in its subnormals
@pytest.mark.parametrize("x_scale,w_scale", [(1.0, 0.02), (3e3, 0.02), (1e-4, 1e-3)])
def test_grouped_forward_within_rounding_bound(x_scale, w_scale):
    x, w = operands(x_scale, w_scale)
    y = np.asarray(jax.jit(grouped)(x, w, GROUPS), np.float64)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    ex, ew = element_error(x64, E4M3, np.abs(x64).max()), element_error(w64, E4M3, np.abs(w64).max())
    ref, bound = np.zeros_like(y), np.ones_like(y)
    for e, rows in enumerate(spans()):
        ref[rows] = x64[rows] @ w64[e]
        bound[rows] = product_bound(x64[rows], ex[rows], w64[e], ew[e])
    err = np.abs(y - ref)
    assert np.all(err <= bound), f"max err/bound {np.max(err / bound):.3f}"
    assert np.all(y[GROUPS.sum() :] == 0)  # rows past the groups give 0, as ragged_dot's
    assert np.linalg.norm(err) / np.linalg.norm(ref) < 0.06  # e4m3's 2^-4 averaged, not the worst case


def test_grouped_gradients_within_rounding_bound_and_their_dots_float8():
    """dX = dY W[e]^T and dW[e] = X_e^T dY_e with dY in e5m2 and X, W in e4m3, against float64; the
    empty group's dW is 0, the rows past the groups get no gradient."""
    x, w = operands(2.0, 0.05, seed=1)
    dy = (np.random.default_rng(2).standard_normal((40, 16)) * 1e-3).astype(np.float32)
    dy[GROUPS.sum() :] = 0  # the caller drops those rows' outputs: no gradient comes back for them

    def vjp(x, w, dy):
        return jax.vjp(lambda a, b: grouped(a, b, GROUPS), x, w)[1](dy)

    dx, dw = jax.jit(vjp)(x, w, dy)
    assert dx.dtype == dw.dtype == jnp.float32 and dw.shape == w.shape
    x64, w64, dy64 = (a.astype(np.float64) for a in (x, w, dy))
    ex, ew = element_error(x64, E4M3, np.abs(x64).max()), element_error(w64, E4M3, np.abs(w64).max())
    eg = element_error(dy64, E5M2, np.abs(dy64).max())
    for e, rows in enumerate(spans()):
        ref_dx, ref_dw = dy64[rows] @ w64[e].T, x64[rows].T @ dy64[rows]
        assert np.all(np.abs(dx[rows] - ref_dx) <= product_bound(dy64[rows], eg[rows], w64[e].T, ew[e].T))
        assert np.all(np.abs(dw[e] - ref_dw) <= product_bound(x64[rows].T, ex[rows].T, dy64[rows], eg[rows]))
    assert np.all(np.asarray(dw[1]) == 0) and np.all(np.asarray(dx[GROUPS.sum() :]) == 0)
    ref_dw = np.stack([x64[r].T @ dy64[r] for r in spans()])
    assert np.linalg.norm(dw - ref_dw) / np.linalg.norm(ref_dw) < 0.12  # e5m2's 2^-3, averaged
    # the three products multiply float8 operands: forward e4m3 x e4m3, dX e5m2 x e4m3, dW e4m3 x e5m2
    jaxpr = jax.make_jaxpr(vjp)(x, w, dy).jaxpr
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    kinds = sorted(tuple(str(v.aval.dtype) for v in e.invars) for e in dots)
    e4, e5 = "float8_e4m3fn", "float8_e5m2"
    assert kinds == sorted([(e4, e4), (e5, e4), (e4, e5)]), kinds


MIXTRAL = dict(
    GPTConfig.PRESETS["mixtral-8x7b"], vocab_size=32, block_size=16, n_layer=2, n_head=2, n_kv_head=1,
    n_embd=32, mlp_hidden=48, num_experts=4, experts_per_token=2,
)  # fmt: skip


def test_tiny_mixtral_forward_near_float32_and_its_experts_float8():
    config = GPTConfig(**MIXTRAL)
    params = gpt.init_params(config, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, 32, (4, 16)).astype(np.int32)  # 64 tokens: the sorted path

    def forward(c):
        return jax.jit(lambda p, t: gpt.GPT(c).apply({"params": p}, t))

    ref = np.asarray(forward(config)(params, tokens), np.float64)
    fp8_config = dataclasses.replace(config, fp8=True, fp8_experts=True)
    out = np.asarray(forward(fp8_config)(params, tokens), np.float64)
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref - ref.mean(-1, keepdims=True))
    # e4m3's 2^-4 a product, a few products deep, averaged over K: about a per cent of the logits'
    # spread (routing follows the router's float product, which fp8 leaves in the compute dtype)
    assert 0 < rel < 0.04, rel  # 0.012 seen
    text = jax.jit(lambda p, t: gpt.GPT(fp8_config).apply({"params": p}, t)).lower(params, tokens).as_text()
    f8_dots = [line for line in text.splitlines() if "dot_general" in line and "xf8E4M3FN>" in line]
    # per layer: attention's 2 projections (q/k/v fused) and the experts' 2 grouped products, their
    # visits batched [V, b, K] x [V, K, N]
    assert len(f8_dots) == 4 * config.n_layer
    assert sum("batching_dims" in line for line in f8_dots) == 2 * config.n_layer
    # model.fp8 alone (fp8_experts off, the default: the tiled float8 form ran 0.77x bf16 on an H200):
    # attention's products only, the experts' in the compute dtype
    dense_only = dataclasses.replace(fp8_config, fp8_experts=False)
    text = jax.jit(lambda p, t: gpt.GPT(dense_only).apply({"params": p}, t)).lower(params, tokens).as_text()
    f8_dots = [line for line in text.splitlines() if "dot_general" in line and "xf8E4M3FN>" in line]
    assert len(f8_dots) == 2 * config.n_layer and not any("batching_dims" in line for line in f8_dots)


def test_tiny_mixtral_trains_with_fp8():
    config = GPTConfig(**{**MIXTRAL, "dtype": "bfloat16"})
    f8_config = dataclasses.replace(config, fp8=True, fp8_experts=True)
    bf16, f8 = _losses(config, steps=12), _losses(f8_config, steps=12)
    assert np.all(np.isfinite(f8)) and f8[-1] < 0.9 * f8[0]  # it learns
    np.testing.assert_allclose(f8, bf16, rtol=0.02)  # as bf16 does (0.55% apart at most seen)


def test_a_run_trained_with_fp8_experts_decodes_quantized_and_exports():
    """fp8 and fp8_experts are how a run trained: int8 / bf16 decoding and a Hugging Face export drop
    both (quantizing kept fp8_experts without fp8, which the config refuses; the export refused it)."""
    from flaxgpt.hf import families

    config = GPTConfig(**{**MIXTRAL, "fp8": True, "fp8_experts": True})
    params = gpt.init_params(config, jax.random.key(0))
    for mode in ("int8", "bf16"):
        qconfig, _ = gpt.quantize_params(config, params, mode)
        assert not qconfig.fp8 and not qconfig.fp8_experts
    written = families.config_to_hf(config, "mixtral")
    assert families.config_from_hf(written, block_size=config.block_size).num_experts == 4


def test_fp8_with_adapted_experts_is_one_line():
    config = GPTConfig(**{**MIXTRAL, "fp8": True, "fp8_experts": True})
    spec = lora.LoraSpec.make(config, 2, 8.0, targets="q,experts_gate_up")
    base, adapters = (
        gpt.init_params(config, jax.random.key(0)),
        lora.init_adapters(config, spec, jax.random.key(1)),
    )
    with pytest.raises(
        ValueError, match=r"^model.fp8_experts has no float8 path for adapted experts \(mlp\): drop"
    ) as e:
        lora.apply(config, spec, base, adapters, np.zeros((1, 8), np.int32))
    assert "\n" not in str(e.value) and "model.fp8_experts=False" in str(e.value)


def test_tiny_mixtral_with_fp8_experts_through_the_pallas_grouped_gemm(monkeypatch):
    """FLAXGPT_GROUPED=pallas with model.fp8 + fp8_experts: the experts' float8 products go through
    kernels.pallas_grouped's kernels (interpreted here), scaled, and the logits, loss and weights'
    gradients are the tiled float8 form's up to float32 sums (an activation whose float8 rounding
    flips on a last-bit difference moves the next product by e4m3's 2^-4 of one element)."""
    from flaxgpt.kernels import pallas_grouped

    config = GPTConfig(**{**MIXTRAL, "fp8": True, "fp8_experts": True})
    params = gpt.init_params(config, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, 32, (4, 16)).astype(np.int32)  # 64 tokens: the sorted path

    def run():
        def loss(p):
            logits = gpt.GPT(config).apply({"params": p}, tokens)
            return jnp.mean(logits**2), logits

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    calls = []
    real = pallas_grouped.gmm
    monkeypatch.setattr(pallas_grouped, "gmm", lambda *a, **k: calls.append(k) or real(*a, **k))
    (want_loss, want_logits), want_grads = run()
    assert not calls  # unset: the tiled form
    monkeypatch.setenv("FLAXGPT_GROUPED", "pallas")
    (loss, logits), grads = run()
    # each layer's two expert products, forward and dX, scaled, through this platform's branch
    interpret = jax.default_backend() != "gpu"
    assert sum(k["interpret"] == interpret and k["scale"] is not None for k in calls) >= 4 * config.n_layer
    # 6e-9 (logits) and 4e-8 (gradients) apart seen on the CPU; a GPU's sums may flip a rounding
    tol = 1e-6 if interpret else 1e-3
    np.testing.assert_allclose(loss, want_loss, rtol=10 * tol)
    spread = np.linalg.norm(want_logits - want_logits.mean(-1, keepdims=True))
    assert np.linalg.norm(logits - want_logits) / spread < tol
    for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want_grads)):
        assert np.linalg.norm(a - b) <= 10 * tol * np.linalg.norm(b) + 1e-12
    monkeypatch.setenv("FLAXGPT_GROUPED", "triton")  # pallas_grouped.wanted, the one reader: one line
    with pytest.raises(
        ValueError, match=r"^FLAXGPT_GROUPED='triton': 'pallas' \(the Triton grouped GEMM\) or unset"
    ):
        run()
