"""The mixed step in the server's scheduler (serve.py --mixed_step): prompts arriving while a stream
decodes run their tail beside it in one step; every reply equals the server's without the mixed step
and generate alone, and /metrics counts the prompt tokens the mixed steps ran."""

import threading

import numpy as np

from flaxgpt.data.tokenizers import CharTokenizer
from flaxgpt.decode.sampling import Rows, Sampling
from flaxgpt.serve.engine import Engine
from flaxgpt.serve.metrics import ServeMetrics
from flaxgpt.serve.scheduler import Delta, Finish, Scheduler, Sequence
from tests.serve import references
from tests.serve.test_paged import BLOCKS, CFG, CHARS, PAGE, SLOTS, W, params, step  # noqa: F401


def serve(step, first, later, mixed):  # noqa: F811
    """`first` submitted alone; `later` submitted from its first token's callback (on the engine
    thread: they are admitted while it decodes) -> each sequence's tokens, the metrics."""
    engine = Engine(step, CFG, slots=SLOTS, chunk=3, prefill_chunk=16, page=PAGE, prefix_blocks=BLOCKS,
                    mixed=mixed)  # fmt: skip
    sched = Scheduler(engine, CharTokenizer(CHARS))
    sched.metrics = ServeMetrics()
    sched.metrics.watch(sched)
    sched.start()
    assert sched.ready.wait(300)
    events = [[] for _ in range(1 + len(later))]
    seqs = [Sequence(p, r, emit=lambda ev, i=i + 1: events[i].append(ev)) for i, (p, r) in enumerate(later)]

    submitted = threading.Event()

    def on_first(ev):
        if not events[0] and isinstance(ev, Delta):
            sched.submit(*seqs)
            submitted.set()
        events[0].append(ev)

    head = Sequence(*first, emit=on_first)
    sched.submit(head)
    assert submitted.wait(300) and sched.drain(timeout=300)
    sched.close()
    assert all(isinstance(ev[-1], Finish) for ev in events)
    engine.blocks.check()
    return [s.ids for s in [head, *seqs]], sched.metrics


def test_mixed_replies_equal_the_two_program_server_and_generate(step):  # noqa: F811
    rng = np.random.default_rng(3)
    system = rng.integers(0, CFG.vocab_size, 9).tolist()  # its first page is cached by the first prefill
    first = (system, Rows.of(Sampling(temperature=0), max_new_tokens=20))
    greedy, sampled = Sampling(temperature=0), Sampling(temperature=0.9, top_k=5)
    tail, other = rng.integers(0, CFG.vocab_size, 5).tolist(), rng.integers(0, CFG.vocab_size, 6).tolist()
    later = [
        (system[:8] + tail, Rows.of(greedy, max_new_tokens=9)),
        (other, Rows.of(sampled, max_new_tokens=8, seed=2)),
    ]
    plain, plain_metrics = serve(step, first, later, mixed=0)
    mixed, metrics = serve(step, first, later, mixed=16)
    assert mixed == plain
    for (prompt, rows), got in zip([first, *later], mixed, strict=True):
        assert got == references.alone(step, CFG, W, prompt, rows)
    # the first prompt's 9 tokens (alone: a step with no decoding row), then beside it the second
    # request's 5-token tail after an 8-token prefix hit and the third's 6 tokens
    assert metrics.mixed_tokens._value.get() == 20 and plain_metrics.mixed_tokens._value.get() == 0
    assert "flaxgpt_mixed_prompt_tokens_total 20.0" in metrics.exposition()[0].decode()
    assert metrics.prefix_hit._value.get() == 8
