"""The page pool: the slots and the prefix cache share it; cached prefixes are mapped into block tables
(never copied), adapters' blocks are told apart, and a request's pages come back however it ends."""

import threading

import httpx
import jax
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from flaxgpt.data.tokenizers import CharTokenizer
from flaxgpt.decode.sampling import Rows, Sampling
from flaxgpt.models.gpt import GPTConfig, init_params
from flaxgpt.models.gpt import step_fn as gpt_step_fn
from flaxgpt.models.paged import paged_impl
from flaxgpt.serve.block_manager import OutOfPages, block_digests
from flaxgpt.serve.engine import Engine, slot_owner
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


def new_engine(step):
    """An engine whose prefix cache holds BLOCKS pages of PAGE positions."""
    return Engine(step, CFG, slots=SLOTS, chunk=2, prefill_chunk=16, page=PAGE, prefix_blocks=BLOCKS)


def rows_of(engine, slot):
    return engine.blocks.table(slot_owner(slot)) if engine.blocks.holds(slot_owner(slot)) else None


def test_shared_prefixes_decode_what_each_request_gives_alone(step):
    """Staggered requests (grouped-query heads, sampled and greedy), half of them sharing a 16-token
    system prompt and some a finished request's reply: the engine maps those blocks in place and
    each request decodes what generate gives it alone; at the end only the prefix cache holds pages."""
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
                Rows.of(s, max_new_tokens=int(rng.integers(2, 9)), seed=i),
            )
        )
    most_shared, engine = 0, new_engine(step)
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
        most_shared = max(most_shared, engine.kv_memory()["shared_blocks"])
        engine.blocks.check()
        for s, i in list(owner.items()):
            out[i] += toks[s, : new[s]].tolist()
            if done[s]:
                assert engine.keep(s, reqs[i][0] + out[i][:-1]) >= 0
                del owner[s]
    for i, (prompt, rows) in enumerate(reqs):
        assert out[i] == references.alone(step, CFG, W, prompt, rows)
    bm = engine.blocks  # every request over: only the prefix cache holds pages
    assert most_shared >= 2 and len(bm.free_pages) == bm.pages - 1 - len(bm.blocks)
    assert not bm.tables


def test_a_shared_prefix_is_mapped_not_copied(step):
    """Two concurrent requests with one 16-token prefix: the second's block table holds the first's
    pages, the pool spends only the pages sharing predicts, those pages are never written again,
    and both decode what generate gives each alone; at their end the cache keeps their blocks in
    place and evicts unmapped ones (LRU) when full."""
    engine = new_engine(step)
    bm = engine.blocks
    assert bm.pages == 1 + SLOTS * M + 4 and len(bm.free_pages) == bm.pages - 1
    rng = np.random.default_rng(1)
    system = rng.integers(0, CFG.vocab_size, 16).tolist()
    a, b = system + [1, 2, 3], system + [4, 5, 6, 7, 8]
    rows = Rows.of(max_new_tokens=6)  # greedy
    prefix_a = engine.prefill(a, rows)  # positions up to 24: blocks 0-3; its 2 full prompt blocks cached
    engine.insert(prefix_a, 0)
    assert len(bm.blocks) == 2 and len(bm.free_pages) == bm.pages - 1 - 4
    shared = rows_of(engine, 0)[:2].copy()
    pool = lambda: [
        np.asarray(x[:, shared]) for x in (*engine.state.cache.inner.k, *engine.state.cache.inner.v)
    ]  # noqa: E731
    before = pool()
    job = engine.start_prefill(b, rows)
    assert job.hit == 16 and (bm.table(job.owner)[:2] == shared).all()  # mapped, not copied
    while (prefix_b := engine.prefill_step(job)) is None:
        pass
    engine.insert(prefix_b, 1)
    assert (rows_of(engine, 1)[:2] == shared).all() and rows_of(engine, 1)[2] not in rows_of(engine, 0)
    assert len(bm.free_pages) == bm.pages - 1 - 4 - 2  # b's fresh pages: blocks 2 and 3 (positions 16..26)
    assert engine.kv_memory()["shared_blocks"] == 2 and all(bm.refs[shared] == 3)  # two rows and the cache
    out = {0: [int(prefix_a.first)], 1: [int(prefix_b.first)]}
    while len(out[0]) < 6 or len(out[1]) < 6:
        toks, new, _ = engine.generate()
        for s in out:
            out[s] += toks[s, : new[s]].tolist()
    assert out[0] == references.alone(step, CFG, W, a, rows) and out[1] == references.alone(
        step, CFG, W, b, rows
    )
    after = pool()
    assert all((x == y).all() for x, y in zip(before, after, strict=True))  # shared pages never written
    kept_a = engine.keep(0, a + out[0][:-1])  # 24 positions: block 2 (a's tail + reply) is new
    kept_b = engine.keep(1, b + out[1][:-1])  # 26: b's own block 2; the cache is now full (4 blocks)
    assert (kept_a, kept_b) == (1, 1) and len(bm.blocks) == 4 and engine.kv_memory()["shared_blocks"] == 0
    assert len(bm.free_pages) == bm.pages - 1 - 4  # the rows' other pages came back
    short = Rows.of(max_new_tokens=2)
    assert engine.start_prefill(b + out[1][:-1] + [9], short).hit == 24  # the reply is reused
    engine.cancel(job := engine.start_prefill(a + out[0][:-1] + [9], short))
    assert job.hit == 24 and not bm.holds(job.owner) and bm.refs[shared[0]] == 2  # cache + the job above
    # c's two full blocks: a's block 2 (mapped by no row since the cancel) is evicted for the first;
    # the second finds only blocks some row maps and is not kept
    a2 = block_digests(a + out[0][:-1], PAGE)[2]
    c = rng.integers(0, CFG.vocab_size, 17).tolist()
    engine.insert(engine.prefill(c, short), 2)
    digests_c = block_digests(c, PAGE)
    assert len(bm.blocks) == 4 and a2 not in bm.blocks
    assert digests_c[0] in bm.blocks and digests_c[1] not in bm.blocks
    with pytest.raises(OutOfPages, match="out of KV pages"):
        for _ in range(2 * SLOTS):  # jobs never inserted nor cancelled hold their pages
            engine.start_prefill(rng.integers(0, CFG.vocab_size, 20).tolist(), Rows.of(max_new_tokens=12))
    bm.check()
    with pytest.raises(ValueError, match="not a multiple of the page size 8"):
        Engine(step, CFG, slots=SLOTS, max_len=W - 4, page=PAGE)


