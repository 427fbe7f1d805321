"""models/linear.py: every weight representation composes with every adapter kind. For {float, bf16,
int8} weights x {no adapter, LoRA, adapter slots (rows of two adapters and one of none)} x {a dense
Llama-style GPT, a mixture of experts (its expert stacks adapted too, by LoRA and by slots)}, the
forward equals the merged float32 reference: the weights
as the quantized model holds them, dequantized to float32 (exact: int8 times its scale, bf16 widened),
with each adapter merged in (lora.merge), through a plain float GPT. Only float32 rounding separates
them: x W + (x A)(s B) against x (W + s A B), and qmatmul's CPU kernel sums in another order."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxgpt.models import gpt, lora
from flaxgpt.models.cache import AdapterCache, KVCache
from flaxgpt.models.gpt import GPT, GPTConfig
from flaxgpt.models.linear import Linear, qdot
from flaxgpt.models.multi_lora import MultiLora
from flaxgpt.models.quantize import QuantizedWeight, quantize_rows
from tests.models.test_lora import LLAMA
from tests.models.test_moe import TINY as MOE_TINY
from tests.models.test_multi_lora import dequantized, random_adapters

DENSE = dataclasses.replace(LLAMA, n_layer=1)
MOE = GPTConfig(**{**MOE_TINY, "n_layer": 1})
ROWS_B = np.array([1, 2, 0], np.int32)  # two rows with different adapters, one with none
B, T = len(ROWS_B), 8
TOKENS = np.random.RandomState(0).randint(0, 64, (B, T)).astype(np.int32)
TOL = 1e-5  # relative to the largest logit: float32 rounding through a layer (seen <= 2e-6)


def forward(config, params):
    return GPT(config).apply({"params": params}, TOKENS)


def reference(config, params, spec=None, adapters=None):
    """Logits [B, T, V] of the plain float32 GPT, the adapter merged into its weights."""
    if spec is not None:
        params = lora.merge(config, spec, params, adapters)
    return np.asarray(forward(config, params))


def slot_logits(multi, stack, config):
    """A prefill of T - 1 tokens, then one decoding step: the slots' two code paths -> [B, T, V]."""
    cache = AdapterCache(KVCache.for_config(config, B, config.block_size), ROWS_B)
    out = []
    for start, stop in [(0, T - 1), (T - 1, T)]:
        positions = np.broadcast_to(np.arange(start, stop, dtype=np.int32), (B, stop - start))
        logits, cache = multi.step_fn(stack)(TOKENS[:, start:stop], positions, cache)
        out.append(np.asarray(logits))
    return np.concatenate(out, axis=1)


def close(got, want):
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < TOL, err


@pytest.fixture(scope="module", params=["dense", "moe"])
def model(request):
    config = DENSE if request.param == "dense" else MOE
    return config, jax.jit(gpt.init_params, static_argnums=0)(config, jax.random.key(0))


@pytest.mark.parametrize("mode", ["float", "bf16", "int8"])
def test_every_weight_with_every_adapter_kind_equals_the_merged_float_model(model, mode):
    config, params = model
    qconfig, qparams = (config, params) if mode == "float" else gpt.quantize_params(config, params, mode)
    deq = dequantized(qparams)  # the exact float32 values the quantized weights stand for

    # no adapter
    close(np.asarray(forward(qconfig, qparams)), reference(qconfig, deq))

    # LoRA (a mixture of experts' stacks adapted too: moe.LoraExperts over the quantized stacks)
    spec = lora.LoraSpec.make(qconfig, 4, 8.0, targets=",".join(lora.model_targets(qconfig)))
    adapters = random_adapters(qconfig, spec, seed=0)
    got = lora.apply(qconfig, spec, qparams, adapters, TOKENS)
    want = reference(qconfig, deq, spec, adapters)
    close(np.asarray(got), want)
    assert np.abs(want - reference(qconfig, deq)).max() > 0.1 * np.abs(want).max()  # adapters matter

    # adapter slots: rows of two adapters (other ranks, scales, targets; a mixture of experts' expert
    # stacks: each token through its row's slot of its expert's pair) and one of none
    specs = [
        lora.LoraSpec.make(qconfig, 4, 8.0, targets=",".join(lora.model_targets(qconfig))),
        lora.LoraSpec.make(
            qconfig, 2, 3.0, targets="v,o,experts_down" if config is MOE else "q,up", rslora=True
        ),
    ]
    trees = [random_adapters(qconfig, s, seed=i + 1) for i, s in enumerate(specs)]
    multi = MultiLora(qconfig, qparams, slots=3, rank=4)
    stack = multi.empty_stack()
    for slot, s, tree in zip((1, 2), specs, trees):
        stack = multi.write(stack, slot, multi.slot_weights(s, tree))
    got = slot_logits(multi, stack, qconfig)
    refs = [reference(qconfig, deq)] + [reference(qconfig, deq, s, t) for s, t in zip(specs, trees)]
    for b, slot in enumerate(ROWS_B):
        close(got[b], refs[slot][b])


