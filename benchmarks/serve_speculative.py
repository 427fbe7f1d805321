"""Speculative decoding in the server: serve.py --speculative_ngram K vs the same server without it.

    python benchmarks/serve_speculative.py                      # 1 and 16 clients, 4 rounds, ~25 min
    python benchmarks/serve_speculative.py --requests 4 --rounds 4 --pause 1 --max_new 16   # a smoke run

GPT-2 124M with random weights (no download), fp32, greedy requests (prompt lookup drafts only for
greedy rows), token-id prompts that repeat a random passage (the case prompt lookup is for: a reply
that quotes or edits its context; a random model's greedy reply also loops, which drafts hit). Each
side is one serve.py process (benchmarks/harness.py: its own process, the order alternating every
round, a pause before each run) that serves the same requests twice: one client at a time, then
--clients concurrent clients. Figures: generated tokens / wall time for each load, and the server's
/metrics acceptance rate and tokens per drafting row and step (the ngram side).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import re
import sys
import time

import harness  # noqa: I001  (first: the benchmarks' one sys.path rule, see harness.py)
import numpy as np
import serve_process


def requests(a) -> list[list[int]]:
    rng = np.random.default_rng(a.seed)
    out = []
    for _ in range(a.requests):
        passage = rng.integers(0, 50257, rng.integers(8, 24)).tolist()
        out.append((passage * 3)[: a.max_prompt])
    return out


def serve_side(a) -> dict:
    import httpx

    args = ["--init_from", "gpt2", "--random_init", "--slots", str(a.slots), "--max_len", str(a.max_len)]
    args += ["--prefill_chunk", "64", "--prefix_cache_tokens", "0"]
    if a.side == "ngram":
        args += ["--speculative_ngram", str(a.k)]
    prompts = requests(a)

    def one(client, prompt):
        body = {"prompt": prompt, "max_tokens": a.max_new, "temperature": 0, "ignore_eos": True}
        r = client.post("/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    out = {}
    with serve_process.running(args) as (url, _):
        with httpx.Client(base_url=url) as client:
            one(client, prompts[0])  # a first request: every program already compiled, the caches warm
            for clients in (1, a.clients):
                t0 = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(clients) as pool:
                    tokens = sum(pool.map(lambda p: one(client, p), prompts))
                out[f"tok_s_{clients}"] = tokens / (time.perf_counter() - t0)
            metrics = client.get("/metrics").text
    for name in ("acceptance_rate", "tokens_per_step"):
        m = re.search(rf"^flaxgpt_spec_{name} (\S+)$", metrics, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--side", choices=("plain", "ngram"), help=argparse.SUPPRESS)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--k", type=int, default=4, help="--speculative_ngram")
    p.add_argument("--max_len", type=int, default=256)
    p.add_argument("--max_prompt", type=int, default=64)
    p.add_argument("--max_new", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    harness.add_arguments(p)
    a = p.parse_args(argv)
    if a.side:
        harness.print_result(serve_side(a))
        return
    keep = [x for x in (argv if argv is not None else sys.argv[1:])]
    sides = [harness.Side(s, [sys.executable, __file__, "--side", s, *keep]) for s in ("plain", "ngram")]
    figures = [
        harness.Figure("tok/s, 1 client", "ngram", "tok_s_1", "plain", "tok_s_1"),
        harness.Figure(
            f"tok/s, {a.clients} clients", "ngram", f"tok_s_{a.clients}", "plain", f"tok_s_{a.clients}"
        ),
    ]
    report = harness.compare(sides, figures, rounds=a.rounds, pause=a.pause)
    print(report.table())
    for key in ("acceptance_rate", "tokens_per_step"):
        print(f"ngram {key}: median {np.median(report.values('ngram', key)):.3f}")


if __name__ == "__main__":
    main()
