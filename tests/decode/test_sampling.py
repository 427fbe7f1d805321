"""flaxgpt.decode.sampling: cached decoding against full forward passes, a fake model, NumPy masks."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxgpt.decode.sampler import check_sampling_args, sample_logits, select_rows, top_k_mask, top_p_mask
from flaxgpt.decode.sampling import (
    cache_length,
    generate,
    stream_generate,
)
from flaxgpt.models.cache import KVCache
from flaxgpt.models.gpt import GPT, GPTConfig, init_params, stack_layers
from flaxgpt.models.gpt import step_fn as gpt_step_fn

CFG = GPTConfig(vocab_size=61, block_size=32, n_layer=2, n_head=2, n_embd=32)
V_FAKE = 23


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(0))


def pad(prompts):
    P = max(map(len, prompts))
    out = np.zeros((len(prompts), P), np.int32)
    for i, p in enumerate(prompts):
        out[i, : len(p)] = p
    return out, np.array([len(p) for p in prompts], np.int32)


def fake_next(context):
    """The fake model's rule: a position-weighted sum of the whole context, mod V_FAKE."""
    return int(sum((i + 1) * t for i, t in enumerate(context)) % V_FAKE)


def fake_step(tokens_BT, positions_BT, cache, logits_at=None):
    """A model with a KV cache whose greedy next token is fake_next(tokens at 0..pos)."""
    rows_B1 = jnp.arange(tokens_BT.shape[0])[:, None]
    k = cache.k[0].at[rows_B1, positions_BT, 0].set(tokens_BT.astype(cache.k[0].dtype))  # 1 head
    S = k.shape[1]
    weights_S = jnp.arange(1, S + 1, dtype=k.dtype)
    seen_BTS = jnp.arange(S)[None, None, :] <= positions_BT[:, :, None]
    total_BT = jnp.sum(jnp.where(seen_BTS, k[:, None, :, 0] * weights_S, 0.0), axis=-1)
    nxt_BT = jnp.mod(total_BT, V_FAKE)
    # logits peaked at the rule's token, spread over the rest so sampling has something to do
    logits_BTV = -jnp.abs(jnp.arange(V_FAKE) - nxt_BT[..., None])
    if logits_at is not None:
        logits_BTV = jnp.take_along_axis(logits_BTV, logits_at[:, None, None], axis=1)
    return logits_BTV, cache.replace(k=(k,))


def fake_cache(B, W):
    return KVCache.init(1, B, W, 1, 1)


def naive_greedy(next_fn, prompt, n, window, keep, eos=None):
    """Crop-and-recompute reference: when a row's context exceeds the window, keep the last `keep`."""
    seq, start, out = list(prompt), 0, []
    for _ in range(n):
        if len(seq) - start > window:
            start = len(seq) - keep
        tok = next_fn(seq[start:])
        seq.append(tok)
        out.append(tok)
        if tok == eos:
            break
    return out


def gpt_next(params):
    """Greedy next token from a full forward pass (no cache) over the context."""
    fwd = jax.jit(lambda t: GPT(CFG).apply({"params": params}, t))

    def next_token(ctx):  # right-padded to block_size (causal: padding never reaches ctx) -> one compile
        logits_1TV = fwd(jnp.array([ctx + [0] * (CFG.block_size - len(ctx))], jnp.int32))
        return int(jnp.argmax(logits_1TV[0, len(ctx) - 1]))

    return next_token


def test_cached_logits_equal_full_forward_every_step(params):
    prompts = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7]]
    prompt_BP, lengths = pad(prompts)
    B, P = prompt_BP.shape
    seqs = np.random.RandomState(0).randint(0, CFG.vocab_size, (B, 20))
    for b, p in enumerate(prompts):
        seqs[b, : len(p)] = p
    step = jax.jit(gpt_step_fn(CFG, params))
    cache = KVCache.for_config(CFG, B, 32)
    logits_BPV, cache = step(jnp.asarray(prompt_BP), jnp.broadcast_to(jnp.arange(P), (B, P)), cache)
    full_BTV = GPT(CFG).apply({"params": params}, jnp.asarray(seqs))
    for b in range(B):
        np.testing.assert_allclose(logits_BPV[b, : lengths[b]], full_BTV[b, : lengths[b]], atol=1e-5)
    pos_B = lengths.copy()
    for _ in range(20 - P):  # one token per row at its own position
        tok_B1 = jnp.asarray(seqs[np.arange(B), pos_B][:, None])
        logits_B1V, cache = step(tok_B1, jnp.asarray(pos_B[:, None]), cache)
        np.testing.assert_allclose(logits_B1V[:, 0], full_BTV[np.arange(B), pos_B], atol=1e-5)
        pos_B += 1


