"""The fused linear + cross-entropy (kernels.linear_xent, losses.fused_*): its four statistics equal a
float64 numpy reference; the losses and log-probs built on them equal today's logits path in value and
gradients (hidden states, the unembedding, and every parameter of tiny models through each task's
objective) to 1e-5 in float32 and to a bf16 tolerance; and the compiled gradient holds no [N, V] logits."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import default
from flaxgpt.kernels.linear_xent import Head, token_stats
from flaxgpt.models import seq2seq
from flaxgpt.models.gpt import GPTConfig, init_params
from flaxgpt.train import dpo_task, grpo_task, lm_task, losses, seq2seq_task
from flaxgpt.train.policy import Frozen, FullPolicy


def _head_inputs(layout, N=10, D=6, V=37, Vp=40, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, D)).astype(np.float32)
    w = rng.normal(size=(D, Vp) if layout == "DV" else (Vp, D)).astype(np.float32)
    return x, w, rng.integers(0, V, N).astype(np.int32)


def _reference_stats(x, w, targets, layout, V, softcap, scale):
    raw = x.astype(np.float64) @ (w if layout == "DV" else w.T).astype(np.float64)
    raw = raw[:, :V]
    z = scale * (softcap * np.tanh(raw / softcap) if softcap else raw)
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    p = np.exp(z - lse[:, None])
    return lse, z[np.arange(len(targets)), targets], z.sum(1), -(p * np.log(p)).sum(1)


@pytest.mark.parametrize(
    "layout,block,softcap,scale",
    [("DV", 8, 0.0, 1.0), ("VD", 16, 3.0, 1.0), ("DV", 37, 0.0, 1 / 0.7), ("VD", 5, 2.0, 1.3)],
)
def test_stats_match_float64(layout, block, softcap, scale):
    """V = 37 over blocks of 8, 16, 37, 5 (the last block overlaps the one before); 3 padded columns."""
    x, w, t = _head_inputs(layout)
    got = token_stats(x, Head(w, layout, 37, softcap), t, scale=scale, block=block)
    for a, b, name in zip(
        got, _reference_stats(x, w, t, layout, 37, softcap, scale), got._fields, strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6, err_msg=name)


def _logits(x, w, layout, V, softcap):
    raw = (x @ w if layout == "DV" else x @ w.T)[:, :V]
    return softcap * jnp.tanh(raw / softcap) if softcap else raw


@pytest.mark.parametrize(
    "layout,softcap,smoothing,z_loss", [("DV", 0.0, 0.0, 0.0), ("VD", 0.0, 0.1, 1e-3), ("DV", 3.0, 0.2, 1e-2)]
)
def test_loss_and_gradients_equal_the_logits_path(layout, softcap, smoothing, z_loss):
    x, w, t = _head_inputs(layout, N=12)
    x3, t3 = x.reshape(3, 4, -1), t.reshape(3, 4)
    mask = np.random.default_rng(1).random((3, 4)) < 0.7

    def plain(x3, w):
        logits = _logits(x3.reshape(12, -1), w, layout, 37, softcap).reshape(3, 4, 37)
        return losses.cross_entropy(logits, t3, mask, smoothing, z_loss)

    def fused(x3, w):
        return losses.fused_cross_entropy(x3, Head(w, layout, 37, softcap), t3, mask, smoothing, z_loss, 8)

    (want, n_want), g_want = jax.value_and_grad(plain, (0, 1), has_aux=True)(x3, w)
    (got, n_got), g_got = jax.jit(jax.value_and_grad(fused, (0, 1), has_aux=True))(x3, w)
    assert float(n_got) == float(n_want) == mask.sum()
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(g_got, g_want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert not np.any(np.asarray(g_got[1])[:, 37:] if layout == "DV" else np.asarray(g_got[1])[37:])


def test_logprobs_and_entropy_equal_grpos():
    """GRPO's (log p, entropy) at a temperature, and their gradients under a random cotangent."""
    x, w, t = _head_inputs("VD", N=12)
    x3, t3 = x.reshape(2, 6, -1), t.reshape(2, 6)
    ct = np.random.default_rng(2).normal(size=(2, 2, 6)).astype(np.float32)

    def plain(x3, w):
        logits = _logits(x3.reshape(12, -1), w, "VD", 37, 0.0).reshape(2, 6, 37)
        return grpo_task.completion_logps(logits, t3, 0.7)

    def fused(x3, w):
        return losses.fused_token_logprobs(x3, Head(w, "VD", 37), t3, 0.7, block=16)

    want, vjp_want = jax.vjp(plain, x3, w)
    got, vjp_got = jax.vjp(fused, x3, w)
    np.testing.assert_allclose(np.stack(got), np.stack(want), rtol=1e-5, atol=1e-6)
    for a, b in zip(vjp_got((ct[0], ct[1])), vjp_want((ct[0], ct[1])), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_bfloat16_within_its_tolerance():
    """A bf16 head (the model's compute dtype): the fused path accumulates in float32, the logits path
    rounds the logits to bf16 first; both stay within bf16's precision of the float32 loss."""
    x, w, t = _head_inputs("DV", N=16, D=32, V=300, Vp=320)
    x3, t3 = x.reshape(2, 8, 32) * 0.3, t.reshape(2, 8)
    xb, wb = jnp.asarray(x3, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)

    def plain(x3, w):
        return losses.cross_entropy((x3.reshape(16, 32) @ w)[:, :300].reshape(2, 8, 300), t3)[0]

    def fused(x3, w):
        return losses.fused_cross_entropy(x3, Head(w, "DV", 300), t3, block=64)[0]

    want, g_want = jax.value_and_grad(plain, (0, 1))(jnp.asarray(x3), jnp.asarray(w))
    got, g_got = jax.value_and_grad(fused, (0, 1))(xb, wb)
    assert g_got[0].dtype == g_got[1].dtype == jnp.bfloat16
    np.testing.assert_allclose(float(got), float(want), rtol=1e-2)
    for a, b in zip(g_got, g_want, strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b)
        assert np.abs(a - b).max() <= 2e-2 * np.abs(b).max() + 1e-3


def _recipe(**optim):
    c = default.get_config()
    c.optim.update(optim)
    return c


def _grads_equal(loss, params, make_objective):
    """loss(objective, params) -> scalar, the same under loss_impl logits and fused."""
    outs = []
    for impl in ("logits", "fused"):
        objective = make_objective(impl)
        outs.append(jax.jit(jax.value_and_grad(lambda p, o=objective: loss(o, p)))(params))
    (want, g_want), (got, g_got) = outs
    np.testing.assert_allclose(got, want, rtol=1e-5)
    pairs = zip(jax.tree_util.tree_leaves_with_path(g_got), jax.tree_util.tree_leaves(g_want), strict=True)
    for (path, a), b in pairs:
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def _gpt(**overrides):
    config = GPTConfig(vocab_size=61, block_size=16, n_layer=1, n_head=2, n_embd=32, **overrides)
    return config, jax.jit(init_params, static_argnums=0)(config, jax.random.key(0))


def _tokens(B=3, T=12, V=61):
    tokens = jax.random.randint(jax.random.key(1), (B, T + 1), 0, V)
    mask = jax.random.bernoulli(jax.random.key(2), 0.7, (B, T)).astype(jnp.float32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask}


@pytest.mark.parametrize(
    "overrides,optim",
    [
        (dict(tie_embeddings=True, pad_vocab_multiple=64), dict(label_smoothing=0.1, loss_block=16)),
        (dict(tie_embeddings=False, logit_softcap=5.0), dict(z_loss=1e-3, loss_block=7)),
        (dict(tie_embeddings=True, num_experts=4, experts_per_token=2, router_z_loss_coef=1e-3), {}),
    ],
)
def test_lm_objective_fused_equals_logits(overrides, optim):
    """LM and SFT (masked) through the whole tiny model: tied (padded vocabulary) and untied heads,
    soft-capped logits, label smoothing, z-loss, a mixture of experts' router losses."""
    config, params = _gpt(**overrides)
    batch, policy = _tokens(), FullPolicy(config)

    def loss(objective, p):
        total, aux = objective.loss(policy, p, Frozen(), batch, jax.random.key(3), True)
        return total / (aux[0] if isinstance(aux, tuple) else aux)

    _grads_equal(loss, params, lambda impl: lm_task.LMObjective(_recipe(loss_impl=impl, **optim), config))


def test_lora_policy_fused_equals_logits():
    """LoRA over a bf16 base: the head is the base's (policy.head_params), the adapters the gradient."""
    from flaxgpt.models import lora
    from flaxgpt.train.policy import LoraPolicy

    config, base = _gpt(tie_embeddings=False)
    policy = LoraPolicy(config, lora.LoraSpec.make(config, 4, 8.0), "bfloat16")
    frozen = Frozen(base=policy.base(base))
    adapters = jax.tree_util.tree_map(lambda a: a + 0.01, policy.init_params(jax.random.key(4)))
    batch = _tokens()

    def loss(objective, p):
        total, weight = objective.loss(policy, p, frozen, batch, None, False)
        return total / weight

    _grads_equal(loss, adapters, lambda impl: lm_task.LMObjective(_recipe(loss_impl=impl), config))


def test_dpo_objective_fused_equals_logits():
    config, params = _gpt(tie_embeddings=False)
    batch, policy = _tokens(B=2), FullPolicy(config)
    batch["segment_ids"] = jnp.asarray([[1] * 6 + [2] * 6, [1] * 12], jnp.int32)
    reference = jax.tree_util.tree_map(lambda a: a * 0.9, params)

    def loss(objective, p):
        total, (weight, _) = objective.loss(policy, p, Frozen(reference=reference), batch, None, False)
        return total / weight

    _grads_equal(loss, params, lambda impl: dpo_task.DPOObjective(_recipe(loss_impl=impl), config))


def test_grpo_objective_fused_equals_logits():
    config, params = _gpt(tie_embeddings=True)
    batch, policy = _tokens(B=2), FullPolicy(config)
    batch["advantages"] = jnp.asarray([0.5, -1.0])
    opts = grpo_task.GRPOOptions(temperature=0.8, beta=0.0)  # (the entropy: test_logprobs_and_entropy...)

    def loss(objective, p):
        total, (weight, _) = objective.loss(policy, p, Frozen(), batch, None, False)
        return total / weight

    _grads_equal(loss, params, lambda impl: grpo_task.GRPOObjective(opts, 12, 1, impl, 32))


def test_seq2seq_objective_fused_equals_logits():
    config = seq2seq.TransformerConfig(
        vocab_size=45, block_size=12, n_enc_layer=1, n_dec_layer=1, n_embd=16, d_ff=32, n_head=2,
        dropout=0.0, tie_embeddings=False, pad_vocab_multiple=8,
    )  # fmt: skip
    params = jax.jit(seq2seq.init_params, static_argnums=0)(config, jax.random.key(0))
    batch = _tokens(B=2, T=12, V=45)
    batch["src"], batch["src_lengths"] = batch["inputs"][:, ::-1], jnp.asarray([12, 7], jnp.int32)

    def loss(objective, p):
        total, weight = objective.loss(None, p, Frozen(), batch, None, False)
        return total / weight

    def objective(impl):
        return seq2seq_task.Seq2SeqObjective(_recipe(loss_impl=impl, label_smoothing=0.1), config)

    _grads_equal(loss, params, objective)


def test_compiled_gradient_holds_no_full_logits():
    """The compiled gradient's temporaries: the logits path holds [N, V] float32 logits and their
    gradient; the fused one a [N, block] block at a time."""
    x = jax.ShapeDtypeStruct((1024, 16), jnp.float32)
    w = jax.ShapeDtypeStruct((16, 4096), jnp.float32)
    targets = jnp.zeros((1, 1024), jnp.int32)
    full_logits = 1024 * 4096 * 4

    def temp_bytes(loss):
        grad = jax.jit(jax.grad(lambda x, w: loss(x[None], w)[0], argnums=(0, 1)))
        return grad.trace(x, w).lower().compile().memory_analysis().temp_size_in_bytes

    plain = temp_bytes(lambda x, w: losses.cross_entropy(x @ w, targets))
    fused = temp_bytes(lambda x, w: losses.fused_cross_entropy(x, Head(w, "DV", 4096), targets, block=128))
    assert plain >= full_logits and fused < full_logits / 4, (plain, fused)


def test_bad_input_says_what_to_fix():
    x, w, t = _head_inputs("DV")
    with pytest.raises(ValueError, match="vocab_size 41 must be in 1..40"):
        token_stats(x, Head(w, "DV", 41), t)
    with pytest.raises(ValueError, match="layout 'VV'"):
        token_stats(x, Head(w, "VV", 37), t)
    with pytest.raises(ValueError, match="choose one of logits, fused"):
        losses.use_fused("fast")
    c = ml_collections.ConfigDict({"optim": {"loss_impl": "fussed", "label_smoothing": 0.0}})
    with pytest.raises(ValueError, match="loss_impl 'fussed'"):
        lm_task.LMObjective(c, _gpt()[0])
