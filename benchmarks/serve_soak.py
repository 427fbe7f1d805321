"""Soak: serve.py under many clients that misbehave; it must end with every slot free, no 5xx, flat memory.

    python benchmarks/serve_soak.py                          # 500 requests, 32 clients, a tiny char model
    python benchmarks/serve_soak.py --requests 60 --clients 8   # CI's size (tests/serve/test_soak.py)

Each request is drawn (seeded) from a mix: completions (plain, streamed, n=2), streams the client
hangs up on after a few events, malformed JSON, bad fields, max_tokens over the server's limit,
bodies over its size limit, and a wrong API key. Expected answers: 200, 400, 401, 413 and 429
(the queue is full: retried once after Retry-After); any 5xx, a 200 of the wrong shape or a
transport error counts as a failure. Afterwards /health must say busy 0 within a bounded time and
a plain completion must still work. The server's resident memory (VmRSS) is read before (after a
warm-up round) and after the soak.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import string
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
KINDS = ["plain", "stream", "n2", "hangup", "malformed", "bad_field", "over_max_tokens", "too_big", "bad_key"]
WEIGHTS = [0.3, 0.2, 0.05, 0.15, 0.06, 0.06, 0.06, 0.06, 0.06]


def _request(kind, rng, max_tokens_limit, max_body_bytes):
    """-> (body or raw bytes, headers override or None, the statuses that are right for it)."""
    prompt = "".join(rng.choice(list("abcdefgh ROMEO:\n"), int(rng.integers(1, 40))))
    body = {
        "prompt": prompt,
        "max_tokens": int(rng.integers(1, max_tokens_limit + 1)),
        "seed": int(rng.integers(99)),
    }
    if kind == "stream" or kind == "hangup":
        body["stream"] = True
    if kind == "n2":
        body["n"] = 2
    if kind == "malformed":
        return b'{"prompt": "ab", "max_tokens":', None, {400}
    if kind == "bad_field":
        return {**body, "temperature": -1}, None, {400}
    if kind == "over_max_tokens":
        return {**body, "max_tokens": max_tokens_limit + 1}, None, {400}
    if kind == "too_big":
        return {**body, "prompt": "a" * (max_body_bytes + 10)}, None, {413}
    if kind == "bad_key":
        return body, {"Authorization": "Bearer wrong"}, {401}
    return body, None, {200, 429}


async def _client(c, url, jobs, out):
    while jobs:
        i, kind, (payload, headers, ok) = jobs.pop()
        for attempt in range(2):
            try:
                kw = {"content": payload} if isinstance(payload, bytes) else {"json": payload}
                async with c.stream("POST", f"{url}/v1/completions", headers=headers, **kw) as r:
                    status, events, line = r.status_code, 0, ""
                    if status == 200 and payload.get("stream"):
                        async for text in r.aiter_lines():
                            line = text or line  # the last data line, not the blank after it
                            events += text.startswith("data: ")
                            if kind == "hangup" and events >= 2:
                                break  # leaving the block closes the connection mid-stream
                        if kind != "hangup" and not line == "data: [DONE]":
                            status = "bad stream end"
                    else:
                        data = json.loads(await r.aread())
                        if status == 200 and len(data["choices"]) != payload.get("n", 1):
                            status = "bad choices"
            except Exception as e:  # a transport error is a failure like a 5xx
                status = f"{type(e).__name__}: {e}"[:80]
            if status == 429 and attempt == 0:
                await asyncio.sleep(1)
                continue
            break
        out["status"][str(status)] += 1
        out["kind"][kind] += 1
        if status not in ok:
            out["failures"].append((i, kind, status))


async def soak(url, *, requests, clients, seed=0, api_key=None, max_tokens_limit=32, max_body_bytes=4096):
    """Send the mix to a running server -> {"status": Counter, "kind": Counter, "failures": [...], ...}."""
    import httpx

    rng = np.random.default_rng(seed)
    kinds = rng.choice(len(KINDS), requests, p=WEIGHTS)
    jobs = [
        (i, KINDS[k], _request(KINDS[k], rng, max_tokens_limit, max_body_bytes)) for i, k in enumerate(kinds)
    ]
    jobs.reverse()
    out = {"status": collections.Counter(), "kind": collections.Counter(), "failures": []}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=120, headers=headers) as c:
        await asyncio.gather(*[_client(c, url, jobs, out) for _ in range(clients)])
        out["wall_s"] = time.perf_counter() - t0
        for _ in range(600):  # every slot free within 60 s (hung-up streams are cancelled)
            health = (await c.get(f"{url}/health")).json()
            if health.get("busy") == 0:
                break
            await asyncio.sleep(0.1)
        out["health"] = health
        r = await c.post(f"{url}/v1/completions", json={"prompt": "ab", "max_tokens": 3})
        out["after"] = r.status_code
    return out


# ---------------------------------------------------------------- the benchmark: a serve.py process


def _rss_mb(pid) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def write_tiny_run(out: Path, *, block_size=256, n_embd=128, n_layer=2):
    """A random-weight char-level GPT run directory (what tests build too): no download."""
    import jax

    from flaxgpt.data.tokenizers import CharTokenizer
    from flaxgpt.models.gpt import GPTConfig, init_params
    from flaxgpt.runs.checkpoint import Checkpointer

    chars = sorted(set(string.ascii_letters + " :\n.,?!'"))
    cfg = GPTConfig(vocab_size=len(chars), block_size=block_size, n_layer=n_layer, n_head=4, n_embd=n_embd)
    (out / "config.json").write_text(json.dumps({"model": {"kind": "gpt", **cfg.to_dict()}}))
    (out / "meta.json").write_text(json.dumps({"tokenizer": CharTokenizer(chars).to_meta()}))
    ckpt = Checkpointer(out, async_save=False)
    ckpt.save(1, {"params": init_params(cfg, jax.random.key(0))}, extra={})
    ckpt.close()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    import harness  # noqa: F401  the benchmarks' sys.path rule (here, not at the top: tests import soak)
    import serve_process

    with tempfile.TemporaryDirectory() as tmp:
        write_tiny_run(Path(tmp))
        cmd = ["--out_dir", tmp, "--model_name", "tiny"]
        cmd += [
            "--slots",
            str(a.slots),
            "--max_queue",
            "16",
            "--max_tokens",
            "32",
            "--max_body_bytes",
            "4096",
        ]
        cmd += ["--api_key", "sk-soak"]
        with serve_process.running(cmd, env={"JAX_PLATFORMS": "cpu"}) as (url, proc):
            asyncio.run(soak(url, requests=32, clients=8, seed=a.seed + 1, api_key="sk-soak"))  # warm-up
            before = _rss_mb(proc.pid)
            out = asyncio.run(
                soak(url, requests=a.requests, clients=a.clients, seed=a.seed, api_key="sk-soak")
            )
            after = _rss_mb(proc.pid)
    ok = not out["failures"] and out["health"].get("busy") == 0 and out["after"] == 200
    print(
        f"{a.requests} requests from {a.clients} clients in {out['wall_s']:.1f} s: statuses "
        f"{dict(out['status'])}; kinds {dict(out['kind'])}; failures {out['failures'][:5]}; "
        f"after: busy {out['health'].get('busy')}, a new request {out['after']}; "
        f"server RSS {before:.0f} MB before, {after:.0f} MB after; {'PASS' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
