"""GRPO's rollouts by the serving engine (train/grpo_rollout.py): the tokens of decode.sampling.generate
for the same seed (sampled, top-p, EOS; prompts of different lengths; fewer slots than completions),
one prefill a prompt, new weights without a recompile; LoRA's adapters unmerged equal to the merged
model's rollouts, and which LoRA rollouts decode merged weights; the same tokens from an engine
over 4 devices."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxgpt import sharding
from flaxgpt.decode import sampling
from flaxgpt.decode.sampling import Sampling
from flaxgpt.models import gpt, lora
from flaxgpt.serve.engine import Engine
from flaxgpt.train import grpo_rollout, grpo_task, policy
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

    def counted(self, prompt_ids, rows, **kw):
        prefills.append(list(prompt_ids))
        return real(self, prompt_ids, rows, **kw)

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


@pytest.mark.parametrize("slots", [5, 16])
def test_logprobs_kept_are_the_forward_passes(params, slots):
    """logprobs=True (an off-policy run's behaviour log-probs): the same tokens, each completion a
    Completion whose logp are the log-probs a forward pass over prompt + completion gives its tokens
    (float32 within 1e-5), first tokens included (from a group's insert, 16 slots, or forks, 5), and
    rollout_batch places them as behaviour_logp beside the targets."""
    rollouts = EngineRollouts(CFG, SETTINGS, max_new_tokens=MAX_NEW, slots=slots, max_len=16, logprobs=True)
    rows, got = rollouts.sample(params, PROMPTS, G, seed=7)
    assert got == by_generate(params, 7)[1] and all(len(c.logp) == len(c) for c in got)
    batch = grpo_task.rollout_batch(rows, got, CFG.block_size)
    logits = gpt.GPT(CFG).apply({"params": params}, jnp.asarray(batch["inputs"]))
    want = np.asarray(grpo_task.completion_logps(logits, jnp.asarray(batch["targets"]))[0])
    mask = batch["loss_mask"] > 0
    np.testing.assert_allclose(batch["behaviour_logp"][mask], want[mask], atol=1e-5)
    assert not batch["behaviour_logp"][~mask].any()
    plain = EngineRollouts(CFG, SETTINGS, max_new_tokens=MAX_NEW, slots=slots, max_len=16)
    assert "behaviour_logp" not in grpo_task.rollout_batch(*plain.sample(params, PROMPTS, G, seed=7), 16)


def test_lora_unmerged_rollouts_are_the_merged_models(params):
    """Adapters added unmerged (models.lora.step_fn: what lets the base be int8, tested through the
    trainer in test_grpo_train) sample the merged model's tokens over a float32 base."""
    spec = lora.LoraSpec.make(CFG, rank=4, alpha=8.0)
    leaves, tree = jax.tree.flatten(lora.init_adapters(CFG, spec, jax.random.key(2)))
    keys = jax.random.split(jax.random.key(3), len(leaves))  # B is zeros at init: make them count
    adapters = tree.unflatten([x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
    rollouts = EngineRollouts(CFG, SETTINGS, max_new_tokens=MAX_NEW, slots=5, max_len=16, lora_spec=spec)
    got = rollouts.sample((params, adapters), PROMPTS, G, seed=7)[1]
    assert got == by_generate(lora.merge(CFG, spec, params, adapters), 7)[1]
    assert got != by_generate(params, 7)[1]  # the adapters change what is sampled
    # over an int8 base (QLoRA-style): grpo.rollout=generate's step (the adapters unmerged, as the
    # engine's) samples the engine's tokens
    base = lora.quantize_base(params, "int8")
    got = rollouts.sample((base, adapters), PROMPTS, G, seed=7)[1]
    step = lora.step_fn(CFG, spec, base, adapters)
    assert got == grpo_task.sample_groups(
        CFG, None, PROMPTS, G, rng=jax.random.key(7), max_new_tokens=MAX_NEW,
        temperature=SETTINGS.temperature, top_p=SETTINGS.top_p, eos_id=EOS, step_fn=step,
    )[1]  # fmt: skip


def test_which_lora_rollouts_merge():
    """grpo_rollout.merged: LoRA over a float32 base with grpo.merge_lora decodes the merged weights
    (exact to rounding); a bfloat16 base (the adapters' product rounded into 8 bits), an int8 one
    (no float kernel to hold it), merge_lora=False and full fine-tuning decode as they are."""
    spec = lora.LoraSpec.make(CFG, rank=4, alpha=8.0)
    for base_dtype, want in (("float32", True), ("bfloat16", False), ("int8", False)):
        assert grpo_rollout.merged(policy.LoraPolicy(CFG, spec, base_dtype), True) is want
    assert not grpo_rollout.merged(policy.LoraPolicy(CFG, spec, "float32"), False)
    bf16_params = dataclasses.replace(CFG, param_dtype="bfloat16")
    assert not grpo_rollout.merged(policy.LoraPolicy(bf16_params, spec, "float32"), True)
    assert not grpo_rollout.merged(policy.FullPolicy(CFG), True)


@pytest.mark.devices(4)
def test_rollouts_over_a_mesh_are_one_devices(params):
    """The engine over 4 devices (the trainer's for a mesh: slots split by rows, the weights placed
    by SERVE_RULES, each completion by fork + insert) samples the one-device engine's tokens."""
    mesh = sharding.make_mesh(1, 4, jax.devices()[:4])
    placed = jax.device_put(
        params, sharding.param_shardings(gpt.abstract_params(CFG), mesh, sharding.SERVE_RULES)
    )
    one = EngineRollouts(CFG, SETTINGS, max_new_tokens=MAX_NEW, slots=8, max_len=16)
    four = EngineRollouts(CFG, SETTINGS, max_new_tokens=MAX_NEW, slots=8, max_len=16, mesh=mesh)
    assert four.sample(placed, PROMPTS, G, seed=7) == one.sample(params, PROMPTS, G, seed=7)
    assert four.engine.state.fill_B.sharding.spec[0] is not None  # the slots split (2 heads: the pool whole)
    # LoRA: the base placed as the trainer places it for the engine, the adapters whole on each device
    spec = lora.LoraSpec.make(CFG, rank=4, alpha=8.0)
    leaves, tree = jax.tree.flatten(lora.init_adapters(CFG, spec, jax.random.key(2)))
    adapters = tree.unflatten([x + 0.3 for x in leaves])
    kw = dict(max_new_tokens=MAX_NEW, slots=8, max_len=16, lora_spec=spec)
    want = EngineRollouts(CFG, SETTINGS, **kw).sample((params, adapters), PROMPTS, G, seed=9)
    on_mesh = jax.device_put(adapters, sharding.replicated(mesh))
    assert (
        EngineRollouts(CFG, SETTINGS, mesh=mesh, **kw).sample((placed, on_mesh), PROMPTS, G, seed=9) == want
    )


@pytest.mark.devices(3)
def test_replicas_sample_one_engines_tokens(params):
    """grpo.engine_replicas: k replicas of the engine, each a share of the prompts (whole groups; 4
    prompts over 3 replicas: 1, 1, 2) and its own slots, sample one engine's tokens (the same keys),
    replica i on device i mod n: 3 over as many devices, 2 on one device (threads of one CPU device
    decode at once; 2 over 2 devices: test_grpo_async's trainer run); LoRA's frozen base is read
    where it lies and copied once to the other device."""
    one = EngineRollouts(CFG, SETTINGS, max_new_tokens=MAX_NEW, slots=8, max_len=16)
    want = one.sample(params, PROMPTS, G, seed=7)
    d = jax.devices()
    for devices, k, where in ((d[:3], 3, d[:3]), ([d[1]], 2, [d[1], d[1]])):
        replicas = grpo_rollout.Replicas(one, devices, k)
        assert [p.slots for p in replicas.parts] == [-(-8 // k)] * k
        assert replicas.sample(params, PROMPTS, G, seed=7) == want
        assert [p.engine.state.fill_B.sharding.device_set for p in replicas.parts] == [{x} for x in where]
    spec = lora.LoraSpec.make(CFG, rank=4, alpha=8.0)
    leaves, tree = jax.tree.flatten(lora.init_adapters(CFG, spec, jax.random.key(2)))
    adapters = tree.unflatten([x + 0.3 for x in leaves])
    kw = dict(max_new_tokens=MAX_NEW, slots=8, max_len=16, lora_spec=spec)
    replicas = grpo_rollout.Replicas(EngineRollouts(CFG, SETTINGS, **kw), d[:2], 2)
    want = EngineRollouts(CFG, SETTINGS, **kw).sample((params, adapters), PROMPTS, G, seed=9)
    assert replicas.sample((params, adapters), PROMPTS, G, seed=9) == want
    bases = dict(replicas.bases)
    assert replicas.sample((params, adapters), PROMPTS, G, seed=9) == want
    # device 0 holds the base (params' device): read there; device 1's copy kept, not copied again
    assert {x.devices().pop() for x in jax.tree.leaves(params)} == {d[0]}
    assert bases.keys() == {d[1]} and all(replicas.bases[x] is bases[x] for x in bases)
