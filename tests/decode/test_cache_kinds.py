"""Every decoder over every cache kind (models.cache: contiguous, ring, paged) gives the same tokens.

A tiny GPT with grouped-query heads whose layer 0 has a sliding window of 8 (a ring when the cache is
longer) and layer 1 is global; generation runs past the window length W of the cache, so `generate`
re-prefills (slides) and the speculative decoder takes back rejected positions.
"""

import functools

import jax
import numpy as np
import pytest

from flaxgpt.decode.beam_search import beam_search
from flaxgpt.decode.sampling import generate
from flaxgpt.decode.speculative import speculative_generate
from flaxgpt.models.cache import Cache, KVCache
from flaxgpt.models.gpt import GPTConfig, init_params, step_fn
from flaxgpt.models.paged import PagedKVCache

WINDOWS = dict(sliding_window=8, window_pattern=2)  # layer 0 a window of 8, layer 1 global
CFG = GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=64, vocab_size=48, **WINDOWS)
KINDS = ("contiguous", "ring", "paged")
K_DRAFT = 3  # speculative draft tokens: rings keep that many positions more
SAMPLED = dict(temperature=0.9, top_k=12, top_p=0.9)


def make_cache(kind: str, batch: int, W: int) -> Cache:
    if kind == "contiguous":
        return KVCache.for_config(CFG, batch, W, ring=False)
    if kind == "ring":
        cache = KVCache.for_config(CFG, batch, W, rewind=K_DRAFT)
        assert cache.has_rings and cache.k[0].shape[1] == 8 + K_DRAFT < W
        return cache
    return PagedKVCache.for_slots(CFG, batch, W, page=4)


def model_steps():
    """(target, draft): two random GPTs of the same shape (peaked logits: no near ties)."""
    scale = lambda p: jax.tree.map(lambda x: x * 3, p)  # noqa: E731
    return tuple(step_fn(CFG, scale(init_params(CFG, jax.random.key(i)))) for i in (0, 1))


@pytest.fixture(scope="module")
def steps():
    return model_steps()


PROMPTS = np.array([[5, 9, 2, 7, 1, 30, 11, 0, 0, 0, 0], [3, 3, 8, 40, 6, 21, 13, 17, 2, 9, 44]], np.int32)
LENGTHS = np.array([7, 11], np.int32)


@pytest.mark.parametrize("settings", [dict(temperature=0.0), SAMPLED], ids=["greedy", "sampled"])
def test_generate_gives_the_same_tokens_over_every_kind(steps, settings):
    """Rows of different lengths run past the 16-position window: each slides (re-prefills) while the
    other feeds past its cache, which no kind may write."""
    out = {}
    for kind in KINDS:
        toks, n = generate(
            steps[0], make_cache(kind, 2, 16), PROMPTS, LENGTHS, max_new_tokens=20, rng=jax.random.key(4),
            keep=6, chunk=8, **settings,
        )  # fmt: skip
        out[kind] = (toks.tolist(), n.tolist())
    assert out["contiguous"][1] == [20, 20]
    assert out["ring"] == out["contiguous"] and out["paged"] == out["contiguous"]


def test_beam_search_gives_the_same_beams_over_every_kind(steps):
    """Two sources x 3 beams: the cache's rows follow the beams (take_rows) in every kind."""
    search = jax.jit(
        functools.partial(beam_search, batch_size=2, beam_size=3, max_len=14, bos_id=1, eos_id=7, alpha=0.6)
    )
    seqs, scores = zip(*(search(steps[0], make_cache(kind, 6, 16)) for kind in KINDS), strict=True)
    for kind_seqs, kind_scores in zip(seqs[1:], scores[1:], strict=True):
        np.testing.assert_array_equal(kind_seqs, seqs[0])
        np.testing.assert_allclose(kind_scores, scores[0], rtol=1e-4)
    assert len({str(beam) for beam in np.asarray(seqs[0])[0].tolist()}) == 3  # three different beams


@pytest.mark.parametrize("settings", [dict(temperature=0.0), SAMPLED], ids=["greedy", "sampled"])
def test_speculative_decoding_gives_the_same_tokens_over_every_kind(steps, settings):
    target, draft = steps
    out = {}
    for kind in KINDS:
        toks, n, stats = speculative_generate(
            target, make_cache(kind, 2, 40), draft, make_cache(kind, 2, 40), PROMPTS, LENGTHS,
            max_new_tokens=20, rng=jax.random.key(5), draft_tokens=K_DRAFT, **settings,
        )  # fmt: skip
        out[kind] = (toks.tolist(), n.tolist(), stats)
    assert out["contiguous"][2].drafted > out["contiguous"][2].accepted  # rejections: positions taken back
    assert out["ring"] == out["contiguous"] and out["paged"] == out["contiguous"]
    if settings["temperature"] == 0:  # greedy speculative decoding is greedy decoding
        toks, n = generate(target, make_cache("contiguous", 2, 40), PROMPTS, LENGTHS, max_new_tokens=20,
                           rng=jax.random.key(0), temperature=0.0)  # fmt: skip
        assert out["contiguous"][:2] == (toks.tolist(), n.tolist())