def test_paged_server_tokens_and_kv_metrics(params, step):
    """serve.py's launch: two concurrent greedy completions sharing a cached
    prompt prefix give generate's text, and /metrics reports a slot's bytes and the pool's free pages."""
    from flaxgpt.serve.launch import scheduler_for
    from flaxgpt.serve.server import create_app
    from tests.serve.test_serve import serving_in_thread

    tok = CharTokenizer(CHARS)
    sched = scheduler_for(
        CFG, params, tok, slots=SLOTS, max_len=W, chunk=2, prefill_chunk=16,
        prefix_cache_tokens=BLOCKS * PAGE, prefix_block=PAGE,
    )  # fmt: skip
    assert sched.engine.blocks.pages == 1 + SLOTS * M + BLOCKS
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
        rows = Rows.of(Sampling(temperature=0.0), max_new_tokens=8)
        assert got == tok.decode(references.alone(step, CFG, W, tok.encode(prompt), rows))
    # a slot's window: M pages of [2 kv heads, PAGE positions, head_dim 8] float32, k and v, 2 layers
    assert m["flaxgpt_kv_bytes_per_slot"] == M * 2 * PAGE * 8 * 4 * 2 * 2
    assert m["flaxgpt_kv_blocks"] == 1 + SLOTS * M + BLOCKS and m["flaxgpt_kv_shared_blocks"] == 0  # all over
    assert m["flaxgpt_kv_free_blocks"] == m["flaxgpt_kv_blocks"] - 1 - m["flaxgpt_prefix_cache_blocks"]
    assert m["flaxgpt_prefix_cache_hit_tokens_total"] >= 2 * 16  # both read the system prompt's pages


def test_serve_py_page_flags(capsys):
    """serve.py: the window must be whole pages (one line); --kv_cache is gone (one cache: the pages)."""
    import serve

    base = ["--init_from", "gpt2", "--random_init"]
    assert serve.parse_args(base + ["--max_num_batched_tokens", "300"]).max_num_batched_tokens == 300
    for extra, needle in [
        (["--max_len", "100"], "--max_len 100 is not a multiple of the page size --prefix_block 16"),
        (["--max_num_batched_tokens", "0"], "--max_num_batched_tokens must be >= 1"),
        (["--max_queue", "-2"], "--max_queue must be >= 0, got -2"),  # (it served, refusing every request)
        (["--kv_cache", "paged"], "unrecognized arguments: --kv_cache"),
    ]:
        with pytest.raises(SystemExit):
            serve.parse_args(base + extra)
        assert needle in capsys.readouterr().err
