"""RoPE's cos and sin on XLA:CPU (models/rope.py: _cos_sin): computed once behind a conditional, not
fused into every rotated element, with the values and gradients of the direct computation bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxgpt.models import rope as rope_lib


def _direct(a_BTk, x_BTHK):
    return jnp.cos(a_BTk), jnp.sin(a_BTk)


@pytest.mark.parametrize("scaling", ["none", "yarn"])
def test_rotation_equals_direct_cos_sin(monkeypatch, scaling):
    rope = rope_lib.RoPE(head_dim=16, scaling=scaling, factor=4.0 if scaling == "yarn" else 1.0)
    x_BTHK = jax.random.normal(jax.random.key(0), (2, 12, 3, 16))

    def loss(x):  # positions from iota, as a training forward makes them (constant-foldable)
        y = rope.apply(x, jnp.broadcast_to(jnp.arange(12)[None], (2, 12)))
        return jnp.sum(y * jnp.cos(y)), y

    fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (_, y), dx = fn(x_BTHK)
    assert "conditional" in fn.lower(x_BTHK).compile().as_text()
    monkeypatch.setattr(rope_lib, "_cos_sin", _direct)
    direct = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (_, y_ref), dx_ref = direct(x_BTHK)
    assert "conditional" not in direct.lower(x_BTHK).compile().as_text()
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx_ref))


def test_decoding_step_computes_directly():
    """One position a row: no conditional (nothing measured to gain in a decoding step)."""
    rope = rope_lib.RoPE(head_dim=16)
    x_BTHK = jnp.ones((2, 1, 3, 16))
    fn = jax.jit(lambda x, p: rope.apply(x, p))
    assert "conditional" not in fn.lower(x_BTHK, jnp.full((2, 1), 5)).compile().as_text()
