"""What serve.py builds before the HTTP layer starts: the model (a run, pretrained weights or a preset's
random weights) and an engine thread over it. The HTTP layer (server.py) never imports a model."""

from __future__ import annotations

from flaxgpt.serve.scheduler import Scheduler


def load(out_dir=None, init_from=None, *, step=None, dtype="float32", random_init=False, quantize=None):
    """-> (run_dir.Run, model name) from a run directory, GPT-2 weights, or a preset's random weights;
    `quantize` ("int8" | "bf16"): weight-only quantized weights, as sample.py --quantize."""
    from pathlib import Path

    import jax

    from flaxgpt.data import tokenizers
    from flaxgpt.hf import gpt2 as hf
    from flaxgpt.models import gpt
    from flaxgpt.runs import run_dir

    if random_init:  # random weights of a preset's shape: load tests without a download
        config = gpt.GPTConfig.preset(init_from)
        run, name = run_dir.Run("gpt", config, gpt.init_params(config, jax.random.key(0)), None), init_from
    elif init_from:  # GPT-2 or a Llama-family directory, with its own tokenizer
        run, name = hf.load_pretrained_run(init_from), Path(init_from).name
    else:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.ERROR)  # orbax's notes about read-only directories
        run, name = run_dir.load_run(out_dir, step), Path(out_dir).resolve().name
        if run.kind != "gpt":
            raise SystemExit(f"error: {out_dir} holds a {run.kind!r} model; the server serves GPT models")
    if run.tokenizer is None:
        run = run._replace(tokenizer=tokenizers.get_tokenizer("gpt2"))
    run = run_dir.with_dtype(run, dtype) if dtype != "float32" else run
    if quantize:  # after the dtype, as sample.py: the engine decodes through the quantized matmuls
        config, params = gpt.quantize_params(run.config, run.params, quantize)
        run = run._replace(config=config, params=params)
    return run, name


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