def test_scan_layers_with_a_cache_equal_unrolled(params):
    """Under scan_layers each layer's buffers are the scan's xs/ys: the same logits and cache as
    the unrolled model (prefill, then a decode step), called directly and through step_fn."""
    scan_cfg = dataclasses.replace(CFG, scan_layers=True)
    stacked = stack_layers(params, CFG.n_layer)
    prompt_BP = jnp.asarray(np.random.RandomState(1).randint(0, CFG.vocab_size, (2, 5)), jnp.int32)
    pos_BP = jnp.broadcast_to(jnp.arange(5), (2, 5))
    tok_B1, pos_B1 = prompt_BP[:, :1], jnp.array([[5], [3]])

    def run(cfg, p):
        model, cache = GPT(cfg), KVCache.for_config(CFG, 2, 16)
        a, cache = model.apply({"params": p}, prompt_BP, positions=pos_BP, cache=cache)
        b, cache = model.apply({"params": p}, tok_B1, positions=pos_B1, cache=cache)
        return a, b, cache

    want = run(CFG, params)
    chex.assert_trees_all_close(run(scan_cfg, stacked), want, atol=1e-5)
    step = gpt_step_fn(scan_cfg, stacked)
    a, cache = step(prompt_BP, pos_BP, KVCache.for_config(CFG, 2, 16))
    b, cache = step(tok_B1, pos_B1, cache)
    chex.assert_trees_all_close((a, b, cache), want, atol=1e-5)


def test_greedy_matches_naive_loop_and_batch_matches_alone(params):
    prompts = [[1, 2, 3, 4, 5], [7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11]]
    prompt_BP, lengths = pad(prompts)
    N, W = 12, 32  # fits the window: no re-prefill
    step = gpt_step_fn(CFG, params)
    toks, lens = generate(
        step,
        KVCache.for_config(CFG, 3, W),
        prompt_BP,
        lengths,
        max_new_tokens=N,
        rng=jax.random.key(0),
        temperature=0,
    )
    assert lens.tolist() == [N] * 3
    nxt = gpt_next(params)
    for b, p in enumerate(prompts):
        assert toks[b].tolist() == naive_greedy(nxt, p, N, W, W)
        alone, _ = generate(
            step,
            KVCache.for_config(CFG, 1, W),
            prompt_BP[b : b + 1],
            lengths[b : b + 1],
            max_new_tokens=N,
            rng=jax.random.key(0),
            temperature=0,
        )
        assert alone[0].tolist() == toks[b].tolist()


def test_past_block_size_matches_crop_reference_gpt(params):
    prompts = [[1, 2, 3, 4, 5], [7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13, 14, 15]]
    prompt_BP, lengths = pad(prompts)
    W, keep, N = CFG.block_size, 10, 45  # every row re-prefills at least once, at different steps
    toks, _ = generate(
        gpt_step_fn(CFG, params),
        KVCache.for_config(CFG, 3, W),
        prompt_BP,
        lengths,
        max_new_tokens=N,
        rng=jax.random.key(0),
        temperature=0,
        keep=keep,
        chunk=16,
    )
    nxt = gpt_next(params)
    for b, p in enumerate(prompts):
        assert toks[b].tolist() == naive_greedy(nxt, p, N, W, keep)


@pytest.mark.parametrize("keep", [1, 2, 5, 8])
def test_past_window_fake_model(keep):
    prompts = [[4, 1], [2, 2, 2, 2, 2, 2, 2], [5]]
    prompt_BP, lengths = pad(prompts)
    W, N = 8, 30
    toks, lens = generate(
        fake_step,
        fake_cache(3, W),
        prompt_BP,
        lengths,
        max_new_tokens=N,
        rng=jax.random.key(0),
        temperature=0,
        keep=keep,
        chunk=7,
    )
    assert lens.tolist() == [N] * 3
    for b, p in enumerate(prompts):
        assert toks[b].tolist() == naive_greedy(fake_next, p, N, W, keep)


