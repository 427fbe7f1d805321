"""The mixture-of-experts MLP: equal to every expert run on every token and mixed by the top-k
weights; gradients flow to the router; scanned layers agree; the presets' total and active
parameters equal transformers' models; FLOPs count the active weights; bad configs are one line."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from flaxgpt.models import flops
from flaxgpt.models.gpt import GPT, GPTConfig, abstract_params, init_params, stack_layers
from flaxgpt.models.moe import ROUTER, MoE, dense_mix, grouped_matmul, mix_experts, router_losses, sorted_mix
from flaxgpt.tools import summary

TINY = dict(
    GPTConfig.PRESETS["smollm2-135m"], vocab_size=64, block_size=16, n_layer=3, n_head=4, n_kv_head=2,
    n_embd=32, mlp_hidden=48, num_experts=4, experts_per_token=2, expert_hidden=24,
)  # fmt: skip
X = jax.random.normal(jax.random.key(1), (2, 8, 32))


def dense_reference(p, x_BTD, k, renormalise):
    """Every expert on every token, then each token's top-k outputs mixed: what MoE must equal."""
    x = x_BTD.reshape(-1, x_BTD.shape[-1])
    probs = jax.nn.softmax(x @ p["router"]["kernel"], axis=-1)
    w, idx = jax.lax.top_k(probs, k)
    w = w / w.sum(-1, keepdims=True) if renormalise else w
    gate, up = jnp.split(jnp.einsum("nd,edf->enf", x, p["experts_fc"]), 2, axis=-1)
    y_END = jnp.einsum("enf,efd->end", jax.nn.silu(gate) * up, p["experts_proj"])
    picked = jnp.take_along_axis(y_END.transpose(1, 0, 2), idx[..., None], axis=1)  # [N, k, D]
    return jnp.einsum("nkd,nk->nd", picked, w).reshape(x_BTD.shape)


@pytest.mark.parametrize("renormalise", [True, False])
def test_moe_equals_every_expert_mixed_by_the_top_k_weights(renormalise):
    moe = MoE(num_experts=4, experts_per_token=2, hidden=24, norm_topk_prob=renormalise)
    p = nn.unbox(moe.init(jax.random.key(0), X)["params"])
    p = jax.tree_util.tree_map(lambda w: w * 10, p)  # a peaked router: the experts really differ
    np.testing.assert_allclose(moe.apply({"params": p}, X), dense_reference(p, X, 2, renormalise), atol=1e-5)
    # gradients (router included) equal the dense reference's
    loss = lambda f: lambda p: jnp.sum(jnp.sin(f(p)))  # noqa: E731
    g = jax.grad(loss(lambda p: moe.apply({"params": p}, X)))(p)
    g_ref = jax.grad(loss(lambda p: dense_reference(p, X, 2, renormalise)))(p)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g_ref)):
        np.testing.assert_allclose(a, b, atol=1e-4)
    assert float(jnp.abs(g["router"]["kernel"]).max()) > 0


def test_grouped_matmul_equals_ragged_dot_without_every_row_through_every_expert():
    """Uneven and empty groups, forward and gradients; on CPU the program's matmul has ~2A rows, not
    the E*A of ragged_dot's CPU fallback."""
    rng = np.random.RandomState(0)
    gm = jax.jit(jax.value_and_grad(lambda x, w, g: jnp.sum(jnp.sin(grouped_matmul(x, w, g))), (0, 1)))
    ref = jax.value_and_grad(lambda x, w, g: jnp.sum(jnp.sin(jax.lax.ragged_dot(x, w, g))), (0, 1))
    for A, E in [(2, 4), (37, 5), (64, 8)]:
        sizes = jnp.asarray(rng.multinomial(A, rng.dirichlet(np.full(E, 0.3))), jnp.int32)
        x, w = jnp.asarray(rng.randn(A, 6), jnp.float32), jnp.asarray(rng.randn(E, 6, 3), jnp.float32)
        for a, b in zip(
            jax.tree_util.tree_leaves(gm(x, w, sizes)), jax.tree_util.tree_leaves(ref(x, w, sizes))
        ):
            np.testing.assert_allclose(a, b, atol=1e-4)
    if jax.default_backend() == "cpu":
        A, E = 256, 8
        hlo = (
            jax.jit(grouped_matmul).lower(jnp.ones((A, 32)), jnp.ones((E, 32, 48)), jnp.full(E, 32)).compile()
        )
        (dot,) = [line for line in hlo.as_text().splitlines() if " dot(" in line]
        rows = np.prod([int(n) for n in dot.split("[", 1)[1].split("]", 1)[0].split(",")][:-1])
        assert rows <= 2 * A


