"""GRPO's asynchronous rollouts (grpo_async), truncated importance sampling (grpo_task.grpo_loss's
behaviour_logp) and DAPO's dynamic sampling (grpo_dynamic): the pipeline's staleness and donation
safety with a fake rollout, the TIS loss and gradient against float64 by hand, dynamic sampling's
refills, and the trainer with off_policy_steps 0 and 1 against a hand-written loop that samples each
step from the weights the docs name (losses and parameters identical over 3 steps)."""

import json
import os
import signal
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the configs/ package

from configs import grpo_toy  # noqa: E402
from flaxgpt.data import batches as data_lib  # noqa: E402
from flaxgpt.envs.base import Environment, Step  # noqa: E402
from flaxgpt.train import grpo_async, grpo_dynamic, grpo_online, grpo_rollout, grpo_task  # noqa: E402
from flaxgpt.train import trainer as trainer_lib  # noqa: E402
from flaxgpt.train.config_check import ConfigError  # noqa: E402
from tests.train.test_grpo_train import llama_prompts, llama_recipe, toy_data  # noqa: E402, F401


def test_pipeline_staleness_and_donation():
    """Rollout m is sampled by the weights of state max(m - k, 0), each from the pipeline's own copy:
    the update donates its input (deleted after), the copies survive, the rollouts run in step order."""
    update = jax.jit(lambda p: {"w": p["w"] + 1.0}, donate_argnums=0)  # state m holds w = m
    for k in (1, 2):
        seen = []

        def rollout(params, frozen, step, n_rows, index, seen=seen):
            seen.append((step, float(params["w"]), float(frozen["f"])))
            return {"step": step}, {"reward": 0.0}

        pipe = grpo_async.Pipeline(rollout, k, max_iters=5)
        params, frozen = {"w": jnp.float32(0.0)}, {"f": jnp.float32(7.0)}
        batch, info = pipe.take(params, frozen, 0, 8)
        for m in range(5):
            assert batch["step"] == m and info["rollout_wait"] >= 0
            pipe.before_update(params, m)
            old, params = params, update(params)
            assert old["w"].is_deleted()  # donation is real: the rollouts never read the trainer's arrays
            if m + 1 < 5:
                batch, info = pipe.take(params, frozen, m + 1, 8)
        assert seen == [(m, float(max(m - k, 0)), 7.0) for m in range(5)], seen
        assert pipe.call(lambda x: x + 1, 1) == 2
    with pytest.raises(ValueError, match="off_policy_steps=0"):
        grpo_async.Pipeline(rollout, 0, 5)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_tis_loss_and_gradient_by_hand(loss_type):
    """min(pi_old / pi_behaviour, C) on each token's loss, before beta's k3 is added: loss and its
    gradient equal a float64 reference; some weights are capped, some below 1."""
    rng = np.random.default_rng(0)
    B, T, C, beta = 3, 5, 2.0, 0.1
    logp = rng.normal(-1.5, 0.5, (B, T))
    behaviour = logp + rng.normal(0.0, 0.9, (B, T))
    ref = logp + rng.normal(0.0, 0.3, (B, T))
    mask = (rng.random((B, T)) < 0.8).astype(np.float64)
    mask[:, 0] = 1.0
    adv = np.array([1.0, -0.5, 0.25])
    w = np.minimum(np.exp(logp - behaviour), C)
    assert (w[mask > 0] == C).any() and (w[mask > 0] < 1).any()
    opts = grpo_task.GRPOOptions(loss_type=loss_type, beta=beta, tis_cap=C)

    def loss(lp):
        s, weight, _ = grpo_task.grpo_loss(
            lp, jnp.asarray(mask, jnp.float32), jnp.asarray(adv, jnp.float32), opts,
            ref_logp_BT=jnp.asarray(ref, jnp.float32), behaviour_logp_BT=jnp.asarray(behaviour, jnp.float32),
        )  # fmt: skip
        return s / weight

    value, grad = jax.value_and_grad(loss)(jnp.asarray(logp, jnp.float32))
    # ratio r = exp(logp - stop_gradient(logp)) = 1 with dr/dlogp = 1: token loss -A w r + beta k3 r
    d = ref - logp
    k3 = np.exp(d) - d - 1
    tok = -adv[:, None] * w + beta * k3
    dtok = -adv[:, None] * w + beta * (1 - np.exp(d) + k3)
    if loss_type == "dapo":
        want, dwant = np.sum(tok * mask) / mask.sum(), dtok * mask / mask.sum()
    else:  # each completion's token mean, averaged over completions
        n = mask.sum(-1, keepdims=True)
        want, dwant = np.mean(np.sum(tok * mask / n, -1)), dtok * mask / n / B
    np.testing.assert_allclose(float(value), want, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), dwant, rtol=1e-4, atol=1e-6)
    # tis_cap 0 turns it off: the on-policy loss
    off = grpo_task.GRPOOptions(loss_type=loss_type, beta=beta, tis_cap=0.0)
    plain = grpo_task.grpo_loss(
        jnp.asarray(logp, jnp.float32), jnp.asarray(mask, jnp.float32), jnp.asarray(adv, jnp.float32), off,
        ref_logp_BT=jnp.asarray(ref, jnp.float32), behaviour_logp_BT=jnp.asarray(behaviour, jnp.float32),
    )  # fmt: skip
    tok0 = -adv[:, None] + beta * k3
    if loss_type == "dapo":
        np.testing.assert_allclose(float(plain[0] / plain[1]), np.sum(tok0 * mask) / mask.sum(), rtol=1e-5)


