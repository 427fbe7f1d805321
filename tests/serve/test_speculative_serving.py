"""Speculative decoding in the server (serve.py --speculative_ngram): prompt-lookup drafts checked in
the engine's step for many rows at once; greedy replies equal the server's without drafting, sampled
rows never draft, and /metrics counts what was drafted and kept."""

import jax
import numpy as np

from flaxgpt.data.tokenizers import CharTokenizer
from flaxgpt.decode.sampling import Rows, Sampling
from flaxgpt.models.gpt import GPTConfig, init_params
from flaxgpt.models.gpt import step_fn as gpt_step_fn
from flaxgpt.serve import ngram
from flaxgpt.serve.engine import Engine
from flaxgpt.serve.metrics import ServeMetrics
from flaxgpt.serve.scheduler import Finish, Scheduler, Sequence
from tests.serve.test_paged import BLOCKS, CFG, CHARS, PAGE, SLOTS, W, params, step  # noqa: F401


def test_propose_is_the_latest_continuation_of_the_longest_suffix():
    assert ngram.propose([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]
    assert ngram.propose([7, 2, 3, 9, 8, 2, 3, 6, 1, 2, 3], 2) == [6, 1]  # the latest of two matches
    assert ngram.propose([4, 5, 6], 2) == []  # nothing repeats
    assert ngram.propose([5, 1, 2, 9, 9, 2], 2, max_n=3) == [9, 9]  # a 1-token suffix when longer fail
    assert ngram.propose([5, 5, 5, 5], 3) == [5, 5, 5]  # a loop drafted past the end, periodically
    assert ngram.propose([1, 2, 1, 2, 1], 4) == [2, 1, 2, 1]


def serve_all(step, prompts, rows, speculate, draft=None):  # noqa: F811
    engine = Engine(step, CFG, slots=SLOTS, chunk=3, prefill_chunk=16, page=PAGE, prefix_blocks=BLOCKS,
                    speculate=speculate, draft=draft)  # fmt: skip
    sched = Scheduler(engine, CharTokenizer(CHARS))
    sched.metrics = ServeMetrics()
    sched.metrics.watch(sched)
    sched.start()
    assert sched.ready.wait(300)
    out = [[] for _ in prompts]
    seqs = []
    for i, (p, r) in enumerate(zip(prompts, rows)):
        seqs.append(Sequence(p, r, emit=lambda ev, i=i: out[i].append(ev)))
    sched.submit(*seqs)
    assert sched.drain(timeout=300)
    sched.close()
    assert all(isinstance(ev[-1], Finish) for ev in out)
    return [s.ids for s in seqs], sched.metrics


def test_greedy_replies_equal_the_server_without_drafting(step):  # noqa: F811
    """Repetitive prompts (drafts that hit) and plain ones, greedy and sampled, in one batch."""
    rng = np.random.default_rng(0)
    motif = list(rng.integers(0, CFG.vocab_size, 5))
    prompts = [motif * 3, list(rng.integers(0, CFG.vocab_size, 9)), motif * 2 + [1], [2, 3, 2, 3, 2, 3]]
    rows = [
        Rows.of(Sampling(temperature=0), max_new_tokens=16),
        Rows.of(Sampling(temperature=0), max_new_tokens=17),
        Rows.of(Sampling(temperature=0.9), max_new_tokens=20, seed=4),  # never drafts
        Rows.of(Sampling(temperature=0), max_new_tokens=3),  # fewer new tokens than a draft
    ]
    plain, _ = serve_all(step, prompts, rows, speculate=0)
    fast, metrics = serve_all(step, prompts, rows, speculate=4)
    assert fast == plain
    # a draft model: the served model itself (every draft kept) and a smaller random one (few kept)
    same, same_metrics = serve_all(step, prompts, rows, speculate=3, draft=(step, CFG))
    small = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=W, vocab_size=CFG.vocab_size)
    other, _ = serve_all(
        step,
        prompts,
        rows,
        speculate=3,
        draft=(gpt_step_fn(small, init_params(small, jax.random.key(9))), small),
    )
    assert same == plain and other == plain
    assert same_metrics._spec[2] / same_metrics._spec[1] > 0.9
    assert metrics._spec[1] > 0 and metrics._spec[2] > 0  # drafts were checked and some kept
    assert [len(t) for t in fast] == [16, 17, 20, 3]
    body = metrics.exposition()[0].decode()
    assert "flaxgpt_spec_acceptance_rate" in body and "flaxgpt_spec_tokens_per_step" in body


def test_logit_bias_rows_take_plain_steps(step):  # noqa: F811
    """Drafts are checked against the raw logits' top token: a row with logit_bias drafted past its
    bias (a banned token emitted). A model whose raw top token is X, then Y; X banned."""
    X, Y = 5, 7

    def biased(weights, tokens, positions, cache, **kw):
        logits, cache = step.func(weights, tokens, positions, cache, **kw)
        return logits.at[..., X].add(50.0).at[..., Y].add(25.0), cache

    peaked = jax.tree_util.Partial(biased, *step.args)
    prompts = [[Y, X, X, X, Y, X, X, X]]  # the prompt's n-grams draft X after X
    rows = [Rows.of(Sampling(temperature=0, logit_bias=((X, -100.0),)), max_new_tokens=8)]
    plain, _ = serve_all(peaked, prompts, rows, speculate=0)
    fast, _ = serve_all(peaked, prompts, rows, speculate=4)
    assert plain == [[Y] * 8] and fast == plain


def test_a_stop_string_ends_the_reply_at_its_token_whatever_a_step_made(step):  # noqa: F811
    """A step makes several tokens (accepted drafts, a chunk): the reply's tokens, count and logprobs end
    at the token that completes the stop string, as one token a step would end them."""
    tok = CharTokenizer(CHARS)

    def run(speculate, chunk, stop):
        engine = Engine(step, CFG, slots=SLOTS, chunk=chunk, prefill_chunk=16, page=PAGE,
                        prefix_blocks=BLOCKS, speculate=speculate)  # fmt: skip
        sched = Scheduler(engine, tok)
        sched.start()
        assert sched.ready.wait(300)
        events = []
        rows = Rows.of(Sampling(temperature=0), max_new_tokens=14)
        seq = Sequence(tok.encode("abab abab abab ab"), rows, stop=stop, emit=events.append)
        sched.submit(seq)
        assert sched.drain(timeout=300)
        sched.close()
        text = "".join(e.text for e in events if hasattr(e, "text"))
        return text, seq.ids, events[-1]

    whole, ids, _ = run(0, 1, [])
    stop = whole[4:7]
    first = whole.find(stop)
    want = len(tok.encode(whole[: first + len(stop)]))  # one character a token
    for speculate, chunk in ((0, 1), (0, 3), (4, 3)):
        text, got, finish = run(speculate, chunk, [stop])
        assert text == whole[:first] and finish.reason == "stop"
        assert len(got) == finish.completion_tokens == want, (speculate, chunk, len(got), want)
