"""Serving under load: serve.py (continuous batching) vs the same requests one at a time.

    python benchmarks/serve_load.py                                   # 64 requests, 16 clients, GPT-2 124M
    python benchmarks/serve_load.py --requests 4 --clients 2 --min_new 4 --max_new 12 --skip_hf --pause 1
    python benchmarks/serve_load.py --prefill_ab --pause 10   # chunked prefill vs whole prompts, ~12 min
    python benchmarks/serve_load.py --adapters 8 --pause 10   # the load over 8 LoRA adapters vs the base
    git worktree add ../old d9de538 && python benchmarks/serve_load.py --against ../old --skip_hf
        # this checkout's serve.py vs another commit's, same load and flags (--this_args: more of its own)
    python benchmarks/serve_load.py --json_schema_fraction 0.5 --requests 32 --pause 5   # half constrained
    python benchmarks/serve_load.py --logprobs 5 --requests 32 --pause 5     # every request with logprobs

GPT-2 124M with random weights (no download), fp32, on 127.0.0.1. Requests: token-id prompts of
random lengths in [--min_prompt, --max_prompt], outputs in [--min_new, --max_new] tokens (decoded
to the end: ignore_eos), temperature 1, top_k 50, one seed each. Three sides, each in its own
process through benchmarks/harness.py (the order alternating every round, --pause seconds of rest
before each run, at least 4 rounds; the table shows medians over rounds):
  serve      serve.py --slots S; --clients concurrent streaming clients (httpx) share the requests
  flaxgpt    the same requests one after another with flaxgpt.decode.sampling.generate (batch 1)
  hf         the same with transformers' GPT2LMHeadModel.generate (batch 1, torch CPU)
With --prefill_ab the sides are instead serve.py with whole-prompt prefills (--prefill_chunk 0,
the engine before chunked prefill) and with --prefill_chunk N (its default), same load.
With --against DIR the sides are serve.py of the checkout in DIR (another commit: its own flaxgpt)
and this checkout's, same flags (--adapters K and --prefill_ab compose with it: each side its own).
With --adapters K the sides are serve.py without adapters (every request on the base) and serve.py
with K random all-linear LoRA adapters of rank --lora_rank (PEFT directories written by the side
itself; --max_adapters K: all resident), request i naming adapter i % K; both without the prefix
cache (the adapter server has none), same load; and, unless --skip_hf, transformers + peft with the
same K adapters loaded (PeftModel.load_adapter), one request at a time, set_adapter per request.
With --json_schema_fraction F and/or --logprobs K the sides are serve.py under the plain load and under
the same load with those features: a fraction F of the requests (spread evenly) sending
`response_format` json_schema (SCHEMA below; no ignore_eos: they end when the JSON is complete, the
same requests on the plain side running to --json_max_tokens), every request asking `logprobs: K`.
Constrained requests make the server decode one step at a time while any is running (each mask follows
the token before) and generate fewer tokens, so compare generated tokens/s.
Figures: generated tokens (serve: the usage each stream reports) / wall time; time to first token
(serve: from sending the request, queueing included; one at a time: from the start of its own
generation); inter-token latency per request = (last token time - first token time) / (tokens - 1),
p50 and p99 over requests.
Compilation is excluded (the server compiles before /health is ok; the others warm up first).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
import harness  # noqa: E402  (first: the benchmarks' one sys.path rule, see harness.py)
import serve_process  # noqa: E402

# a moderately nested record: bounded strings, integers and arrays, so a random model's JSON ends
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "name": {"type": "string", "maxLength": 10},
        "active": {"type": "boolean"},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 2},
        "scores": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "k": {"type": "string", "maxLength": 4},
                    "v": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["k", "v"],
                "additionalProperties": False,
            },
            "maxItems": 2,
        },
    },
    "required": ["id", "name", "active", "address", "tags", "scores"],
    "additionalProperties": False,
}
SMALL = {"n_layer": 4, "n_head": 4, "n_embd": 256}  # --small: GPT-2's vocabulary, a 4-layer 256-wide body
JSON_KEYS = ("json_complete", "json_requests")  # a constrained side's RESULT: replies complete, sent
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}


def make_requests(a, features: bool = True):
    """The load; with `features`, the --json_schema_fraction and --logprobs fields (else plain)."""
    rng = np.random.default_rng(a.seed)
    out = []
    for i in range(a.requests):
        p = int(rng.integers(a.min_prompt, a.max_prompt + 1))
        req = {
            "prompt": rng.integers(0, 50256, p).tolist(),
            "max_tokens": int(rng.integers(a.min_new, a.max_new + 1)),
            "seed": i,
            "ignore_eos": True,
        }
        if int((i + 1) * a.json_schema_fraction) > int(i * a.json_schema_fraction):  # both sides' length
            req["max_tokens"] = a.json_max_tokens
            if features:  # it ends when the JSON is complete
                req |= {"response_format": RESPONSE_FORMAT, "ignore_eos": False}
        if features and a.logprobs is not None:
            req["logprobs"] = a.logprobs
        out.append(req)
    return out


def pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def summary(name, wall, records, **extra):
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
        **extra,
    }


# ---------------------------------------------------------------- the server side


async def _client(url, queue, records, replies):
    """Streams requests off the shared queue; records (tokens, TTFT, ITL), and each constrained reply's
    text in `replies`."""
    import httpx

    async with httpx.AsyncClient(timeout=600) as c:
        while queue:
            req = queue.pop(0)
            body = {**req, "stream": True, "temperature": 1.0, "top_k": 50}
            body["stream_options"] = {"include_usage": True}  # the tokens generated (JSON ends early)
            start, times, text, n = time.perf_counter(), [], "", req["max_tokens"]
            async with c.stream("POST", f"{url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()}")
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:
                            times.append(time.perf_counter())
                        if chunk["choices"]:
                            text += chunk["choices"][0]["text"]
                        if chunk.get("usage"):
                            n = chunk["usage"]["completion_tokens"]
            if "response_format" in req:
                replies.append(text)
            itl = (times[-1] - times[0]) / (n - 1) if n > 1 and len(times) > 1 else None
            records.append((n, times[0] - start, itl))


def run_server_side(a, reqs):
    if a.side == "serve_plain":
        reqs = make_requests(a, features=False)
    cmd = []
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
    if a.side in ("serve_base", "serve_adapters"):
        cmd += ["--prefill_chunk", str(a.prefill_chunk), "--prefix_cache_tokens", "0"]
    else:
        cmd += ["--prefill_chunk", str(0 if a.side == "serve_whole" else a.prefill_chunk)]  # whole: 0
    with contextlib.ExitStack() as stack:
        if a.small:
            run = stack.enter_context(tempfile.TemporaryDirectory())
            write_small_run(Path(run))
            cmd += ["--out_dir", run, "--model_name", "gpt2"]
        else:
            cmd += ["--init_from", "gpt2", "--random_init"]
        if a.side == "serve_adapters":
            root = stack.enter_context(tempfile.TemporaryDirectory())
            names = write_adapters(root, a.adapters, a.lora_rank)
            cmd += [f"--adapter={n}={root}/{n}" for n in names]
            cmd += ["--max_adapters", str(a.adapters), "--max_lora_rank", str(a.lora_rank)]
            reqs = [{**r, "model": names[i % len(names)]} for i, r in enumerate(reqs)]
        cmd += [] if a.against_side else a.this_args.split()
        return _serve_and_load(a, cmd, reqs, root=a.against if a.against_side else serve_process.ROOT)


def write_small_run(out: Path):
    """A random GPT of SMALL's shape with GPT-2's vocabulary and tokenizer, as a run directory."""
    import jax

    from flaxgpt.data.tokenizers import get_tokenizer
    from flaxgpt.models.gpt import GPTConfig, init_params
    from flaxgpt.runs.checkpoint import Checkpointer

    cfg = GPTConfig.preset("gpt2", **SMALL)
    (out / "config.json").write_text(json.dumps({"model": {"kind": "gpt", **cfg.to_dict()}}))
    (out / "meta.json").write_text(json.dumps({"tokenizer": get_tokenizer("gpt2").to_meta()}))
    ckpt = Checkpointer(out, async_save=False)
    ckpt.save(1, {"params": init_params(cfg, jax.random.key(0))}, extra={})
    ckpt.close()


def write_adapters(root, k: int, rank: int) -> list[str]:
    """k PEFT adapters for GPT-2's shape (all-linear, random A and B: every one changes the model)."""
    import jax

    from flaxgpt.hf import peft
    from flaxgpt.models import lora
    from flaxgpt.models.gpt import GPTConfig

    config = GPTConfig.preset("gpt2")
    spec = lora.LoraSpec.make(config, rank, 2.0 * rank)
    names = [f"lora{i}" for i in range(k)]
    for i, name in enumerate(names):
        adapters = lora.init_adapters(config, spec, jax.random.key(i))
        adapters = jax.tree_util.tree_map_with_path(  # B random too (init gives zeros)
            lambda path, x, i=i: (
                x
                if path[-1].key.endswith("_a")
                else 0.01 * jax.random.normal(jax.random.key(1000 + i), x.shape)
            ),
            adapters,
        )
        peft.export_adapter(config, spec, adapters, f"{root}/{name}", base="gpt2")
    return names