def test_dynamic_sampling_refills_then_gives_up():
    """Groups of equal rewards are replaced by the next rounds' groups that differ, in the order drawn;
    short after the last round, dropped groups fill the batch and train nothing."""
    G = 2

    def drawn(tag, rewards):  # groups of G completions named by tag
        n = len(rewards)
        return [[tag, i // G] for i in range(n)], [[tag, i] for i in range(n)], np.array(rewards, float)

    first = drawn(0, [1, 1, 0, 1, 0, 0])  # group 1 differs
    rounds = {1: drawn(1, [1, 1, 1, 0, 0.5, 0.5]), 2: drawn(2, [0, 1, 0, 0, 1, 0])}
    (p, c, total, trains), info = grpo_dynamic.fill(rounds.__getitem__, first, G, rounds=4)
    assert [x[0] for x in c[::G]] == [0, 1, 2] and total.tolist() == [0, 1, 1, 0, 0, 1]
    assert trains.all() and info == {"dynamic_sampling/rounds": 2.0, "dynamic_sampling/kept": 1.0}
    assert p[:G] == [[0, 1], [0, 1]]
    (p, c, total, trains), info = grpo_dynamic.fill(rounds.__getitem__, first, G, rounds=1)
    assert [x[0] for x in c[::G]] == [0, 1, 0] and trains.tolist() == [True] * 4 + [False] * 2
    assert total.tolist() == [0, 1, 1, 0, 1, 1] and info["dynamic_sampling/kept"] == pytest.approx(2 / 3)


def recipe(data, out, **over):
    config = grpo_toy.get_config()
    config.data.dir, config.out_dir = str(data), str(out)
    config.tensorboard = config.plot = False
    over = {"max_iters": 3, "batch_size": 8, "eval_interval": 100, "model.n_layer": 1,
            "grpo.num_generations": 4, "grpo.eval_prompts": 4, **over}  # fmt: skip
    for key, value in over.items():
        section, _, name = key.rpartition(".")
        (config[section] if section else config)[name] = value
    return config


def by_hand(config, k: int):
    """The synchronous loop of trainer._loop, each step's batch sampled by the weights of state
    max(step - k, 0): (losses, final parameters)."""
    tr = trainer_lib.Trainer(config, jax.devices()[:1], print_fn=lambda *a: None)
    try:
        state, src, snaps, losses = tr.init_state(), tr.task.source, [], []
        # off-policy at temperature 1: the behaviour log-probs are the engine's, else a forward pass's
        assert src.engine.logprobs == (k > 0 and config.grpo.temperature == 1.0)
        with jax.set_mesh(tr.mesh):
            for m in range(config.max_iters):
                snaps.append(grpo_async.own_copy(state.params))
                local, _ = src.sampled(snaps[max(m - k, 0)], state.frozen, m, config.batch_size, 0)
                local = data_lib.split_micro(local, config.grad_accum)
                state, metrics = tr.train_step(state, data_lib.to_global(local, tr.train_batch_sharding, 1))
                losses.append(float(metrics["loss"]))
        return losses, jax.device_get(state.params)
    finally:
        tr.close()


@pytest.mark.parametrize("k, temperature", [(0, 1.0), (1, 1.0), (1, 0.7)])
def test_trainer_equals_the_loop_by_hand(tmp_path, k, temperature):
    """trainer.train with off_policy_steps k: the losses and the parameters of the loop by hand over
    3 steps (k 0: the synchronous trainer; k 1: steps 0 and 1 sampled by the start's weights, step 2
    by state 1's, on the rollout thread, weighted by TIS, with dynamic sampling's refills; the
    behaviour log-probs the engine's at temperature 1, a forward pass's at 0.7), the same seeds giving
    the same run."""
    data = toy_data(tmp_path)
    over = {"grpo.off_policy_steps": k, "grpo.dynamic_sampling": k > 0, "grpo.temperature": temperature}
    config = recipe(data, tmp_path / "run", **over)
    summary = trainer_lib.train(config, devices=jax.devices()[:1], print_fn=lambda *a: None)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "reward" in x]
    losses, params = by_hand(recipe(data, tmp_path / "hand", **over), k)
    np.testing.assert_allclose(
        [x["loss"] for x in steps], losses, rtol=1e-5, atol=1e-6
    )  # the log's 6 decimals
    for a, b in zip(jax.tree.leaves(jax.device_get(summary["state"].params)), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)
    for key in ("tis_weight", "rollout_wait", "dynamic_sampling/rounds", "dynamic_sampling/kept"):
        assert all((key in x) == (k > 0) for x in steps), key
    if k:
        assert steps[0]["tis_weight"] == pytest.approx(1.0, abs=1e-5)  # sampled by the same weights
        assert steps[2]["tis_weight"] != pytest.approx(1.0, abs=1e-5)  # by state 1's, trained by 2's


def test_sigterm_during_an_update_saves_without_sampling_the_next_batch(tmp_path, monkeypatch):
    """SIGTERM while update 1 runs: step 2 is saved at once, its batch never sampled (it was sampled,
    a whole rollout waited for, and then saved)."""
    sampled, real_sampled, real_update = [], grpo_online.Rollouts.sampled, grpo_online.Rollouts.before_update

    def spy(self, params, frozen, step, *rest):
        sampled.append(step)
        return real_sampled(self, params, frozen, step, *rest)

    def before_update(self, params, step):
        real_update(self, params, step)
        if step == 1:  # the update of step 1 is dispatched next
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(grpo_online.Rollouts, "sampled", spy)
    monkeypatch.setattr(grpo_online.Rollouts, "before_update", before_update)
    config = recipe(toy_data(tmp_path), tmp_path / "run", max_iters=4)
    trainer_lib.train(config, devices=jax.devices()[:1], print_fn=lambda *a: None)
    assert os.listdir(tmp_path / "run" / "checkpoints") == ["2"] and sampled == [0, 1]


def test_bad_async_settings(tmp_path):
    data = toy_data(tmp_path)
    cases = {
        "grpo.off_policy_steps=1 with grpo.num_iterations=2": {
            "grpo.off_policy_steps": 1, "grpo.num_iterations": 2
        },
        "grpo.off_policy_steps=-1 must be >= 0": {"grpo.off_policy_steps": -1},
        "grpo.tis_cap=-1.0 must be >= 0": {"grpo.tis_cap": -1.0},
        "grpo.dynamic_sampling_rounds=-1 must be >= 0": {"grpo.dynamic_sampling_rounds": -1},
        "grpo.engine_devices=4 gives the engine devices of its own": {"grpo.engine_devices": 4},
        "set grpo.off_policy_steps >= 1 and grpo.rollout=engine": {
            "grpo.engine_devices": 4, "grpo.off_policy_steps": 1, "grpo.rollout": "generate"
        },
        "grpo.engine_replicas=2 splits the engine's rollouts; grpo.rollout=generate samples": {
            "grpo.engine_replicas": 2, "grpo.rollout": "generate"
        },
        "engine_replicas=3 gives each engine ceil(batch_size / 3) = 3 slots, fewer than a group's 4": {
            "grpo.engine_replicas": 3, "grpo.env": "flaxgpt.envs.calculator:Calculator"
        },
        "grpo.engine_replicas=0 must be >= 1": {"grpo.engine_replicas": 0},
    }  # fmt: skip
    for message, over in cases.items():
        with pytest.raises((ConfigError, ValueError)) as e:
            trainer_lib.train(recipe(data, tmp_path / "never", **over), print_fn=lambda *a: None)
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
        assert not (tmp_path / "never").exists()


@pytest.mark.devices(4)
def test_engine_on_devices_of_its_own_trains_as_the_shared_run(tmp_path, monkeypatch, llama_prompts):  # noqa: F811
    """grpo.engine_devices=2 over 4 CPU devices: LoRA over a tiny Llama, the trainer's FSDP mesh on
    devices 0-1, the engine's on 2-3 (its copy of the base placed there once, the adapters pushed each
    rollout); 2 steps with k = 1 give the losses and the parameters of the run whose engine shares the
    trainer's devices 0-1 (4 devices, not 8: the same split at half the CPU's work)."""
    engine_on = []  # the devices each run's engine decodes on

    def over_devices(self, devices, frozen, real=grpo_online.Rollouts._engine_over):
        engine_on.append([d.id for d in devices])
        return real(self, devices, frozen)

    monkeypatch.setattr(grpo_online.Rollouts, "_engine_over", over_devices)
    model, data = llama_prompts
    over = {
        "lora.rank": 4, "lora.alpha": 8.0, "grpo.num_generations": 2, "batch_size": 4, "max_iters": 2,
        "eval_interval": 2, "grpo.eval_prompts": 0, "grpo.reward_funcs": ("length=3",),
        "grpo.off_policy_steps": 1, "mesh.data": 1, "mesh.fsdp": 2, "optim.learning_rate": 3e-2,
    }  # fmt: skip
    runs = []
    for devices, extra in ((2, {}), (4, {"grpo.engine_devices": 2})):
        out = tmp_path / f"run{devices}"
        config = llama_recipe(model)
        config.data.dir, config.out_dir, config.tensorboard, config.plot = str(data), str(out), False, False
        for key, value in {**over, **extra}.items():
            section, _, name = key.rpartition(".")
            (config[section] if section else config)[name] = value
        summary = trainer_lib.train(config, devices=jax.devices()[:devices], print_fn=lambda *a: None)
        steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        params = summary["state"].params
        assert {d.id for leaf in jax.tree.leaves(params) for d in leaf.devices()} == {0, 1}
        runs.append(([x["loss"] for x in steps if "reward" in x], jax.device_get(params)))
    assert engine_on == [[0, 1], [2, 3]]
    (losses, params), (own_losses, own_params) = runs
    assert len(losses) == 2 and all(np.isfinite(losses)) and own_losses == losses
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(own_params), strict=True):
        np.testing.assert_array_equal(a, b)
    config.grpo.engine_devices, config.out_dir = 4, str(tmp_path / "never")
    with pytest.raises(ValueError, match="grpo.engine_devices=4 leaves the trainer none of the run's 4"):
        trainer_lib.train(config, devices=jax.devices()[:4], print_fn=lambda *a: None)


