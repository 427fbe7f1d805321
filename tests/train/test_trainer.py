"""The train step: loss goes down, 1 vs 8 devices, micro-batching, overfitting, sharding errors."""

import json
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the configs/ package

from configs import default  # noqa: E402
from flaxgpt import sharding  # noqa: E402
from flaxgpt.data import prepare  # noqa: E402
from flaxgpt.tools import summary  # noqa: E402
from flaxgpt.train import (
    tasks,  # noqa: E402
    trainer,  # noqa: E402
)

TEXT = "".join(f"{i % 7} little pigs went to market and {i % 5} stayed home.\n" for i in range(300))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "pigs"
    prepare.prepare_text(TEXT, out, "char", 0.1, "generated")
    return out


def tiny_config(data_dir, **kw):
    c = default.get_config()
    c.data.dir = str(data_dir)
    # a fresh run directory beside the data, inside pytest's managed temporary tree (cleaned with it)
    c.out_dir = tempfile.mkdtemp(prefix="run_", dir=Path(data_dir).parent)
    c.model.n_layer, c.model.n_head, c.model.n_embd, c.model.block_size = 1, 2, 32, 16
    c.model.pad_vocab_multiple = 8
    c.batch_size, c.max_iters, c.eval_iters, c.log_interval = 16, 5, 2, 1
    c.optim.warmup_steps, c.optim.learning_rate, c.optim.min_lr = 2, 3e-3, 3e-4
    c.tensorboard, c.plot = False, False
    for k, v in kw.items():
        section, _, key = k.rpartition("__")
        (c[section] if section else c)[key] = v
    return c


def losses_over(cfg, steps, devices=None, t=None):
    t = t or trainer.Trainer(cfg, devices=devices, print_fn=lambda *a: None)
    state = t.init_state()
    out = []
    for step in range(steps):
        state, m = t.train_step(state, t.global_batch("train", step, cfg.batch_size, micro=True))
        out.append(float(m["loss"]))
    return np.array(out), state


@pytest.fixture(scope="module")
def one_device(data_dir):
    """The reference: the tiny model on one device, 5 steps (losses, final state, its Trainer)."""
    cfg = tiny_config(data_dir)
    t = trainer.Trainer(cfg, devices=jax.devices()[:1], print_fn=lambda *a: None)
    losses, state = losses_over(cfg, 5, t=t)
    return losses, state, t


def test_one_step_on_a_fixed_batch_lowers_the_loss(one_device):
    _, _, t = one_device
    state = t.init_state()
    batch = t.global_batch("train", 0, t.config.batch_size, micro=True)
    losses = []
    for _ in range(3):
        state, m = t.train_step(state, batch)
        losses.append(float(m["loss"]))
    assert losses[1] < losses[0] and losses[2] < losses[1]
    assert int(state.step) == 3


@pytest.mark.devices(8)
def test_one_device_and_eight_devices_agree(data_dir, one_device):
    assert jax.device_count() == 8
    one = one_device[0]
    # 8 devices: 2-way data parallel x 4-way FSDP (parameters and optimizer state split)
    eight, state = losses_over(tiny_config(data_dir, mesh__data=2, mesh__fsdp=4), 5)
    np.testing.assert_allclose(eight, one, atol=1e-5)
    kernel = state.params["h_0"]["mlp"]["c_fc"]["kernel"]  # [embed, mlp]: embed split over fsdp
    assert kernel.sharding.spec[0] == "fsdp" and kernel.addressable_shards[0].data.shape == (8, 128)