def test_plain_loop_and_one_graph_loop_agree():
    """graphs=False compiles the token loop without GPU_LOOP_OPTIONS (CUDA graphs on NVIDIA GPUs):
    the same tokens, sampled and past the window, either way."""
    prompt_BP, lengths = pad([[4, 1], [2, 2, 2, 2, 2, 2, 2]])
    out = [
        generate(fake_step, fake_cache(2, 8), prompt_BP, lengths, max_new_tokens=20, rng=jax.random.key(3),
                 temperature=0.8, top_k=5, keep=3, chunk=6, graphs=graphs)
        for graphs in (True, False)
    ]  # fmt: skip
    assert out[0][1].tolist() == out[1][1].tolist() == [20, 20]
    assert out[0][0].tolist() == out[1][0].tolist()


def test_eos_stops_a_row():
    prompts = [[1, 2, 3], [5, 6], [1]]
    prompt_BP, lengths = pad(prompts)
    refs = [naive_greedy(fake_next, p, 20, 32, 16) for p in prompts]
    eos = refs[0][3]  # row 0 meets it at its 4th new token
    toks, lens = generate(
        fake_step,
        fake_cache(3, 32),
        prompt_BP,
        lengths,
        max_new_tokens=20,
        rng=jax.random.key(0),
        temperature=0,
        eos_id=eos,
        chunk=4,
    )
    for b, p in enumerate(prompts):
        ref = naive_greedy(fake_next, p, 20, 32, 16, eos=eos)
        assert lens[b] == len(ref) and toks[b, : lens[b]].tolist() == ref
        assert not toks[b, lens[b] :].any()
    assert lens[0] == 4


def test_same_seed_same_output_any_chunking():
    prompt_BP, lengths = pad([[1, 2, 3], [4]])
    kw = dict(max_new_tokens=25, temperature=1.0, top_k=10, top_p=0.9)

    def run(seed, chunk):
        return generate(
            fake_step, fake_cache(2, 16), prompt_BP, lengths, rng=jax.random.key(seed), chunk=chunk, **kw
        )[0]

    a = run(0, 64)
    np.testing.assert_array_equal(a, run(0, 64))
    np.testing.assert_array_equal(a, run(0, 3))  # the rng folds in the step, not the chunk
    assert not np.array_equal(a, run(1, 64))


def test_stream_yields_the_same_tokens():
    prompt_BP, lengths = pad([[1, 2, 3]])
    kw = dict(max_new_tokens=10, rng=jax.random.key(3), temperature=0.7)
    got = [
        t
        for out, n in stream_generate(fake_step, fake_cache(1, 16), prompt_BP, lengths, chunk=4, **kw)
        for t in out[0, : n[0]]
    ]
    toks, _ = generate(fake_step, fake_cache(1, 16), prompt_BP, lengths, **kw)
    assert got == toks[0].tolist()


# ---------------------------------------------------------------- selection against NumPy


def np_top_k(logits, k):
    kth = np.sort(logits, axis=-1)[:, -k][:, None]
    return np.where(logits >= kth, logits, -np.inf)


def np_top_p(logits, p):
    out = np.full_like(logits, -np.inf)
    for b, row in enumerate(logits.astype(np.float64)):
        order = np.argsort(-row)
        probs = np.exp(row[order] - row.max())
        probs /= probs.sum()
        mass = 0.0
        for i, idx in enumerate(order):
            if mass >= p:
                break
            out[b, idx] = row[idx]
            mass += probs[i]
    return out


@pytest.mark.parametrize("k", [1, 3, 17, 50])
def test_top_k_mask_matches_numpy(k):
    logits = np.random.RandomState(k).randn(4, 50).astype(np.float32)
    np.testing.assert_array_equal(top_k_mask(jnp.asarray(logits), k), np_top_k(logits, k))


@pytest.mark.parametrize("p", [0.05, 0.3, 0.9, 0.999, 1.0])
def test_top_p_mask_matches_numpy(p):
    logits = (2 * np.random.RandomState(1).randn(5, 40)).astype(np.float32)
    np.testing.assert_array_equal(top_p_mask(jnp.asarray(logits), p), np_top_p(logits, p))


