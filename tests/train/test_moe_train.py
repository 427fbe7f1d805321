"""A tiny mixture of experts trains: the loss falls, the router losses enter the training loss with
their coefficients (evaluations leave them out) and metrics.jsonl logs them."""

import json
from pathlib import Path

import jax
import numpy as np

from flaxgpt.train import trainer
from tests.train.test_trainer import data_dir, tiny_config  # noqa: F401 (the data_dir fixture)

MOE = dict(
    model__pos_embedding="rope", model__norm="rmsnorm", model__activation="silu", model__glu=True,
    model__bias=False, model__n_layer=2, model__num_experts=4, model__experts_per_token=2,
    model__expert_hidden=16, model__mlp_only_layers=(1,), model__router_aux_loss_coef=0.5,
    model__router_z_loss_coef=0.01,
)  # fmt: skip


def test_tiny_moe_trains_and_logs_its_router_losses(data_dir):  # noqa: F811
    cfg = tiny_config(data_dir, max_iters=4, eval_interval=100, **MOE)
    t = trainer.Trainer(cfg, devices=jax.devices()[:1], print_fn=lambda *a: None)
    state = t.init_state()
    batch = t.global_batch("train", 0, cfg.batch_size, micro=True)
    params = state.params
    # the train step's loss is the language-model loss + 0.5 aux + 0.01 z, on the step's own params
    lm_sum, weight = t.eval_step(params, jax.tree_util.tree_map(lambda x: x[0], batch), state.frozen)
    state, m = t.train_step(state, batch)
    expected = float(lm_sum / weight) + 0.5 * float(m["router_aux"]) + 0.01 * float(m["router_z"])
    np.testing.assert_allclose(float(m["loss"]), expected, rtol=1e-5)
    assert 1.9 < float(m["router_aux"]) < 2.5  # k = 2 when the load is uniform, more when it is not
    losses = [float(m["loss"])]
    for _ in range(3):
        state, m = t.train_step(state, batch)
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0] and all(np.isfinite(losses))

    summary = t.run(t.init_state())  # the trainer's loop, with the steps compiled above
    assert np.isfinite(summary["loss"])
    rows = [json.loads(line) for line in (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "router_aux" in r]
    assert len(logged) == 4 and all(r["router_z"] > 0 for r in logged)
