"""Muon: its update against Keller Jordan's reference, the parameter groups, the wsd schedule, and
in the trainer: FSDP-sharded state, micro-batches, exact resume with the Muon momentum, errors."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import linen as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flaxgpt.models import gpt  # noqa: E402
from flaxgpt.train import optim  # noqa: E402
from tests.train.test_resume import PreemptedAt, losses  # noqa: E402
from tests.train.test_trainer import data_dir, losses_over, tiny_config  # noqa: E402,F401

QUIET = dict(print_fn=lambda *a: None)


def _cfg(**kw):
    c = ml_collections.ConfigDict(
        dict(
            name="muon",
            schedule="constant",
            learning_rate=0.01,
            min_lr=0.0,
            warmup_steps=0,
            decay_steps=0,
            weight_decay=0.0,
            beta1=0.9,
            beta2=0.99,
            eps=1e-8,
            grad_clip=0.0,
            cooldown_frac=0.0,
            muon_learning_rate=0.05,
            muon_momentum=0.95,
            muon_momentum_warmup=0,
            muon_momentum_start=0.85,
            muon_nesterov=True,
            muon_ns_steps=5,
            muon_weight_decay=0.0,
            embed_learning_rate=0.3,
            head_learning_rate=0.002,
        )
    )
    c.update(kw)
    return c


def newton_schulz5(G, steps=5, eps=1e-7):
    """modded-nanogpt's zeropower_via_newtonschulz5, in float64 NumPy."""
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G / (np.linalg.norm(G) + eps)
    transposed = X.shape[0] > X.shape[1]
    if transposed:
        X = X.T
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if transposed else X


def test_first_update_is_the_orthogonalised_gradient_with_adamw_elsewhere():
    rng = np.random.default_rng(0)
    params = {
        "wte": {"embedding": jnp.ones((8, 4))},
        "h_0": {"mlp": {"c_fc": {"kernel": jnp.ones((4, 16)), "bias": jnp.ones((16,))}}},
        "h_1": {"mlp": {"c_proj": {"kernel": jnp.ones((16, 4))}}},  # stacked with c_fc, transposed
        "lm_head": {"kernel": jnp.ones((4, 8))},
    }
    grads = jax.tree_util.tree_map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
    assert optim.param_groups(params) == {
        "wte": {"embedding": "embed"},
        "h_0": {"mlp": {"c_fc": {"kernel": "muon", "bias": "adamw"}}},
        "h_1": {"mlp": {"c_proj": {"kernel": "muon"}}},
        "lm_head": {"kernel": "head"},
    }
    tx, _ = optim.make_optimizer(_cfg(), max_iters=10)
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    g = np.asarray(grads["h_0"]["mlp"]["c_fc"]["kernel"], np.float64)
    # Nesterov's first step is a multiple of the gradient; [4, 16] has fan_out / fan_in = 4: scale 2
    want = -0.05 * 2.0 * newton_schulz5(g)
    np.testing.assert_allclose(updates["h_0"]["mlp"]["c_fc"]["kernel"], want, atol=2e-5)
    g2 = np.asarray(grads["h_1"]["mlp"]["c_proj"]["kernel"], np.float64)  # fan_out < fan_in: scale 1
    np.testing.assert_allclose(
        updates["h_1"]["mlp"]["c_proj"]["kernel"], -0.05 * newton_schulz5(g2), atol=2e-5
    )
    s = np.linalg.svd(want / (-0.1), compute_uv=False)
    assert 0.5 < s.min() and s.max() < 1.5  # roughly orthogonal: Muon's whole point
    for name, lr in (("wte", 0.3), ("lm_head", 0.002)):  # Adam's first step: -lr * sign(g)
        leaf = next(iter(params[name]))
        np.testing.assert_allclose(updates[name][leaf], -lr * np.sign(grads[name][leaf]), rtol=1e-4)
    bias = updates["h_0"]["mlp"]["c_fc"]["bias"]
    np.testing.assert_allclose(bias, -0.01 * np.sign(grads["h_0"]["mlp"]["c_fc"]["bias"]), rtol=1e-4)


def test_groups_of_the_gpt_in_both_layouts():
    for scan in (False, True):
        config = gpt.GPTConfig(
            vocab_size=32,
            block_size=8,
            n_layer=2,
            n_head=2,
            n_embd=16,
            tie_embeddings=False,
            scan_layers=scan,
        )
        params = nn.unbox(gpt.abstract_params(config))  # shapes only: fast
        flat = jax.tree_util.tree_flatten_with_path(optim.param_groups(params))[0]
        groups = {"/".join(str(k.key) for k in path): g for path, g in flat}
        muon = sorted(n for n, g in groups.items() if g == "muon")
        assert len(muon) == 4 * (1 if scan else 2) and all(n.endswith("kernel") for n in muon)
        assert groups["wte/embedding"] == groups["wpe/embedding"] == "embed"
        assert groups["lm_head/kernel"] == "head" and groups["ln_f/scale"] == "adamw"
        tx, _ = optim.make_optimizer(_cfg(), max_iters=10)
        updates, _ = jax.eval_shape(lambda p, tx=tx: tx.update(p, tx.init(p), p), params)
        assert jax.tree_util.tree_structure(updates) == jax.tree_util.tree_structure(params)


