"""What serve.py builds before the HTTP layer starts: the model (a run, pretrained weights or a preset's
random weights) and an engine thread over it. The HTTP layer (server.py) never imports a model."""

from __future__ import annotations

import logging

from flaxgpt.serve.scheduler import Scheduler


def load(
    out_dir=None,
    init_from=None,
    *,
    step=None,
    dtype="float32",
    random_init=False,
    quantize=None,
    adapter=None,
):
    """-> (Run, model name) from a run directory, pretrained weights (flaxgpt.load), or a preset's
    random weights; `dtype` and `quantize` ("int8" | "bf16") as flaxgpt.load (cast, then quantize);
    `adapter`: a PEFT LoRA directory merged into init_from's weights (a LoRA run merges its own)."""
    from pathlib import Path

    from flaxgpt import loader

    dtype = None if dtype == "float32" else dtype
    if random_init:  # random weights of a preset's shape: load tests without a download
        return loader.init(init_from, dtype=dtype, quantize=quantize), init_from
    if not init_from:
        loader.require_run(out_dir)
    source = init_from or out_dir
    run = loader.load(source, step=step, dtype=dtype, quantize=quantize, adapter=adapter)
    if run.kind != "gpt":
        raise SystemExit(f"error: {source} holds a {run.kind!r} model; the server serves GPT models")
    return run, Path(init_from).name if init_from else Path(out_dir).resolve().name


def scheduler_for(
    config,
    params,
    tokenizer,
    *,
    slots=8,
    max_len=None,
    chunk=4,
    max_queue=64,
    max_tokens=None,
    prefill_chunk=None,
    prefix_cache_tokens=0,
    prefix_block=16,
) -> Scheduler:
    """The engine (a window of max_len, default block_size) and its thread, not started.
    prefill_chunk: prompt tokens per prefill call (None: a whole prompt); prefix_cache_tokens: the
    prefix cache's budget in positions (0: off), rounded down to blocks of prefix_block."""
    from flaxgpt.models import gpt
    from flaxgpt.models.cache import KVCache
    from flaxgpt.serve.engine import Engine

    W = min(max_len or config.block_size, config.block_size)
    if prefix_cache_tokens and KVCache.for_config(config, 0, W).has_rings:
        # window layers keep only their window (rings), the prefix cache every position's keys
        logging.getLogger("flaxgpt.serve").warning(
            "prefix cache off: this model's sliding-window layers keep ring buffers of their window"
        )
        prefix_cache_tokens = 0
    engine = Engine(
        gpt.step_fn(config, params),
        lambda b: KVCache.for_config(config, b, W),
        slots=slots,
        chunk=chunk,
        prefill_chunk=prefill_chunk,
        prefix_block=prefix_block,
        prefix_blocks=prefix_cache_tokens // prefix_block,
    )
    return Scheduler(engine, tokenizer, max_queue=max_queue, max_tokens=max_tokens)
