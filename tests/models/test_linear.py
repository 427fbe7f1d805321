"""models/linear.py: every weight representation composes with every adapter kind. For {float, bf16,
int8, int4 (groups of 32)} weights x {no adapter, LoRA, adapter slots (rows of two adapters and one of
none)} x {a dense Llama-style GPT, a mixture of experts (its expert stacks adapted too, by LoRA and by
slots; int4 refused there)}, the forward equals the merged float32 reference: the weights as the
quantized model holds them, dequantized to float32 (exact: int8 or int4 times its scale, bf16
widened), with each adapter merged in (lora.merge), through a plain float GPT. Only float32 rounding
separates them: x W + (x A)(s B) against x (W + s A B), and qmatmul's CPU kernel sums in another order."""

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
from flaxgpt.models.quantize import QuantizedWeight, quantize_rows, quantize_stacked
from tests.models.test_lora import LLAMA
from tests.models.test_moe import TINY as MOE_TINY
from tests.models.test_multi_lora import dequantized, random_adapters

DENSE = dataclasses.replace(LLAMA, n_layer=1)
DENSE4 = dataclasses.replace(DENSE, mlp_hidden=64)  # int4's groups of 32 divide every K (48 does not)
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


@pytest.mark.parametrize("mode", ["float", "bf16", "int8", "int4_g32"])
def test_every_weight_with_every_adapter_kind_equals_the_merged_float_model(model, mode):
    config, params = model
    if mode.startswith("int4") and config is MOE:  # stacked experts: refused in one line
        with pytest.raises(ValueError, match="int4 quantizes 2-D weights.*use --quantize int8 or bf16"):
            gpt.quantize_params(config, params, mode)
        return
    if mode.startswith("int4"):
        config, params = DENSE4, gpt.init_params(DENSE4, jax.random.key(0))
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


def test_fp8_base_composes_with_lora_and_refuses_a_quantized_base():
    """Linear(fp8=True): the float base through kernels.fp8.fp8_dot (plus bias), LoRA's adapters added
    in float32 over it exactly as over a float base; an int8 base with fp8 is a one-line error."""
    from flaxgpt.kernels.fp8 import fp8_dot

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((6, 16)), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal((16, 12)) * 0.1, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(12), jnp.float32)
    spec = lora.LoraSpec(rank=2, alpha=4.0, dropout=0.0, targets=("q",), columns=(("q", 0, 12),))
    a, b = jnp.asarray(rng.standard_normal((16, 2)), jnp.float32), jnp.asarray(rng.standard_normal((2, 12)))
    variables = {"params": {"kernel": kernel, "bias": bias}, "lora": {"q_a": a, "q_b": b.astype(jnp.float32)}}
    got = Linear(12, fp8=True, lora=spec).apply(variables, x)
    want = fp8_dot(x, kernel) + bias + (x @ a) @ b * 2.0
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    plain = Linear(12, lora=spec).apply(variables, x)
    assert 0 < np.abs(np.asarray(got - plain)).max() < 0.1 * np.abs(np.asarray(plain)).max()
    quantized = {"params": {"kernel": quantize_rows(kernel.T, "int8"), "bias": bias}}
    with pytest.raises(ValueError, match=r"model\.fp8.*quantized.*model\.fp8=False") as e:
        Linear(12, fp8=True).apply(quantized, x)
    assert "\n" not in str(e.value)


def test_int4_linear_trains_its_adapters_and_refuses_groups_that_do_not_divide_k():
    """int4 (groups of 32 over K = 64): qdot's product and gradient are the dequantized weight's; a group
    that does not divide K, and a model whose MLP width it does not divide, are one line naming the fix."""
    rng = np.random.RandomState(0)
    w_KN = rng.standard_normal((64, 8)).astype(np.float32)
    q = quantize_rows(w_KN.T, "int4_g32")
    assert q.w.shape == (8, 32) and q.w.dtype == jnp.uint8 and q.scale.shape == (8, 2)
    deq_KN = dequantized({"k": {"kernel": q}})["k"]["kernel"]
    assert np.abs(deq_KN - w_KN).max() <= np.abs(w_KN).max() / 7.5  # within a step of its group's grid
    x_MK = jnp.asarray(rng.standard_normal((3, 64)).astype(np.float32))
    close(np.asarray(qdot(x_MK, q.w, q.scale)), np.asarray(x_MK @ deq_KN))
    dx = jax.grad(lambda x: jnp.sum(jnp.sin(qdot(x, q.w, q.scale))))(x_MK)
    close(np.asarray(dx), np.asarray(jax.grad(lambda x: jnp.sum(jnp.sin(x @ deq_KN)))(x_MK)))
    with pytest.raises(ValueError, match=r"int4 group size 128 does not divide K=64 \(a weight's inputs\): "
                       r"use --quantize int4_g64"):  # fmt: skip
        quantize_rows(w_KN.T, "int4")
    params = gpt.init_params(DENSE, jax.random.key(0))
    with pytest.raises(ValueError, match=r"group size 32 does not divide K=48 \(h_0.mlp.c_proj's inputs\): "
                       r"use --quantize int8"):  # fmt: skip
        gpt.quantize_params(DENSE, params, "int4_g32")
    # the hint fits every weight: 128 divides neither 64 nor 96, and 64 (which fits c_attn) not 96
    wide = dataclasses.replace(DENSE, n_embd=64, mlp_hidden=96)
    with pytest.raises(ValueError, match=r"group size 128 does not divide K=64 .*: use --quantize int4_g32$"):
        gpt.quantize_params(wide, gpt.init_params(wide, jax.random.key(0)), "int4")
    with pytest.raises(ValueError, match="int4 quantizes 2-D weights"):
        quantize_stacked(np.zeros((2, 64, 8), np.float32), "int4")