def test_an_int8_linear_trains_its_adapters_through_qmatmul():
    """qdot's gradient for x is the dequantized weight's: an adapter under a quantized layer trains."""
    rng = np.random.RandomState(0)
    w_KN = rng.standard_normal((16, 8)).astype(np.float32)
    q = quantize_rows(w_KN.T, "int8")
    x_MK = jnp.asarray(rng.standard_normal((3, 16)).astype(np.float32))
    deq_KN = (np.asarray(q.w, np.float32) * np.asarray(q.scale)[:, None]).T
    close(np.asarray(qdot(x_MK, q.w, q.scale)), np.asarray(x_MK @ deq_KN))
    dx = jax.grad(lambda x: jnp.sum(jnp.sin(qdot(x, q.w, q.scale))))(x_MK)
    want = jax.grad(lambda x: jnp.sum(jnp.sin(x @ deq_KN)))(x_MK)
    close(np.asarray(dx), np.asarray(want))
    # the layer keeps nn.Dense's parameter tree: kernel [K, N] and bias [N] (a QuantizedWeight in place)
    layer = Linear(8)
    params = layer.init(jax.random.key(0), x_MK)["params"]
    assert {k: v.shape for k, v in params.items()} == {"kernel": (16, 8), "bias": (8,)}
    y = layer.apply({"params": {"kernel": q, "bias": params["bias"]}}, x_MK)
    assert isinstance(q, QuantizedWeight)
    close(np.asarray(y), np.asarray(x_MK @ deq_KN))


@pytest.mark.devices(8)
def test_expert_adapter_slots_over_an_expert_mesh_equal_one_device():
    """Adapter slots on a mixture of experts split over an "expert" mesh axis of 4 (moe.expert_parallel:
    each token's slot travels with it to its experts' devices, the slot stacks split by expert): the
    prefill's and a decoding step's logits equal one device's."""
    from flaxgpt import sharding

    config = dataclasses.replace(MOE, n_layer=2)
    params = gpt.init_params(config, jax.random.key(0))
    spec = lora.LoraSpec.make(config, 4, 8.0, targets="q,experts_gate_up,experts_down")
    multi = MultiLora(config, params, slots=3, rank=4)
    stack = multi.empty_stack()
    for slot in (1, 2):
        stack = multi.write(stack, slot, multi.slot_weights(spec, random_adapters(config, spec, seed=slot)))
    rows_B = np.array([1, 2, 0, 1, 2, 0, 1, 2], np.int32)  # 8 rows: one a device
    tokens_BT = np.random.RandomState(1).randint(0, 64, (8, T)).astype(np.int32)
    mesh = sharding.make_mesh(data=1, fsdp=2, expert=4)

    def logits(step):
        cache = AdapterCache(KVCache.for_config(config, 8, config.block_size), rows_B)
        out = []
        for start, stop in [(0, T - 1), (T - 1, T)]:
            positions = np.broadcast_to(np.arange(start, stop, dtype=np.int32), (8, stop - start))
            logits_BTV, cache = step(multi.step_fn(stack), tokens_BT[:, start:stop], positions, cache)
            out.append(np.asarray(logits_BTV))
        return np.concatenate(out, axis=1)

    call = lambda step_fn, *args: step_fn(*args)  # noqa: E731
    split = sharding.under_mesh(call, mesh)
    cache = AdapterCache(KVCache.for_config(config, 8, config.block_size), rows_B)
    step = (multi.step_fn(stack), tokens_BT[:, :1], np.zeros((8, 1), np.int32), cache)
    assert "shard_map" in str(jax.make_jaxpr(split)(*step))  # moe.expert_parallel, not a replicated step
    on_mesh = lambda *args: jax.jit(split)(*jax.device_put(args, sharding.replicated(mesh)))  # noqa: E731
    close(logits(on_mesh), logits(jax.jit(call)))