def _serve_and_load(a, cmd, reqs, root):
    t = time.perf_counter()
    with serve_process.running(cmd, root=root) as (url, _):
        print(f"serve: ready after {time.perf_counter() - t:.0f} s (load + compile)", file=sys.stderr)
        records, queue, replies = [], list(reqs), []
        t0 = time.perf_counter()

        async def main():
            await asyncio.gather(*[_client(url, queue, records, replies) for _ in range(a.clients)])

        asyncio.run(main())
        wall = time.perf_counter() - t0
        prefill = f"prefill chunks of {a.prefill_chunk}" if a.side != "serve_whole" else "whole prompts"
        if a.side in ("serve_base", "serve_adapters"):
            prefill = (
                "the base" if a.side == "serve_base" else f"{a.adapters} LoRA adapters, rank {a.lora_rank}"
            )
        name = f"serve ({prefill}, slots {a.slots}, {a.clients} clients)"
        if a.against:
            name = f"{'against' if a.against_side else 'this checkout'}: {name}"
        extra = {}
        if any("response_format" in r for r in reqs):
            complete = sum(_is_record(t) for t in replies)
            name += f", {len(replies)} of {len(reqs)} json_schema"
            extra = dict(zip(JSON_KEYS, (complete, len(replies))))
        if any("logprobs" in r for r in reqs):
            name += f", logprobs {a.logprobs}"
        return summary(name, wall, records, **extra)


