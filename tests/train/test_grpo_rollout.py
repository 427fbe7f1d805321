"""GRPO's rollouts by the serving engine (train/grpo_rollout.py): the tokens of decode.sampling.generate
for the same seed (sampled, top-p, EOS; prompts of different lengths; fewer slots than completions),
one prefill a prompt, new weights without a recompile; LoRA's adapters unmerged equal to the merged
model's rollouts, and GRPO steps with LoRA over an int8 base."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flaxgpt.decode import sampling
from flaxgpt.decode.sampling import Sampling
from flaxgpt.models import gpt, lora
from flaxgpt.serve.engine import Engine
from flaxgpt.train import grpo_task
from flaxgpt.train.grpo_rollout import EngineRollouts

CFG = gpt.GPTConfig(vocab_size=16, block_size=16, n_layer=1, n_head=2, n_embd=32)
PROMPTS = [[1, 2, 3], [4, 5], [6, 8, 9, 11, 12], [10]]  # lengths 3, 2, 5, 1
G, MAX_NEW, EOS = 4, 6, 3
SETTINGS = Sampling(temperature=1.0, top_p=0.9, eos_id=EOS)


def by_generate(weights, seed):
    return grpo_task.sample_groups(
        CFG, weights, PROMPTS, G, rng=jax.random.key(seed), max_new_tokens=MAX_NEW,
        temperature=SETTINGS.temperature, top_p=SETTINGS.top_p, eos_id=EOS,
    )  # fmt: skip


@pytest.fixture(scope="module")
def params():
    return gpt.init_params(CFG, jax.random.key(1))


def test_engine_rollouts_are_generates_tokens(params, monkeypatch):
    """16 completions through 5 slots (a completion ending at EOS frees its slot for the next): the
    tokens generate(rng=key(seed)) samples, each prompt prefilled once; new weights, no recompile."""
    prefills, real = [], Engine.prefill

    def counted(self, prompt_ids, rows, adapter=0):
        prefills.append(list(prompt_ids))
        return real(self, prompt_ids, rows, adapter)

    monkeypatch.setattr(Engine, "prefill", counted)
    rollouts = EngineRollouts(CFG, SETTINGS, max_new_tokens=MAX_NEW, slots=5, max_len=16)
    rows, got = rollouts.sample(params, PROMPTS, G, seed=7)
    want_rows, want = by_generate(params, 7)
    assert rows == want_rows and got == want
    assert prefills == PROMPTS  # G completions forked from one prefill
    lengths = [len(c) for c in got]
    assert min(lengths) < MAX_NEW and max(lengths) == MAX_NEW and any(c[-1] == EOS for c in got)
    compiled = sampling.decode_chunk._cache_size()
    moved = jax.tree.map(lambda x: x * 1.5, params)  # the next step's weights
    assert rollouts.sample(moved, PROMPTS, G, seed=8)[1] == by_generate(moved, 8)[1]
    assert sampling.decode_chunk._cache_size() == compiled


def test_lora_unmerged_equals_merged_then_grpo_steps_over_an_int8_base(params):
    """Adapters added unmerged (models.lora.step_fn) sample the merged model's tokens over a float32
    base; over an int8 base (QLoRA) three GRPO steps (beta 0.04: the reference is the int8 base)
    run: the loss finite, the adapters moving, each step's rollout from the updated adapters."""
    from flaxgpt.train.steps import TrainState, make_train_step

    spec = lora.LoraSpec.make(CFG, rank=4, alpha=8.0)
    leaves, tree = jax.tree.flatten(lora.init_adapters(CFG, spec, jax.random.key(2)))
    keys = jax.random.split(jax.random.key(3), len(leaves))  # B is zeros at init: make them count
    adapters = tree.unflatten([x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
    float_rollouts = EngineRollouts(
        CFG, SETTINGS, max_new_tokens=MAX_NEW, slots=16, max_len=16, lora_spec=spec
    )
    got = float_rollouts.sample((params, adapters), PROMPTS, G, seed=7)[1]
    assert got == by_generate(lora.merge(CFG, spec, params, adapters), 7)[1]
    assert got != by_generate(params, 7)[1]  # the adapters change what is sampled

    base8 = lora.quantize_base(params, "int8")
    task = grpo_task.GRPOTask(CFG, grpo_task.GRPOOptions(beta=0.04, max_completion_length=MAX_NEW), spec)
    tx = optax.adam(3e-2)
    state = TrainState(jnp.int32(0), adapters, tx.init(adapters), jax.random.key(0), frozen=base8)
    step = jax.jit(make_train_step(task, tx, lambda s: 3e-2, grad_accum=1), donate_argnums=0)
    ref_logps = jax.jit(task.reference_logps)
    rollouts = EngineRollouts(CFG, SETTINGS, max_new_tokens=MAX_NEW, slots=16, max_len=16, lora_spec=spec)
    for i in range(3):
        before = jax.tree.map(np.asarray, state.params)
        rows, completions = rollouts.sample((state.frozen, state.params), PROMPTS, G, seed=10 + i)
        total = np.array([np.mean([t == 7 for t in c]) for c in completions])
        batch = grpo_task.rollout_batch(
            rows, completions, CFG.block_size, grpo_task.group_advantages(total, G)[0]
        )
        batch["ref_logp"] = np.asarray(ref_logps(batch, state.frozen))
        state, metrics = step(state, jax.tree.map(lambda x: x[None], batch))
        assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["kl"]))
        moved = max(
            float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(before))
        )
        assert moved > 0
