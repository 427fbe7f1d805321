"""Decoding with sliding-window layers' ring buffers (models/cache.py): a window layer's cache holds its
window only, and every decoder gives the tokens it gives over full-length buffers and transformers'.

Tiny random Gemma 2 (local / global layers alternating) and Gemma 3 (five local, one global) models
with a window of 8 and prompts three times as long: a prompt goes through the rings in one call, in
chunks, and the speculative decoder writes and takes back positions in them.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never touch the network, even by accident

import jax
import numpy as np
import pytest
import torch
import transformers

from flaxgpt.decode.beam_search import beam_search
from flaxgpt.decode.sampling import Rows, Sampling, generate
from flaxgpt.decode.speculative import speculative_generate
from flaxgpt.hf import pretrained as hf
from flaxgpt.models.cache import KVCache
from flaxgpt.models.gpt import init_params, step_fn
from flaxgpt.serve import launch
from flaxgpt.serve.engine import Engine
from tests.hf.test_families import TINY
from tests.hf.test_llama import torch_greedy
from tests.serve.test_engine import run

WINDOW, S = 8, 48  # the models' sliding window; the caches' length
FAMILIES = {
    # eager: transformers applies Gemma 2's softcap there only (5.17 defaulted it to sdpa, without it)
    "gemma2": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        dict(attn_logit_softcapping=5.0, attn_implementation="eager"),
    ),
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, {}),
}
PROMPTS = np.random.RandomState(1).randint(3, TINY["vocab_size"], (2, 24))  # 3 windows long


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(flaxgpt config, params, transformers model) of a tiny model with a window of 8."""
    config_cls, model_cls, extra = FAMILIES[request.param]
    torch.manual_seed(0)
    model = model_cls(config_cls(**TINY, sliding_window=WINDOW, query_pre_attn_scalar=20, **extra)).eval()
    with torch.no_grad():
        for p in model.parameters():  # peaked logits: no argmax ties in the greedy comparisons
            p.add_(0.15 * torch.randn_like(p))
    directory = str(tmp_path_factory.mktemp(request.param))
    model.save_pretrained(directory)
    config, params = hf.load_pretrained(directory)
    return config, params, model


def test_window_layers_keep_only_their_window(family):
    config, params, _ = family
    cache = KVCache.for_config(config, 2, S, rewind=3)
    windows = [config.layer_window(i) for i in range(config.n_layer)]
    assert 0 in windows and WINDOW in windows
    for w, k, v, pos in zip(windows, cache.k, cache.v, cache.pos):
        R = WINDOW + 3 if w else S  # a ring of window + rewind slots, or the full length
        assert k.shape == v.shape == (2 * config.kv_heads, R, config.head_dim)
        assert (pos is None) == (w == 0) and (pos is None or pos.shape == (2, R))
    assert (cache.max_len, cache.batch, cache.rewind) == (S, 2, 3)
    # one prefill of three windows comes back with the same shapes
    positions = np.broadcast_to(np.arange(24), (2, 24))
    _, out = jax.jit(step_fn(config, params))(PROMPTS, positions, cache)
    assert jax.tree_util.tree_map(np.shape, out) == jax.tree_util.tree_map(np.shape, cache)


def test_generate_past_the_window_equals_transformers(family):
    """Two prompts of 24 and 19 tokens in one right-padded batch, written in one call each."""
    config, params, model = family
    lengths = [24, 19]
    got, _ = generate(
        step_fn(config, params), KVCache.for_config(config, 2, S), PROMPTS, lengths, max_new_tokens=14,
        rng=jax.random.key(0), temperature=0.0, chunk=5,
    )  # fmt: skip
    for b, n in enumerate(lengths):
        assert got[b].tolist() == torch_greedy(model, PROMPTS[b, :n].tolist(), 14)