def _is_record(text: str) -> bool:
    """A reply that parses and has the schema's keys (one cut by --json_max_tokens does not)."""
    try:
        return set(json.loads(text)) == set(SCHEMA["properties"])
    except (ValueError, TypeError):
        return False


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

    torch.manual_seed(0)
    one = _hf_one(transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval())
    one({"prompt": reqs[0]["prompt"], "max_tokens": 4, "seed": 0})  # warm up
    name = f"transformers {transformers.__version__} (torch {torch.__version__}) generate one at a time"
    return _sequential(name, reqs, one)


def run_hf_peft_side(a, reqs):
    """transformers + peft, one request at a time, the adapter of each request switched in first
    (PeftModel.set_adapter over all K adapters loaded: the way one process serves many with peft)."""
    import peft
    import torch
    import transformers

    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()
    with tempfile.TemporaryDirectory() as root:
        names = write_adapters(root, a.adapters, a.lora_rank)  # the serve side's adapters, same seeds
        model = peft.PeftModel.from_pretrained(base, f"{root}/{names[0]}", adapter_name=names[0])
        for n in names[1:]:
            model.load_adapter(f"{root}/{n}", adapter_name=n)
    model.eval()
    one_hf = _hf_one(model)

    def one(req, i=[0]):  # noqa: B006  (request i names adapter i % K, as on the serve side)
        model.set_adapter(names[i[0] % len(names)])
        i[0] += 1
        return one_hf(req)

    one_hf({"prompt": reqs[0]["prompt"], "max_tokens": 4, "seed": 0})  # warm up
    versions = f"transformers {transformers.__version__}, peft {peft.__version__}, torch {torch.__version__}"
    return _sequential(f"{versions}: {a.adapters} adapters, one request at a time", reqs, one)


