"""flaxgpt.train.losses: the masked, label-smoothed cross-entropy equals a numpy reference; the chunked
one equals the plain one in value and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxgpt.models.gpt import GPT, GPTConfig, head_logits, init_params
from flaxgpt.train.losses import chunked_cross_entropy, cross_entropy


def test_cross_entropy_matches_numpy():
    rng = np.random.default_rng(0)
    logits, targets = rng.normal(size=(2, 3, 5)), rng.integers(0, 5, (2, 3))
    mask = np.array([[1, 1, 0], [1, 0, 1]])
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    smooth = 0.9 * nll - 0.1 * logp.mean(-1)
    total, weight = cross_entropy(logits.astype(np.float32), targets, mask, 0.1)
    assert float(weight) == 4 and float(total) == pytest.approx((smooth * mask).sum(), rel=1e-5)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(tie_embeddings=True, pad_vocab_multiple=64),  # padded vocabulary rows never reach the loss
        dict(tie_embeddings=False, logit_softcap=5.0, scan_layers=True),
    ],
)
def test_chunked_cross_entropy_equals_the_plain_one(overrides):
    """Same loss and gradients (to 1e-5, float32) with the head applied a chunk of positions at a time;
    T = 20 is not a multiple of the chunk (the padded tail is masked)."""
    config = GPTConfig(vocab_size=61, block_size=32, n_layer=1, n_head=2, n_embd=32, **overrides)
    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (3, 21), 0, 61)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    mask = jax.random.bernoulli(jax.random.key(2), 0.7, targets.shape)
    model = GPT(config)

    def plain(p):
        return cross_entropy(model.apply({"params": p}, inputs), targets, mask, 0.1)

    def chunked(p):
        hidden = model.apply({"params": p}, inputs, hidden=True)
        head = lambda x: head_logits(config, p, x)  # noqa: E731
        return chunked_cross_entropy(hidden, head, targets, mask, 0.1, chunk=8)

    (want, w_want), g_want = jax.jit(jax.value_and_grad(plain, has_aux=True))(params)
    (got, w_got), g_got = jax.jit(jax.value_and_grad(chunked, has_aux=True))(params)
    assert float(w_got) == float(w_want) == float(mask.sum())
    np.testing.assert_allclose(got, want, rtol=1e-5)
    pairs = zip(jax.tree_util.tree_leaves_with_path(g_got), jax.tree_util.tree_leaves(g_want))
    for (path, a), b in pairs:
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_chunked_cross_entropy_keeps_no_full_logits():
    """The compiled gradient's temporaries: the plain loss holds [B, T, V] float32 logits (and their
    gradient), the chunked one a [B, chunk, V] slice at a time (the backward recomputes each)."""
    hidden = jax.ShapeDtypeStruct((2, 512, 8), jnp.float32)
    w = jax.ShapeDtypeStruct((8, 4096), jnp.float32)
    targets = jnp.zeros((2, 512), jnp.int32)
    full_logits = 2 * 512 * 4096 * 4

    def temp_bytes(loss):
        grad = jax.jit(jax.grad(lambda h, w: loss(h, w)[0], argnums=(0, 1)))
        return grad.trace(hidden, w).lower().compile().memory_analysis().temp_size_in_bytes

    plain = temp_bytes(lambda h, w: cross_entropy(h @ w, targets))
    chunked = temp_bytes(lambda h, w: chunked_cross_entropy(h, lambda x: x @ w, targets, chunk=16))
    assert plain >= full_logits and chunked < full_logits / 4, (plain, chunked)
