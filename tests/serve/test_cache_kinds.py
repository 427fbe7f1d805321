"""The serving engine over every kind of slots cache (models.cache: contiguous, ring, paged) gives a
request the tokens `generate` gives it: one decode loop (decode.sampling.decode_chunk), the same keys."""

import jax
import numpy as np
import pytest

from flaxgpt.decode.sampling import Rows, Sampling, generate
from flaxgpt.serve.engine import Engine
from tests.decode.test_cache_kinds import CFG, KINDS, PROMPTS, SAMPLED, make_cache, model_steps


@pytest.fixture(scope="module")
def steps():
    return model_steps()


@pytest.mark.parametrize("kind", KINDS)
def test_the_engine_gives_one_request_what_generate_gives(steps, kind):
    """One request at a time into a 2-slot engine (its page pool, prefills written through a table),
    greedy and temperature / top-k / top-p with a seed: generate(rng=key(seed)) over each kind of cache
    (contiguous, rings, paged) gives the same tokens (one decode loop: the same keys, stop rules)."""
    W = 32
    engine = Engine(steps[0], CFG, slots=2, max_len=W, chunk=4, max_k=16, prefill_chunk=16, page=4)
    prompt = PROMPTS[1].tolist()
    for i, settings in enumerate([dict(temperature=0.0), SAMPLED, dict(temperature=1.3, top_p=0.7)]):
        rows = Rows.of(Sampling(**settings), max_new_tokens=14, seed=10 + i)
        prefix = engine.prefill(prompt, rows)
        got = [int(prefix.first)]
        engine.insert(prefix, i % 2)
        while True:
            toks, new, done = engine.generate()
            got += toks[i % 2, : new[i % 2]].tolist()
            assert (toks[i % 2, new[i % 2] :] == -1).all()  # the loop's padding past a row's tokens
            if done[i % 2]:
                break
        want, n = generate(
            steps[0], make_cache(kind, 1, W), np.array([prompt]), [len(prompt)], max_new_tokens=14,
            rng=jax.random.key(10 + i), **settings,
        )  # fmt: skip
        assert got == want[0, : n[0]].tolist() and len(got) == 14
