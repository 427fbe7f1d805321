"""The mixed step (serve/mixed.py): prompt tails and decode rows in one [slots, T] program give each
request the tokens of the two-program path and of generate alone; it compiles once per width."""

import jax
import numpy as np
import pytest

from flaxgpt.decode.sampling import Rows, Sampling
from flaxgpt.models.gpt import GPTConfig, init_params
from flaxgpt.models.gpt import step_fn as gpt_step_fn
from flaxgpt.serve.engine import Engine
from flaxgpt.serve.runner import programs
from tests.serve import references

W = 64
CFG = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=W, vocab_size=40)
SETTINGS = [(0, 0, 1), (0.8, 0, 1), (1.0, 5, 1), (1.0, 0, 0.9), (0.7, 20, 0.8), (0, 0, 1)]


@pytest.fixture(scope="module")
def step():
    return gpt_step_fn(CFG, init_params(CFG, jax.random.key(0)))


def new_engine(step, mixed=16, prefix_blocks=8):
    return Engine(step, CFG, slots=3, chunk=3, max_k=8, mixed=mixed, prefix_blocks=prefix_blocks)


def requests(seed=0, longest=40):
    rng = np.random.default_rng(seed)
    out = []
    for i, (t, k, p) in enumerate(SETTINGS):
        prompt = rng.integers(0, CFG.vocab_size, size=int(rng.integers(1, longest))).tolist()
        rows = Rows.of(
            Sampling(temperature=t, top_k=k, top_p=p), max_new_tokens=int(rng.integers(1, 20)), seed=i
        )
        out.append((prompt, rows))
    return out


def run(engine, reqs, mixed: bool, logprobs=False):
    """Requests into free slots as they free up. mixed: a prompt runs [1, P] chunks of 8 while its rest
    is over the widest width, then holds its slot and its rest runs in the next mixed step beside the
    decoding rows; else prefill + insert, then generate(steps=1). -> each request's tokens (and the
    logprob of each)."""
    out = {i: [] for i in range(len(reqs))}
    lps = {i: [] for i in range(len(reqs))}
    waiting, owner = list(range(len(reqs))), {}
    while waiting or owner:
        plan = {}
        for slot in [s for s in range(engine.slots) if s not in owner]:
            if not waiting:
                break
            i = waiting.pop(0)
            prompt, rows = reqs[i]
            if mixed:
                job = engine.start_prefill(prompt, rows)
                while job.left > engine.mixed_widths[-1]:
                    assert engine.prefill_step(job, 8) is None
                engine.hold(job, slot)
                plan[slot], owner[slot] = job.left, i
            else:
                prefix = engine.prefill(prompt, rows)
                out[i].append(int(prefix.first))
                lps[i].append(float(prefix.logprobs.chosen))
                if not bool(prefix.done):
                    engine.insert(prefix, slot)
                    owner[slot] = i
        if not owner:
            continue
        tokens_BC, new_B, done_B = engine.mixed(plan) if plan else engine.generate(steps=1)
        for s, i in list(owner.items()):
            out[i] += tokens_BC[s, : new_B[s]].tolist()
            lps[i] += engine.logprobs.chosen[s, : new_B[s]].tolist()
            if done_B[s]:
                del owner[s]
    got = [out[i] for i in range(len(reqs))]
    return (got, [lps[i] for i in range(len(reqs))]) if logprobs else got


def test_mixed_step_gives_the_two_program_paths_tokens_and_generates(step):
    """Greedy and sampled rows, tails of 1 to 16 tokens and longer prompts (chunks first), a cached
    prefix (the second round's prompts): the same tokens and logprobs as prefill + generate, and the
    tokens of generate alone with the request's seed."""
    reqs = requests()
    mixed_engine, plain_engine = new_engine(step), new_engine(step, mixed=0)
    for _ in range(2):  # round 2: every prompt's full blocks cached by round 1 (tails after a hit)
        got, lp = run(mixed_engine, reqs, mixed=True, logprobs=True)
        want, want_lp = run(plain_engine, reqs, mixed=False, logprobs=True)
        assert got == want
        np.testing.assert_allclose(np.concatenate(lp), np.concatenate(want_lp), atol=1e-5)
        for (prompt, rows), tokens in zip(reqs, got, strict=True):
            assert tokens == references.alone(step, CFG, W, prompt, rows)
        mixed_engine.blocks.check()
        long = next(p for p, _ in reqs if len(p) > 16)
        job = mixed_engine.start_prefill(long, reqs[0][1])
        mixed_engine.cancel(job)
        assert job.hit >= 16  # round 2 (and this check after round 1) runs tails after a prefix hit


def test_penalties_eos_and_release_in_the_mixed_step(step):
    """A repetition-penalized row reads its prompt's tokens as the prefill does; a first token that is
    EOS ends the request at once (its pages back); a held slot released before its step frees its pages."""
    prompt = [3, 3, 7, 1, 9, 3, 2]
    pen = Rows.of(Sampling(temperature=0, repetition_penalty=1.8), max_new_tokens=10)
    want = run(new_engine(step, mixed=0), [(prompt, pen)], mixed=False)
    assert run(new_engine(step), [(prompt, pen)], mixed=True) == want
    first = want[0][0]
    ends = Rows.of(Sampling(temperature=0, repetition_penalty=1.8, eos_id=first), max_new_tokens=10)
    engine = new_engine(step, prefix_blocks=0)
    free = engine.blocks.memory()["free_blocks"]
    assert run(engine, [(prompt, ends)], mixed=True) == [[first]]
    assert engine.blocks.memory()["free_blocks"] == free and not engine.held
    job = engine.start_prefill(prompt, pen)
    engine.hold(job, 1)
    engine.release(1)  # a client gone before its prompt ran
    assert engine.blocks.memory()["free_blocks"] == free and not engine.held
    with pytest.raises(ValueError, match="a mixed step feeds 1 to 16"):
        held = engine.start_prefill(list(range(30)), pen)
        engine.hold(held, 0)
        engine.mixed({0: 17})
    with pytest.raises(ValueError, match="Engine\\(mixed=N\\)"):
        new_engine(step, mixed=0).hold(new_engine(step, mixed=0).start_prefill(prompt, pen), 0)


def test_mixed_step_compiles_once_per_width(step):
    """Widths 8 and 16 (mixed=16): each compiles on first use, later steps of any plan reuse it."""
    p = programs()
    engine = new_engine(step)
    assert engine.mixed_widths == (8, 16)
    assert engine.n_programs == new_engine(step, mixed=0).n_programs + 3
    run(engine, requests(1, longest=10), mixed=True)  # warm whatever this model's shapes need
    run(engine, requests(2, longest=40), mixed=True)
    before = p["mixed"]._cache_size(), p["hold"]._cache_size()
    run(engine, requests(3, longest=40), mixed=True)
    run(engine, requests(4, longest=12), mixed=True)
    assert (p["mixed"]._cache_size(), p["hold"]._cache_size()) == before
