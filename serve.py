"""Serve a GPT over HTTP with OpenAI's completions API and continuous batching.

    python serve.py --out_dir out/shakespeare_char_cpu                 # a training run
    python serve.py --init_from gpt2 --slots 8 --port 8000             # GPT-2 weights (HF cache or download)
    python serve.py --init_from gpt2 --random_init                     # GPT-2's shape, random weights
    python serve.py --init_from gpt2 --quantize int8                   # int8 weights: faster decoding
    python serve.py --init_from path/to/Meta-Llama-3-8B --dtype bfloat16 --mesh 8 --slots 16 \\
        --max_len 8192 --prefill_chunk 128       # split over 8 devices (a v5e-8): docs/serving_ops.md
    python serve.py --init_from path/to/SmolLM2-135M --adapter path/to/peft_adapter   # base + LoRA merged
    python serve.py --init_from path/to/SmolLM2-135M --adapter sql=adapters/sql --adapter chat=out/lora_run
        # many LoRA adapters, unmerged: a request's "model" picks one ("sql", "chat" or the base's name)
    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"prompt": "ROMEO:", "max_tokens": 50, "temperature": 0.8, "top_k": 200}'

Every slot is a row of one KV cache of --max_len positions (default the model's block_size); a
request needs prompt + max_tokens <= max_len. All programs are compiled before /health says ok.
SIGTERM drains: running requests finish, new ones get 503, then the process exits.
Operations (docs/serving_ops.md): --api_key (or $FLAXGPT_API_KEY), GET /metrics (Prometheus), one
access-log line per request on stderr, --max_tokens and --max_body_bytes limits (400 / 413).
The keys and values live in one pool of pages (--prefix_block positions each): prompts sharing a
prefix read its pages in place (--prefix_cache_tokens), long prompts are prefilled in chunks of
--prefill_chunk tokens between decode steps, under a budget of --max_num_batched_tokens a turn.
LoRA adapters (--adapter NAME=DIR, --max_adapters, --max_cpu_adapters; POST /v1/load_lora_adapter and
/v1/unload_lora_adapter with --allow_runtime_lora --adapter_root DIR) go with all of it, --mesh and
--quantize included: docs/serving_ops.md.
Started by srun, mpirun, SkyPilot (num_nodes > 1) or a JobSet, every process joins the job and
--mesh spans all their devices: process 0 serves, the others replay its engine calls
(docs/serving_ops.md, "Several hosts").
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default=None, help="a training run's directory")
    p.add_argument("--init_from", default=None, help="GPT-2 weights: gpt2, gpt2-medium, ... or a directory")
    p.add_argument("--random_init", action="store_true", help="with --init_from PRESET: random weights")
    p.add_argument(
        "--adapter",
        action="append",
        default=[],
        help="NAME=DIR: a LoRA adapter (PEFT directory or LoRA run) served unmerged as model NAME "
        "(repeatable); DIR alone: a PEFT adapter merged into --init_from",
    )
    p.add_argument(
        "--max_adapters",
        type=int,
        default=None,
        help="adapters resident on the device at once (default 4 with NAME=DIR adapters or "
        "--allow_runtime_lora, else 0: none); the rest wait in host memory",
    )
    p.add_argument(
        "--allow_runtime_lora",
        action="store_true",
        help="let clients load and unload adapters while serving (POST /v1/load_lora_adapter, "
        "/v1/unload_lora_adapter; off: both answer 403, as vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING): "
        "anyone with the API key can then make the server read any adapter under --adapter_root and "
        "hold it in memory. Adapters given with --adapter NAME=DIR are served either way",
    )
    p.add_argument(
        "--adapter_root",
        default=None,
        help="DIR, required with --allow_runtime_lora: the only directory a runtime lora_path is read "
        "from (relative to DIR, or absolute inside it; '..' and symlinks leading out are refused). No "
        "default: the working directory may hold checkpoints, keys or data no client should reach",
    )
    p.add_argument(
        "--max_cpu_adapters",
        type=int,
        default=None,
        help="adapters whose weights stay in host memory (default: every one loaded); over N, the least "
        "recently requested one not on the device is dropped and read again from its directory when a "
        "request names it. >= --max_adapters",
    )
    p.add_argument("--max_lora_rank", type=int, default=16, help="the highest adapter rank a slot holds")
    p.add_argument(
        "--step", type=int, default=None, help="checkpoint step of --out_dir (default: the latest)"
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--quantize",
        default=None,
        help="weight-only quantized weights: int8, bf16, int4 (int4_g64, int4_g32): models/quantize.py MODES",
    )
    p.add_argument("--slots", type=int, default=8, help="requests decoded together (rows of the KV cache)")
    p.add_argument(
        "--mesh",
        type=int,
        default=1,
        help="devices the model is split over (a data 1 x fsdp N mesh, flaxgpt aot --serve_devices N's): "
        "each loads only its slices of the MLP and vocabulary weights (sharding.SERVE_RULES) and holds "
        "slots / N of the KV cache (default 1: one device)",
    )
    p.add_argument(
        "--max_len", type=int, default=None, help="context window per request (default block_size)"
    )
    p.add_argument("--chunk", type=int, default=4, help="decode steps between admitting new requests")
    p.add_argument("--max_queue", type=int, default=64, help="waiting requests beyond the slots; then 429")
    p.add_argument(
        "--prefill_chunk",
        type=int,
        default=256,
        help="prompt tokens prefilled per engine turn while others decode (0: a whole prompt at once)",
    )
    p.add_argument(
        "--speculative_ngram",
        type=int,
        default=0,
        help="speculative decoding without a draft model: up to this many tokens drafted per step by "
        "prompt lookup (the tokens that followed the latest earlier occurrence of the last 1-3 tokens) "
        "and checked in the same model call, for greedy requests (0: off)",
    )
    p.add_argument(
        "--draft",
        default=None,
        help="a smaller model with the same tokenizer (a run directory, a Hugging Face directory or a "
        "GPT-2 name) that drafts --speculative_tokens tokens per step for greedy requests, checked by "
        "the served model in one call (replies unchanged)",
    )
    p.add_argument(
        "--speculative_tokens",
        type=int,
        default=4,
        help="tokens the --draft model proposes per step",
    )
    p.add_argument(
        "--max_num_batched_tokens",
        type=int,
        default=None,
        help="tokens one engine turn runs while slots decode: one per decoding slot, the rest prefill "
        "chunks, oldest prompt first (default: 2048, at least --prefill_chunk, + --slots)",
    )
    p.add_argument(
        "--mixed_step",
        type=int,
        default=0,
        help="prompts whose rest is at most this many tokens (a chat turn after a prefix-cache hit) run "
        "it in the next decode step, beside the decoding slots, instead of a prefill call of their own "
        "(one [slots, T] program per width T: powers of two from 8, and this; 0: off)",
    )
    p.add_argument(
        "--prefix_cache_tokens",
        type=int,
        default=4096,
        help="KV positions kept for reuse by prompts sharing a prefix (0: no prefix cache)",
    )
    p.add_argument(
        "--prefix_block",
        type=int,
        default=16,
        help="the KV page size in positions (the prefix cache's granularity); --max_len must be a multiple",
    )
    p.add_argument(
        "--api_key",
        default=os.environ.get("FLAXGPT_API_KEY"),
        help="required as 'Authorization: Bearer KEY' on every route but /health (default: $FLAXGPT_API_KEY)",
    )
    p.add_argument("--max_tokens", type=int, default=None, help="the most max_tokens a request may ask for")
    p.add_argument("--max_body_bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    p.add_argument("--model_name", default=None, help="the model id clients send (default: the run's name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    a = p.parse_args(argv)
    if (a.out_dir is None) == (a.init_from is None):
        p.error("give exactly one of --out_dir RUN and --init_from NAME")
    if a.random_init and not a.init_from:
        p.error("--random_init needs --init_from PRESET (e.g. gpt2)")
    merged = [x for x in a.adapter if "=" not in x]
    a.adapters = [tuple(x.split("=", 1)) for x in a.adapter if "=" in x]  # (name, directory)
    if len(merged) > 1:
        p.error("one --adapter DIR is merged into the base; serve several as --adapter NAME=DIR")
    a.adapter = merged[0] if merged else None
    if a.adapter and (not a.init_from or a.random_init):
        p.error("--adapter DIR goes with --init_from BASE (a LoRA run's --out_dir merges its own)")
    names = [n for n, _ in a.adapters]
    if any(not n or not d for n, d in a.adapters) or len(set(names)) != len(names):
        p.error(f"--adapter NAME=DIR: names must be non-empty and distinct, got {names}")
    if a.max_adapters is None:
        a.max_adapters = 4 if a.adapters or a.allow_runtime_lora else 0
    wants_slots = a.adapters or a.allow_runtime_lora
    if a.max_adapters < 0 or a.max_lora_rank < 1 or (wants_slots and not a.max_adapters):
        p.error(
            "--max_adapters must be >= 1 with --adapter NAME=DIR or --allow_runtime_lora (and >= 0), "
            "--max_lora_rank >= 1"
        )
    if a.allow_runtime_lora != (a.adapter_root is not None):
        p.error(
            "--allow_runtime_lora and --adapter_root DIR go together: DIR is where runtime adapters are read"
        )
    if a.adapter_root is not None and not os.path.isdir(a.adapter_root):
        p.error(
            f"--adapter_root {a.adapter_root} is not a directory: give the directory holding the adapters"
        )
    if a.max_cpu_adapters is not None and a.max_cpu_adapters < max(a.max_adapters, 1):
        p.error(
            f"--max_cpu_adapters {a.max_cpu_adapters} is below --max_adapters {a.max_adapters}: an adapter "
            "on the device stays in host memory too"
        )
    if a.mesh < 1:
        p.error(f"--mesh must be >= 1 (devices), got {a.mesh}")
    if a.draft and a.speculative_ngram:
        p.error("--draft and --speculative_ngram are two ways to draft tokens: give one")
    if a.draft and a.speculative_tokens < 1:
        p.error(f"--speculative_tokens must be >= 1 with --draft, got {a.speculative_tokens}")
    for name in ("prefill_chunk", "prefix_cache_tokens", "speculative_ngram", "mixed_step", "max_queue"):
        if getattr(a, name) < 0:
            p.error(f"--{name} must be >= 0, got {getattr(a, name)}")
    for name in ("prefix_block", "max_body_bytes", "max_tokens", "max_num_batched_tokens"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(a, name)}")
    if a.max_len and a.max_len % a.prefix_block:
        p.error(f"--max_len {a.max_len} is not a multiple of the page size --prefix_block {a.prefix_block}")
    return a


def main(argv=None):
    a = parse_args(argv)
    from flaxgpt import extras, runtime

    extras.require("serve", "python serve.py")  # before loading anything
    if not a.random_init:
        extras.require_hf(a.init_from, "--init_from")

    runtime.setup()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("flaxgpt.serve").setLevel(logging.INFO)  # and its access log, a line per request
    import jax

    from flaxgpt import cluster
    from flaxgpt.serve import launch, server

    # srun -n 2, mpirun, SkyPilot num_nodes 2, a JobSet: every process joins (None: one process) and
    # builds the same engine over all the job's devices; process 0 serves, the others replay its plans
    how = cluster.join()
    launch.check_replayable(
        max_adapters=a.max_adapters, allow_runtime_lora=a.allow_runtime_lora,
        processes=1 if how is None else jax.process_count(),
    )  # fmt: skip
    mesh = launch.serving_mesh(a.mesh, a.slots)  # more devices than there are: one line, nothing loaded
    run, name = launch.load(
        a.out_dir,
        a.init_from,
        step=a.step,
        dtype=a.dtype,
        random_init=a.random_init,
        quantize=a.quantize,
        adapter=a.adapter,
        mesh=mesh,
    )
    config, tok = run.config, run.tokenizer
    draft = None
    if a.draft:  # the same dtype and devices as the served model
        draft_run, _ = launch.load(None, a.draft, dtype=a.dtype, mesh=mesh)
        if draft_run.config.vocab_size != config.vocab_size:
            raise SystemExit(
                f"error: --draft {a.draft} has {draft_run.config.vocab_size} tokens, the served model "
                f"{config.vocab_size}: a draft must share its tokenizer"
            )
        draft = (draft_run.config, draft_run.params)
    drafting = bool(a.draft or a.speculative_ngram)
    if a.max_len and a.max_len > config.block_size:  # the window the model has positions for: said
        logging.getLogger("flaxgpt.serve").warning(
            "--max_len %d is past the model's context of %d positions; serving %d",
            a.max_len, config.block_size, config.block_size,
        )  # fmt: skip
    if drafting and a.mixed_step:  # every step then verifies drafts: prompt tails take the two programs
        logging.getLogger("flaxgpt.serve").warning(
            "--mixed_step is unused with drafting (each step verifies drafts); prompts prefill on their own"
        )
    sched = launch.scheduler_for(
        config,
        run.params,
        tok,
        slots=a.slots,
        max_len=a.max_len,
        chunk=a.chunk,
        max_queue=a.max_queue,
        max_tokens=a.max_tokens,
        prefill_chunk=a.prefill_chunk or None,
        max_num_batched_tokens=a.max_num_batched_tokens,
        prefix_cache_tokens=a.prefix_cache_tokens,
        prefix_block=a.prefix_block,
        adapters=a.adapters,
        max_adapters=a.max_adapters,
        max_lora_rank=a.max_lora_rank,
        adapter_root=a.adapter_root,
        max_cpu_adapters=a.max_cpu_adapters,
        mesh=mesh,
        speculate=a.speculative_ngram or (a.speculative_tokens if a.draft else 0),
        draft=draft,
        mixed=0 if drafting else a.mixed_step,
    )
    if launch.follows(sched):  # a process > 0 of a job: it replayed process 0's engine calls, now done
        return 0
    W = sched.engine.max_len
    logging.getLogger("flaxgpt.serve").info(
        "%s: %d slots x %d positions (pages of %d), %d compiled programs (prompt buckets %s); compiling",
        name,
        a.slots,
        W,
        a.prefix_block,
        sched.engine.n_programs,
        sched.engine.buckets,
    )
    sched.start()
    app = server.create_app(
        sched,
        tok,
        model=a.model_name or name,
        max_len=W,
        vocab_size=config.vocab_size,
        api_key=a.api_key,
        max_body_bytes=a.max_body_bytes,
    )
    print(
        f"serving {a.model_name or name} on http://{a.host}:{a.port}; compiling (GET /health is ok once "
        "compiled, and a `ready on` line says so)",
        flush=True,
    )
    ready = (  # printed once compiled and listening (server.serve)
        f"ready on http://{a.host}:{a.port}: model {a.model_name or name}, context {W} tokens "
        "(a prompt plus max_tokens must fit)"
    )
    server.serve(app, sched, host=a.host, port=a.port, ready_line=ready)
    launch.stop_followers(sched)  # the other processes of a job return from replaying
    return 0


if __name__ == "__main__":
    from flaxgpt import errors

    sys.exit(errors.run_cli(main))  # bad input found at start-up (a mesh that does not fit): one line