def near(a, b, tol):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.abs(a - b).max() <= tol * np.abs(b).max(), np.abs(a - b).max() / np.abs(b).max()


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])  # of the largest
def test_activation_and_split_products_equal_the_plain_expressions(dtype, tol, monkeypatch):
    """Linear's `activation` (GELU with the bias, recomputed in the backward pass) and `splits` (one
    product per piece: c_attn's q | k | v for cuDNN) give the plain layer's values and gradients:
    gelu(x W + b), and jnp.split of x W + b. (Their own forms are for GPUs: here asked for.)"""
    monkeypatch.setenv("FLAXGPT_EPILOGUES", "on")
    x_MK = jax.random.normal(jax.random.key(0), (6, 16), jnp.float32).astype(dtype)
    gelu = lambda y: jax.nn.gelu(y, approximate=True)  # noqa: E731
    kw = dict(dtype=dtype, bias_init=jax.nn.initializers.normal(1.0))
    params = Linear(24, **kw).init(jax.random.key(1), x_MK)
    cases = [
        (Linear(24, activation=gelu, **kw), lambda p, x: gelu(Linear(24, **kw).apply(p, x))),
        (
            Linear(24, splits=(8, 16), **kw),
            lambda p, x: jnp.split(Linear(24, **kw).apply(p, x), (8, 16), axis=-1),
        ),
    ]
    for layer, plain in cases:

        def total(fn, p, x):
            outs = jax.tree.leaves(fn(p, x))
            return sum(jnp.sum(jnp.sin(y.astype(jnp.float32) * (i + 1))) for i, y in enumerate(outs))

        got, want = layer.apply(params, x_MK), plain(params, x_MK)
        assert [y.shape for y in jax.tree.leaves(got)] == [y.shape for y in jax.tree.leaves(want)]
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            near(a, b, tol)
        g_got = jax.grad(total, argnums=(1, 2))(layer.apply, params, x_MK)
        g_want = jax.grad(total, argnums=(1, 2))(plain, params, x_MK)
        for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want), strict=True):
            near(a, b, tol)
    # quantized weights and adapters take the one product, then the split and the activation
    q = {
        "params": {
            "kernel": quantize_rows(params["params"]["kernel"].T, "int8"),
            "bias": params["params"]["bias"],
        }
    }
    pieces = Linear(24, splits=(8, 16), **kw).apply(q, x_MK)
    whole = Linear(24, **kw).apply(q, x_MK)
    np.testing.assert_array_equal(np.concatenate([np.asarray(p) for p in pieces], -1), np.asarray(whole))
    np.testing.assert_array_equal(Linear(24, activation=gelu, **kw).apply(q, x_MK), gelu(whole))


def _lhs_rows(fn, *args):
    """The row counts of the dot_generals' left operands in fn's jaxpr (traced afresh: a trace of fn
    made under the other platform is not reused)."""
    jaxpr = jax.make_jaxpr(lambda *a: fn(*a))(*args)
    return [e.invars[0].aval.shape[0] for e in jaxpr.eqns if e.primitive.name == "dot_general"]


def test_a_one_row_product_on_a_gpu_takes_two_rows_and_the_same_values(monkeypatch):
    """linear.product: a batch-1 decoding row times a weight under XLA's size threshold goes in as the
    row twice on a GPU (a GEMM there, not XLA's multiply-and-sum; its compiled bytes are checked in
    tests/aot/test_decode_kernels.py), the first result kept: the plain product's values (float32 at
    HIGHEST precision: no TF32). Several rows, a larger weight and other platforms keep the one
    product."""
    from flaxgpt.kernels import target
    from flaxgpt.models import linear

    k = jax.random.split(jax.random.key(0), 3)
    w = jax.random.normal(k[0], (48, 40), jnp.float32)
    x = jax.random.normal(k[1], (1, 1, 48), jnp.float32)
    many = jax.random.normal(k[2], (3, 48), jnp.float32)
    plain = lambda x, w: jnp.einsum("...k,kn->...n", x, w, precision="highest")  # noqa: E731
    assert _lhs_rows(linear.product, x, w) == [1]  # the CPU's
    monkeypatch.setattr(target, "platform", lambda: "gpu")
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        xd, wd = x.astype(dtype), w.astype(dtype)
        assert _lhs_rows(linear.product, xd, wd) == [2]
        got = linear.product(xd, wd)
        assert got.shape == (1, 1, 40) and got.dtype == dtype
        near(got, plain(xd, wd), 1e-6 if dtype == jnp.float32 else 1e-2)
    jaxpr = jax.make_jaxpr(lambda x, w: linear.product(x, w))(x, w)
    assert "HIGHEST" in str(jaxpr)
    assert _lhs_rows(linear.product, many, w) == [3]
    monkeypatch.setattr(linear, "XLA_GPU_REDUCED_BELOW", w.size)  # a weight XLA multiplies as a GEMM
    assert _lhs_rows(linear.product, x, w) == [1]
    # through the layer (nn.Dense's parameters): the decoding row's output is the plain layer's
    monkeypatch.setattr(linear, "XLA_GPU_REDUCED_BELOW", 10_000_000)
    layer = Linear(40, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    params = layer.init(jax.random.key(1), x)
    xb = x.astype(jnp.bfloat16)
    assert _lhs_rows(lambda x: layer.apply(params, x), xb) == [2]
    want = xb @ params["params"]["kernel"] + params["params"]["bias"]
    near(layer.apply(params, xb), want, 1e-2)