def test_grouped_matmul_at_decoding_rows_visits_only_their_experts():
    """A <= 2E rows (decoding: batch 1, top 2): equal to ragged_dot, rows past the groups 0, and on CPU
    one matmul of A rows (each through its own gathered expert), not the tiled pass's ~2E visits."""
    A, E = 3, 8
    x, w = jax.random.normal(jax.random.key(0), (A, 6)), jax.random.normal(jax.random.key(1), (E, 6, 5))
    sizes = jnp.asarray([0, 1, 0, 0, 0, 1, 0, 0], jnp.int32)  # 2 rows in groups, the third past them
    y = jax.jit(grouped_matmul)(x, w, sizes)
    np.testing.assert_allclose(y, jax.lax.ragged_dot(x, w, sizes), atol=1e-5)
    assert not np.asarray(y[2]).any()
    if jax.default_backend() == "cpu":
        hlo = jax.jit(grouped_matmul).lower(x, w, sizes).compile().as_text()
        (dot,) = [line for line in hlo.splitlines() if " dot(" in line]
        shape = dot.split("[", 1)[1].split("]", 1)[0]
        assert np.prod([int(n) for n in shape.split(",")]) == A * 5, dot  # [A, 5]: one row each


def test_decoding_batches_on_cpu_read_each_expert_once_and_mix_as_the_sorted_path():
    """dense_mix (the CPU's path for a few tokens that hit about every expert) equals sorted_mix:
    float and int8 experts, and the experts 2..5 of 8 held on one device (`first`); on the CPU a
    batch of 8 tokens, top 2 over 8 experts, compiles to the dense path's matmuls batched over the
    experts, a batch of 1 to the sorted path's one row per assignment."""
    from flaxgpt.models import quantize
    from flaxgpt.models.layers import swiglu

    rng = np.random.RandomState(0)
    N, D, F, E, C = 8, 6, 5, 8, 2
    x = jnp.asarray(rng.randn(N, D), jnp.float32)
    weights, experts = jax.lax.top_k(jax.nn.softmax(jnp.asarray(rng.randn(N, E) * 3), -1), C)
    w_fc, w_proj = (
        jnp.asarray(rng.randn(E, D, 2 * F), jnp.float32),
        jnp.asarray(rng.randn(E, F, D), jnp.float32),
    )
    q_fc, q_proj = (quantize.quantize_stacked(w, "int8") for w in (w_fc, w_proj))
    for fc, proj, first in [(w_fc, w_proj, 0), (q_fc, q_proj, 0), (w_fc[2:6], w_proj[2:6], 2)]:
        args = (x, weights, experts, fc, proj, swiglu, first)
        np.testing.assert_allclose(dense_mix(*args), sorted_mix(*args), atol=1e-4)
    if jax.default_backend() == "cpu":

        def dots(n):
            mix = lambda *a: mix_experts(*a, swiglu)  # noqa: E731
            hlo = jax.jit(mix).lower(x[:n], weights[:n], experts[:n], w_fc, w_proj).compile().as_text()
            return [
                line.split("=")[1].split("dot(")[0].strip() for line in hlo.splitlines() if " dot(" in line
            ]

        # [E, N, out] batched over the experts (and the mix over them), no [A = 16, ...] gathered rows
        assert {"f32[8,8,10]{2,1,0}", "f32[8,8,6]{2,1,0}"} <= set(dots(8)), dots(8)
        assert not any(d.startswith("f32[16,") for d in dots(8)), dots(8)
        # batch 1: its 2 assignments each through its own expert, no pass over all 8
        assert "f32[2,1,10]{2,1,0}" in dots(1) and not any(d.startswith("f32[8,") for d in dots(1)), dots(1)


