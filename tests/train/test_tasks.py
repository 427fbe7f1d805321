"""Tasks are composed (train.tasks.Task: an objective x a policy x a batch source): for a tiny config of
each objective x policy pair (LM, DPO, GRPO full and LoRA; seq2seq full), the first-step loss equals
an independent computation (the model called directly, the loss functions on its output) bit for bit
and the value the subclassed tasks gave at 1412091 (to float32 rounding: another CPU may round
otherwise); Task.abstract builds the same task with shapes, no data and no weights."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the configs/ package

from configs import default, seq2seq_default  # noqa: E402
from flaxgpt.models import gpt, lora  # noqa: E402
from flaxgpt.models import registry as models  # noqa: E402
from flaxgpt.models.seq2seq import Transformer  # noqa: E402
from flaxgpt.train import dpo_task, grpo_task  # noqa: E402
from flaxgpt.train.losses import cross_entropy, token_logprobs  # noqa: E402
from flaxgpt.train.policy import Frozen  # noqa: E402
from flaxgpt.train.tasks import Task  # noqa: E402

# the first-step losses of the subclassed tasks (LMTask, DPOTask, GRPOOnlineTask, Seq2SeqTask) at
# commit 1412091 on this file's configs, weights and batches (float.hex), as tests/conftest.py runs
# them on the CPU (8 devices, JAX_DISABLE_MOST_OPTIMIZATIONS): equal bit for bit on the AVX2 machine
AT_1412091 = {
    ("lm", 0): "0x1.0e6bfa0000000p+2",
    ("lm", 4): "0x1.0ca1340000000p+2",
    ("dpo", 0): "0x1.5df1360000000p-1",
    ("dpo", 4): "0x1.6126840000000p-1",
    ("grpo", 0): "0x1.abe2da0000000p-1",
    ("grpo", 4): "0x1.b5bcac0000000p-1",
    ("seq2seq", 0): "0x1.5864dc0000000p+2",
}
FORMATS = {"lm": "tokens", "dpo": "pairs", "grpo": "prompts", "seq2seq": "tokens"}


def config(name, rank):
    c = (seq2seq_default if name == "seq2seq" else default).get_config()
    if name == "seq2seq":
        c.model.n_enc_layer, c.model.n_dec_layer, c.model.d_ff = 1, 1, 64
    else:
        c.model.n_layer, c.model.dtype = 1, "float32"
    c.model.n_head, c.model.n_embd, c.model.block_size, c.model.vocab_size, c.model.dropout = (
        2,
        32,
        16,
        64,
        0.0,
    )
    c.data.format, c.lora.rank, c.lora.alpha = FORMATS[name], rank, 8.0
    c.grpo.beta, c.grpo.rollout = (0.04 if name == "grpo" else 0.0), "generate"
    return c


def noisy(tree, seed):
    """The tree plus small noise: LoRA's B starts at zero, which would hide the adapters."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noise = [x + 0.02 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)]
    return jax.tree.unflatten(treedef, noise)


def batch_for(name, B=2, T=16):
    r = np.random.default_rng(0)
    b = {
        "inputs": r.integers(0, 64, (B, T)).astype(np.int32),
        "targets": r.integers(0, 64, (B, T)).astype(np.int32),
    }
    if name == "dpo":  # two pairs a row: segments 1, 2 (chosen, rejected) and 3, 4
        seg = np.zeros((B, T), np.int32)
        seg[:, 0:4], seg[:, 4:8], seg[:, 8:11], seg[:, 11:15] = 1, 2, 3, 4
        mask = (seg > 0).astype(np.float32)
        mask[:, [0, 4, 8, 11]] = 0
        b.update(segment_ids=seg, loss_mask=mask)
    if name == "grpo":
        mask = np.zeros((B, T), np.float32)
        mask[:, 5:12] = 1
        ref = -r.random((B, T)).astype(np.float32) * 4
        b.update(loss_mask=mask, advantages=np.array([0.7, -1.1], np.float32), ref_logp=ref)
    if name == "seq2seq":
        b = {
            "src": r.integers(3, 64, (B, 10)).astype(np.int32),
            "src_lengths": np.array([10, 7], np.int32),
            "inputs": r.integers(3, 64, (B, 12)).astype(np.int32),
            "targets": r.integers(3, 64, (B, 12)).astype(np.int32),
            "loss_mask": (np.arange(12)[None] < np.array([[12], [9]])).astype(np.float32),
        }
    return b