# Gemma 3's five local layers to one global: tests/decode/test_cache_kinds.py checks the same over
# alternating layers (Gemma 2's layout) with every cache kind
@pytest.mark.parametrize("family", ["gemma3_text"], indirect=True)
def test_sampling_and_sliding_past_the_cache_equal_full_length_buffers(family):
    """Sampling with temperature, and the sampler's re-prefill when a row outgrows the cache (24 +
    30 tokens in 32 positions), give over rings exactly the tokens full-length buffers give."""
    config, params, _ = family
    outs = []
    for ring in (True, False):
        out, _ = generate(
            step_fn(config, params), KVCache.for_config(config, 2, 32, ring=ring), PROMPTS, [24, 17],
            max_new_tokens=30, rng=jax.random.key(3), temperature=0.9, top_k=40, keep=12,
        )  # fmt: skip
        outs.append(out)
    np.testing.assert_array_equal(*outs)


def test_engine_whole_and_chunked_prefill_equal_transformers(family):
    """The engine's bucket-padded prefill (one call, and chunks of 10 with padding inside the window)
    and slot decoding over rings: transformers' greedy tokens for requests sharing the slots."""
    config, params, model = family
    prompts = [PROMPTS[0].tolist(), PROMPTS[1, :21].tolist(), PROMPTS[1, :5].tolist()]
    rows = Rows.of(Sampling(temperature=0), max_new_tokens=12)
    expect = [torch_greedy(model, p, 12) for p in prompts]
    for prefill_chunk in (None, 10):
        engine = Engine(
            step_fn(config, params), config, slots=2, chunk=3, max_len=S, prefill_chunk=prefill_chunk
        )
        assert run(engine, [(p, rows) for p in prompts]) == expect
    # the prefix cache over sliding-window layers: the pool keeps every position (the window is a mask),
    # so a second round maps the first's blocks in place and still decodes transformers' tokens
    sched = launch.scheduler_for(
        config, params, None, slots=2, max_len=S, prefix_cache_tokens=64, prefix_block=4
    )
    engine = sched.engine
    assert run(engine, [(p, rows) for p in prompts]) == expect
    job = engine.start_prefill(prompts[0], rows)
    engine.cancel(job)
    assert job.hit >= 20
    assert run(engine, [(p, rows) for p in prompts]) == expect


@pytest.mark.parametrize("family", ["gemma3_text"], indirect=True)  # alternating: test_cache_kinds
def test_speculative_decoding_takes_back_positions_in_the_rings(family):
    config, params, model = family
    # the draft: a model of the same shape with other weights, so that drafts are often rejected
    draft = jax.tree_util.tree_map(lambda x: 8 * x, init_params(config, jax.random.key(1)))
    prompt = PROMPTS[1:, :24]
    caches = lambda rewind: (KVCache.for_config(config, 1, S, rewind=rewind) for _ in range(2))  # noqa: E731
    target_cache, draft_cache = caches(3)
    got, _, stats = speculative_generate(
        step_fn(config, params), target_cache, step_fn(config, draft), draft_cache, prompt, [24],
        max_new_tokens=14, rng=jax.random.key(0), draft_tokens=3, temperature=0,
    )  # fmt: skip
    assert stats.accepted < stats.drafted  # some drafts were rejected: positions were taken back
    assert got[0].tolist() == torch_greedy(model, prompt[0].tolist(), 14)
    target_cache, draft_cache = caches(2)
    with pytest.raises(ValueError, match="take back 2 written positions.*make it with rewind=3"):
        speculative_generate(
            step_fn(config, params), target_cache, step_fn(config, draft), draft_cache, prompt, [24],
            max_new_tokens=4, rng=jax.random.key(0), draft_tokens=3,
        )  # fmt: skip


def test_beam_search_over_rings_equals_full_length_buffers(family):
    config, params, _ = family
    results = []
    for ring in (True, False):
        cache = KVCache.for_config(config, 2 * 3, 30, ring=ring)  # 2 sources x 3 beams, 30 > 3 windows
        search = jax.jit(
            lambda c: beam_search(
                step_fn(config, params), c, batch_size=2, beam_size=3, max_len=29, bos_id=1, eos_id=2
            )
        )
        results.append(jax.device_get(search(cache)))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-5)
