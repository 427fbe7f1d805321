"""The paged engine: slots and the prefix cache share one page pool; cached prefixes are mapped into
block tables (never copied) and decoding gives what the contiguous engine gives."""

import threading

import httpx
import jax
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from flaxgpt.data.tokenizers import CharTokenizer
from flaxgpt.decode.sampling import Sampling
from flaxgpt.models.cache import KVCache
from flaxgpt.models.gpt import GPTConfig, init_params
from flaxgpt.models.gpt import step_fn as gpt_step_fn
from flaxgpt.models.paged import PagedKVCache, paged_impl
from flaxgpt.serve.engine import Engine, RowSampling
from flaxgpt.serve.pages import SCRATCH, OutOfPages
from flaxgpt.serve.prefix_cache import block_digests
from tests.serve import references

# every engine here (and the server's) has these shapes and settings: they share compiled programs
W, PAGE, SLOTS, BLOCKS = 32, 8, 3, 4
M = W // PAGE
CHARS = sorted(set("abcdefghijklmnopqrstuvwxyz ROMEO:\n.,!?;-'"))  # 40: the model's vocabulary
CFG = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=W, vocab_size=len(CHARS), n_kv_head=2)


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(0))


@pytest.fixture(scope="module")
def step(params):
    return gpt_step_fn(CFG, params)


def engines(step):
    """(contiguous, paged) engines of the same settings, prefix caches of BLOCKS blocks of PAGE."""
    make = lambda b: KVCache.for_config(CFG, b, W)  # noqa: E731
    kw = dict(slots=SLOTS, chunk=2, prefill_chunk=16, prefix_block=PAGE, prefix_blocks=BLOCKS)
    pool = PagedKVCache.for_slots(CFG, SLOTS, W, page=PAGE, extra_pages=1 + BLOCKS)
    return Engine(step, make, **kw), Engine(step, make, slots_cache=pool, **kw)


def test_paged_engine_decodes_what_the_contiguous_engine_does(step):
    """Staggered requests (grouped-query heads, sampled and greedy), half of them sharing a 16-token
    system prompt and some a finished request's reply: the paged engine maps those blocks in place
    and decodes the contiguous engine's tokens."""
    assert (paged_impl("tpu", 64), paged_impl("tpu", 128), paged_impl("gpu", 64)) == (
        "xla",
        "pallas_tpu",
        "pallas_gpu",
    )
    rng = np.random.default_rng(0)
    system = rng.integers(0, CFG.vocab_size, 16).tolist()
    reqs = []
    for i in range(7):
        tail = rng.integers(0, CFG.vocab_size, int(rng.integers(1, 8))).tolist()
        s = Sampling(temperature=0.0 if i % 2 else 0.9, top_k=5)
        reqs.append(
            (
                (system if i % 3 else []) + tail,
                RowSampling.of(s, max_new_tokens=int(rng.integers(2, 9)), seed=i),
            )
        )
    outs, most_shared = [], 0
    for engine in engines(step):
        out, owner, waiting = {i: [] for i in range(len(reqs))}, {}, list(range(len(reqs)))
        while waiting or owner:
            free = [s for s in range(SLOTS) if s not in owner]
            if waiting and free:
                i = waiting.pop(0)
                prefix = engine.prefill(*reqs[i])
                out[i].append(int(prefix.first))
                engine.insert(prefix, free[0])
                owner[free[0]] = i
            toks, new, done = engine.generate()
            if engine.pages is not None:
                most_shared = max(most_shared, engine.pages.shared)
            for s, i in list(owner.items()):
                out[i] += toks[s, : new[s]].tolist()
                if done[s]:
                    assert engine.keep(s, reqs[i][0] + out[i][:-1]) >= 0
                    del owner[s]
        outs.append(out)
    assert outs[0] == outs[1]
    pages = engine.pages  # every request over: only the prefix cache holds pages
    assert most_shared >= 2 and len(pages.free) == pages.pool - 1 - len(pages)
    assert (pages.rows == SCRATCH).all()