def test_sample_logits_support_and_greedy():
    logits = jnp.asarray(np.random.RandomState(2).randn(3, 30).astype(np.float32))
    assert (sample_logits(None, logits, temperature=0) == jnp.argmax(logits, -1)).all()
    allowed = np.isfinite(np_top_p(np_top_k(np.asarray(logits) / 0.8, 5), 0.7))
    draws = jax.vmap(lambda r: sample_logits(r, logits, temperature=0.8, top_k=5, top_p=0.7))(
        jax.random.split(jax.random.key(0), 300)
    )  # [300, 3]
    for b in range(3):
        seen = set(np.asarray(draws[:, b]).tolist())
        assert seen == set(np.flatnonzero(allowed[b]).tolist())  # every allowed token, nothing else


@pytest.mark.parametrize(
    "temperature, top_k, top_p, max_k",
    [(1.0, 0, 1.0, 64), (0.7, 20, 1.0, 64), (0.5, 0, 0.9, 64), (1.0, 0, 0.95, 64)],
    ids=["over all V in blocks", "among the candidates", "nucleus among them", "nucleus past them"],
)
def test_select_rows_draws_each_kept_token_with_its_probability(temperature, top_k, top_p, max_k):
    """Each of select_rows' draws (among the K candidates; over all V in blocks of 256, V = 600 not a
    multiple; after sorting all V) gives each token its renormalised softmax probability over the
    kept tokens (numpy's top-k and nucleus): 6000 draws, each token's count within 5 standard errors."""
    N, V = 6000, 600
    x_V = (1.5 * np.random.RandomState(3).randn(V)).astype(np.float32)
    kept_1V = np_top_k(x_V[None] / temperature, top_k or V)  # the nucleus: 36 of 600 tokens, 324
    kept_V = (np_top_p(kept_1V, top_p) if top_p < 1 else kept_1V)[0]
    p_V = np.exp(kept_V - kept_V[np.isfinite(kept_V)].max())
    p_V /= p_V.sum()
    full = lambda v, dtype: np.full(N, v, dtype)  # noqa: E731
    tok_N = jax.jit(select_rows, static_argnames="max_k")(
        jax.vmap(jax.random.key)(np.arange(N, dtype=np.uint32)), np.tile(x_V, (N, 1)),
        full(temperature, np.float32), full(top_k, np.int32), full(top_p, np.float32), max_k=max_k,
    )  # fmt: skip
    count_V = np.bincount(np.asarray(tok_N), minlength=V)
    assert not count_V[p_V == 0].any()
    # 5 standard errors, and 3 draws of slack for the tail's tokens expected < 1 time
    np.testing.assert_array_less(np.abs(count_V - N * p_V), 5 * np.sqrt(N * p_V * (1 - p_V)) + 3)