def independent(name, c, mc, params, start, spec, batch, rng):
    """The loss with no task: the model called directly, the objective's loss functions on its output."""
    if name == "seq2seq":
        logits = Transformer(mc, deterministic=False).apply(
            {"params": params}, batch["src"], batch["src_lengths"], batch["inputs"], rngs={"dropout": rng}
        )
        return cross_entropy(logits, batch["targets"], batch["loss_mask"], c.optim.label_smoothing)

    def logits(p, train, **kw):
        if spec is not None:  # the base (start) with the adapters p ({}: none)
            return lora.apply(mc, spec, start, p, batch["inputs"], deterministic=not train, rng=rng, **kw)
        return gpt.GPT(mc).apply(
            {"params": p},
            batch["inputs"],
            deterministic=not train,
            rngs={"dropout": rng} if train else None,
            **kw,
        )

    reference = {} if spec is not None else start
    if name == "lm":
        return cross_entropy(logits(params, True), batch["targets"], None, c.optim.label_smoothing)
    if name == "dpo":
        seg = batch["segment_ids"]
        sums = lambda lp: dpo_task.pair_sums(lp * batch["loss_mask"], seg)  # noqa: E731
        pol = sums(token_logprobs(logits(params, True, segment_ids_BT=seg), batch["targets"]))
        ref = sums(token_logprobs(logits(reference, False, segment_ids_BT=seg), batch["targets"]))
        n = dpo_task.pair_sums(batch["loss_mask"], seg)
        keys = ("policy_chosen", "policy_rejected", "ref_chosen", "ref_rejected", "n_chosen", "n_rejected")
        logps = dict(zip(keys, (*pol, *jax.lax.stop_gradient(ref), *n), strict=True))
        losses, _ = dpo_task.dpo_losses(logps, c.dpo.beta, c.dpo.loss, c.dpo.label_smoothing)
        pair = (n[0] > 0).astype(jnp.float32)
        return jnp.sum(losses * pair), jnp.sum(pair)
    opts = grpo_task.GRPOOptions(beta=c.grpo.beta, max_completion_length=c.grpo.max_completion_length)
    logp, entropy = grpo_task.completion_logps(logits(params, True), batch["targets"], c.grpo.temperature)
    loss_sum, weight, _ = grpo_task.grpo_loss(
        logp, batch["loss_mask"], batch["advantages"], opts, ref_logp_BT=batch["ref_logp"], entropy_BT=entropy
    )
    return loss_sum, weight


def weight_of(aux):
    return aux[0] if isinstance(aux, tuple) else aux


PAIRS = [("lm", 0), ("lm", 4), ("dpo", 0), ("dpo", 4), ("grpo", 0), ("grpo", 4), ("seq2seq", 0)]


@pytest.mark.parametrize("name, rank", PAIRS, ids=[f"{n}-{'lora' if r else 'full'}" for n, r in PAIRS])
def test_first_step_loss_is_the_independent_one_and_the_subclassed_tasks(name, rank):
    c = config(name, rank)
    mc = models.config_from(c.model, 64)
    start = None if name == "seq2seq" else nn.unbox(gpt.init_params(mc, jax.random.key(7)))
    task = Task(c, mc, start)  # the real constructor, no data: no batch source
    params = task.init_params(jax.random.key(0))
    params = noisy(params, 1) if rank else nn.unbox(params)
    reference = start if name in ("dpo", "grpo") and not rank else None  # a copy of the start
    expected = Frozen(base=lora.quantize_base(start, "float32") if rank else None, reference=reference)
    assert jax.tree.structure(task.frozen) == jax.tree.structure(expected)
    assert all(map(np.array_equal, jax.tree.leaves(task.frozen), jax.tree.leaves(expected)))
    batch, rng = batch_for(name), jax.random.key(3)
    loss_sum, aux = jax.jit(lambda p, f: task.loss(p, batch, rng, True, f))(params, task.frozen)
    ours = float(loss_sum / weight_of(aux))
    spec = task.policy.lora
    s, w = jax.jit(lambda p, st: independent(name, c, mc, p, st, spec, batch, rng))(params, start)
    assert ours == float(s / w), (ours, float(s / w))
    np.testing.assert_allclose(ours, float.fromhex(AT_1412091[(name, rank)]), rtol=2e-6)


@pytest.mark.parametrize("name, rank", [("lm", 4), ("dpo", 0), ("grpo", 0), ("seq2seq", 0)])
def test_abstract_task_is_the_real_one_in_shapes(name, rank):
    """Task.abstract: the real constructor with no data, shapes for the start (LoRA's base, the
    reference): the same trained parameters and frozen weights, in shapes."""
    c = config(name, rank)
    mc = models.config_from(c.model, 64)
    abstract = Task.abstract(c, mc)
    assert abstract.source is None and abstract.splits == () and not abstract.online
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract.frozen))
    start = None if name == "seq2seq" else nn.unbox(gpt.init_params(mc, jax.random.key(7)))
    real = Task(c, mc, start)
    shapes = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype), t)  # noqa: E731
    assert shapes(abstract.frozen) == shapes(real.frozen)
    assert shapes(abstract.abstract_params()) == shapes(real.abstract_params())
    assert abstract.batch_shapes(2) == real.batch_shapes(2)