def test_muon_on_a_parameter_it_cannot_handle_is_one_line():
    tx, _ = optim.make_optimizer(_cfg(), max_iters=10)
    params = {"h_0": {"attn": {"c_q": {"kernel": jnp.ones((4, 2, 2))}}}}
    with pytest.raises(
        ValueError, match=r"^Muon cannot orthogonalise h_0/attn/c_q/kernel of shape \(4, 2, 2\)"
    ):
        tx.init(params)
    with pytest.raises(ValueError, match="unknown optim.name 'sgd'"):
        optim.make_optimizer(_cfg(name="sgd"), max_iters=10)


def test_momentum_warmup():
    tx, _ = optim.make_optimizer(_cfg(muon_momentum_warmup=4, muon_momentum_start=0.85), max_iters=10)
    params = {"h_0": {"c_fc": {"kernel": jnp.ones((4, 4))}}}
    state, update, betas = tx.init(params), jax.jit(tx.update), []
    for _ in range(6):
        _, state = update(params, state, params)
        betas.append(float(state[0].inner_states["muon"].inner_state[1].hyperparams["beta"]))
    np.testing.assert_allclose(betas, [0.85, 0.875, 0.9, 0.925, 0.95, 0.95], rtol=1e-6)  # used at step 0..5


def test_wsd_schedule():
    s = optim.make_schedule("wsd", 1.0, 10, 100, 0.1, cooldown_frac=0.4)
    assert float(s(0)) == pytest.approx(1 / 11) and float(s(10)) == float(s(60)) == 1.0
    assert float(s(80)) == pytest.approx(0.55) and float(s(100)) == float(s(150)) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="cooldown_frac"):
        optim.make_schedule("wsd", 1.0, 10, 100)


def _muon_config(data_dir, **kw):  # noqa: F811
    return tiny_config(
        data_dir, optim__name="muon", optim__muon_learning_rate=0.02, model__tie_embeddings=False, **kw
    )


def test_muon_resumes_exactly_and_trains_sharded_and_accumulated(data_dir):  # noqa: F811
    # stopped at step 3 and resumed: the same parameters and optimizer state as straight through
    cfg = _muon_config(data_dir, max_iters=6, eval_interval=100, eval_iters=1, ckpt_interval=0)
    t = PreemptedAt(cfg, devices=jax.devices()[:1], **QUIET)
    t.k = 3
    assert int(t.run(t.init_state())["state"].step) == 3
    t.k = None
    resumed = t.run(t.init_state())["state"]
    cfg.out_dir = str(Path(cfg.out_dir) / "full")
    full = t.run(jax.jit(t._init_state_fn, out_shardings=t.state_shardings)(jax.random.key(cfg.seed)))
    leaves = lambda s: jax.tree_util.tree_leaves((s.params, s.opt_state))  # noqa: E731
    for a, b in zip(leaves(full["state"]), leaves(resumed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    t.close()

    one = np.array([v for k, v in sorted(losses(cfg.out_dir).items()) if k <= 5])  # one device
    assert one[-1] < one[0] - 0.2
    # 8 data-parallel devices: each orthogonalises its share of the stacked kernels
    data_parallel, _ = losses_over(_muon_config(data_dir, mesh__data=8, max_iters=6), 5)  # same schedule
    np.testing.assert_allclose(data_parallel, one, atol=1e-5)
    # 8 devices, 2-way data x 4-way FSDP: the Muon momentum is split like its parameters
    fsdp = _muon_config(data_dir, mesh__data=2, mesh__fsdp=4, grad_accum=2, max_iters=6)
    eight, state = losses_over(fsdp, 5)
    np.testing.assert_allclose(eight, one, atol=1e-5)
    mu = state.opt_state[1].inner_states["muon"].inner_state[1].mu["h_0"]["mlp"]["c_fc"]["kernel"]
    assert mu.sharding.spec[0] == "fsdp" and mu.addressable_shards[0].data.shape == (8, 128)

    # saved on one device, resumed on 8-way data parallel (each device orthogonalising its share of
    # the stack): the momentum is stored per parameter, so a checkpoint holds nothing of the mesh
    for mesh in (dict(data=8, fsdp=1),):
        moved = _muon_config(data_dir, max_iters=6, eval_interval=100, eval_iters=1, ckpt_interval=0)
        t = PreemptedAt(moved, devices=jax.devices()[:1], **QUIET)
        t.k = 3
        t.run(t.init_state())
        t.close()
        moved.mesh.update(mesh)
        t = PreemptedAt(moved, **QUIET)
        t.run(t.init_state())
        t.close()
        after = losses(moved.out_dir)
        np.testing.assert_allclose(
            [after[k] for k in (4, 5)], [losses(cfg.out_dir)[k] for k in (4, 5)], atol=1e-5
        )