class Retry(Environment):
    """The toy's copy task over up to 2 replies: each scored as copy_reward does, 'a' the observation."""

    max_turns = 2

    def reset(self, prompt, answer, **row):
        self.answer = answer

    def step(self, action):
        reward = grpo_toy.copy_reward([None], [action], [self.answer])[0]
        return Step("a", reward, reward == 1.0)


@pytest.mark.devices(2)
@pytest.mark.parametrize(
    "devices, k, env", [(1, 0, False), (2, 0, False), (2, 1, False), (1, 0, True), (2, 1, True)]
)
def test_engine_replicas_train_as_one_engine(tmp_path, monkeypatch, devices, k, env):
    """grpo.engine_replicas=2, each replica sampling half the step's prompts (and the evaluation's):
    on one device (two threads of it) or over the trainer's 2 devices (mesh data 2, one a device),
    the losses and the parameters of the run with one engine, synchronous (k 0) and off-policy (k 1:
    to the log-probs' rounding); multi-turn episodes (grpo.env) alike, on one device and off-policy
    over 2."""
    data = toy_data(tmp_path)
    built = []

    def replicas(self, one, on, n, real=grpo_rollout.Replicas.__init__):
        real(self, one, on, n)
        built.append([x.id for x in self.where])

    monkeypatch.setattr(grpo_rollout.Replicas, "__init__", replicas)
    runs = []
    for n in (1, 2):
        over = {"grpo.off_policy_steps": k, "grpo.engine_replicas": n, "eval_interval": 2}
        if env:  # room for a reply, the observation and a second reply
            over |= {"grpo.env": "tests.train.test_grpo_async:Retry", "grpo.max_completion_length": 10}
        out = tmp_path / f"run{n}"
        config = recipe(data, out, **over)
        summary = trainer_lib.train(config, devices=jax.devices()[:devices], print_fn=lambda *a: None)
        lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        evals = [x["val_reward"] for x in lines if "val_reward" in x]
        losses = [x["loss"] for x in lines if "reward" in x]
        assert not env or any(x.get("episodes/observations_mean", 0) > 0 for x in lines)  # 2 turns
        runs.append((losses, evals, jax.device_get(summary["state"].params)))
    assert built == [[0, 1] if devices == 2 else [0, 0]]
    (losses, evals, params), (r_losses, r_evals, r_params) = runs
    assert len(losses) == 3 and r_losses == losses and evals and r_evals == evals
    # k 1: TIS weighs by the engines' own log-probs, whose rounding differs between one engine's heads
    # split over the devices and each replica's whole heads (the same tokens: the losses equal)
    tolerance = {"atol": 5e-5, "rtol": 0} if k else {"atol": 0, "rtol": 0}
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(r_params), strict=True):
        np.testing.assert_allclose(a, b, **tolerance)


class Broken(Retry):
    def step(self, action):
        raise RuntimeError("the tool is down")


def test_an_environment_failing_on_every_prompt_stops_the_run(tmp_path, capsys):
    """Every group dropped, step after step: the run trained nothing for all of max_iters (loss 0,
    a warning a group); after 3 such steps in a row it stops with one line naming the last error."""
    from flaxgpt.envs.base import EnvError

    over = {
        "grpo.env": "tests.train.test_grpo_async:Broken",
        "grpo.max_completion_length": 10,
        "max_iters": 6,
    }
    config = recipe(toy_data(tmp_path), tmp_path / "run", **over)
    with pytest.raises(
        EnvError, match=r"dropped every group of 3 steps in a row: .* fix it \(environment Broken"
    ):
        trainer_lib.train(config, devices=jax.devices()[:1], print_fn=lambda *a: None)
    assert "the tool is down" in capsys.readouterr().err
