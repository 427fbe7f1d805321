"""The encoder-decoder Transformer: a float64 NumPy reference, masks, the decoding cache, decoders."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from flaxgpt.decode.beam_search import beam_search, length_penalty
from flaxgpt.decode.translate import generate
from flaxgpt.models import seq2seq
from flaxgpt.models.gpt import count_params
from flaxgpt.models.seq2seq import Transformer, TransformerConfig, abstract_params

TINY = TransformerConfig.preset("tiny", vocab_size=23, block_size=16, n_head=4)


@functools.partial(jax.jit, static_argnums=0)
def forward(c, p, src, src_len, tgt):
    return Transformer(c).apply({"params": p}, src, src_len, tgt)


@functools.partial(jax.jit, static_argnums=0)
def decode_step(c, p, tgt, src_len, cache, pos):
    return Transformer(c).apply(
        {"params": p}, tgt, None, src_len, cache=cache, positions=pos, method=Transformer.decode
    )


def ref_forward(p, c: TransformerConfig, src, src_len, tgt):
    """The paper's model written directly in float64 NumPy from the parameter dict."""
    p = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), p)
    D, H = c.n_embd, c.n_head

    def ln(x, q):
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + c.layer_norm_epsilon) * q["scale"] + q["bias"]

    def dense(x, q):
        return x @ q["kernel"] + q["bias"]

    def heads(x, n):  # [B, T, n*D] -> n arrays [B, H, T, K]
        B, T, _ = x.shape
        return [x.reshape(B, T, n, H, D // H)[:, :, i].transpose(0, 2, 1, 3) for i in range(n)]

    def attention(q, k, v, allowed_BTS):
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(D // H)
        s = np.where(allowed_BTS[:, None], s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        B, _, T, _ = q.shape
        return (w @ v).transpose(0, 2, 1, 3).reshape(B, T, D)

    def block(x, branch, q):
        return x + branch(ln(x, q)) if c.pre_ln else ln(x + branch(x), q)

    def mlp(x, q):
        return dense(np.maximum(dense(x, q["c_fc"]), 0.0), q["c_proj"])

    def embed(tokens, table):
        T = tokens.shape[1]
        i = np.arange(D // 2)
        angle = np.arange(T)[:, None] / 10000.0 ** (2 * i / D)[None]
        pe = np.zeros((T, D))
        pe[:, 0::2], pe[:, 1::2] = np.sin(angle), np.cos(angle)  # the paper's interleaved layout
        return table[tokens] * np.sqrt(D) + pe

    S, T = src.shape[1], tgt.shape[1]
    src_ok = np.arange(S)[None, None, :] < src_len[:, None, None]  # [B, 1, S]
    emb = p["embed"]["embedding"] if c.tie_embeddings else None
    x = embed(src, emb if emb is not None else p["src_embed"]["embedding"])
    for i in range(c.n_enc_layer):
        q = p[f"enc_{i}"]
        sa = lambda h, q=q: dense(
            attention(*heads(dense(h, q["attn"]["c_attn"]), 3), src_ok), q["attn"]["c_proj"]
        )
        x = block(block(x, sa, q["ln_1"]), lambda h, q=q: mlp(h, q["mlp"]), q["ln_2"])
    memory = ln(x, p["enc_ln"]) if c.pre_ln else x
    y = embed(tgt, emb if emb is not None else p["tgt_embed"]["embedding"])
    causal = np.tril(np.ones((T, T), bool))[None]
    for i in range(c.n_dec_layer):
        q = p[f"dec_{i}"]
        sa = lambda h, q=q: dense(
            attention(*heads(dense(h, q["attn"]["c_attn"]), 3), causal), q["attn"]["c_proj"]
        )
        y = block(y, sa, q["ln_1"])

        def ca(h, q=q):
            (qh,), (k, v) = heads(dense(h, q["cross"]["c_q"]), 1), heads(dense(memory, q["cross"]["c_kv"]), 2)
            return dense(attention(qh, k, v, src_ok), q["cross"]["c_proj"])

        y = block(block(y, ca, q["ln_2"]), lambda h, q=q: mlp(h, q["mlp"]), q["ln_3"])
    if c.pre_ln:
        y = ln(y, p["dec_ln"])
    return y @ (emb.T if emb is not None else p["lm_head"]["kernel"])


def batch(c, B=3, S=9, T=7, seed=1):
    rng = np.random.default_rng(seed)
    src = rng.integers(0, c.vocab_size, (B, S)).astype(np.int32)
    src_len = np.array([S, 4, 1, 6, 9, 2][:B], np.int32)
    tgt = rng.integers(0, c.vocab_size, (B, T)).astype(np.int32)
    return src, src_len, tgt


@functools.cache
def params_for(c: TransformerConfig, seed: int = 0):
    """Random parameters of the model's shapes, drawn in NumPy (compiling `init` is slow on a busy
    CPU): non-zero biases and non-unit LayerNorm scales, so the reference checks them too."""
    rng = np.random.default_rng(seed)
    shapes = jax.tree_util.tree_map(lambda x: x.shape, nn.unbox(abstract_params(c)))

    def draw(path, shape):
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        std = 0.1 if "bias" in name else 1.0 / np.sqrt(shape[0])
        return (std * rng.standard_normal(shape)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(draw, shapes, is_leaf=lambda x: isinstance(x, tuple))


@pytest.mark.parametrize("variant", [{}, {"pre_ln": False}, {"tie_embeddings": False, "d_ff": 96}])
def test_matches_float64_reference(variant):
    c = dataclasses.replace(TINY, **variant)
    p = params_for(c)
    src, src_len, tgt = batch(c)
    want = ref_forward(p, c, src, src_len, tgt)
    np.testing.assert_allclose(np.asarray(forward(c, p, src, src_len, tgt)), want, atol=2e-4, rtol=1e-4)


def test_source_padding_and_future_targets_are_invisible():
    p = params_for(TINY)
    src, src_len, tgt = batch(TINY)
    base = np.asarray(forward(TINY, p, src, src_len, tgt))
    src2 = src.copy()
    src2[1, src_len[1] :] = (src2[1, src_len[1] :] + 5) % TINY.vocab_size  # only padding changes
    np.testing.assert_allclose(np.asarray(forward(TINY, p, src2, src_len, tgt)), base, atol=1e-6)
    tgt2 = tgt.copy()
    tgt2[:, 4] = (tgt2[:, 4] + 1) % TINY.vocab_size
    out2 = np.asarray(forward(TINY, p, src, src_len, tgt2))
    np.testing.assert_allclose(out2[:, :4], base[:, :4], atol=1e-6)
    assert np.abs(out2[:, 4:] - base[:, 4:]).max() > 1e-4


def start_decoding(c, p, src, src_len, max_len, beams=1):
    m, v = Transformer(c), {"params": p}
    memory = jnp.repeat(m.apply(v, src, src_len, method=Transformer.encode), beams, axis=0)
    return m.apply(v, memory, max_len, method=Transformer.init_cache)


def test_cached_decoding_equals_uncached():
    p = params_for(TINY)
    src, src_len, tgt = batch(TINY)
    full = np.asarray(forward(TINY, p, src, src_len, tgt))
    for chunks in ([1] * 7, [3, 1, 1, 2]):  # one token at a time; a prefill, then steps
        cache = start_decoding(TINY, p, src, src_len, 10)
        assert len(cache.cross_k) == TINY.n_dec_layer  # one array per layer, like the self-attention's
        assert cache.cross_k[0].shape == (3, 9, TINY.n_head, TINY.head_dim)
        out, t = [], 0
        for n in chunks:
            pos = np.broadcast_to(np.arange(t, t + n), (3, n))
            logits, cache = decode_step(TINY, p, tgt[:, t : t + n], src_len, cache, pos)
            out.append(np.asarray(logits))
            t += n
        np.testing.assert_allclose(np.concatenate(out, 1), full, atol=2e-5, rtol=1e-5)


def test_cache_take_rows_moves_self_and_cross_attention_rows():
    """Seq2SeqCache.take_rows is right for any rows, across sources too: after a prefill, the taken
    rows decode exactly as those sources' own rows (the cross-attention keys move with them)."""
    p = params_for(TINY)
    src, src_len, tgt = batch(TINY)
    full = np.asarray(forward(TINY, p, src, src_len, tgt))
    cache = start_decoding(TINY, p, src, src_len, 10)
    pos = np.broadcast_to(np.arange(4), (3, 4))
    _, cache = decode_step(TINY, p, tgt[:, :4], src_len, cache, pos)
    for rows in ([2, 0, 0, 1], [2, 0, 1], [0, 1, 2]):  # more rows; a permutation; the same rows
        rows = np.array(rows)
        taken = cache.take_rows(jnp.asarray(rows))
        assert taken.batch == len(rows) and taken.cross_v[1].shape[0] == len(rows)
        R = len(rows)
        logits, _ = decode_step(TINY, p, tgt[rows, 4:5], src_len[rows], taken, np.full((R, 1), 4))
        np.testing.assert_allclose(np.asarray(logits)[:, 0], full[rows, 4], atol=2e-5, rtol=1e-5)
    # rows that stay with their source (beams) keep the cross keys/values as they are
    beams, _ = seq2seq.start_decoding(TINY, p, src, src_len, beams=2, max_len=10)
    np.testing.assert_array_equal(beams.source_R, [0, 0, 1, 1, 2, 2])
    swapped = beams.take_rows(jnp.array([1, 0, 3, 3, 4, 5]))
    np.testing.assert_array_equal(swapped.source_R, beams.source_R)
    np.testing.assert_array_equal(swapped.cross_k[0], beams.cross_k[0])


def uncached_logprobs(c, p, src, src_len, tgt_in):
    return np.asarray(jax.nn.log_softmax(forward(c, p, src, src_len, tgt_in), -1))


def test_generate_greedy_equals_uncached_greedy_and_beam_one():
    c = dataclasses.replace(TINY, block_size=12)
    p = params_for(c, 3)  # random but far from uniform logits
    src, src_len, _ = batch(c, B=4, S=8)
    src_len = np.minimum(src_len, 8)
    N = 10
    greedy = np.asarray(generate(p, src, src_len, config=c, beam_size=1, max_len=N, eos_id=2))
    # the reference re-runs the whole uncached model per token (causal: later slots are unseen)
    tgt = np.zeros((4, N), np.int32)
    tgt[:, 0] = 1
    for t in range(N - 1):
        tgt[:, t + 1] = uncached_logprobs(c, p, src, src_len, tgt)[:, t].argmax(-1)
    last = uncached_logprobs(c, p, src, src_len, tgt)[:, N - 1].argmax(-1)
    want = np.concatenate([tgt[:, 1:], last[:, None]], 1)
    for row, ref in zip(greedy, want):  # equal up to the first EOS, pad after
        n = list(ref).index(2) + 1 if 2 in ref else len(ref)
        np.testing.assert_array_equal(row[:n], ref[:n])
        assert np.all(row[n:] == 0)

    step = lambda t, pos, cache: decode_step(c, p, t, src_len, cache, pos)
    seqs, _ = jax.jit(
        lambda cache: beam_search(
            step, cache, batch_size=4, beam_size=1, max_len=N, bos_id=1, eos_id=2, alpha=0.0
        )
    )(start_decoding(c, p, src, src_len, N))
    np.testing.assert_array_equal(np.asarray(seqs[:, 0]), greedy)
    for bad in (0, -2):  # (-2 sized the cache's buffers first: a JAX TypeError)
        with pytest.raises(ValueError, match=f"beam_size {bad} must be >= 1 \\(1: greedy decoding\\)"):
            generate(p, src, src_len, config=c, beam_size=bad, max_len=N, eos_id=2)


def test_beam_scores_are_the_model_log_probs():
    """Beam search through the real cache: each returned hypothesis's score equals its log-prob
    under a fresh uncached forward pass, length-normalized (a wrong cache reorder breaks this)."""
    c = dataclasses.replace(TINY, block_size=12)
    p = params_for(c, 4)
    src, src_len, _ = batch(c, B=2, S=8, seed=5)
    src_len = np.minimum(src_len, 8)
    W, N, alpha = 3, 6, 0.6

    @jax.jit
    def search(p, src, src_len):  # the model's own adapter: start_decoding + step_fn
        cache, lengths_R = seq2seq.start_decoding(c, p, src, src_len, beams=W, max_len=N)
        step = seq2seq.step_fn(c, p, lengths_R)
        return beam_search(step, cache, batch_size=2, beam_size=W, max_len=N, bos_id=1, eos_id=2, alpha=alpha)

    seqs, scores = search(p, src, src_len)
    seqs = np.asarray(seqs).reshape(2 * W, N)
    tgt_in = np.concatenate([np.ones((2 * W, 1), np.int32), seqs[:, :-1]], 1)
    logp = uncached_logprobs(c, p, np.repeat(src, W, 0), np.repeat(src_len, W), tgt_in)
    for r, row in enumerate(seqs):
        n = list(row).index(2) + 1 if 2 in row else N
        total = logp[r, np.arange(n), row[:n]].sum()
        want = total / float(length_penalty(n, alpha))
        np.testing.assert_allclose(float(np.asarray(scores).reshape(-1)[r]), want, rtol=1e-4)


def test_presets_have_the_paper_sizes():
    def expected(d, f, vocab):  # independent count: weights + biases + LayerNorms
        attn = 4 * d * d + 4 * d
        enc = attn + 2 * d * f + f + d + 2 * 2 * d
        dec = 2 * attn + 2 * d * f + f + d + 3 * 2 * d
        return vocab * d + 6 * enc + 6 * dec + 2 * 2 * d

    base = TransformerConfig.base(vocab_size=37000)
    big = TransformerConfig.big(vocab_size=37000)
    assert (base.n_embd, base.d_ff, base.n_head, base.dropout) == (512, 2048, 8, 0.1)
    assert (big.n_embd, big.d_ff, big.n_head, big.dropout) == (1024, 4096, 16, 0.3)
    n_base, n_big = count_params(abstract_params(base)), count_params(abstract_params(big))
    assert n_base == expected(512, 2048, 37000)
    assert n_big == expected(1024, 4096, 37000)
    assert 60e6 < n_base < 66e6 and 205e6 < n_big < 215e6  # the paper: 65M and 213M


def test_bad_configs_and_inputs_are_one_line_errors():
    with pytest.raises(ValueError, match="not divisible by n_head"):
        TransformerConfig(n_embd=100, n_head=8)
    with pytest.raises(ValueError, match="unknown preset"):
        TransformerConfig.preset("huge")
    with pytest.raises(ValueError, match="unknown TransformerConfig fields"):
        TransformerConfig.from_dict({"d_modle": 4})
    with pytest.raises(ValueError, match="activation"):
        TransformerConfig(activation="swish")
    p = params_for(TINY)
    src = np.zeros((1, TINY.block_size + 1), np.int32)
    with pytest.raises(ValueError, match="longer than the model's block_size"):
        Transformer(TINY).apply({"params": p}, src, np.array([3]), src[:, :4])
    assert TransformerConfig.from_dict(TINY.to_dict()) == TINY


def test_dropout_is_active_only_in_training():
    c = dataclasses.replace(TINY, dropout=0.3)
    p = params_for(TINY)  # dropout adds no parameters
    src, src_len, tgt = batch(c)
    train = jax.jit(
        lambda k: Transformer(c, deterministic=False).apply(
            {"params": p}, src, src_len, tgt, rngs={"dropout": k}
        )
    )
    a, b = train(jax.random.key(1)), train(jax.random.key(2))
    assert np.abs(np.asarray(a - b)).max() > 1e-3
    np.testing.assert_allclose(
        np.asarray(forward(c, p, src, src_len, tgt)),
        np.asarray(forward(TINY, p, src, src_len, tgt)),
        atol=1e-6,
    )
