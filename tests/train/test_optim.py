"""Schedules at known steps (nanoGPT's get_lr as the reference) and AdamW's decay mask."""

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from flaxgpt.train import optim


def nanogpt_lr(it, lr=1e-3, warmup=100, decay=2000, min_lr=1e-4):
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it > decay:
        return min_lr
    ratio = (it - warmup) / (decay - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def test_cosine_matches_nanogpt():
    s = optim.make_schedule("cosine", 1e-3, 100, 2000, 1e-4)
    for step in (0, 1, 50, 99, 100, 101, 500, 1050, 1999, 2000, 2500):
        assert float(s(step)) == pytest.approx(nanogpt_lr(step), rel=1e-5), step
    assert float(s(1050)) == pytest.approx(5.5e-4, rel=1e-5)  # half way: the mean of lr and min_lr


def test_constant_and_rsqrt():
    c = optim.make_schedule("constant", 2e-3, 10)
    assert float(c(0)) == pytest.approx(2e-3 / 11) and float(c(10)) == float(c(10_000)) == pytest.approx(2e-3)
    r = optim.make_schedule("rsqrt", 1.0, 4000)
    assert float(r(3999)) == pytest.approx(1.0)  # the peak at the end of warmup
    assert float(r(1999)) == pytest.approx(0.5)  # linear before
    assert float(r(15999)) == pytest.approx(0.5)  # 1/sqrt after: 4x the steps, half the rate
    with pytest.raises(ValueError, match="unknown schedule"):
        optim.make_schedule("linear", 1.0, 10)
    with pytest.raises(ValueError, match="decay_steps"):
        optim.make_schedule("cosine", 1.0, 100, 50)


def _cfg(**kw):
    c = ml_collections.ConfigDict(
        dict(
            schedule="constant",
            learning_rate=0.1,
            min_lr=0.0,
            warmup_steps=0,
            decay_steps=0,
            weight_decay=0.5,
            beta1=0.9,
            beta2=0.99,
            eps=1e-8,
            grad_clip=0.0,
        )
    )
    c.update(kw)
    return c


def test_weight_decay_only_on_matrices():
    params = {"w": jnp.ones((2, 3)), "b": jnp.ones((3,))}
    tx, _ = optim.make_optimizer(_cfg(learning_rate=0.1), max_iters=10)
    zero = jax.tree_util.tree_map(jnp.zeros_like, params)
    updates, _ = tx.update(zero, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], -0.1 * 0.5 * np.ones((2, 3)), rtol=1e-6)  # -lr * wd * w
    np.testing.assert_allclose(updates["b"], 0.0)


def test_clipping_is_part_of_the_chain():
    params = {"w": jnp.ones((2, 2))}
    with_clip, _ = optim.make_optimizer(_cfg(grad_clip=1.0), max_iters=10)
    without, _ = optim.make_optimizer(_cfg(grad_clip=0.0), max_iters=10)
    assert len(with_clip.init(params)) == 2 and len(without.init(params)) == 1
