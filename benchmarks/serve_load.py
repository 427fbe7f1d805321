"""Serving under load: serve.py (continuous batching) vs the same requests one at a time.

    python benchmarks/serve_load.py                                   # 64 requests, 16 clients, GPT-2 124M
    python benchmarks/serve_load.py --requests 4 --clients 2 --max_new 12 --skip_hf   # smoke run

GPT-2 124M with random weights (no download), fp32, on 127.0.0.1. Requests: token-id prompts of
random lengths in [--min_prompt, --max_prompt], outputs in [--min_new, --max_new] tokens (decoded
to the end: ignore_eos), temperature 1, top_k 50, one seed each. Three sides, each in its own
process, flaxgpt first:
  serve      serve.py --slots S; --clients concurrent streaming clients (httpx) share the requests
  flaxgpt    the same requests one after another with flaxgpt.decode.sampling.generate (batch 1)
  hf         the same with transformers' GPT2LMHeadModel.generate (batch 1, torch CPU)
Figures: generated tokens / wall time; time to first token (serve: from sending the request,
queueing included; one at a time: from the start of its own generation); inter-token latency per
request = (last token time - first token time) / (tokens - 1), p50 and p99 over requests.
Compilation is excluded (the server compiles before /health is ok; the others warm up first).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def make_requests(a):
    rng = np.random.default_rng(a.seed)
    out = []
    for i in range(a.requests):
        p = int(rng.integers(a.min_prompt, a.max_prompt + 1))
        out.append(
            {
                "prompt": rng.integers(0, 50256, p).tolist(),
                "max_tokens": int(rng.integers(a.min_new, a.max_new + 1)),
                "seed": i,
            }
        )
    return out


def pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def summary(name, wall, records):
    """records: [(tokens, ttft_s, itl_s)]."""
    tokens = sum(r[0] for r in records)
    ttft, itl = [r[1] for r in records], [r[2] for r in records if r[2] is not None]
    return {
        "side": name,
        "requests": len(records),
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "ttft_p50": pct(ttft, 50),
        "ttft_p99": pct(ttft, 99),
        "itl_p50": pct(itl, 50),
        "itl_p99": pct(itl, 99),
    }


# ---------------------------------------------------------------- the server side


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _client(url, queue, records, t0):
    import httpx

    async with httpx.AsyncClient(timeout=600) as c:
        while queue:
            req = queue.pop(0)
            body = {**req, "stream": True, "temperature": 1.0, "top_k": 50, "ignore_eos": True}
            start, times = time.perf_counter(), []
            async with c.stream("POST", f"{url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()}")
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:
                            times.append(time.perf_counter())
            n = req["max_tokens"]
            itl = (times[-1] - times[0]) / (n - 1) if n > 1 and len(times) > 1 else None
            records.append((n, times[0] - start, itl))


def run_server_side(a, reqs, root=ROOT, name="serve"):
    port = free_port()
    cmd = [
        sys.executable,
        str(root / "serve.py"),
        "--init_from",
        "gpt2",
        "--random_init",
        "--port",
        str(port),
    ]
    cmd += [
        "--slots",
        str(a.slots),
        "--max_len",
        str(a.max_len),
        "--chunk",
        str(a.chunk),
        "--max_queue",
        "256",
    ]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        t = time.perf_counter()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"serve.py exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        print(f"serve: ready after {time.perf_counter() - t:.0f} s (load + compile)", file=sys.stderr)
        records, queue = [], list(reqs)
        t0 = time.perf_counter()

        async def main():
            await asyncio.gather(*[_client(url, queue, records, t0) for _ in range(a.clients)])

        asyncio.run(main())
        return summary(f"{name} (slots {a.slots}, {a.clients} clients)", time.perf_counter() - t0, records)
    finally:
        proc.terminate()
        proc.wait(timeout=120)


# ---------------------------------------------------------------- one at a time


def run_flaxgpt_side(a, reqs):
    import jax

    from flaxgpt.decode.sampling import stream_generate
    from flaxgpt.models.cache import KVCache
    from flaxgpt.models.gpt import GPTConfig, init_params
    from flaxgpt.models.gpt import step_fn as gpt_step_fn
    from flaxgpt.serve.engine import prompt_buckets

    config = GPTConfig.preset("gpt2")
    step = gpt_step_fn(config, init_params(config, jax.random.key(0)))
    buckets = prompt_buckets(a.max_len)

    def one(req):
        n = len(req["prompt"])
        P = next(b for b in buckets if n >= 0 and b >= n)  # the server's prompt buckets: no recompiles
        prompt = np.zeros((1, P), np.int32)
        prompt[0, :n] = req["prompt"]
        start, times = time.perf_counter(), []
        for _, count in stream_generate(
            step, KVCache.for_config(config, 1, a.max_len), prompt, [n], max_new_tokens=req["max_tokens"],
            rng=jax.random.key(req["seed"]), temperature=1.0, top_k=50, chunk=a.chunk,
        ):  # fmt: skip
            times += [time.perf_counter()] * int(count[0])
        return start, times

    for b in sorted({next(b for b in buckets if b >= len(r["prompt"])) for r in reqs}):  # warm up
        one({"prompt": [0] * b, "max_tokens": 2 * a.chunk + 2, "seed": 0})
    return _sequential("flaxgpt one at a time", reqs, one)


def run_hf_side(a, reqs):
    import torch
    import transformers
    from transformers.generation.streamers import BaseStreamer

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()

    class Clock(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    def one(req):
        ids = torch.tensor([req["prompt"]])
        clock, start = Clock(), time.perf_counter()
        torch.manual_seed(req["seed"])
        with torch.no_grad():
            model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=req["max_tokens"],
                min_new_tokens=req["max_tokens"], do_sample=True, temperature=1.0, top_k=50,
                pad_token_id=50256, streamer=clock,
            )  # fmt: skip
        return start, clock.times[1:]  # the first put() is the prompt

    one({"prompt": reqs[0]["prompt"], "max_tokens": 4, "seed": 0})  # warm up
    name = f"transformers {transformers.__version__} (torch {torch.__version__}) generate one at a time"
    return _sequential(name, reqs, one)


def _sequential(name, reqs, one):
    records, t0 = [], time.perf_counter()
    for req in reqs:
        start, times = one(req)
        n = len(times)
        records.append((n, times[0] - start, (times[-1] - times[0]) / (n - 1) if n > 1 else None))
    return summary(name, time.perf_counter() - t0, records)


# ---------------------------------------------------------------- the driver


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--chunk", type=int, default=4, help="serve.py --chunk (and generate's chunk)")
    p.add_argument("--max_len", type=int, default=512, help="the window: prompt + output tokens fit")
    p.add_argument("--min_prompt", type=int, default=16)
    p.add_argument("--max_prompt", type=int, default=256)
    p.add_argument("--min_new", type=int, default=16)
    p.add_argument("--max_new", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip_hf", action="store_true")
    p.add_argument("--torch_python", default=sys.executable, help="interpreter for the transformers side")
    p.add_argument(
        "--baseline_root",
        default=None,
        help="another checkout (e.g. `git archive` of an older commit): its serve.py runs too, alternating "
        "with this one's (--rounds pairs), instead of the one-at-a-time sides",
    )
    p.add_argument("--rounds", type=int, default=1, help="with --baseline_root: (this, baseline) pairs")
    p.add_argument(
        "--side", default=None, choices=["serve", "flaxgpt", "hf", "base"], help="(internal) run one side"
    )
    return p.parse_args(argv)


def main(argv=None):
    a = parse(argv)
    reqs = make_requests(a)
    if a.side:
        base = lambda a, reqs: run_server_side(a, reqs, Path(a.baseline_root), "baseline serve")  # noqa: E731
        sides = {"serve": run_server_side, "flaxgpt": run_flaxgpt_side, "hf": run_hf_side, "base": base}
        print("RESULT " + json.dumps(sides[a.side](a, reqs)))
        return
    import jax

    versions = f"jax {jax.__version__}"
    load = f"{a.requests} requests, {a.clients} clients, slots {a.slots}"
    lengths = f"prompts {a.min_prompt}-{a.max_prompt}, outputs {a.min_new}-{a.max_new} tokens"
    print(f"{versions}, python {platform.python_version()}, {os.cpu_count()} cores; {load}; {lengths}")
    results = []
    order = ["flaxgpt", "serve"] + ([] if a.skip_hf else ["hf"])  # flaxgpt's processes first
    if a.baseline_root:  # alternating: a slower or faster spell of a shared machine hits both
        order = [s for i in range(a.rounds) for s in (("serve", "base") if i % 2 == 0 else ("base", "serve"))]
    for side in order:
        python = a.torch_python if side == "hf" else sys.executable
        args = [python, __file__, *(argv if argv is not None else sys.argv[1:]), "--side", side]
        out = subprocess.run(
            args, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True
        )
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if out.returncode or not line:
            raise SystemExit(f"{side} failed ({out.returncode}):\n{out.stderr[-3000:]}")
        results.append(json.loads(line[0][7:]))
        print(f"  {side}: {json.dumps(results[-1])}", file=sys.stderr, flush=True)
    base = next(r for r in results if r["side"].startswith(("flaxgpt", "baseline")))["tok_s"]
    print(
        f"| side | requests | tokens | wall s | tok/s | vs {results[1 if a.baseline_root else 0]['side']} "
        "| TTFT p50 / p99 s | ITL p50 / p99 ms |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(
            f"| {r['side']} | {r['requests']} | {r['tokens']} | {r['wall_s']:.1f} | {r['tok_s']:.1f} | "
            f"{r['tok_s'] / base:.2f}x | {r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} | "
            f"{1e3 * r['itl_p50']:.0f} / {1e3 * r['itl_p99']:.0f} |"
        )


if __name__ == "__main__":
    main()
