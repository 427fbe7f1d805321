"""Per-row sampling controls in the engine's one decode step: penalties, min_p, logit_bias, structured-output
masks and logprobs, each checked against a float64 reference of its definition (vLLM's), several
different settings in one batch."""

import jax
import numpy as np
import pytest

from flaxgpt.decode.sampler import MAX_LOGPROBS, select_rows
from flaxgpt.decode.sampling import Rows, Sampling
from flaxgpt.models.cache import KVCache
from flaxgpt.models.gpt import GPTConfig, init_params
from flaxgpt.models.gpt import step_fn as gpt_step_fn
from flaxgpt.serve.engine import Engine

W = 64
CFG = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=W, vocab_size=40)


@pytest.fixture(scope="module")
def step():
    return gpt_step_fn(CFG, init_params(CFG, jax.random.key(1)))


@pytest.fixture(scope="module")
def engine(step):
    return Engine(step, CFG, slots=3, chunk=3, max_k=8)


@jax.jit
def _window_logits(step, tokens_1W):
    logits, _ = step(tokens_1W, np.arange(W, dtype=np.int32)[None], KVCache.for_config(CFG, 1, W))
    return logits[0]


def logits_after(step, tokens) -> np.ndarray:
    """float64 logits of the next token after `tokens`: the model over the whole sequence at once (padded
    to the window, one compiled shape: causal attention keeps the padding out of position n - 1)."""
    t = np.zeros((1, W), np.int32)
    t[0, : len(tokens)] = tokens
    return np.asarray(_window_logits(step, t)[len(tokens) - 1], np.float64)


def vllm_adjusted(logits, s: Sampling, prompt, out) -> np.ndarray:
    """vLLM's logits processing, written from its definitions: bias, repetition (prompt + output),
    frequency and presence (output)."""
    x = logits.copy()
    for t, b in s.logit_bias:
        x[t] += b
    seen = set(prompt) | set(out)
    for t in seen:
        x[t] = x[t] / s.repetition_penalty if x[t] > 0 else x[t] * s.repetition_penalty
    counts = np.bincount(np.asarray(out, np.int64), minlength=len(x)) if out else np.zeros(len(x))
    return x - s.frequency_penalty * counts - s.presence_penalty * (counts > 0)


def run(engine, requests, steps=None, masks=None):
    """requests: [(prompt, rows)] all at once into slots 0..; -> (tokens, logprobs entries) per request."""
    out, lps, owner = [[] for _ in requests], [[] for _ in requests], {}
    for i, (prompt, rows) in enumerate(requests):
        mask = None if masks is None else masks[i]
        prefix = engine.prefill(prompt, rows, mask=mask)
        out[i].append(int(prefix.first))
        lps[i].append(tuple(np.asarray(x) for x in prefix.logprobs))
        if not bool(prefix.done):
            engine.insert(prefix, i)
            owner[i] = i
    while owner:
        mask_BW = None
        if masks is not None:
            mask_BW = np.stack([masks[owner.get(b, 0)] for b in range(engine.slots)])
        tokens_BC, new_B, done_B = engine.generate(1 if masks is not None else steps, mask_BW=mask_BW)
        lp = engine.logprobs
        for s, i in list(owner.items()):
            for c in range(new_B[s]):
                out[i].append(int(tokens_BC[s, c]))
                lps[i].append((lp.chosen[s, c], lp.top_ids[s, c], lp.top[s, c]))
            if done_B[s]:
                del owner[s]
    return out, lps


PENALTIES = [
    Sampling(temperature=0, repetition_penalty=1.8),
    Sampling(temperature=0, frequency_penalty=1.5, presence_penalty=0.5),
    Sampling(temperature=0, presence_penalty=-1.0, logit_bias=((3, 2.5), (11, -5.0))),
]


def test_penalties_and_bias_follow_vllm_definitions_per_row(step, engine):
    """Three rows of one batch, each with other penalties: greedy tokens equal a float64 loop over the
    model's logits with vLLM's processing; a row without penalties is plain greedy."""
    prompts = [[5, 6, 7, 5, 6, 7, 5], [1, 2, 3, 1, 2], [9, 9, 9, 4]]
    reqs = [(p, Rows.of(s, max_new_tokens=12)) for p, s in zip(prompts, PENALTIES)]
    got, _ = run(engine, reqs)
    for (prompt, _), s, tokens in zip(reqs, PENALTIES, got):
        want = []
        for _ in range(12):
            want.append(int(np.argmax(vllm_adjusted(logits_after(step, prompt + want), s, prompt, want))))
        assert tokens == want, (s, tokens, want)
    plain, _ = run(engine, [(prompts[0], Rows.of(Sampling(temperature=0), max_new_tokens=12))])
    assert plain[0] != got[0]  # the penalties changed something: the test can fail


def test_logit_bias_forces_and_bans():
    prompt = [4, 2, 8]
    step = gpt_step_fn(CFG, init_params(CFG, jax.random.key(1)))
    engine = Engine(step, CFG, slots=2, chunk=3, max_k=8)
    forced = Rows.of(Sampling(temperature=0.9, logit_bias=((17, 100.0),)), max_new_tokens=6, seed=3)
    greedy, _ = run(engine, [(prompt, Rows.of(Sampling(temperature=0), max_new_tokens=6))])
    top = greedy[0][0]
    banned = Rows.of(Sampling(temperature=0, logit_bias=((top, -100.0),)), max_new_tokens=6)
    got, _ = run(engine, [(prompt, forced), (prompt, banned)])
    assert got[0] == [17] * 6
    assert top not in got[1]