def test_a_shared_prefix_is_mapped_not_copied(step):
    """Two concurrent requests with one 16-token prefix: the second's block table holds the first's
    pages, the pool spends only the pages sharing predicts, those pages are never written again,
    and both decode what generate gives each alone; at their end the cache keeps their blocks in
    place and evicts unmapped ones (LRU) when full."""
    _, engine = engines(step)
    pages = engine.pages
    assert pages.pool == 1 + SLOTS * M + 4 and len(pages.free) == pages.pool - 1
    rng = np.random.default_rng(1)
    system = rng.integers(0, CFG.vocab_size, 16).tolist()
    a, b = system + [1, 2, 3], system + [4, 5, 6, 7, 8]
    rows = RowSampling.of(max_new_tokens=6)  # greedy
    prefix_a = engine.prefill(a, rows)  # positions up to 24: blocks 0-3; its 2 full prompt blocks cached
    engine.insert(prefix_a, 0)
    assert len(pages) == 2 and len(pages.free) == pages.pool - 1 - 4
    shared = pages.rows[0, :2].copy()
    before = [np.asarray(x[:, shared]) for x in (*engine.state.cache.k, *engine.state.cache.v)]
    job = engine.start_prefill(b, rows)
    assert job.hit == 16 and (job.pages[:2] == shared).all()  # mapped, not copied
    while (prefix_b := engine.prefill_step(job)) is None:
        pass
    engine.insert(prefix_b, 1)
    assert (pages.rows[1, :2] == shared).all() and pages.rows[1, 2] not in pages.rows[0]
    assert len(pages.free) == pages.pool - 1 - 4 - 2  # b's fresh pages: blocks 2 and 3 (positions 16..26)
    assert pages.shared == 2 and all(pages.refs[shared] == 3)  # two rows and the prefix cache
    out = {0: [int(prefix_a.first)], 1: [int(prefix_b.first)]}
    while len(out[0]) < 6 or len(out[1]) < 6:
        toks, new, _ = engine.generate()
        for s in out:
            out[s] += toks[s, : new[s]].tolist()
    assert out[0] == references.alone(step, CFG, W, a, rows) and out[1] == references.alone(
        step, CFG, W, b, rows
    )
    after = [np.asarray(x[:, shared]) for x in (*engine.state.cache.k, *engine.state.cache.v)]
    assert all((x == y).all() for x, y in zip(before, after, strict=True))  # shared pages never written
    kept_a = engine.keep(0, a + out[0][:-1])  # 24 positions: block 2 (a's tail + reply) is new
    kept_b = engine.keep(1, b + out[1][:-1])  # 26: b's own block 2; the cache is now full (4 blocks)
    assert (kept_a, kept_b) == (1, 1) and len(pages) == 4 and pages.shared == 0
    assert len(pages.free) == pages.pool - 1 - 4  # the rows' other pages came back
    short = RowSampling.of(max_new_tokens=2)
    assert engine.start_prefill(b + out[1][:-1] + [9], short).hit == 24  # the reply is reused
    engine.cancel(job := engine.start_prefill(a + out[0][:-1] + [9], short))
    assert job.hit == 24 and job.pages is None and pages.refs[shared[0]] == 2  # cache + the job above
    # c's two full blocks: a's block 2 (mapped by no row since the cancel) is evicted for the first;
    # the second finds only blocks some row maps and is not kept
    a2 = block_digests(a + out[0][:-1], PAGE)[2]
    c = rng.integers(0, CFG.vocab_size, 17).tolist()
    engine.insert(engine.prefill(c, short), 2)
    digests_c = block_digests(c, PAGE)
    assert len(pages) == 4 and a2 not in pages.blocks
    assert digests_c[0] in pages.blocks and digests_c[1] not in pages.blocks
    with pytest.raises(OutOfPages, match="out of KV pages"):
        for _ in range(2 * SLOTS):  # jobs never inserted nor cancelled hold their pages
            engine.start_prefill(
                rng.integers(0, CFG.vocab_size, 20).tolist(), RowSampling.of(max_new_tokens=12)
            )
    with pytest.raises(ValueError, match="cannot hold 3 slots x 4 pages"):
        Engine(step, lambda b: KVCache.for_config(CFG, b, W), slots=SLOTS, prefix_block=PAGE, prefix_blocks=4,
               slots_cache=PagedKVCache.for_slots(CFG, SLOTS, W, page=PAGE, extra_pages=4))  # fmt: skip


