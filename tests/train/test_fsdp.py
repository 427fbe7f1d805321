"""FSDP on 8 simulated CPU devices: every data x fsdp mesh trains exactly like one device, the
parameters and Adam moments really are split over fsdp, and the bad meshes fail in one line."""

import sys
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the configs/ package

from configs import default  # noqa: E402
from flaxgpt.train import trainer  # noqa: E402

pytestmark = pytest.mark.devices(8)  # every mesh here spans 8 devices

STEPS = 3


def config(foxes_dir, data=-1, fsdp=1, batch_size=16, **model):
    c = default.get_config()
    c.data.dir = str(foxes_dir)
    c.out_dir, c.init_from = str(foxes_dir.parent / "never_written"), "scratch"
    c.model.n_layer, c.model.n_head, c.model.n_embd, c.model.block_size = 1, 2, 32, 16
    c.model.pad_vocab_multiple = 8
    c.model.update(model)
    c.mesh.data, c.mesh.fsdp = data, fsdp
    c.batch_size, c.eval_iters, c.max_iters, c.tensorboard = batch_size, 1, STEPS, False
    c.optim.warmup_steps, c.optim.learning_rate = 1, 3e-3
    return c


def train(cfg, devices=None):
    t = trainer.Trainer(cfg, devices=devices, print_fn=lambda *a: None)
    state, losses = t.init_state(), []
    for step in range(STEPS):
        state, m = t.train_step(state, t.global_batch("train", step, cfg.batch_size, micro=True))
        losses.append(float(m["loss"]))
    return np.array(losses), state


@pytest.fixture(scope="module")
def one_device(foxes_dir):
    return train(config(foxes_dir), jax.devices()[:1])


def adam_moments(opt_state):
    """(mu, nu) of the Adam state inside the optax chain."""
    found = [
        s
        for s in jax.tree_util.tree_leaves(opt_state, is_leaf=lambda x: hasattr(x, "mu"))
        if hasattr(s, "mu")
    ]
    assert len(found) == 1, opt_state
    return found[0].mu, found[0].nu


@pytest.mark.parametrize("data, fsdp", [(8, 1), (4, 2), (1, 8)])
def test_mesh_trains_like_one_device(foxes_dir, one_device, data, fsdp):
    losses, state = train(config(foxes_dir, data, fsdp))
    want_losses, want_state = one_device
    np.testing.assert_allclose(losses, want_losses, atol=1e-5, rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(want_state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)

    # every "embed" axis is split over fsdp: c_fc [embed 32, mlp 128], wte [vocab 64, embed 32]
    mu, nu = adam_moments(state.opt_state)
    for tree in (state.params, mu, nu):
        fc = tree["h_0"]["mlp"]["c_fc"]["kernel"]
        assert fc.sharding.shard_shape(fc.shape) == (32 // fsdp, 128)
        assert fc.addressable_shards[0].data.shape == (32 // fsdp, 128)
        wte = tree["wte"]["embedding"]
        assert wte.sharding.shard_shape(wte.shape) == (wte.shape[0], 32 // fsdp)
        bias = tree["h_0"]["mlp"]["c_fc"]["bias"]  # [mlp]: replicated
        assert bias.sharding.shard_shape(bias.shape) == bias.shape


def test_scanned_layers_with_remat_shard_and_match(foxes_dir):
    # scanned blocks draw their initial weights differently: compare with scanned on one device
    want, _ = train(config(foxes_dir, scan_layers=True), jax.devices()[:1])
    losses, state = train(config(foxes_dir, 1, 8, scan_layers=True, remat="full"))
    np.testing.assert_allclose(losses, want, atol=1e-5, rtol=1e-5)
    stacked = adam_moments(state.opt_state)[0]["h"]["block"]["mlp"]["c_fc"]["kernel"]  # [layers, embed, mlp]
    assert stacked.sharding.shard_shape(stacked.shape) == (1, 4, 128)


def test_bad_meshes_fail_in_one_line(foxes_dir):
    cases = [
        (config(foxes_dir, 3, 1), "mesh.data x mesh.fsdp must equal the 8 devices, got 3 x 1"),
        (config(foxes_dir, 2, 2), "mesh.data x mesh.fsdp must equal the 8 devices, got 2 x 2"),
        (config(foxes_dir, 4, 2, batch_size=12), "batch_size // grad_accum 12 is not divisible by the 8"),
        (config(foxes_dir, 1, 8, n_embd=36), "dim 36 is not divisible by the 8 devices of mesh axes"),
    ]
    for cfg, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            trainer.Trainer(cfg, print_fn=lambda *a: None)
        assert "\n" not in str(err.value)
