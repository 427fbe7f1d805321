"""Faults in the serving core: a client gone mid-prefill gives its pages back (counted), a request whose
step raises fails alone with a 500 while the others are served, and nothing is freed twice."""

import concurrent.futures

import httpx
import numpy as np

from flaxgpt.data.tokenizers import CharTokenizer
from flaxgpt.decode.sampling import Rows, Sampling
from flaxgpt.serve.engine import Engine
from flaxgpt.serve.launch import scheduler_for
from flaxgpt.serve.scheduler import Failed, Scheduler, Sequence
from flaxgpt.serve.server import create_app
from tests.serve import references
from tests.serve.test_paged import BLOCKS, CFG, CHARS, PAGE, SLOTS, W, params, step  # noqa: F401
from tests.serve.test_serve import serving_in_thread


def test_a_client_gone_mid_prefill_gives_its_pages_back(step):  # noqa: F811
    """One sequence decodes; a 26-token prompt is prefilled a chunk of 4 per turn (the token budget: 5,
    one for the decoding row); cancelled after its first chunk, its pages are free again at the next
    turn: the pool's free pages are what they were before it came, and every count is exact."""
    engine = Engine(step, CFG, slots=SLOTS, chunk=2, prefill_chunk=4, page=PAGE, prefix_blocks=BLOCKS)
    sched = Scheduler(engine, CharTokenizer(CHARS), max_num_batched_tokens=5)
    events = []
    rows = Rows.of(Sampling(temperature=0), max_new_tokens=4)
    sched.submit(Sequence([1, 2, 3], rows, emit=events.append))
    sched._admit()  # nobody decodes yet: prefilled whole, then it decodes
    free_before = len(engine.blocks.free_pages)
    long = Sequence(list(np.arange(26) % CFG.vocab_size), rows, emit=events.append)
    sched.submit(long)
    sched._admit()
    [(slot, job)] = sched.prefilling.items()
    assert job.done_upto == 4 and engine.blocks.holds(job.owner)  # one chunk in, its pages held
    assert len(engine.blocks.free_pages) == free_before - 4  # positions up to 26 + 4 - 1: 4 pages
    long.cancel()
    sched._admit()
    assert not sched.prefilling and slot not in sched.active and not engine.blocks.holds(job.owner)
    assert len(engine.blocks.free_pages) == free_before
    engine.blocks.check()
    assert sched.stats["cancelled"] == 1 and not any(isinstance(e, Failed) for e in events)


def test_a_poisoned_request_fails_alone_with_a_500(params, step):  # noqa: F811
    """A request whose prefill raises (a poisoned input: the step sees one token the test marks) gets
    a 500 with OpenAI's error JSON; requests before, beside and after it get generate's text; its
    pages come back."""
    tok = CharTokenizer(CHARS)
    sched = scheduler_for(
        CFG, params, tok, slots=SLOTS, max_len=W, chunk=2, prefill_chunk=16, prefix_cache_tokens=0,
        prefix_block=PAGE,
    )  # fmt: skip
    engine = sched.engine
    poison = tok.encode("!")[0]
    prefill = engine.runner.prefill

    def poisoned(table_M, adapter, chunk_1P, *args):
        if (chunk_1P == poison).any():
            raise FloatingPointError("a NaN in the step (test)")
        return prefill(table_M, adapter, chunk_1P, *args)

    sched.start()
    assert sched.ready.wait(timeout=300), "the engine did not compile in 300 s"
    engine.runner.prefill = poisoned  # after the warm-up, which compiled every program
    app = create_app(sched, tok, model="tiny", max_len=W, vocab_size=len(CHARS))
    prompts = ["ROMEO: hi", "ROMEO: bad!", "ROMEO: how", "ROMEO: now"]

    def complete(url, prompt):
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
        return httpx.post(f"{url}/v1/completions", json=body, timeout=60)

    with serving_in_thread(app) as url:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda p: complete(url, p), prompts))
        after = complete(url, "ROMEO: again")
    sched.close()
    bad = answers.pop(1)
    assert bad.status_code == 500 and "a NaN in the step" in bad.json()["error"]["message"]
    for prompt, r in zip([prompts[0], *prompts[2:], "ROMEO: again"], [*answers, after], strict=True):
        rows = Rows.of(Sampling(temperature=0.0), max_new_tokens=6)
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == tok.decode(
            references.alone(step, CFG, W, tok.encode(prompt), rows)
        )
    assert sched.stats["failed"] == 1 and sched.stats["finished"] == 4
    engine.blocks.check()
    assert len(engine.blocks.free_pages) == engine.blocks.pages - 1  # every page back (no prefix cache)


def test_a_client_that_hangs_up_on_a_whole_reply_frees_its_slot_mid_decode(params, step):  # noqa: F811
    """A non-streaming client that times out while its reply decodes (events every step): the server
    notices within a second and cancels the sequence, not decoding to max_tokens for nobody."""
    import time

    tok = CharTokenizer(CHARS)
    sched = scheduler_for(
        CFG, params, tok, slots=SLOTS, max_len=W, chunk=2, prefill_chunk=16, prefix_cache_tokens=0,
        prefix_block=PAGE,
    )  # fmt: skip
    generate = sched.engine.runner.generate

    def slow(*args):  # 2 tokens every 0.3 s: 24 tokens take ~3.6 s
        time.sleep(0.3)
        return generate(*args)

    sched.start()
    assert sched.ready.wait(timeout=300), "the engine did not compile in 300 s"
    sched.engine.runner.generate = slow
    app = create_app(sched, tok, model="tiny", max_len=W, vocab_size=len(CHARS))
    with serving_in_thread(app) as url:
        body = {"prompt": "ROMEO:", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        start = time.monotonic()
        try:
            httpx.post(f"{url}/v1/completions", json=body, timeout=0.6)
            raise AssertionError("the reply came before the client's timeout")
        except httpx.TimeoutException:
            pass
        while time.monotonic() - start < 10 and not (sched.stats["cancelled"] or sched.stats["finished"]):
            time.sleep(0.05)
        gone = time.monotonic() - start
    sched.close()
    assert sched.stats["cancelled"] == 1 and sched.stats["finished"] == 0, (dict(sched.stats), gone)
    assert gone < 3.0, gone  # within about a second of the hang-up (0.6 s), long before 3.6 s


def test_closed_while_compiling_stops_after_that_program(step):  # noqa: F811
    """SIGTERM while serve.py compiles: close() waits for the program under way, and the warm-up stops
    there (it waited 10 s, then the process exited with the thread inside XLA: abort, status 134)."""
    import threading
    import time

    engine = Engine(step, CFG, slots=SLOTS, chunk=2, prefill_chunk=W, page=PAGE, prefix_blocks=BLOCKS)
    calls, compiling = [], threading.Event()

    def slow_prefill(*args, **kw):  # a compile that outlasts close()'s call
        calls.append(args)
        compiling.set()
        time.sleep(0.5)
        return prefill(*args, **kw)

    prefill, engine.prefill = engine.prefill, slow_prefill
    sched = Scheduler(engine, CharTokenizer(CHARS))
    sched.start()
    assert compiling.wait(30)
    sched.close()
    assert not sched.thread.is_alive() and not sched.ready.is_set()
    assert len(engine.buckets) > 1 and len(calls) == 1  # no program after the one under way