def test_paged_server_tokens_and_kv_metrics(params, step):
    """serve.py's launch with kv_cache="paged": two concurrent greedy completions sharing a cached
    prompt prefix give generate's text, and /metrics reports a slot's bytes and the pool's free pages."""
    from flaxgpt.serve.launch import scheduler_for
    from flaxgpt.serve.server import create_app
    from tests.serve.test_serve import serving_in_thread

    tok = CharTokenizer(CHARS)
    sched = scheduler_for(
        CFG, params, tok, slots=SLOTS, max_len=W, chunk=2, prefill_chunk=16,
        prefix_cache_tokens=BLOCKS * PAGE, prefix_block=PAGE, kv_cache="paged",
    )  # fmt: skip
    assert sched.engine.pages.pool == 1 + SLOTS * M + BLOCKS
    sched.start()
    assert sched.ready.wait(timeout=300), "the engine did not compile in 300 s"
    app = create_app(sched, tok, model="tiny", max_len=W, vocab_size=len(CHARS))
    system = "ROMEO: a system\n"  # 16 characters: 2 pages
    prompts = [system + "hi", system + "how"]

    def complete(url, prompt, max_tokens):
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        return httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]

    with serving_in_thread(app) as url:
        complete(url, system + "a", 2)  # the system prompt's pages are cached
        texts = [None, None]
        threads = [
            threading.Thread(target=lambda i=i: texts.__setitem__(i, complete(url, prompts[i], 8)))
            for i in (0, 1)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        text = httpx.get(f"{url}/metrics").text
    sched.close()
    m = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    for prompt, got in zip(prompts, texts, strict=True):
        rows = RowSampling.of(Sampling(temperature=0.0), max_new_tokens=8)
        assert got == tok.decode(references.alone(step, CFG, W, tok.encode(prompt), rows))
    # a slot's window: M pages of [2 kv heads, PAGE positions, head_dim 8] float32, k and v, 2 layers
    assert m["flaxgpt_kv_bytes_per_slot"] == M * 2 * PAGE * 8 * 4 * 2 * 2
    assert m["flaxgpt_kv_blocks"] == 1 + SLOTS * M + BLOCKS and m["flaxgpt_kv_shared_blocks"] == 0  # all over
    assert m["flaxgpt_kv_free_blocks"] == m["flaxgpt_kv_blocks"] - 1 - m["flaxgpt_prefix_cache_blocks"]
    assert m["flaxgpt_prefix_cache_hit_tokens_total"] >= 2 * 16  # both read the system prompt's pages


def test_serve_py_kv_cache_flags(capsys):
    """serve.py --kv_cache: paged parses; a window that is not whole pages, or LoRA adapters, is one line."""
    import serve

    base = ["--init_from", "gpt2", "--random_init", "--kv_cache", "paged"]
    assert serve.parse_args(base).kv_cache == "paged" and serve.parse_args(base[:3]).kv_cache == "contiguous"
    for extra, needle in [
        (["--max_len", "100"], "--max_len 100 is not a multiple of the page size 16"),
        (["--adapter", "sql=adapters/sql"], "LoRA adapters need --kv_cache contiguous"),
    ]:
        with pytest.raises(SystemExit):
            serve.parse_args(base + extra)
        assert needle in capsys.readouterr().err