def test_micro_batches_equal_one_big_batch(data_dir, one_device):
    one, s1, _ = one_device
    four, s4 = losses_over(tiny_config(data_dir, grad_accum=4), 5, devices=jax.devices()[:1])
    np.testing.assert_allclose(four, one, atol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(s1.params), jax.tree_util.tree_leaves(s4.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_tiny_model_overfits_a_short_text(data_dir):
    cfg = tiny_config(
        data_dir, max_iters=150, eval_interval=150, log_interval=50, batch_size=8, ckpt_interval=0
    )
    cfg.optim.learning_rate, cfg.optim.warmup_steps = 1e-2, 10
    t = trainer.Trainer(cfg, devices=jax.devices()[:1], print_fn=lambda *a: None)
    summary = t.run(t.init_state())
    # chars of a 27-symbol, highly repetitive text: uniform is ln 27 = 3.3
    assert summary["train_loss"] < 0.5 and summary["val_loss"] < 0.5, summary


def test_init_from_a_gpt2_directory(data_dir, tmp_path, one_device):
    from flaxgpt.hf import pretrained as hf

    _, state, t = one_device  # export the reference run's trained weights, then start from them
    hf.export_pretrained(t.task.model_config, jax.device_get(state.params), str(tmp_path / "gpt2dir"))
    cfg = tiny_config(
        data_dir, init_from=str(tmp_path / "gpt2dir"), model__dropout=0.1, model__attn_dropout=0.0
    )
    t2 = trainer.Trainer(cfg, devices=jax.devices()[:1], print_fn=lambda *a: None)
    c2 = t2.task.model_config  # the architecture from the checkpoint, run-time fields from the recipe
    assert (c2.embd_dropout, c2.attn_dropout, c2.resid_dropout, c2.pad_vocab_multiple) == (0.1, 0.0, 0.1, 8)
    s2 = t2.init_state()
    assert int(s2.step) == 0
    V = t.task.model_config.vocab_size  # exported without the padding rows; they come back as zeros
    trim = lambda p: {**p, "wte": {"embedding": p["wte"]["embedding"][:V]}}  # noqa: E731
    leaves = jax.tree_util.tree_leaves
    for a, b in zip(leaves(trim(state.params)), leaves(trim(s2.params))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    # a preempted fine-tune continues from its own checkpoints, not from the GPT-2 weights again
    t2.run(s2), t2.close()
    printed = []
    cfg.max_iters = 7
    out = trainer.train(cfg, devices=jax.devices()[:1], print_fn=printed.append)
    assert f"resumed from {cfg.out_dir}/checkpoints/5" in printed and int(out["state"].step) == 7


@pytest.mark.devices(8)
def test_bfloat16_parameters_train_past_the_first_step(data_dir):
    """model.param_dtype=bfloat16: the mean gradient keeps the parameters' dtype (dividing by the
    float32 token count made it float32, then the optimizer's moments, and step 2 refused the state)."""
    cfg = tiny_config(data_dir, model__param_dtype="bfloat16", max_iters=3)
    trainer.train(cfg, devices=jax.devices()[:1], print_fn=lambda *a: None)
    rows = [json.loads(x) for x in (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) for r in rows if "loss" in r)


def test_sharding_errors(data_dir):
    with pytest.raises(ValueError, match="not divisible by the 8 data-parallel devices"):
        trainer.Trainer(tiny_config(data_dir, batch_size=12))
    with pytest.raises(ValueError, match="mesh.data x mesh.fsdp must equal the 8 devices, got 3 x 1"):
        trainer.Trainer(tiny_config(data_dir, mesh__data=3))
    with pytest.raises(ValueError, match="not divisible by the 8 devices of mesh axes"):
        sharding.param_shardings(_abstract(n_embd=36, n_head=2), sharding.make_mesh(1, 8))
    with pytest.raises(ValueError, match="not divisible by grad_accum"):
        trainer.Trainer(tiny_config(data_dir, grad_accum=3))


def test_cpu_device_count_divides_the_batch():
    assert sharding.cpu_device_count(cores=2, batch_rows=12) == 2
    assert sharding.cpu_device_count(cores=4, batch_rows=6) == 3
    assert sharding.cpu_device_count(cores=2, batch_rows=7) == 1
    # a context axis: groups of its devices, each some rows (2 cores, 3 rows, context 2: 1 device was
    # chosen and mesh.context 2 refused it)
    assert sharding.cpu_device_count(cores=2, batch_rows=3, context=2) == 2
    assert sharding.cpu_device_count(cores=8, batch_rows=6, context=2) == 6
    assert sharding.cpu_device_count(cores=2, batch_rows=4, context=4) == 4


def _abstract(**kw):
    from flaxgpt.models import gpt

    return gpt.abstract_params(gpt.GPTConfig(vocab_size=64, block_size=8, n_layer=1, **kw))


def test_dropout_rates_and_training_flops(data_dir):
    cfg = tiny_config(data_dir, model__dropout=0.2, model__attn_dropout=0.0, model__tie_embeddings=False)
    task = tasks.make_task(cfg)
    c = task.model_config
    assert (c.embd_dropout, c.attn_dropout, c.resid_dropout) == (0.2, 0.0, 0.2)
    # 6N + 12*L*H*Q*T with N the matmul weights: no position table, no (untied) embedding lookup
    params = task.init_params(jax.random.key(0))
    total = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
    n = total - params["wpe"]["embedding"].size - params["wte"]["embedding"].size
    want = 6 * n + 12 * c.n_layer * c.n_head * c.head_dim * c.block_size
    assert summary.flops_per_token(c, task.tokens_per_row)["train"] == want
    t = trainer.Trainer(cfg, devices=jax.devices()[:1], print_fn=lambda *a: None)
    assert t.flops_per_token == want == summary.summarize(c)["flops"]["train"]  # MFU counts as summary
    t.close()