def _hf_one(model):
    """One request through a torch model's generate: (start time, each new token's time)."""
    import torch
    from transformers.generation.streamers import BaseStreamer

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
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=req["max_tokens"],
                min_new_tokens=req["max_tokens"], do_sample=True, temperature=1.0, top_k=50,
                pad_token_id=50256, streamer=clock,
            )  # fmt: skip
        return start, clock.times[1:]  # the first put() is the prompt

    return one


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
    p.add_argument(
        "--prefill_chunk",
        type=int,
        default=256,
        help="serve.py --prefill_chunk (prompt tokens per engine turn)",
    )
    p.add_argument(
        "--prefill_ab",
        action="store_true",
        help="two serve.py sides instead: --prefill_chunk 0 (whole prompts: the old engine) and N",
    )
    p.add_argument(
        "--adapters",
        type=int,
        default=0,
        help="two serve.py sides instead: every request on the base, and requests spread over K adapters",
    )
    p.add_argument("--lora_rank", type=int, default=8, help="the adapters' rank (--adapters)")
    p.add_argument(
        "--json_schema_fraction",
        type=float,
        default=0.0,
        help="two serve.py sides instead: the plain load, and this fraction of it sending a json_schema",
    )
    p.add_argument(
        "--json_max_tokens",
        type=int,
        default=160,
        help="a constrained request's max_tokens (it ends earlier)",
    )
    p.add_argument(
        "--logprobs",
        type=int,
        default=None,
        help="two serve.py sides instead: the plain load, and every request asking logprobs K (0-20)",
    )
    p.add_argument(
        "--against", default=None, help="two serve.py sides: this checkout's and DIR's (a worktree)"
    )
    p.add_argument("--against_side", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--this_args", default="", help="serve.py flags for this checkout's side only, e.g. '--mixed_step 64'"
    )
    p.add_argument(
        "--small",
        action="store_true",
        help="serve.py sides: a random 4-layer 256-wide GPT with GPT-2's vocabulary instead of GPT-2 124M "
        "(a cheaper forward pass: the host's share of each step shows more)",
    )
    p.add_argument("--skip_hf", action="store_true")
    p.add_argument("--torch_python", default=sys.executable, help="interpreter for the transformers side")
    harness.add_arguments(p)
    p.add_argument(
        "--side",
        default=None,
        choices=[
            "serve",
            "serve_plain",
            "serve_whole",
            "serve_base",
            "serve_adapters",
            "flaxgpt",
            "hf",
            "hf_peft",
        ],
        help=argparse.SUPPRESS,
    )
    a = p.parse_args(argv)
    for lo, hi in (("min_prompt", "max_prompt"), ("min_new", "max_new")):
        if getattr(a, lo) > getattr(a, hi):
            p.error(f"--{lo} {getattr(a, lo)} is above --{hi} {getattr(a, hi)}")
    if not 0 <= a.json_schema_fraction <= 1:
        p.error(f"--json_schema_fraction must be in [0, 1], got {a.json_schema_fraction}")
    if a.json_schema_fraction and a.max_prompt + a.json_max_tokens > a.max_len:
        p.error(
            f"--max_prompt {a.max_prompt} + --json_max_tokens {a.json_max_tokens} exceeds "
            f"--max_len {a.max_len}"
        )
    if a.logprobs is not None and not 0 <= a.logprobs <= 20:
        p.error(f"--logprobs must be in [0, 20], got {a.logprobs}")
    two_sides = a.against or a.prefill_ab or a.json_schema_fraction or a.logprobs is not None
    if a.small and not two_sides:
        p.error(
            "--small is for two serve.py sides (--json_schema_fraction, --logprobs, --prefill_ab, --against)"
        )
    return a


