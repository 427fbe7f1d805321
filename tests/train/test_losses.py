"""flaxgpt.train.losses: the masked, label-smoothed cross-entropy equals a numpy reference."""

import numpy as np
import pytest

from flaxgpt.train.losses import cross_entropy


def test_cross_entropy_matches_numpy():
    rng = np.random.default_rng(0)
    logits, targets = rng.normal(size=(2, 3, 5)), rng.integers(0, 5, (2, 3))
    mask = np.array([[1, 1, 0], [1, 0, 1]])
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    smooth = 0.9 * nll - 0.1 * logp.mean(-1)
    total, weight = cross_entropy(logits.astype(np.float32), targets, mask, 0.1)
    assert float(weight) == 4 and float(total) == pytest.approx((smooth * mask).sum(), rel=1e-5)