def test_tests_taken_outside_the_token_loop_change_no_token():
    """sampler.RowTests (the conditionals' tests from the rows' settings alone, taken once a chunk) give
    take's tokens for every kind of row: greedy, top-k, top-p, min-p, top_k >= V (a filter pass run for
    no row), a logit_bias entry and one past V (a bias pass that adds nothing), all greedy, none biased."""
    from flaxgpt.decode.sampler import RowTests
    from flaxgpt.decode.sampling import DecodeState, Rows, Sampling, take

    V = 300
    logits_BV = jnp.asarray(2.0 * np.random.RandomState(0).randn(6, V), jnp.float32)
    biased = Sampling(1.0, logit_bias=((7, 30.0), (V + 1, 5.0)))
    settings = [
        Sampling(temperature=0.0), Sampling(0.8, top_k=20), Sampling(1.0, top_p=0.9),
        Sampling(0.7, min_p=0.1), Sampling(1.2, top_k=V + 5), biased,
    ]  # fmt: skip
    batches = [settings, settings[:1] * 2, [settings[4], Sampling(1.0)], [settings[5], settings[0]]]
    for batch in batches:
        rows = Rows.stack(
            [Rows.of(s, max_new_tokens=4, seed=3, stream=b) for b, s in enumerate(batch)]
        ).keyed()
        B = len(batch)
        state = DecodeState(
            cache=None, last_B=jnp.zeros(B, jnp.int32), fill_B=jnp.ones(B, jnp.int32),
            count_B=jnp.full(B, 2, jnp.int32), done_B=jnp.zeros(B, bool), rows=rows,
        )  # fmt: skip
        go = jax.jit(lambda st, x, tests: take(st, x, None, st.fill_B, None, 256, 0, False, tests)[1])
        want = go(state, logits_BV[:B], None)
        np.testing.assert_array_equal(go(state, logits_BV[:B], RowTests.of(rows)), want)
        for b, s in enumerate(batch):  # the passes ran where needed: the argmax, the bias's token
            assert s.temperature or want[b] == jnp.argmax(logits_BV[b])
            assert not s.logit_bias or want[b] == 7
    # max_k 0 (every row greedy: generate's and the engine's greedy programs): the bias's conditional
    # ends in the argmax; the same tokens as the general path's, biased or not, from bf16 logits too
    greedy_biased = Sampling(0.0, logit_bias=((7, 30.0), (V + 1, 5.0)))
    for batch in ([settings[0]] * 2, [greedy_biased, settings[0]]):
        rows = Rows.stack([Rows.of(s, max_new_tokens=4, stream=b) for b, s in enumerate(batch)]).keyed()
        B = len(batch)
        state = DecodeState(
            cache=None, last_B=jnp.zeros(B, jnp.int32), fill_B=jnp.ones(B, jnp.int32),
            count_B=jnp.full(B, 2, jnp.int32), done_B=jnp.zeros(B, bool), rows=rows,
        )  # fmt: skip
        for x in (logits_BV[:B], logits_BV[:B].astype(jnp.bfloat16)):
            want = take(state, x, None, state.fill_B, None, 256, 0, False)[1]
            for tests in (None, RowTests.of(rows)):
                np.testing.assert_array_equal(
                    take(state, x, None, state.fill_B, None, 0, 0, False, tests)[1], want
                )
            assert [int(t) for t in want] == [
                7 if s.logit_bias else int(jnp.argmax(x[b])) for b, s in enumerate(batch)
            ]


def test_bad_arguments():
    prompt_BP, lengths = pad([[1, 2]])
    with pytest.raises(ValueError, match="top_p"):
        generate(
            fake_step,
            fake_cache(1, 8),
            prompt_BP,
            lengths,
            max_new_tokens=2,
            rng=jax.random.key(0),
            top_p=1.5,
        )
    with pytest.raises(ValueError, match="temperature"):
        generate(
            fake_step,
            fake_cache(1, 8),
            prompt_BP,
            lengths,
            max_new_tokens=2,
            rng=jax.random.key(0),
            temperature=-1,
        )
    for bad in (float("nan"), float("inf")):  # accepted silently before: garbage samples
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            check_sampling_args(bad, 0, 1.0)
    with pytest.raises(ValueError, match="top_p"):
        check_sampling_args(1.0, 0, float("nan"))
    with pytest.raises(ValueError, match="lengths"):
        generate(fake_step, fake_cache(1, 8), prompt_BP, [0], max_new_tokens=2, rng=jax.random.key(0))
    assert cache_length(1024, 16, 256) == 320 and cache_length(1024, 16, 2000) == 1024


def test_sampling_needs_no_model_and_no_cache_type():
    """sampler.py, sampling.py and beam_search.py import no model module and no cache type (issue 13):
    nothing of flaxgpt's outside decode/."""
    import ast
    import pathlib

    import flaxgpt

    root = pathlib.Path(flaxgpt.__file__).parent
    for name in ("sampler.py", "sampling.py", "beam_search.py"):
        tree = ast.parse((root / "decode" / name).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        outside = {m for m in imported if (m or "").startswith("flaxgpt") and ".decode" not in m}
        assert not outside, (name, imported)


def test_kvcache_layout_and_take_rows():
    """One [B*H, S, K] buffer per layer (row b*H + h); take_rows moves whole sequences, all heads."""
    cache = KVCache.init(2, 3, 8, 4, 5)
    assert len(cache.k) == 2 and cache.k[0].shape == (12, 8, 5)
    assert (cache.batch, cache.max_len) == (3, 8)
    x = jnp.arange(12 * 8 * 5, dtype=jnp.float32).reshape(12, 8, 5)
    taken = cache.replace(k=(x, x + 1)).take_rows(jnp.array([2, 0]))
    assert taken.batch == 2
    np.testing.assert_array_equal(
        taken.k[1].reshape(2, 4, 8, 5), (x + 1).reshape(3, 4, 8, 5)[np.array([2, 0])]
    )
