"""The GPT model: shapes, causality, parameter counts, options, and a float64 reference."""

import dataclasses
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from flaxgpt.models.gpt import (
    GPT,
    GPTConfig,
    abstract_params,
    count_params,
    init_params,
    stack_layers,
    unstack_layers,
)

TINY = GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=4, n_embd=32)


def tokens(key=0, shape=(2, 12), vocab=61):
    return jax.random.randint(jax.random.key(key), shape, 0, vocab)


def apply(cfg, params, x, **kw):
    return GPT(cfg).apply({"params": params}, x, **kw)


# ---------------------------------------------------------------- float64 reference


def np_gelu(x, approximate):
    if approximate:
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    from scipy.special import erf  # noqa: PLC0415  (scipy ships with jax)

    return 0.5 * x * (1 + erf(x / math.sqrt(2)))


def np_layer_norm(x, p, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + eps) * p["scale"]
    return y + p["bias"] if "bias" in p else y


def np_dense(x, p):
    y = x @ p["kernel"]
    return y + p["bias"] if "bias" in p else y


def np_gpt(cfg: GPTConfig, params, x_BT):
    """An independent float64 GPT forward pass written with NumPy only."""
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    B, T = x_BT.shape
    H, K = cfg.n_head, cfg.head_dim
    h = p["wte"]["embedding"][x_BT]
    if cfg.pos_embedding == "learned":
        h = h + p["wpe"]["embedding"][np.arange(T)]
    else:
        half = cfg.n_embd // 2
        ang = np.arange(T)[:, None] / 10000.0 ** (np.arange(half) / half)
        # the paper's layout: PE(pos, 2i) = sin, PE(pos, 2i + 1) = cos
        h = h + np.stack([np.sin(ang), np.cos(ang)], -1).reshape(T, -1)
    act = {
        "gelu": lambda v: np_gelu(v, True),
        "gelu_exact": lambda v: np_gelu(v, False),
        "relu": lambda v: np.maximum(v, 0),
    }[cfg.activation]
    for i in range(cfg.n_layer):
        blk = p[f"h_{i}"]
        a = np_layer_norm(h, blk["ln_1"], cfg.layer_norm_epsilon)
        q, k, v = np.split(np_dense(a, blk["attn"]["c_attn"]), 3, axis=-1)
        q, k, v = (t.reshape(B, T, H, K).transpose(0, 2, 1, 3) for t in (q, k, v))
        s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(K)
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        w = w / w.sum(-1, keepdims=True)
        y = (w @ v).transpose(0, 2, 1, 3).reshape(B, T, cfg.n_embd)
        h = h + np_dense(y, blk["attn"]["c_proj"])
        m = np_layer_norm(h, blk["ln_2"], cfg.layer_norm_epsilon)
        h = h + np_dense(act(np_dense(m, blk["mlp"]["c_fc"])), blk["mlp"]["c_proj"])
    h = np_layer_norm(h, p["ln_f"], cfg.layer_norm_epsilon)
    head = p["wte"]["embedding"].T if cfg.tie_embeddings else p["lm_head"]["kernel"]
    return (h @ head)[..., : cfg.vocab_size]


