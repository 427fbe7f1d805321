"""Chat traffic: time to first token with and without the prefix cache (serve.py --prefix_cache_tokens).

    python benchmarks/serve_chat.py --rounds 4        # 8 conversations x 4 turns, 4 at a time, ~5 minutes
    python benchmarks/serve_chat.py --conversations 2 --turns 2 --pause 1    # smoke run
    python benchmarks/serve_chat.py --against ../old   # cache on: another checkout's serve.py vs this one's
    python benchmarks/serve_chat.py --against ../old --this_args '--mixed_step 64'   # a flag DIR lacks

A random-weight char-level GPT (6 layers, 384 wide, window 1024; no download) behind serve.py on
127.0.0.1. Every conversation starts with the same 200-token system prompt; turn t sends the system
prompt, the earlier turns (user messages and the server's replies) and a new user message of
20-40 tokens, and streams a reply of --reply tokens (ignore_eos). --clients conversations run at
once. The same seeded workload runs against a server without the prefix cache and one with it,
two sides of benchmarks/harness.py (each in its own process with its own server, the order
alternating every round, --pause seconds of rest before each run); TTFT is from sending the request
to its first streamed token, p50 and p99 over every turn of a run; the table gives each round's
ratio and the medians over rounds. With --against DIR both sides have the cache on: serve.py of the
checkout in DIR (a git worktree of another commit) against this checkout's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
import harness  # noqa: E402  (first: the benchmarks' one sys.path rule, see harness.py)
import serve_process  # noqa: E402

from benchmarks.serve_soak import write_tiny_run  # noqa: E402

LETTERS = list("abcdefghijklmnopqrstuvwxyz ")
SIDES = {"cache off": 0, "cache on": 8192}  # serve.py --prefix_cache_tokens


async def conversation(c, url, system, rng, a, ttfts):
    history = system
    for _ in range(a.turns):
        user = "".join(rng.choice(LETTERS, int(rng.integers(20, 41))))
        prompt = f"{history}\nUSER: {user}\nROMEO:"
        body = {"prompt": prompt, "max_tokens": a.reply, "temperature": 0.8, "seed": 1}
        body |= {"stream": True, "ignore_eos": True}
        start, first, reply = time.perf_counter(), None, ""
        async with c.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()}")
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    if first is None and choice["finish_reason"] is None:
                        first = time.perf_counter()
                    reply += choice["text"]
        ttfts.append(first - start)
        history = prompt + reply


def run_side(a, cache_tokens: int, run_dir: str, root=serve_process.ROOT) -> list[float]:
    import httpx

    cmd = ["--out_dir", run_dir, "--slots", str(a.clients), "--prefix_cache_tokens", str(cache_tokens)]
    cmd += a.this_args.split() if root == serve_process.ROOT else []
    with serve_process.running([*cmd, *a.serve_args.split()], root=root) as (url, _):
        rng = np.random.default_rng(a.seed)
        system = "".join(rng.choice(LETTERS, 200))
        ttfts: list[float] = []

        async def main():
            async with httpx.AsyncClient(timeout=600) as c:
                queue = [np.random.default_rng(a.seed + 1 + i) for i in range(a.conversations)]

                async def client():
                    while queue:
                        await conversation(c, url, system, queue.pop(0), a, ttfts)

                await asyncio.gather(*[client() for _ in range(a.clients)])

        asyncio.run(main())
        return ttfts


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--clients", type=int, default=4, help="conversations at once (= the server's slots)")
    p.add_argument("--reply", type=int, default=24, help="tokens per reply")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve_args", default="", help="more serve.py flags for both sides, e.g. '--chunk 2'")
    harness.add_arguments(p)
    p.add_argument("--against", default=None, help="two cache-on sides: DIR's serve.py and this checkout's")
    p.add_argument(
        "--this_args",
        default="",
        help="serve.py flags of this checkout's sides only: '--mixed_step 64'",
    )
    p.add_argument("--side", default=None, choices=[*SIDES, "against"], help=argparse.SUPPRESS)
    p.add_argument("--run_dir", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.side:
        root = a.against if a.side == "against" else serve_process.ROOT
        ttfts = run_side(a, SIDES.get(a.side, SIDES["cache on"]), a.run_dir, root)
        pct = lambda q: float(np.percentile(ttfts, q))  # noqa: E731
        return harness.print_result({"turns": len(ttfts), "ttft_p50": pct(50), "ttft_p99": pct(99)})
    args = [*(argv if argv is not None else sys.argv[1:])]
    with tempfile.TemporaryDirectory() as run_dir:
        write_tiny_run(Path(run_dir), block_size=1024, n_embd=384, n_layer=6)
        env = {"PYTHONPATH": str(ROOT)}
        names = {"cache off": "cache off", "cache on": "cache on"}
        if a.against:
            names = {"against": f"cache on ({a.against})", "cache on": "cache on (this checkout)"}
        sides = [
            harness.Side(n, [sys.executable, __file__, *args, "--side", s, "--run_dir", run_dir], env=env)
            for s, n in names.items()
        ]
        on, off = names["cache on"], names["against" if a.against else "cache off"]
        figures = [
            harness.Figure(f"TTFT {q} (lower: > 1x)", on, f"ttft_{q}", off, f"ttft_{q}",
                           higher_is_better=False)
            for q in ("p50", "p99")
        ]  # fmt: skip
        report = harness.compare(sides, figures, rounds=a.rounds, pause=a.pause)
    print(f"{a.conversations} conversations x {a.turns} turns, {a.clients} at a time, {os.cpu_count()} cores")
    print(report.table() + "\n")
    print("medians over rounds:\n| prefix cache | turns | TTFT p50 ms | TTFT p99 ms |")
    print("| --- | ---: | ---: | ---: |")
    for s in names.values():
        p50, p99 = (1e3 * float(np.median(report.values(s, f"ttft_{q}"))) for q in ("p50", "p99"))
        print(f"| {s} | {report.results[0][s]['turns']} | {p50:.0f} | {p99:.0f} |")


if __name__ == "__main__":
    main()