def test_min_p_keeps_tokens_near_the_top():
    """min_p: a token survives when p >= min_p * p_max (after temperature); draws stay in that set and
    reach all of it."""
    rng = np.random.default_rng(0)
    logits_V = rng.normal(size=30).astype(np.float32) * 2
    B = 4000
    keys = jax.random.split(jax.random.key(0), B)
    full = lambda x, dtype: np.full(B, x, dtype)  # noqa: E731
    tok = jax.jit(select_rows, static_argnames="max_k")(
        keys, np.broadcast_to(logits_V, (B, 30)), full(1.5, np.float32), full(0, np.int32),
        full(1.0, np.float32), min_p_B=full(0.2, np.float32), max_k=8,
    )  # fmt: skip
    p = np.exp(logits_V / 1.5 - np.max(logits_V / 1.5))
    kept = set(np.flatnonzero(p >= 0.2 * p.max()).tolist())
    assert set(np.asarray(tok).tolist()) == kept and 2 < len(kept) < 30


def test_mask_constrains_every_token_of_its_row_only(engine):
    """A bitmask row allowing tokens {3, 5, 30} (bit j of word i = token 32 i + j): every token of that row,
    the first (prefill) one included, is one of them; an all-ones row is unconstrained."""
    words = engine.mask_words
    allowed = np.zeros(words, np.int32)
    for t in (3, 5, 30):
        allowed[t // 32] |= np.int32(1 << (t % 32)) if t % 32 < 31 else np.int32(-(2**31))
    anything = np.full(words, -1, np.int32)
    rows = Rows.of(Sampling(temperature=1.0), max_new_tokens=10, seed=5)
    got, _ = run(engine, [([1, 2, 3], rows), ([1, 2, 3], rows)], masks=[allowed, anything])
    assert set(got[0]) <= {3, 5, 30} and len(got[0]) == 10
    assert not set(got[1]) <= {3, 5, 30}


def test_logprobs_are_the_models_log_softmax(step, engine):
    """Each token's logprob and top alternatives: float32 log-softmax of the raw logits (before temperature
    and penalties), within 1e-5 of float64; rows that did not ask get nothing computed for them."""
    prompt = [7, 1, 8, 2]
    s = Sampling(temperature=0.7, repetition_penalty=1.3)
    got, lps = run(engine, [(prompt, Rows.of(s, max_new_tokens=7, seed=2, logprobs=5))])
    for i, (chosen, top_ids, top) in enumerate(lps[0]):
        x = logits_after(step, prompt + got[0][:i])
        ref = x - np.logaddexp.reduce(x)
        order = np.argsort(-ref)[:MAX_LOGPROBS]
        assert abs(float(chosen) - ref[got[0][i]]) < 1e-5
        np.testing.assert_array_equal(np.asarray(top_ids)[:5], order[:5])
        np.testing.assert_allclose(np.asarray(top)[:5], ref[order[:5]], atol=1e-5)
    _, none = run(engine, [(prompt, Rows.of(s, max_new_tokens=4, seed=2))])
    assert all(float(c) == 0 for c, _, _ in none[0][1:])


def test_echo_prompt_logprobs(step, engine):
    """An echo prefill reports each prompt token's logprob given the tokens before it, in chunks."""
    prompt = [3, 14, 15, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6]
    rows = Rows.of(Sampling(temperature=0), max_new_tokens=1, logprobs=2)
    job = engine.start_prefill(prompt, rows, echo=True)
    while (prefix := engine.prefill_step(job, 8)) is None:
        pass
    engine.drop(prefix)
    chosen = np.concatenate([c.chosen for c in job.echoed])
    assert len(job.echoed) == 3 and chosen.shape == (len(prompt),)
    for i in range(1, len(prompt)):
        x = logits_after(step, prompt[:i])
        assert abs(chosen[i - 1] - (x[prompt[i]] - np.logaddexp.reduce(x))) < 1e-5


def test_an_echo_request_caches_nothing_and_gives_its_pages_back(step):
    """An echo prefill is salted apart (its positions report logprobs a cached one has not): its blocks
    were still cached, under a salt no request can match, evicting real prefixes; and a reply that
    ended by length kept its pages until a later request needed them."""
    from flaxgpt.data.tokenizers import CharTokenizer
    from flaxgpt.serve.scheduler import Scheduler
    from flaxgpt.serve.sequence import Sequence

    engine = Engine(step, CFG, slots=2, chunk=3, max_k=8)
    free, cached = engine.blocks.memory()["free_blocks"], len(engine.blocks.blocks)
    sched = Scheduler(engine, CharTokenizer([chr(65 + i) for i in range(CFG.vocab_size)]))
    sched.start()
    assert sched.ready.wait(300)
    events = []
    seq = Sequence(
        list(range(1, 36)), Rows.of(Sampling(temperature=0), max_new_tokens=4), echo=True, logprobs=1
    )
    seq.emit = events.append
    sched.submit(seq)
    assert sched.drain(timeout=300)
    sched.close()
    assert type(events[-1]).__name__ == "Finish" and events[-1].reason == "length"
    assert len(engine.blocks.blocks) == cached and engine.blocks.memory()["free_blocks"] == free
