"""kernels/fp8.py: the scaled float8 product and its gradients against float64, within a bound derived
from float8's rounding (and exceeded by the same product without scaling), and the device notice."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxgpt.kernels import fp8
from flaxgpt.kernels.fp8 import E4M3, E5M2, fp8_dot


def element_error(a, f8):
    """The largest error of one element of `a` quantized with current scaling: u |a| for a normal value,
    half a subnormal step (in a's units: / scale) below the normal range."""
    scale = float(jnp.finfo(f8).max) / np.abs(a).max()
    return fp8.UNIT_ROUNDOFF[f8] * np.abs(a) + fp8.SUBNORMAL_STEP[f8] / 2 / scale


def product_bound(a, fa, b, fb):
    """|ã b̃ - a b| elementwise for a [M, K] @ [K, N] product of rounded operands, plus float32
    accumulation over K (K u32 of the sum of magnitudes): first-order and second-order rounding terms."""
    ea, eb = element_error(a, fa), element_error(b, fb)
    mags = (np.abs(a) + ea) @ (np.abs(b) + eb)
    return ea @ np.abs(b) + np.abs(a) @ eb + ea @ eb + a.shape[1] * 2.0**-24 * mags


def unscaled_dot(x, w):
    """The same float8 product without scaling: a plain cast (what the scales are for)."""
    return (x.astype(E4M3).astype(jnp.float32) @ w.astype(E4M3).astype(jnp.float32)).astype(x.dtype)


def operands(x_scale, w_scale, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((48, 96)) * x_scale).astype(np.float32)
    w = (rng.standard_normal((96, 40)) * w_scale).astype(np.float32)
    return x, w


# large activations overflow e4m3's 448 unscaled (NaN in e4m3fn); tiny ones underflow its 2^-9 step
@pytest.mark.parametrize("x_scale,w_scale", [(1.0, 0.02), (3e3, 0.02), (1e-4, 1e-3)])
def test_forward_within_rounding_bound(x_scale, w_scale):
    x, w = operands(x_scale, w_scale)
    ref = x.astype(np.float64) @ w.astype(np.float64)
    bound = product_bound(x.astype(np.float64), E4M3, w.astype(np.float64), E4M3)
    err = np.abs(np.asarray(jax.jit(fp8_dot)(x, w), np.float64) - ref)
    assert np.all(err <= bound), f"max err/bound {np.max(err / bound):.3f}"
    # the bound is tight enough to matter: typical error is a few per cent of |y|, near e4m3's
    # 2^-4 unit roundoff averaged over K terms, not the bound's worst case
    assert np.linalg.norm(err) / np.linalg.norm(ref) < 0.06
    if x_scale != 1.0:  # and the unscaled cast breaks it (overflow to NaN, or underflow to zero)
        unscaled = np.abs(np.asarray(unscaled_dot(jnp.asarray(x), jnp.asarray(w)), np.float64) - ref)
        assert not np.all(unscaled <= bound)


def test_gradients_within_rounding_bound():
    """dX = dY W^T and dW = X^T dY with dY in e5m2 (2^-3) and X, W in e4m3 (2^-4), against float64."""
    x, w = operands(2.0, 0.05, seed=1)
    dy = (np.random.default_rng(2).standard_normal((48, 40)) * 1e-3).astype(np.float32)
    _, vjp = jax.vjp(fp8_dot, jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(dy))
    assert dx.dtype == jnp.float32 and dw.dtype == jnp.float32
    x64, w64, dy64 = (a.astype(np.float64) for a in (x, w, dy))
    err_dx = np.abs(np.asarray(dx, np.float64) - dy64 @ w64.T)
    err_dw = np.abs(np.asarray(dw, np.float64) - x64.T @ dy64)
    assert np.all(err_dx <= product_bound(dy64, E5M2, w64.T, E4M3))
    assert np.all(err_dw <= product_bound(x64.T, E4M3, dy64, E5M2))
    assert np.linalg.norm(err_dw) / np.linalg.norm(x64.T @ dy64) < 0.12  # e5m2's 2^-3, averaged


def test_compute_dtype_and_leading_axes():
    """[B, T, K] inputs keep their leading axes; bf16 in -> bf16 out and bf16 gradients; zeros stay 0."""
    x, w = operands(1.0, 0.02)
    x3 = jnp.asarray(x, jnp.bfloat16).reshape(4, 12, 96)
    y = fp8_dot(x3, jnp.asarray(w, jnp.bfloat16))
    assert y.shape == (4, 12, 40) and y.dtype == jnp.bfloat16
    g = jax.grad(lambda a, b: fp8_dot(a, b).astype(jnp.float32).sum(), argnums=(0, 1))
    dx, dw = g(x3, jnp.asarray(w, jnp.bfloat16))
    assert dx.dtype == dw.dtype == jnp.bfloat16 and dx.shape == x3.shape
    zeros = fp8_dot(jnp.zeros((3, 96)), jnp.asarray(w))
    assert np.all(np.asarray(zeros) == 0)
    dx0, dw0 = g(jnp.zeros((3, 96), jnp.bfloat16), jnp.asarray(w, jnp.bfloat16))
    assert np.all(np.isfinite(np.asarray(dx0, np.float32))) and np.all(np.asarray(dw0, np.float32) == 0)


def test_cpu_has_no_float8_matmul_and_says_its_fallback():
    assert not fp8.has_fp8_matmul()
    note = fp8.fp8_note()
    assert note.count("\n") == 0 and "no float8 matmuls" in note and "model.fp8=False" in note


@pytest.mark.parametrize(
    "cc,kind,native",
    [
        ("9.0", "NVIDIA H100 80GB HBM3", True),
        ("8.9", "NVIDIA L4", True),
        ("8.0", "NVIDIA A100-SXM4-80GB", False),
        (None, "NVIDIA H200", True),  # an abstract device (flaxgpt aot) has only its name
        (None, "NVIDIA A100-SXM4-40GB", False),
    ],
)
def test_gpus_with_float8_gemms_are_compute_capability_8_9_and_up(monkeypatch, cc, kind, native):
    class Device:
        platform, device_kind = "cuda", kind

    device = Device()
    if cc:
        device.compute_capability = cc
    monkeypatch.setattr(fp8.target, "_device", lambda: device)
    assert fp8.has_fp8_matmul() is native
    assert (fp8.fp8_note() is None) is native
    if not native:
        assert fp8.fp8_note().startswith(f"note: model.fp8 on {kind} (gpu), which has no float8 matmuls")
