"""GRPO's pure pieces without a model (TRL parity: test_grpo_trl.py): advantages, the rollout batch
layout, truncation, the loss's bad settings, each a one-line error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxgpt.train import grpo_task as g


def test_advantages_by_hand():
    r = [1.0, 3.0, 5.0, 5.0]  # two groups of 2
    adv, zero = g.group_advantages(r, 2, "group")
    s = np.std([1.0, 3.0], ddof=1)  # Bessel-corrected, as TRL's nanstd
    np.testing.assert_allclose(adv, [-1 / (s + 1e-4), 1 / (s + 1e-4), 0, 0], rtol=1e-6)
    assert zero.tolist() == [False, False, True, True]  # an all-equal group: no signal, not an error
    adv, _ = g.group_advantages(r, 2, "none")
    np.testing.assert_allclose(adv, [-1, 1, 0, 0])
    adv, _ = g.group_advantages(r, 2, "batch")  # the group's mean, the step's std
    np.testing.assert_allclose(adv, np.array([-1, 1, 0, 0]) / (np.std(r, ddof=1) + 1e-4), rtol=1e-6)
    adv, _ = g.group_advantages([1.0, np.nan, 2.0, 4.0], 2)  # unscorable: left out, advantage 0
    assert adv[1] == 0 and adv[0] == 0 and adv[2] < 0 < adv[3]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: g.group_advantages([1.0, 2.0], 1), "num_generations=1: a group needs >= 2"),
        (lambda: g.group_advantages([1.0, 2.0, 3.0], 2), "3 rewards are not groups of num_generations=2"),
        (lambda: g.group_advantages([1.0, 2.0], 2, "std"), "scale_rewards='std'"),
        (
            lambda: g.rollout_batch([[1, 2]], [[3, 4, 5]], 3),
            "row 0: prompt 2 + completion 3 tokens > block_size",
        ),
        (lambda: g.rollout_batch([[]], [[3]], 3), "row 0: an empty prompt"),
        (lambda: g.GRPOOptions(loss_type="ppo"), "grpo.loss_type='ppo'; choose one of grpo"),
        (lambda: g.GRPOOptions(importance_sampling_level="row"), "importance_sampling_level='row'"),
        (lambda: g.GRPOOptions(top_entropy_quantile=0.0), "top_entropy_quantile=0.0 is not in (0, 1]"),
        (lambda: g.GRPOTask(None, g.GRPOOptions(beta=0.1)), "grpo.beta > 0 needs a reference"),
    ],
)
def test_bad_input_is_one_line(call, message):
    with pytest.raises(ValueError) as e:
        call()
    assert message in str(e.value) and "\n" not in str(e.value)


def test_rollout_layout_and_truncation():
    b = g.rollout_batch([[5, 6], [7]], [[8, 9, 2], [10]], 5, advantages=[0.5, -0.5], pad=0)
    assert b["inputs"].tolist() == [[5, 6, 8, 9, 2], [7, 10, 0, 0, 0]]
    assert b["targets"].tolist() == [[6, 8, 9, 2, 0], [10, 0, 0, 0, 0]]
    assert b["loss_mask"].tolist() == [[0, 1, 1, 1, 0], [1, 0, 0, 0, 0]]  # the completion's targets only
    assert g.truncated([[8, 9, 2], [10], []], eos_ids=[2]).tolist() == [False, True, True]


def test_old_policy_equal_to_current_is_the_plain_policy_gradient():
    """Ratio 1 (num_iterations 1): the gradient is -A grad log p averaged as the loss type says."""
    logp = jnp.array([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]])
    mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = jnp.array([1.5, -0.5])
    for loss_type, weight in (("grpo", None), ("dapo", 5.0), ("dr_grpo", 2 * 4.0)):
        opts = g.GRPOOptions(loss_type=loss_type, max_completion_length=4)

        def loss(x, opts=opts):
            s, w, _ = g.grpo_loss(x, mask, adv, opts)
            return s / w

        grad = jax.grad(loss)(logp)
        if weight is None:  # each row's token mean, over rows
            expect = -adv[:, None] * mask / mask.sum(-1, keepdims=True) / 2
        else:
            expect = -adv[:, None] * mask / weight
        np.testing.assert_allclose(grad, expect, rtol=1e-6)
