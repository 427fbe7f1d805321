"""kernels/pallas_xent.py in Pallas interpret mode: the Triton kernels' statistics equal a float64
reference and their gradients (dx, dw; padded columns zero) equal the XLA form's, for both head
layouts, soft-capping and a vocabulary that is not a multiple of the tile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxgpt.kernels import linear_xent, pallas_xent
from flaxgpt.kernels.linear_xent import Head, token_stats


def _inputs(layout, N=128, D=256, V=200, Vp=256):
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(N, D)) * 0.2).astype(np.float32)
    w = rng.normal(size=(D, Vp) if layout == "DV" else (Vp, D)).astype(np.float32)
    return x, w, rng.integers(0, V, N).astype(np.int32)


@pytest.mark.parametrize("layout,softcap,scale", [("DV", 0.0, 1.0), ("VD", 4.0, 1 / 0.7)])
def test_pallas_equals_reference_and_the_xla_form(layout, softcap, scale):
    """V = 200 over tiles of 128 (the last overlaps the first); 56 padded columns."""
    x, w, t = _inputs(layout)
    head = Head(jnp.asarray(w), layout, 200, softcap)
    raw = x.astype(np.float64) @ (w if layout == "DV" else w.T).astype(np.float64)
    z = raw[:, :200]
    z = scale * (softcap * np.tanh(z / softcap) if softcap else z)
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    p = np.exp(z - lse[:, None])
    want = (lse, z[np.arange(128), t], z.sum(1), -(p * np.log(p)).sum(1))
    got = token_stats(x, head, t, scale=scale, impl="pallas")
    for a, b, name in zip(got, want, got._fields, strict=True):
        # float32 sums of 200 logits up to ~80 in size: ~1e-6 of the largest term
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4, err_msg=name)

    ct = np.random.default_rng(1).normal(size=(4, 128)).astype(np.float32)

    def grads(impl):
        def f(x, w):
            s = token_stats(x, Head(w, layout, 200, softcap), t, scale=scale, impl=impl, block=64)
            return sum(jnp.vdot(c, v) for c, v in zip(ct, s, strict=True))

        return jax.grad(f, (0, 1))(x, jnp.asarray(w))

    (dx_p, dw_p), (dx_x, dw_x) = grads("pallas"), grads("xla")
    # float32 sums in another order: equal to ~1e-6 of the largest entry (|dx| ~ 20 here)
    np.testing.assert_allclose(dx_p, dx_x, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(dw_p, dw_x, rtol=1e-5, atol=1e-4)
    assert not np.any(np.asarray(dw_p)[:, 200:] if layout == "DV" else np.asarray(dw_p)[200:])


def test_the_rule_picks_xla_unless_asked_on_one_gpu(monkeypatch):
    assert pallas_xent.fits(128, 768, 50257) and not pallas_xent.fits(100, 768, 50257)
    assert not pallas_xent.fits(128, 96, 50257) and not pallas_xent.fits(128, 768, 40)
    assert linear_xent.pick_impl(128, 768, 50257) == "xla"
    monkeypatch.setenv("FLAXGPT_XENT", "pallas")
    assert linear_xent.pick_impl(128, 768, 50257) == ("pallas" if jax.default_backend() == "gpu" else "xla")
    monkeypatch.setenv(
        "FLAXGPT_XENT", "triton"
    )  # a value it does not know: one line, not XLA's form silently
    with pytest.raises(ValueError, match=r"^FLAXGPT_XENT='triton': use xla \(the default\) or pallas"):
        linear_xent.pick_impl(128, 768, 50257)
    x, w, t = np.zeros((100, 128), np.float32), np.zeros((128, 200), np.float32), np.zeros(100, np.int32)
    with pytest.raises(
        ValueError, match="cannot tile 100 tokens x 128 features x 200 words .*use impl='xla'"
    ):
        token_stats(x, Head(w, "DV", 200), t, impl="pallas")
