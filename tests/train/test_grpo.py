"""GRPO's pure pieces without a model (TRL parity: test_grpo_trl.py): advantages, the rollout batch
layout, truncation, the loss's bad settings, each a one-line error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxgpt.train import grpo_task as g
from flaxgpt.train.policy import REAL


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
    adv, zero = g.group_advantages([1.0, np.nan, 2.0, 4.0, np.nan, np.nan], 2)  # unscorable: left out
    assert adv[1] == 0 and adv[0] == 0 and adv[2] < 0 < adv[3] and not adv[4:].any()
    # one reward, or none (a dropped group): no signal, as an all-equal group (dynamic sampling refills them)
    assert zero.tolist() == [True, True, False, False, True, True]


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
        (lambda: g.GRPOOptions(top_entropy_quantile=0.0), "top_entropy_quantile=0.0 must be in (0, 1]"),
        (lambda: g.GRPOObjective(g.GRPOOptions(beta=0.1)).reference(None, None, REAL), "needs a reference"),
        (
            lambda: g.sample_groups(tiny_config(), None, [[1] * 12], 2, rng=None, max_new_tokens=5),
            "a prompt of 12 tokens + max_completion_length 5 > block_size 16",
        ),  # fmt: skip
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


TINY = dict(vocab_size=16, block_size=16, n_layer=1, n_head=2, n_embd=32)
SEVEN = 7


def tiny_config():
    from flaxgpt.models import gpt

    return gpt.GPTConfig(**TINY)


def sevens(prompts, completions, completion_ids, **_):
    """The toy task's reward: the share of the completion's tokens that are 7."""
    return [sum(t == SEVEN for t in ids) / max(len(ids), 1) for ids in completion_ids]


def test_rollouts_by_the_decode_loop_then_the_train_step_raise_the_reward():
    """The whole loop on a random tiny GPT: G completions a prompt sampled by flaxgpt's decode loop
    from the current parameters, rewards, group advantages, the trainer's jitted train step on
    GRPOObjective.loss over a full policy: the mean reward rises from chance (1/16) by a wide margin
    in 10 steps."""
    import optax

    from flaxgpt.models import gpt
    from flaxgpt.train import rewards
    from flaxgpt.train.policy import FullPolicy
    from flaxgpt.train.steps import TrainState, make_train_step

    cfg = gpt.GPTConfig(**TINY)
    objective, policy = g.GRPOObjective(g.GRPOOptions(loss_type="dapo")), FullPolicy(cfg)

    class task:  # what the train step asks of a task: its loss
        loss = staticmethod(lambda p, b, rng, train, frozen: objective.loss(policy, p, frozen, b, rng, train))

    tx = optax.adam(3e-2)
    params = gpt.init_params(cfg, jax.random.key(1))
    state = TrainState(step=jnp.int32(0), params=params, opt_state=tx.init(params), rng=jax.random.key(0))
    step = jax.jit(make_train_step(task, tx, lambda s: 3e-2, grad_accum=1), donate_argnums=0)
    score = rewards.Rewards([("sevens", sevens, ())])
    prompts, G, curve = [[1, 2, 3], [4, 5], [6, 8, 9], [10]], 8, []
    for i in range(10):
        rows, completions = g.sample_groups(
            cfg, state.params, prompts, G, rng=jax.random.key(100 + i), max_new_tokens=5
        )
        total, _ = score(rows, completions, [{} for _ in rows], completion_ids=completions)
        curve.append(float(total.mean()))
        adv, _ = g.group_advantages(total, G)
        batch = g.rollout_batch(rows, completions, cfg.block_size, adv)
        state, metrics = step(state, jax.tree.map(lambda x: x[None], batch))
        assert np.isfinite(float(metrics["loss"])) and float(metrics["completion_length"]) == 5.0
    assert all(len(c) == 5 for c in completions) and len(completions) == len(prompts) * G
    print("mean reward by step", [f"{r:.2f}" for r in curve])
    assert np.mean(curve[:2]) < 0.2 and np.mean(curve[-3:]) > 0.5, curve


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "cispo", "grpo", "sapo", "dr_grpo", "luspo"])
def test_micro_batches_sum_to_the_whole_batch(loss_type):
    """The (sum, weight) contract the train step relies on: two micro-batches' summed losses over
    their summed weights are the whole batch's loss, gradient included (token counts unequal)."""
    rng = np.random.default_rng(0)
    logp = jnp.asarray(-rng.random((4, 5)), jnp.float32)
    old = logp + jnp.asarray(0.1 * rng.standard_normal((4, 5)), jnp.float32)
    mask = jnp.array([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], jnp.float32)
    adv = jnp.array([1.0, -1.0, 0.5, -0.5])
    opts = g.GRPOOptions(loss_type=loss_type, beta=0.1, max_completion_length=5)

    def loss(x, parts):
        sums = [g.grpo_loss(x[p], mask[p], adv[p], opts, old[p], old[p] - 0.05)[:2] for p in parts]
        return sum(s for s, _ in sums) / sum(w for _, w in sums)

    def both(x):  # one program: eager dispatch of the small ops is the slow part
        halves, whole = loss(x, [slice(0, 2), slice(2, 4)]), loss(x, [slice(0, 4)])
        return jnp.stack([halves, whole]), jax.grad(loss)(x, [slice(0, 2), slice(2, 4)]) - jax.grad(loss)(
            x, [slice(0, 4)]
        )

    values, grad_diff = jax.jit(both)(logp)
    np.testing.assert_allclose(values[0], values[1], rtol=1e-6)
    assert float(jnp.abs(grad_diff).max()) < 1e-6


def test_reward_statistics_of_no_numbers_are_nan_without_a_warning():
    import warnings

    from flaxgpt.train.grpo_online import _nan_stat

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's "Mean of empty slice" would fail here
        assert np.isnan(_nan_stat(np.nanmean, np.array([np.nan, np.nan])))
        assert np.isnan(_nan_stat(np.nanmean, np.zeros(0)))
        assert _nan_stat(np.nanmean, np.array([1.0, np.nan, 3.0])) == 2.0