def main(argv=None):
    a = parse(argv)
    reqs = make_requests(a)
    if a.side:
        run = {
            s: run_server_side
            for s in ("serve", "serve_plain", "serve_whole", "serve_base", "serve_adapters")
        }
        run["flaxgpt"] = run_flaxgpt_side
        result = {**run, "hf": run_hf_side, "hf_peft": run_hf_peft_side}[a.side](a, reqs)
        return harness.print_result(result)
    load = f"{a.requests} requests, {a.clients} clients, slots {a.slots}"
    lengths = f"prompts {a.min_prompt}-{a.max_prompt}, outputs {a.min_new}-{a.max_new} tokens"
    print(f"python {platform.python_version()}, {os.cpu_count()} cores; {load}; {lengths}")
    args = [*(argv if argv is not None else sys.argv[1:])]
    env = {"PYTHONPATH": str(ROOT)}
    if a.against:
        return against_ab(a, args, env)
    if a.prefill_ab:
        return prefill_ab(a, args, env)
    if a.adapters:
        return adapters_ab(a, args, env)
    if a.json_schema_fraction or a.logprobs is not None:
        return features_ab(a, args, env)
    sides = [
        harness.Side("one at a time", [sys.executable, __file__, *args, "--side", "flaxgpt"], env=env),
        harness.Side("serve.py", [sys.executable, __file__, *args, "--side", "serve"], env=env),
    ]
    figures = [
        harness.Figure("tok/s vs flaxgpt one at a time", "serve.py", "tok_s", "one at a time", "tok_s")
    ]
    if not a.skip_hf:
        sides.append(harness.Side("transformers", [a.torch_python, __file__, *args, "--side", "hf"], env=env))
        figures.append(
            harness.Figure(
                "tok/s vs transformers one at a time", "serve.py", "tok_s", "transformers", "tok_s"
            )
        )
    report = harness.compare(sides, figures, rounds=a.rounds, pause=a.pause)
    print_medians(report, sides)


def against_ab(a, args, env):
    """This checkout's serve.py against DIR's, the same load and flags, alternating."""
    side = "serve_adapters" if a.adapters else "serve"
    old, new = f"serve.py of {a.against}", "serve.py (this checkout)"
    sides = [
        harness.Side(old, [sys.executable, __file__, *args, "--side", side, "--against_side"], env=env),
        harness.Side(new, [sys.executable, __file__, *args, "--side", side], env=env),
    ]
    two_servers(a, sides, "this / against")


def prefill_ab(a, args, env):
    """serve.py with whole-prompt prefills (--prefill_chunk 0) against chunked prefills, alternating."""
    whole, chunked = "whole prompts", f"prefill chunks of {a.prefill_chunk}"
    sides = [
        harness.Side(whole, [sys.executable, __file__, *args, "--side", "serve_whole"], env=env),
        harness.Side(chunked, [sys.executable, __file__, *args, "--side", "serve"], env=env),
    ]
    two_servers(a, sides, "chunked / whole")


