"""model.fp8 through the trainer's own train step (train.steps.make_train_step, LMObjective, a full
policy): a tiny Llama-style GPT learns a repeating sequence as the bf16 model does (20 AdamW steps on a
fixed batch, the losses within 3%), and the config check refuses float8 over an int8 LoRA base in one line."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import default
from flaxgpt.models import gpt
from flaxgpt.models.gpt import GPTConfig
from flaxgpt.train import config_check
from flaxgpt.train.lm_task import LMObjective
from flaxgpt.train.policy import FullPolicy
from flaxgpt.train.sections import ConfigError
from flaxgpt.train.steps import TrainState, make_train_step

TINY = GPTConfig(
    vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=32, dtype="bfloat16", norm="rmsnorm",
    activation="silu", glu=True, bias=False, qkv_bias=False, pos_embedding="rope",
)  # fmt: skip


def _losses(model_config, steps=20):
    """The loss of each of `steps` train steps on one fixed batch of random tokens."""
    objective, policy = LMObjective(default.get_config(), model_config), FullPolicy(model_config)

    class task:  # what the train step asks of a task: its loss
        loss = staticmethod(lambda p, b, rng, train, frozen: objective.loss(policy, p, frozen, b, rng, train))

    tx = optax.adamw(3e-3, weight_decay=0.0)
    params = gpt.init_params(model_config, jax.random.key(0))
    state = TrainState(step=jnp.int32(0), params=params, opt_state=tx.init(params), rng=jax.random.key(1))
    step = jax.jit(make_train_step(task, tx, lambda s: 3e-3, grad_accum=1), donate_argnums=0)
    seq = np.random.default_rng(0).integers(0, 32, (8, 17)).astype(np.int32)
    batch = {"inputs": seq[None, :, :-1], "targets": seq[None, :, 1:]}  # [grad_accum=1, B, T]
    out = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        out.append(float(metrics["loss"]))
    return np.array(out)


def test_fp8_train_step_learns_as_bf16_does():
    bf16, fp8 = _losses(TINY), _losses(dataclasses.replace(TINY, fp8=True))
    assert np.all(np.isfinite(fp8)) and abs(fp8[0] - bf16[0]) < 0.02 * bf16[0]  # the same start
    assert fp8[-1] < 0.9 * fp8[0]  # it learns
    # within a few per cent at every step: float8's ~2^-4 rounding per product moves the trajectory
    # a little, not its course
    np.testing.assert_allclose(fp8, bf16, rtol=0.03)


def test_fp8_changes_the_products():
    """fp8 is really on: the same weights give different (close) logits, float8's rounding."""
    params = gpt.init_params(TINY, jax.random.key(0))
    tokens = np.arange(16, dtype=np.int32)[None] % 32
    a = np.asarray(gpt.GPT(TINY).apply({"params": params}, tokens), np.float32)
    b = np.asarray(gpt.GPT(dataclasses.replace(TINY, fp8=True)).apply({"params": params}, tokens), np.float32)
    assert 0 < np.abs(a - b).max() < 0.1 * np.abs(a).max()


def test_fp8_over_an_int8_base_is_refused_before_compiling():
    c = default.get_config()
    c.model.fp8 = True
    c.lora.rank, c.lora.base_dtype, c.init_from = 4, "int8", "gpt2"
    with pytest.raises(ConfigError, match=r"model\.fp8.*int8.*lora\.base_dtype=float32") as e:
        config_check.check(c)
    assert "\n" not in str(e.value)
