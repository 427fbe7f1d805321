"""models/multi_lora.py over quantized bases: in one batch, rows of slot 0 (no adapter) give the
quantized model's own logits and rows of two adapters (other ranks, scales and targets) give that
adapter merged into the dequantized weights, in a prefill (T > 1) and in decoding steps (T = 1); bases
from loader.compact (int8, bf16) for GPT-2 (fused qkv), grouped-query attention (narrower k, v
columns), Llama (q, k, v, gate, up) and a mixture of experts (quantized expert stacks, attention
adapters), and QLoRA's own base (lora.quantize_base, scanned layers) against models.lora's step."""

import dataclasses

import jax
import numpy as np
import pytest

from flaxgpt import loader
from flaxgpt.models import gpt, lora, quantize
from flaxgpt.models.cache import AdapterCache, KVCache
from flaxgpt.models.gpt import GPTConfig
from flaxgpt.models.multi_lora import MultiLora
from flaxgpt.runs.run_dir import Run
from tests.models.test_lora import GPT2, LLAMA
from tests.models.test_moe import TINY as MOE_TINY

GQA = dataclasses.replace(GPT2, n_kv_head=2)
MOE = GPTConfig(**{**MOE_TINY, "n_layer": 2})
# rows: adapter one, the base, adapter two, adapter one, the base (slot 2 stays empty). A prefill of
# 5 x 14 = 70 rows > 64 takes qmatmul's XLA dot, a decoding step of 5 rows its CPU kernel
SLOT_B = np.array([1, 0, 3, 1, 0], np.int32)
B, T, STEPS = len(SLOT_B), 14, 2
TOKENS = np.random.RandomState(0).randint(0, 64, (B, T + STEPS)).astype(np.int32)
# second adapter: other rank, scale and targets than the first (all-linear, rank 4)
SECOND = {GPT2: "qkv,down", GQA: "qkv,o", LLAMA: "k,v,up", MOE: "q,o"}


def random_adapters(config, spec, seed):
    """Non-zero A and B (training starts B at zeros: nothing would be tested), drawn on the host: op by
    op on the device, drawing them took longer than the rest of a test."""
    rng = np.random.RandomState(seed)
    shapes = jax.eval_shape(lambda: lora.init_adapters(config, spec, jax.random.key(0)))
    return jax.tree_util.tree_map(lambda x: 0.2 * rng.standard_normal(x.shape).astype(np.float32), shapes)


def dequantized(qparams):
    """The quantized weights as a plain GPT's float32 ones: a kernel [K, N] = (w [N, K] * scale).T, the
    token table w * scale (its rows: lm_head's kernel is its transpose), an expert stack w * scale [E, N];
    int4 unpacked here in numpy (kernels/int4.py's layout, read independently of it)."""

    def one(path, x):
        if not isinstance(x, quantize.QuantizedWeight):
            return x
        w, scale = np.asarray(x.w, np.float32), np.asarray(x.scale)
        if x.w.dtype == np.uint8:  # int4: two a byte (low nibble first, stored + 8), a scale per group
            u = np.asarray(x.w)
            q = np.stack([u & 0xF, u >> 4], axis=-1).reshape(u.shape[0], -1).astype(np.float32) - 8
            w = (q.reshape(*scale.shape, -1) * scale[..., None]).reshape(q.shape)
            return w if path[-1].key == "embedding" else w.T
        if w.ndim == 3:
            return w * scale[:, None, :]
        return w * scale[:, None] if path[-1].key == "embedding" else (w * scale[:, None]).T

    is_weight = lambda x: isinstance(x, quantize.QuantizedWeight)  # noqa: E731
    return jax.tree_util.tree_map_with_path(one, qparams, is_leaf=is_weight)


@jax.jit
def _call(step, tokens_BT, positions_BT, cache):
    return step(tokens_BT, positions_BT, cache)


def logits_of(step, cache):
    """Logits of a prefill of T tokens, then of STEPS one-token steps (the given tokens, not sampled)."""
    out = []
    for start, stop in [(0, T)] + [(T + i, T + i + 1) for i in range(STEPS)]:
        positions = np.broadcast_to(np.arange(start, stop, dtype=np.int32), (B, stop - start))
        logits, cache = _call(step, TOKENS[:, start:stop], positions, cache)
        out.append(np.asarray(logits))
    return out