def two_servers(a, sides, what: str):
    """Two serve.py sides (reference first) on the same load: tok/s, TTFT and ITL p50 / p99 ratios."""
    ref, side = sides[0].name, sides[1].name
    lower = dict(higher_is_better=False)
    figures = [harness.Figure(f"tok/s ({what})", side, "tok_s", ref, "tok_s")] + [
        harness.Figure(f"{label} {q} (lower: > 1x)", side, f"{key}_{q}", ref, f"{key}_{q}", **lower)
        for label, key in (("TTFT", "ttft"), ("ITL", "itl"))
        for q in ("p50", "p99")
    ]
    report = harness.compare(sides, figures, rounds=a.rounds, pause=a.pause)
    print_medians(report, sides)
    return report


def features_ab(a, args, env):
    """serve.py on the plain load against the same load with structured outputs and/or logprobs."""
    wants = [f"{a.json_schema_fraction:g} json_schema"] * bool(a.json_schema_fraction)
    wants += [f"logprobs {a.logprobs}"] * (a.logprobs is not None)
    plain, features = "plain", " + ".join(wants)
    sides = [
        harness.Side(plain, [sys.executable, __file__, *args, "--side", "serve_plain"], env=env),
        harness.Side(features, [sys.executable, __file__, *args, "--side", "serve"], env=env),
    ]
    report = two_servers(a, sides, f"{features} / plain")
    if a.json_schema_fraction:
        done = [f"{c:.0f}/{n:.0f}" for c, n in zip(*(report.values(features, k) for k in JSON_KEYS))]
        print(f"json_schema replies complete (parse, every key) per round: {' '.join(done)}")


def adapters_ab(a, args, env):
    """serve.py on the base alone against serve.py with the load spread over --adapters adapters."""
    base, spread = "base", f"{a.adapters} adapters"
    sides = [
        harness.Side(base, [sys.executable, __file__, *args, "--side", "serve_base"], env=env),
        harness.Side(spread, [sys.executable, __file__, *args, "--side", "serve_adapters"], env=env),
    ]
    lower = dict(higher_is_better=False)
    figures = [
        harness.Figure("tok/s (adapters / base)", spread, "tok_s", base, "tok_s"),
        harness.Figure("TTFT p50 (lower: > 1x)", spread, "ttft_p50", base, "ttft_p50", **lower),
        harness.Figure("ITL p50 (lower: > 1x)", spread, "itl_p50", base, "itl_p50", **lower),
        harness.Figure("ITL p99 (lower: > 1x)", spread, "itl_p99", base, "itl_p99", **lower),
    ]
    if not a.skip_hf:
        peft_side = "transformers + peft"
        sides.append(harness.Side(peft_side, [a.torch_python, __file__, *args, "--side", "hf_peft"], env=env))
        figures.append(
            harness.Figure("tok/s (adapters / transformers + peft)", spread, "tok_s", peft_side, "tok_s")
        )
    report = harness.compare(sides, figures, rounds=a.rounds, pause=a.pause)
    print_medians(report, sides)


def print_medians(report, sides):
    print(report.table() + "\n")
    print("medians over rounds:")
    print("| side | requests | tokens | wall s | tok/s | TTFT p50 / p99 s | ITL p50 / p99 ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for s in sides:
        m = {
            k: float(np.median(report.values(s.name, k))) for k in ("wall_s", "tok_s", "ttft_p50", "ttft_p99")
        }
        m |= {k: 1e3 * float(np.median(report.values(s.name, k))) for k in ("itl_p50", "itl_p99")}
        r = report.results[0][s.name]
        print(
            f"| {r['side']} | {r['requests']} | {r['tokens']} | {m['wall_s']:.1f} | {m['tok_s']:.1f} | "
            f"{m['ttft_p50']:.2f} / {m['ttft_p99']:.2f} | {m['itl_p50']:.0f} / {m['itl_p99']:.0f} |"
        )


if __name__ == "__main__":
    main()