def test_dense_layers_among_sparse_ones_and_scanned_layers():
    config = GPTConfig(**TINY, decoder_sparse_step=2, mlp_only_layers=(2,))
    assert [config.layer_is_sparse(i) for i in range(3)] == [False, True, False]
    params = init_params(config, jax.random.key(0))
    assert set(params["h_0"]["mlp"]) == {"c_fc", "c_proj"}
    assert params["h_1"]["mlp"]["experts_fc"].shape == (4, 32, 48)

    every = GPTConfig(**TINY)  # every layer sparse: scan_layers stacks the experts [L, E, ...]
    params = init_params(every, jax.random.key(0))
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 64, (2, 8)))
    out, state = GPT(every).apply({"params": params}, tokens, mutable=[ROUTER])
    scanned = dataclasses.replace(every, scan_layers=True)
    out_s, state_s = GPT(scanned).apply({"params": stack_layers(params, 3)}, tokens, mutable=[ROUTER])
    np.testing.assert_allclose(out_s, out, atol=1e-5)
    for a, b in zip(router_losses(state_s[ROUTER], 4), router_losses(state[ROUTER], 4)):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_bad_configs_are_one_line():
    cases = {
        r"experts_per_token 5 must be in \[1, num_experts 4\]: lower experts_per_token or raise": dict(
            experts_per_token=5
        ),
        "they need scan_layers=False": dict(mlp_only_layers=(0,), scan_layers=True),
        "decoder_sparse_step must be >= 1, got 0": dict(decoder_sparse_step=0),
    }
    for match, change in cases.items():
        with pytest.raises(ValueError, match=match) as e:
            GPTConfig(**{**TINY, **change})
        assert "\n" not in str(e.value)
    # LoRA on a mixture of experts: attention and the expert stacks (its sparse layers have no dense
    # MLP); "all-linear" is PEFT's, the Linear modules (attention) only
    from flaxgpt.models import lora

    assert lora.LoraSpec.make(GPTConfig(**TINY), 4, 8.0).targets == ("q", "k", "v", "o")
    choices = "choose from q, k, v, o, experts_gate_up, experts_down or all-linear"
    with pytest.raises(ValueError, match=f"this mixture-of-experts model has no gate; {choices}"):
        lora.LoraSpec.make(GPTConfig(**TINY), 4, 8.0, targets="q,gate")
    with pytest.raises(ValueError, match=r"lora dropout 0.1 cannot apply to expert weights \(experts_down\)"):
        lora.LoraSpec.make(GPTConfig(**TINY), 4, 8.0, dropout=0.1, targets="q,experts_down")
    # served adapter slots hold expert adapters too, a pair per expert (their logits: test_linear.py)
    from flaxgpt.models.multi_lora import MultiLora

    config = GPTConfig(**TINY)
    multi = MultiLora(config, abstract_params(config), slots=2, rank=4)
    spec = lora.LoraSpec.make(config, 2, 8.0, targets="q,experts_gate_up")
    slot = multi.slot_weights(spec, lora.init_adapters(config, spec, jax.random.key(0)))
    assert slot["h_0"]["mlp"]["experts_gate_up_a"].shape == (4, 32, 4)  # [E, D, R]: rank 2 padded to 4
    # config.json stores mlp_only_layers as a list: it comes back a tuple (the config stays hashable)
    assert hash(GPTConfig.from_dict({**GPTConfig(**TINY).to_dict(), "mlp_only_layers": [1]}))


def test_int8_experts_decode_close_to_float():
    """int8 weights for decoding: the stacked experts (and a Qwen2-MoE shared expert, a dense MLP)
    per expert and output channel, the routers left float32; logits within 2% of the float model's
    range and the same greedy tokens."""
    from flaxgpt.decode.sampling import generate
    from flaxgpt.models import quantize
    from flaxgpt.models.cache import KVCache
    from flaxgpt.models.gpt import quantize_params, step_fn

    config = GPTConfig(**{**TINY, "n_layer": 2}, shared_expert_hidden=16, shared_expert_gate=True)
    # x3: peaked logits (no greedy ties), yet not so large that rounding anywhere flips a route
    params = jax.tree_util.tree_map(lambda x: x * 3, init_params(config, jax.random.key(3)))
    qconfig, qparams = quantize_params(config, params, "int8")
    fc, w = qparams["h_0"]["mlp"]["experts_fc"], np.asarray(params["h_0"]["mlp"]["experts_fc"])
    assert fc.w.dtype == jnp.int8 and fc.w.shape == (4, 32, 48) and fc.scale.shape == (4, 48)
    # each expert's output channel: error at most half its own step, max |w[e, :, f]| / 254
    back = np.asarray(fc.w, np.float32) * np.asarray(fc.scale)[:, None, :]
    assert np.all(np.abs(back - w) <= np.abs(w).max(axis=1, keepdims=True) / 254 * 1.0001)
    assert not quantize.is_quantized(qparams["h_0"]["mlp"]["router"])
    assert quantize.is_quantized(qparams["h_0"]["mlp"]["shared_expert"])
    # the abstract layout (what flaxgpt aot compiles int8 decoding with) is the same tree
    layout = lambda tree: jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), tree)  # noqa: E731
    abstract = jax.eval_shape(
        lambda p: quantize_params(config, p, "int8")[1], nn.unbox(abstract_params(config))
    )
    assert layout(abstract) == layout(qparams)

    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 64, (2, 8)))
    want = GPT(config).apply({"params": params}, tokens)
    got = GPT(qconfig).apply({"params": qparams}, tokens)
    assert float(jnp.max(jnp.abs(got - want))) < 0.02 * float(jnp.max(want) - jnp.min(want))
    prompt = np.asarray(tokens[:, :5])
    greedy = dict(max_new_tokens=10, rng=jax.random.key(0), temperature=0)
    float_tokens, _ = generate(
        step_fn(config, params), KVCache.for_config(config, 2, 16), prompt, [5, 3], **greedy
    )
    int8_tokens, _ = generate(
        step_fn(qconfig, qparams), KVCache.for_config(qconfig, 2, 16), prompt, [5, 3], **greedy
    )
    np.testing.assert_array_equal(int8_tokens, float_tokens)


