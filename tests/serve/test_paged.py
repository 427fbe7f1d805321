"""The paged slots cache: decoding through block tables gives what the contiguous cache gives."""

import jax
import numpy as np

from flaxgpt.decode.sampling import Sampling
from flaxgpt.models.cache import KVCache
from flaxgpt.models.gpt import GPTConfig, init_params
from flaxgpt.models.gpt import step_fn as gpt_step_fn
from flaxgpt.models.paged import PagedKVCache, paged_impl
from flaxgpt.serve.engine import Engine, RowSampling

W = 32
CFG = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=W, vocab_size=40, n_kv_head=2)


def test_paged_engine_decodes_what_the_contiguous_engine_does():
    """Staggered requests (grouped-query heads, sampled and greedy) through pages of 8 and a prefix cache."""
    step = gpt_step_fn(CFG, init_params(CFG, jax.random.key(0)))
    make = lambda b: KVCache.for_config(CFG, b, W)  # noqa: E731
    paged = PagedKVCache.for_slots(CFG, 3, W, page=8, impl=paged_impl("cpu", CFG.head_dim))
    assert paged.impl == "xla" and paged.k[0].shape == (2, 12, 8, 8)
    assert (paged_impl("tpu", 64), paged_impl("tpu", 128), paged_impl("gpu", 64)) == (
        "xla",
        "pallas_tpu",
        "pallas_gpu",
    )
    rng = np.random.default_rng(0)
    reqs = []
    for i in range(5):
        prompt = rng.integers(0, CFG.vocab_size, int(rng.integers(2, 14))).tolist()
        s = Sampling(temperature=0.0 if i % 2 else 0.9, top_k=5)
        reqs.append((prompt, RowSampling.of(s, max_new_tokens=int(rng.integers(2, 12)), seed=i)))
    outs = []
    for slots_cache in (None, paged):
        engine = Engine(
            step, make, slots=3, chunk=2, max_k=8, prefill_chunk=16, slots_cache=slots_cache, prefix_blocks=8
        )
        out, owner, waiting = {i: [] for i in range(len(reqs))}, {}, list(range(len(reqs)))
        while waiting or owner:
            free = [s for s in range(3) if s not in owner]
            if waiting and free:
                i = waiting.pop(0)
                prefix = engine.prefill(*reqs[i])
                out[i].append(int(prefix.first))
                engine.insert(prefix, free[0])
                owner[free[0]] = i
            toks, new, done = engine.generate()
            for s, i in list(owner.items()):
                out[i] += toks[s, : new[s]].tolist()
                if done[s]:
                    assert engine.keep(s, reqs[i][0] + out[i][:-1]) >= 0  # paged: read back from pages
                    del owner[s]
        outs.append(out)
    assert outs[0] == outs[1]
