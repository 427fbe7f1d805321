"""DPO and GRPO updates with sequences split over a mesh "context" axis (8 simulated CPU devices): one
train step of each objective over data 2 x fsdp 2 x context 2 (ring attention) gives one device's
loss, gradient norm and parameters. Their sums over a row's tokens (a pair's completion log-probs,
GRPO's token losses against old and reference log-probs) cross the chunks; DPO's pairs are packed
as two segments a row, so segment ids cross them too."""

import sys
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the configs/ package

from configs import default  # noqa: E402
from flaxgpt import sharding  # noqa: E402
from flaxgpt.data import batches as data_lib  # noqa: E402
from flaxgpt.models import gpt  # noqa: E402
from flaxgpt.models import registry as models  # noqa: E402
from flaxgpt.train.steps import make_steps  # noqa: E402
from flaxgpt.train.tasks import Task  # noqa: E402

pytestmark = pytest.mark.devices(8)

B, T, V = 8, 16, 64


def recipe(data_format: str, **section):
    c = default.get_config()
    c.data.format = data_format
    c.model.n_layer, c.model.n_head, c.model.n_embd, c.model.block_size = 1, 2, 32, T
    c.model.pos_embedding, c.model.n_kv_head, c.model.sliding_window = "rope", 1, 6  # crosses chunks of 4
    c.model.pad_vocab_multiple, c.model.dropout = 8, 0.0
    c.batch_size, c.max_iters = B, 2
    c.optim.warmup_steps, c.optim.learning_rate = 1, 3e-3
    for key, value in section.items():
        c[{"prompts": "grpo", "pairs": "dpo"}[data_format]][key] = value
    return c


def dpo_batch(rng):
    """Each row a pair packed as two segments (ids 1 and 2, padding 0) whose lengths differ by row."""
    seg = np.zeros((B, T), np.int32)
    for b in range(B):
        first, second = 4 + b % 5, 3 + b % 4
        seg[b, :first], seg[b, first : first + second] = 1, 2
    mask = ((seg > 0) & (rng.random((B, T)) < 0.7)).astype(np.float32)
    tokens = rng.integers(0, V, (2, B, T), dtype=np.int32)
    return dict(inputs=tokens[0], targets=tokens[1], loss_mask=mask, segment_ids=seg)


def grpo_batch(rng):
    tokens = rng.integers(0, V, (2, B, T), dtype=np.int32)
    mask = (np.arange(T)[None] >= 5 + np.arange(B)[:, None] % 3).astype(np.float32)  # completions
    logp = -rng.random((2, B, T)).astype(np.float32) * 3
    adv = rng.standard_normal(B).astype(np.float32)
    return dict(
        inputs=tokens[0],
        targets=tokens[1],
        loss_mask=mask,
        advantages=adv,
        old_logp=logp[0],
        ref_logp=logp[1],
    )


def one_step(config, batch, devices, **mesh):
    """(loss, grad_norm) and the parameters after one train step of `config`'s task on `mesh`."""
    mc = models.config_from(config.model, V)
    start = gpt.init_params(mc, jax.random.key(0))
    task = Task(config, mc, start)  # full fine-tuning from `start`, the reference a copy of it
    steps = make_steps(config, task, sharding.make_mesh(devices=devices, **mesh))
    state = jax.jit(steps.init_state, out_shardings=steps.state_shardings)(jax.random.key(1), start)
    state = state.replace(frozen=steps.frozen)
    placed = data_lib.to_global(data_lib.split_micro(batch, 1), steps.train_batch_sharding, batch_axis=1)
    state, m = steps.train_step(state, placed)
    return np.array([float(m["loss"]), float(m["grad_norm"])]), state.params


CASES = {
    "dpo": (lambda: recipe("pairs", beta=0.1), dpo_batch),
    "grpo": (lambda: recipe("prompts", beta=0.05, num_iterations=2, max_completion_length=8), grpo_batch),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_update_over_context_equals_one_device(name):
    make_config, make_batch = CASES[name]
    batch = make_batch(np.random.default_rng(0))
    want, want_params = one_step(make_config(), batch, jax.devices()[:1])
    got, params = one_step(make_config(), batch, jax.devices(), data=2, fsdp=2, context=2)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(want_params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_a_context_group_across_processes_is_one_line():
    """Two processes of one device each with mesh.context 2: each loads whole rows, and jax refused the
    batch with "Invalid host data" on the first step; now refused before anything runs, naming the fix.
    (Processes stood in for by device stand-ins: the check reads their process_index alone.)"""
    from types import SimpleNamespace

    def mesh(process_of_device, context):
        devices = np.array([SimpleNamespace(process_index=p) for p in process_of_device])
        return SimpleNamespace(
            devices=devices.reshape(-1, 1, context), axis_names=("data", "fsdp", sharding.CONTEXT_AXIS)
        )

    with pytest.raises(
        ValueError, match=r"mesh.context 2 splits a row's sequence over devices of 2 processes"
    ):
        sharding.check_context_in_processes(mesh([0, 1], 2))
    with pytest.raises(ValueError, match=r"mesh.context <= its 2 devices"):
        sharding.check_context_in_processes(mesh([0, 0, 1, 1], 4))
    sharding.check_context_in_processes(mesh([0, 0, 1, 1], 2))  # each group inside a process: fine
