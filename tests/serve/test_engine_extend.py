"""Engine.extend (serve/engine.py): prompt tokens appended to a decoding slot between turns (a tool's
answer in a GRPO episode) continue it exactly as generate continues the whole history prefilled
afresh, the history never re-prefilled, the other slots decoding on undisturbed; what it refuses."""

import jax
import numpy as np
import pytest

from flaxgpt.decode.sampling import Rows, Sampling
from flaxgpt.models import gpt
from flaxgpt.serve.engine import Engine
from tests.serve.references import greedy_rows

CFG = gpt.GPTConfig(vocab_size=32, block_size=64, n_layer=2, n_head=2, n_embd=32)
W = 64
GREEDY = Sampling(temperature=0.0)


@pytest.fixture(scope="module")
def params():
    # weights x 3: a random GPT's greedy tokens then depend on the whole history, not only the last token
    return jax.tree.map(lambda x: 3 * x, gpt.init_params(CFG, jax.random.key(3)))


def engine_for(params, **kw):
    return Engine(
        gpt.step_fn(CFG, params), CFG, slots=3, max_len=W, chunk=4, max_k=0, page=16, slot_windows=True, **kw
    )


def test_extend_continues_as_generate_over_the_whole_history(params):
    """Slot 0 decodes 4 tokens, keeps 3 (its reply cut after a stop marker: the 4th was decoded past
    it), takes 13 observation tokens (more than a prefill chunk of 8: two chunks) and decodes 6 more;
    slot 1 decodes throughout. Each equals greedy generate over its history; positions written past
    the cut are overwritten before anything reads them."""
    engine = engine_for(params, prefill_chunk=8)
    a, b = [1, 5, 9, 2, 7], [3, 4]
    for slot, prompt in [(0, a), (1, b)]:
        engine.insert(engine.prefill(prompt, Rows.of(GREEDY, max_new_tokens=30)), slot)
    firsts = {s: int(engine.state.last_B[s]) for s in (0, 1)}
    tokens_BC, new_B, _ = engine.generate()
    reply = [firsts[0], *tokens_BC[0, : new_B[0]].tolist()][:3]
    observation = [(7 * i + 3) % 32 for i in range(13)]
    history = a + reply + observation
    start = len(a) + len(reply) - 1  # the reply's last token is fed again, then the observation
    first = engine.extend(0, [reply[-1], *observation], start, Rows.of(GREEDY, max_new_tokens=6))
    got = [int(first)]
    slot1 = [firsts[1], *tokens_BC[1, : new_B[1]].tolist()]
    while True:
        tokens_BC, new_B, done_B = engine.generate()
        got += tokens_BC[0, : new_B[0]].tolist()
        slot1 += tokens_BC[1, : new_B[1]].tolist()
        if done_B[0] and done_B[1]:
            break
    assert got == greedy_rows(CFG, params, [history], W, 6)[0]
    assert slot1 == greedy_rows(CFG, params, [b], W, 30)[0]


def test_extend_refusals(params):
    engine = engine_for(params)
    engine.insert(engine.prefill([1, 2, 3], Rows.of(GREEDY, max_new_tokens=8)), 0)
    rows = Rows.of(GREEDY, max_new_tokens=40)
    with pytest.raises(ValueError, match="exceed the context window of 64"):
        engine.extend(0, list(range(30)), 3, rows)
    with pytest.raises(ValueError, match=">= 1 token"):
        engine.extend(0, [], 3, rows)
    paged = Engine(gpt.step_fn(CFG, params), CFG, slots=2, max_len=W, page=16)
    with pytest.raises(ValueError, match="slot_windows=True"):
        paged.extend(0, [1], 3, rows)
    assert np.asarray(engine.state.fill_B)[0] == 3  # nothing changed by a refusal