@pytest.mark.parametrize(
    "config, mode",
    [(GPT2, "int8"), (GPT2, "bf16"), (GQA, "int8"), (LLAMA, "int8"), (LLAMA, "bf16"), (MOE, "int8")],
    ids=["gpt2-int8", "gpt2-bf16", "gqa-int8", "llama-int8", "llama-bf16", "moe-int8"],
)
def test_rows_over_a_quantized_base_match_the_quantized_model_and_merged_adapters(config, mode):
    params = jax.jit(gpt.init_params, static_argnums=0)(config, jax.random.key(0))
    run = loader.compact(Run("gpt", config, params, None), quantize=mode)
    qconfig, qparams = run.config, run.params
    assert quantize.is_quantized(qparams["h_0"]["attn"]["c_attn"]) and quantize.is_quantized(qparams["wte"])
    specs = [
        lora.LoraSpec.make(qconfig, 4, 8.0),
        lora.LoraSpec.make(qconfig, 2, 3.0, targets=SECOND[config], rslora=True),
    ]
    adapters = [random_adapters(qconfig, spec, seed=i) for i, spec in enumerate(specs)]

    multi = MultiLora(qconfig, qparams, slots=4, rank=4)
    stack = multi.empty_stack()
    for slot, spec, tree in zip((1, 3), specs, adapters):
        stack = multi.write(stack, slot, multi.slot_weights(spec, tree))
    cache = KVCache.for_config(qconfig, B, qconfig.block_size)
    got = logits_of(multi.step_fn(stack), AdapterCache(cache, SLOT_B))

    base = logits_of(gpt.step_fn(qconfig, qparams), cache)  # the quantized model alone
    # each adapter merged into the dequantized weights, a plain float32 GPT: x (W + s A B)
    deq = dequantized(qparams)
    merged = [
        gpt.step_fn(qconfig, lora.merge(qconfig, spec, deq, tree)) for spec, tree in zip(specs, adapters)
    ]
    refs = {0: base, 1: logits_of(merged[0], cache), 3: logits_of(merged[1], cache)}
    for i, (got_BTV, base_BTV) in enumerate(zip(got, base)):  # the prefill, then each decoding step
        want_BTV = np.stack([refs[slot][i][b] for b, slot in enumerate(SLOT_B)])
        scale = np.abs(want_BTV).max()
        err_B = np.abs(got_BTV - want_BTV).max(axis=(1, 2)) / scale
        # float32 rounding only (~1e-7 relative a product, through a few layers; seen <= 2e-6): an
        # adapter's row sums x W + (x A)(s B) where the reference has x (W + s A B), and qmatmul's CPU
        # kernel sums in another order than XLA's dot
        assert err_B.max() < 1e-5, (i, err_B)
        if jax.default_backend() == "cpu":  # a slot-0 row adds an exact zero to the same qmatmul calls:
            # bit for bit the quantized model's (lora's differentiable XLA dot would be ~1e-7 off)
            assert np.all(err_B[SLOT_B == 0] == 0), (i, err_B)
        # and the adapters change their rows' logits (by tens of percent), nobody else's
        moved_B = np.abs(got_BTV - base_BTV).max(axis=(1, 2)) / scale
        assert np.all(moved_B[SLOT_B != 0] > 1e-1) and np.all(moved_B[SLOT_B == 0] < 1e-5), (i, moved_B)


def test_rows_over_a_qlora_base_match_models_lora():
    """QLoRA's int8 base (lora.quantize_base: the blocks' kernels, scanned [L, ...], the embedding left
    float32) and a trained adapter's layout: a row of the adapter gives models.lora's step over the same
    base (its differentiable XLA dot for the base), a slot-0 row the quantized model's."""
    config = dataclasses.replace(LLAMA, scan_layers=True)
    params = jax.jit(gpt.init_params, static_argnums=0)(config, jax.random.key(0))
    qbase = lora.quantize_base(params, "int8")
    spec = lora.LoraSpec.make(config, 4, 8.0, targets="q,v,down")
    adapters = random_adapters(config, spec, seed=0)  # h/block [L, ...], as the trainer holds them

    multi = MultiLora(config, qbase, slots=2, rank=4)
    flat = gpt.unstack_layers(adapters, config.n_layer)  # slots hold the h_0.. layout (load_adapter's)
    stack = multi.write(multi.empty_stack(), 1, multi.slot_weights(spec, flat))
    slot_B = (SLOT_B != 0).astype(np.int32)
    cache = KVCache.for_config(multi.config, B, config.block_size)
    got = logits_of(multi.step_fn(stack), AdapterCache(cache, slot_B))
    base = logits_of(gpt.step_fn(config, qbase), cache)
    qlora = logits_of(lora.step_fn(config, spec, qbase, adapters), cache)
    for got_BTV, base_BTV, qlora_BTV in zip(got, base, qlora):
        want_BTV = np.where(slot_B[:, None, None] == 1, qlora_BTV, base_BTV)
        err_B = np.abs(got_BTV - want_BTV).max(axis=(1, 2)) / np.abs(want_BTV).max()
        assert err_B.max() < 1e-5, err_B  # float32 rounding, as above
        assert np.abs(got_BTV - base_BTV)[slot_B == 1].max() > 1e-1 * np.abs(base_BTV).max()
