"""The server's Prometheus metrics (prometheus-client), one registry per app, served at GET /metrics.

    metrics = ServeMetrics()
    metrics.watch(scheduler)                     # gauges read the scheduler at scrape time
    scheduler.metrics = metrics                  # the engine thread reports tokens and latencies
    body, content_type = metrics.exposition()

The HTTP middleware counts requests by route and status; the scheduler reports prompt and
generated tokens, time to first token (from submit, queueing included) and inter-token latency
(a chunk of n tokens that arrived t s after the previous one counts n gaps of t / n s); the
prefix cache reports hit and looked-up prompt tokens; the KV cache's gauges (flaxgpt_kv_*) say
what a slot's window takes and how many pages of the pool are free and shared. One registry per
app, not the process's global one, so several apps (tests) never collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# seconds: a cached 10-token prompt on an idle GPU (ms) up to a long prompt queued on 2 CPU cores
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2)


class ServeMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "flaxgpt_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.prompt_tokens = Counter(
            "flaxgpt_prompt_tokens",
            "prompt tokens of admitted sequences",
            registry=r,
        )
        self.generation_tokens = Counter("flaxgpt_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram(
            "flaxgpt_time_to_first_token_seconds",
            "from submit (queueing included) to the first token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "flaxgpt_inter_token_latency_seconds", "time between tokens", buckets=ITL_BUCKETS, registry=r
        )
        self.sequences = Counter("flaxgpt_sequences", "sequences by outcome", ["outcome"], registry=r)
        self.prefix_hit = Counter(
            "flaxgpt_prefix_cache_hit_tokens", "prompt tokens whose KV came from the prefix cache", registry=r
        )
        self.prefix_query = Counter(
            "flaxgpt_prefix_cache_query_tokens", "prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_rate = Gauge(
            "flaxgpt_prefix_cache_hit_rate", "hit / looked-up prompt tokens since start", registry=r
        )
        self._hit = self._query = 0  # the rate's terms (the counters expose no public read)
        self.prefix_rate.set_function(lambda: self._rate())
        self.queue_depth = Gauge("flaxgpt_queue_depth", "sequences waiting for a slot", registry=r)
        self.busy_slots = Gauge("flaxgpt_busy_slots", "slots holding a sequence", registry=r)
        self.slots = Gauge("flaxgpt_slots", "slots (rows of the KV cache)", registry=r)
        self.prefix_blocks = Gauge("flaxgpt_prefix_cache_blocks", "blocks in the prefix cache", registry=r)
        kv = {  # the engine's kv_memory() keys
            "bytes_per_slot": "KV cache bytes one slot's whole window takes",
            "blocks": "pages of the KV page pool (the slots' windows, the prefix cache's blocks, scratch)",
            "free_blocks": "pages of the pool held by no slot and no cached prefix",
            "shared_blocks": "pages held more than once: cached prefixes read in place by running requests",
        }
        self.kv = {k: Gauge(f"flaxgpt_kv_{k}", doc, registry=r) for k, doc in kv.items()}
        # speculative decoding (serve.py --speculative_ngram): per drafting row and step
        self.spec_steps = Counter("flaxgpt_spec_row_steps", "steps of rows that checked drafts", registry=r)
        self.spec_drafted = Counter("flaxgpt_spec_draft_tokens", "tokens drafted and checked", registry=r)
        self.spec_accepted = Counter("flaxgpt_spec_accepted_tokens", "drafted tokens kept", registry=r)
        self._spec = [0, 0, 0]  # steps, drafted, accepted
        Gauge("flaxgpt_spec_acceptance_rate", "kept / drafted tokens since start", registry=r).set_function(
            lambda: self._spec[2] / self._spec[1] if self._spec[1] else 0.0
        )
        Gauge(
            "flaxgpt_spec_tokens_per_step", "new tokens per drafting row and step since start", registry=r
        ).set_function(lambda: (self._spec[0] + self._spec[2]) / self._spec[0] if self._spec[0] else 0.0)

        self.mixed_tokens = Counter(  # serve.py --mixed_step
            "flaxgpt_mixed_prompt_tokens", "prompt tokens run in a decode step, beside the decoding slots",
            registry=r,
        )  # fmt: skip

    def _rate(self) -> float:
        return self._hit / self._query if self._query else 0.0

    def watch(self, sched):
        """Gauges that read the scheduler (and its engine's block manager) when scraped."""
        self.queue_depth.set_function(lambda: sum(not seq.cancelled for seq in list(sched.pending)))
        self.busy_slots.set_function(lambda: len(sched.active))
        self.slots.set(sched.engine.slots)
        self.prefix_blocks.set_function(lambda: len(sched.engine.blocks.blocks))
        for k, gauge in self.kv.items():
            gauge.set_function(lambda k=k: sched.engine.kv_memory()[k])

    # ------------------------------------------------------------ called by the engine thread

    def admitted(self, prompt_tokens: int, hit_tokens: int):
        self.prompt_tokens.inc(prompt_tokens)
        self.prefix_query.inc(prompt_tokens)
        self.prefix_hit.inc(hit_tokens)
        self._hit, self._query = self._hit + hit_tokens, self._query + prompt_tokens

    def tokens(self, n: int, first_after: float | None, gap: float | None):
        """n new tokens; first_after: seconds from submit when these include the first token; gap:
        seconds since the sequence's previous tokens."""
        if n <= 0:
            return
        self.generation_tokens.inc(n)
        if first_after is not None:
            self.ttft.observe(first_after)
            n -= 1
        if gap is not None and n > 0:
            for _ in range(n):
                self.itl.observe(gap / n)

    def speculated(self, rows: int, drafted: int, accepted: int):
        """One step in which `rows` rows checked `drafted` drafts in all and kept `accepted`."""
        self.spec_steps.inc(rows)
        self.spec_drafted.inc(drafted)
        self.spec_accepted.inc(accepted)
        self._spec = [self._spec[0] + rows, self._spec[1] + drafted, self._spec[2] + accepted]

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
