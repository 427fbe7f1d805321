"""Training with sequences split over a mesh "context" axis (mesh.context) on 8 simulated CPU devices:
context 2 and data 2 x fsdp 2 x context 2 (ring attention) train exactly like one device
(losses, gradient norms, parameters); a block_size the axis cannot balance, or Ulysses around the splash
kernel, fails in one line before the steps are built."""

import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the configs/ package

from configs import default  # noqa: E402
from flaxgpt.train import trainer  # noqa: E402

pytestmark = pytest.mark.devices(8)

STEPS = 2


def config(foxes_dir, data=-1, fsdp=1, context=1, impl="ring", block_size=16, expert=1, **model):
    c = default.get_config()
    c.data.dir = str(foxes_dir)
    c.out_dir, c.init_from = str(foxes_dir.parent / "never_written"), "scratch"
    c.model.n_layer, c.model.n_head, c.model.n_embd, c.model.block_size = 1, 2, 32, block_size
    # RoPE, grouped-query heads and a window that crosses the chunks (block 16, context 2: chunks of 4)
    c.model.pos_embedding, c.model.n_kv_head, c.model.sliding_window = "rope", 1, 6
    c.model.pad_vocab_multiple, c.model.context_impl = 8, impl
    c.model.update(model)
    c.mesh.data, c.mesh.fsdp, c.mesh.context, c.mesh.expert = data, fsdp, context, expert
    c.batch_size, c.eval_iters, c.max_iters, c.tensorboard = 8, 1, STEPS, False
    c.optim.warmup_steps, c.optim.learning_rate = 1, 3e-3
    return c


def train(cfg, devices=None):
    t = trainer.Trainer(cfg, devices=devices, print_fn=lambda *a: None)
    state, metrics = t.init_state(), []
    for step in range(STEPS):
        state, m = t.train_step(state, t.global_batch("train", step, cfg.batch_size, micro=True))
        metrics.append((float(m["loss"]), float(m["grad_norm"])))
    return np.array(metrics), state


@pytest.fixture(scope="module")
def one_device(foxes_dir):
    return train(config(foxes_dir), jax.devices()[:1])


# Ulysses is checked against one device in tests/models/test_context_attention.py (attention and a GPT)
@pytest.mark.parametrize("data, fsdp, context, impl", [(-1, 1, 2, "ring"), (2, 2, 2, "ring")])
def test_context_trains_like_one_device(foxes_dir, one_device, data, fsdp, context, impl):
    got, state = train(config(foxes_dir, data, fsdp, context, impl))
    want, want_state = one_device
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)  # losses and gradient norms
    for a, b in zip(jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(want_state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


MOE = dict(
    norm="rmsnorm", activation="silu", glu=True, bias=False, num_experts=4, experts_per_token=2,
    expert_hidden=16, router_aux_loss_coef=0.5, router_z_loss_coef=0.01,
)  # fmt: skip


def test_a_mixture_of_experts_trains_over_context_like_one_device(foxes_dir):
    """MoE over fsdp 2 x expert 2 x context 2: the experts split over the expert axis and each
    sequence over context (expert_parallel gathers the tokens of every axis, context's too)."""
    want, want_state = train(config(foxes_dir, **MOE), jax.devices()[:1])
    got, state = train(config(foxes_dir, 1, 2, 2, expert=2, **MOE))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)  # losses (router terms in) and norms
    for a, b in zip(jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(want_state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_block_size_the_ring_cannot_balance(foxes_dir):
    with pytest.raises(ValueError, match="sequence length 18 is not divisible by 2 x mesh.context = 4"):
        trainer.Trainer(config(foxes_dir, context=2, block_size=18), print_fn=lambda *a: None)


def test_ulysses_around_the_splash_kernel_is_refused_before_tracing(foxes_dir, monkeypatch):
    """attention_impl=pallas (what auto picks on TPU) under Ulysses: one line before the steps exist."""
    monkeypatch.setattr(trainer, "make_steps", lambda *_: pytest.fail("the steps were built first"))
    cfg = config(foxes_dir, context=2, impl="ulysses", attention_impl="pallas")
    with pytest.raises(
        ValueError, match=r"^context_impl=ulysses cannot run the splash kernel \(attention_impl=pallas\)"
    ):
        trainer.Trainer(cfg, print_fn=lambda *a: None)


def test_token_ids_are_split_over_the_context_axis(foxes_dir):
    """The batch's [.., B, T] arrays are placed with T over "context" (no device holds a sequence's
    ids whole): a device of data 2 x fsdp 2 x context 2 holds 8 / 4 rows of 16 / 2 tokens."""
    t = trainer.Trainer(config(foxes_dir, 2, 2, 2), print_fn=lambda *a: None)
    micro = t.global_batch("train", 0, 8, micro=True)  # [grad_accum, B, T]
    evals = t.global_batch("val", 0, 8, micro=False)  # [B, T]
    for batch, rows in ((micro, (None, ("data", "fsdp"))), (evals, (("data", "fsdp"),))):
        for x in batch.values():
            assert x.sharding.spec == P(*rows, "context")
            assert x.addressable_shards[0].data.shape[-2:] == (2, 8)
    assert t.eval_batch_sharding(1).spec == P(("data", "fsdp"))  # [B] leaves (advantages): rows only