def transformers_counts(model_type):
    """(total, active) parameters of transformers' model for the preset's published config, built
    on the meta device (no memory): active = total less E - k experts' weights per sparse layer."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if model_type == "mixtral":  # mistralai/Mixtral-8x7B-v0.1's config.json
        cfg = transformers.MixtralConfig(
            vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
            tie_word_embeddings=False,
        )  # fmt: skip
        cls = transformers.MixtralForCausalLM
    elif model_type == "qwen2_moe":  # Qwen/Qwen1.5-MoE-A2.7B's config.json
        cfg = transformers.Qwen2MoeConfig(
            vocab_size=151936, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
            num_key_value_heads=16, num_experts=60, num_experts_per_tok=4, norm_topk_prob=False,
            tie_word_embeddings=False,
        )  # fmt: skip
        cls = transformers.Qwen2MoeForCausalLM
    else:  # Qwen/Qwen3-30B-A3B's config.json
        cfg = transformers.Qwen3MoeConfig(
            vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
            num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
            num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False,
        )  # fmt: skip
        cls = transformers.Qwen3MoeForCausalLM
    with torch.device("meta"):
        model = cls(cfg)
    total = sum(p.numel() for p in model.parameters())
    E, k = cfg.num_local_experts if model_type == "mixtral" else cfg.num_experts, cfg.num_experts_per_tok
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)  # not shared
    return total, total - experts * (E - k) // E


@pytest.mark.parametrize(
    "preset,model_type",
    [("mixtral-8x7b", "mixtral"), ("qwen3-30b-a3b", "qwen3_moe"), ("qwen1.5-moe-a2.7b", "qwen2_moe")],
)
def test_presets_total_and_active_parameters_equal_transformers(preset, model_type):
    s = summary.summarize(GPTConfig.preset(preset))
    assert (s["totals"]["total"], s["totals"]["active"]) == transformers_counts(model_type)
    # FLOPs count the active matmul weights: all but the untied embedding lookup and idle experts
    f = s["flops"]
    assert f["n_matmul"] == s["totals"]["active"] - s["parts"]["token embeddings"]
    assert flops.flops_per_token(GPTConfig.preset(preset))["n_matmul"] == f["n_matmul"]
    assert "active per token" in summary.format_summary(s)


@pytest.mark.devices(8)
def test_expert_parallel_on_8_devices_equals_one_device():
    """Experts split over an "expert" mesh axis of 4 (2 each), parameters over fsdp 2: the loss (with
    the router losses) and every gradient equal one device's; an axis that does not divide the
    experts is a one-line error."""
    from flaxgpt import sharding

    assert jax.device_count() == 8
    config = GPTConfig(**{**TINY, "num_experts": 8, "n_layer": 2})
    params = init_params(config, jax.random.key(0))
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 64, (8, 8)))

    def loss(p, t):
        logits, state = GPT(config).apply({"params": p}, t, mutable=[ROUTER])
        aux, z = router_losses(state[ROUTER], config.num_experts)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0]) + aux + z

    one = jax.jit(jax.value_and_grad(loss))(params, tokens)
    mesh = sharding.make_mesh(data=1, fsdp=2, expert=4)
    shardings = sharding.param_shardings(abstract_params(config), mesh)
    assert shardings["h_0"]["mlp"]["experts_fc"].spec[0] == "expert"
    step = jax.jit(
        sharding.under_mesh(jax.value_and_grad(loss), mesh),
        in_shardings=(shardings, sharding.batch_sharding(mesh)),
    )
    traced = jax.make_jaxpr(sharding.under_mesh(loss, mesh))(params, tokens)
    assert "shard_map" in str(traced)  # models/moe.py's expert_parallel, not a replicated computation
    many = step(jax.device_put(params, shardings), jax.device_put(tokens, sharding.batch_sharding(mesh)))
    np.testing.assert_allclose(many[0], one[0], rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(many[1]), jax.tree_util.tree_leaves(one[1])):
        np.testing.assert_allclose(a, b, atol=1e-5)
    # expert adapters on this mesh: tests/train/test_lora.py trains them as on one device

    with pytest.raises(ValueError, match="mesh.expert 3 does not divide the 8 devices"):
        sharding.make_mesh(expert=3)
    four = GPTConfig(**{**TINY, "n_layer": 2})  # 4 experts on an expert axis of 8
    with pytest.raises(ValueError, match=r"experts_fc'\] dim 4 is not .* 8 devices .* mesh.expert") as e:
        sharding.param_shardings(abstract_params(four), sharding.make_mesh(data=1, expert=8))
    assert "\n" not in str(e.value)