OPTIONS = {
    "default": {},
    "sinusoidal": dict(pos_embedding="sinusoidal"),
    "gelu_exact": dict(activation="gelu_exact"),
    "relu": dict(activation="relu"),
    "untied": dict(tie_embeddings=False),
    "no_bias": dict(bias=False, qkv_bias=False),
    "no_qkv_bias": dict(qkv_bias=False),
    "eps": dict(layer_norm_epsilon=1e-2),
    "padded_vocab": dict(pad_vocab_multiple=64),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_matches_float64_reference(name):
    cfg = dataclasses.replace(TINY, **OPTIONS[name])
    params = init_params(cfg, jax.random.key(1))
    # random non-zero biases and LayerNorm parameters, so every term of the reference is exercised
    leaves, tree = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    params = jax.tree_util.tree_unflatten(
        tree, [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    )
    x = tokens()
    got = np.asarray(apply(cfg, params, x))
    want = np_gpt(cfg, params, np.asarray(x))
    assert got.shape == (2, 12, cfg.vocab_size)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def test_option_parameter_structure():
    names = lambda cfg: set(init_params(cfg, jax.random.key(0)))  # noqa: E731
    assert "lm_head" not in names(TINY) and "wpe" in names(TINY)
    assert "lm_head" in names(dataclasses.replace(TINY, tie_embeddings=False))
    assert "wpe" not in names(dataclasses.replace(TINY, pos_embedding="sinusoidal"))
    p = init_params(dataclasses.replace(TINY, bias=False, qkv_bias=False), jax.random.key(0))
    paths = ["/".join(str(k.key) for k in path) for path, _ in jax.tree_util.tree_leaves_with_path(p)]
    assert not [q for q in paths if q.endswith("bias")]
    p = init_params(dataclasses.replace(TINY, qkv_bias=False), jax.random.key(0))
    assert "bias" not in p["h_0"]["attn"]["c_attn"] and "bias" in p["h_0"]["attn"]["c_proj"]


# ---------------------------------------------------------------- shapes, jit, causality


class ShapeTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_shapes(self):
        params = init_params(TINY, jax.random.key(0))
        fn = self.variant(lambda p, x: apply(TINY, p, x))
        for shape in [(1, 1), (3, 7), (2, 16)]:
            logits = fn(params, tokens(shape=shape))
            chex.assert_shape(logits, (*shape, TINY.vocab_size))
            chex.assert_tree_all_finite(logits)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(("float32", jnp.float32), ("bfloat16", jnp.bfloat16))
    def test_compute_dtype(self, dtype, want):
        cfg = dataclasses.replace(TINY, dtype=dtype)
        params = init_params(cfg, jax.random.key(0))
        chex.assert_trees_all_equal_dtypes(params, jax.tree_util.tree_map(jnp.float32, params))
        logits = self.variant(lambda p, x: apply(cfg, p, x))(params, tokens())
        assert logits.dtype == want


def test_causal_logits():
    params = init_params(TINY, jax.random.key(0))
    x = tokens()
    y = x.at[:, 7:].set((x[:, 7:] + 5) % TINY.vocab_size)
    a, b = apply(TINY, params, x), apply(TINY, params, y)
    np.testing.assert_array_equal(np.asarray(a[:, :7]), np.asarray(b[:, :7]))
    assert not np.allclose(a[:, 7:], b[:, 7:])


def test_causal_gradients():
    """Logits at position t have no gradient with respect to inputs after t."""
    cfg = dataclasses.replace(TINY, tie_embeddings=False)  # the head must not read the input table
    params = init_params(cfg, jax.random.key(0))
    T = 10
    emb_TD = params["wte"]["embedding"][tokens(shape=(1, T))[0]]

    def logits_at(emb_TD, t):
        # feed the embeddings directly: token i of the input is row i of a table made from them
        table = jnp.concatenate([emb_TD, params["wte"]["embedding"][T:]])
        p = dict(params, wte={"embedding": table})
        return apply(cfg, p, jnp.arange(T)[None])[0, t].sum()

    for t in (0, 4, 9):
        g_TD = np.asarray(jax.grad(logits_at)(emb_TD, t))
        assert np.abs(g_TD[: t + 1]).sum() > 0
        np.testing.assert_array_equal(g_TD[t + 1 :], 0.0)


def test_deterministic_and_dropout():
    cfg = dataclasses.replace(TINY, embd_dropout=0.1, attn_dropout=0.1, resid_dropout=0.1)
    params = init_params(cfg, jax.random.key(0))
    x = tokens()
    np.testing.assert_array_equal(apply(cfg, params, x), apply(cfg, params, x))
    drop = lambda seed: apply(
        cfg,
        params,
        x,
        deterministic=False,  # noqa: E731
        rngs={"dropout": jax.random.key(seed)},
    )
    assert not np.allclose(drop(0), drop(1))
    np.testing.assert_array_equal(drop(3), drop(3))
    # each rate acts on its own: with only one of them non-zero, training differs from eval
    for field in ("embd_dropout", "attn_dropout", "resid_dropout"):
        one = dataclasses.replace(TINY, **{field: 0.5})
        train = apply(one, params, x, deterministic=False, rngs={"dropout": jax.random.key(0)})
        assert not np.allclose(train, apply(one, params, x)), field


def test_bfloat16_close_to_float32():
    params = init_params(TINY, jax.random.key(0))
    x = tokens()
    f32 = apply(TINY, params, x)
    bf16 = apply(dataclasses.replace(TINY, dtype="bfloat16"), params, x).astype(jnp.float32)
    np.testing.assert_allclose(bf16, f32, atol=0.05, rtol=0.05)
    assert np.mean(np.argmax(bf16, -1) == np.argmax(f32, -1)) > 0.9


def test_padded_vocab_never_returned():
    cfg = dataclasses.replace(TINY, pad_vocab_multiple=64)
    params = init_params(cfg, jax.random.key(0))
    assert params["wte"]["embedding"].shape == (64, cfg.n_embd)
    assert apply(cfg, params, tokens()).shape[-1] == 61
    assert count_params(params) > count_params(init_params(TINY, jax.random.key(0)))


# ---------------------------------------------------------------- counts and init


@pytest.mark.parametrize(
    "name,want",
    [
        ("gpt2", 124_439_808),
        ("gpt2-medium", 354_823_168),
        ("gpt2-large", 774_030_080),
        ("gpt2-xl", 1_557_611_200),
    ],
)
def test_preset_parameter_counts(name, want):
    assert count_params(abstract_params(GPTConfig.preset(name))) == want


def test_gpt2_counts_without_qkv_bias():
    assert count_params(abstract_params(GPTConfig.gpt2(qkv_bias=False))) == 124_412_160
    untied = GPTConfig.gpt2(qkv_bias=False, tie_embeddings=False)
    assert count_params(abstract_params(untied)) == 163_009_536


def test_gpt2_initialisation():
    cfg = dataclasses.replace(TINY, n_layer=8, n_embd=256, n_head=4, vocab_size=4096, block_size=64)
    p = init_params(cfg, jax.random.key(0))
    np.testing.assert_allclose(np.std(p["wte"]["embedding"]), 0.02, rtol=0.03)
    np.testing.assert_allclose(np.std(p["h_0"]["mlp"]["c_fc"]["kernel"]), 0.02, rtol=0.05)
    resid = 0.02 / math.sqrt(2 * cfg.n_layer)
    np.testing.assert_allclose(np.std(p["h_3"]["mlp"]["c_proj"]["kernel"]), resid, rtol=0.05)
    np.testing.assert_allclose(np.std(p["h_3"]["attn"]["c_proj"]["kernel"]), resid, rtol=0.05)
    assert not np.any(p["h_1"]["attn"]["c_attn"]["bias"])
    np.testing.assert_array_equal(p["ln_f"]["scale"], 1.0)


# ---------------------------------------------------------------- layouts


def test_scan_layers_and_remat_match():
    params = init_params(TINY, jax.random.key(0))
    x = tokens()

    def logits_and_grads(cfg, p):  # one jitted program per layout: eager scans are slow to trace
        def loss(p):
            logits = apply(cfg, p, x)
            return logits.astype(jnp.float32).mean(), logits

        (_, logits), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(p)
        return logits, g

    want, g_want = logits_and_grads(TINY, params)
    stacked = stack_layers(params, TINY.n_layer)
    for kw in (
        dict(scan_layers=True),
        dict(scan_layers=True, remat="full"),
        dict(scan_layers=True, remat="dots"),
        dict(scan_layers=True, remat="offload_dots_no_batch"),
    ):
        got, g = logits_and_grads(dataclasses.replace(TINY, **kw), stacked)
        np.testing.assert_allclose(got, want, atol=1e-5)
        chex.assert_trees_all_close(unstack_layers(g, TINY.n_layer), g_want, atol=1e-6)
    for policy in ("full", "dots_no_batch"):  # unscanned blocks too
        _, g = logits_and_grads(dataclasses.replace(TINY, remat=policy), params)
        chex.assert_trees_all_close(g, g_want, atol=1e-6)
    # the scanned init has the same shapes as the stacked GPT-2 layout
    chex.assert_trees_all_equal_shapes(
        init_params(dataclasses.replace(TINY, scan_layers=True), jax.random.key(0)), stacked
    )


# ---------------------------------------------------------------- bad input


def test_bad_config_and_input():
    with pytest.raises(ValueError, match="n_embd 100 is not divisible by n_head 12"):
        GPTConfig(n_embd=100, n_head=12)
    with pytest.raises(ValueError, match="known presets: gpt2, gpt2-medium"):
        GPTConfig.preset("gpt3")
    with pytest.raises(ValueError, match="activation='swish'"):
        GPTConfig(activation="swish")
    # --config.model.mlp_only_layers=abc: "invalid literal for int()", naming nothing
    with pytest.raises(ValueError, match=r"mlp_only_layers must be a list of layer indices such as \(0, 3\)"):
        GPTConfig(mlp_only_layers=("abc",))
    params = init_params(TINY, jax.random.key(0))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 61\), got min 0 max 61"):
        apply(TINY, params, jnp.array([[0, 61]]))
    with pytest.raises(ValueError, match="sequence length 17 is longer than block_size 16"):
        apply(TINY, params, jnp.zeros((1, 17), jnp.int32))


def test_tied_head_same_for_few_and_many_rows():
    """Few rows (decoding) multiply by the [V, D] table directly, many rows use wte.attend: same logits."""
    cfg = dataclasses.replace(TINY, pad_vocab_multiple=64)
    params = init_params(cfg, jax.random.key(0))
    tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (10, 8))  # 80 rows > 64
    many = GPT(cfg).apply({"params": params}, tokens)
    few = GPT(cfg).apply({"params": params}, tokens[:2])  # 16 rows
    assert few.shape == (2, 8, cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(few), np.asarray(many[:2]), atol=1e-5)


@pytest.mark.parametrize("head", ["tied", "untied", "softcap"])
def test_logits_at_one_position_per_row(head):
    """logits_at (what prefills ask for) == the full logits at those time indices, cache written alike."""
    from flaxgpt.models.cache import KVCache

    cfg = {
        "tied": TINY,
        "untied": dataclasses.replace(TINY, tie_embeddings=False),
        "softcap": dataclasses.replace(TINY, logit_softcap=3.0),
    }[head]
    params = init_params(cfg, jax.random.key(1))
    x = tokens(shape=(3, 10))
    at = jnp.array([9, 0, 4])
    full, cache_full = apply(cfg, params, x, cache=KVCache.for_config(cfg, 3, 16))
    one, cache_one = apply(cfg, params, x, cache=KVCache.for_config(cfg, 3, 16), logits_at=at)
    assert one.shape == (3, 1, cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(one[:, 0]), np.asarray(full[jnp.arange(3), at]), atol=1e-5)
    chex.assert_trees_all_equal(cache_one, cache_full)
