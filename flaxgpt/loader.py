"""One loader for every model flaxgpt can run: a training run, Hugging Face weights, or a GPT-2 name.

    run = flaxgpt.load("out/shakespeare_char")                    # a run directory: the latest step
    run = flaxgpt.load("out/run", step=2000, dtype="bfloat16")    # weights cast, computing in bfloat16
    run = flaxgpt.load("gpt2", quantize="int8")                   # GPT-2 from the HF cache or the hub
    run = flaxgpt.load("path/to/SmolLM2-135M")                    # a GPT-2 or Llama-family HF directory
    kind, config, params, tokenizer = run                         # Run: "gpt" | "seq2seq"

sample.py, serve.py, `flaxgpt eval` and `flaxgpt hf export` load through `load`; `compact` is the one
place that casts (`dtype`) and then quantizes (`quantize`). Bad input is a one-line ValueError / OSError.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from flaxgpt.runs.run_dir import Run

DTYPES = ("float32", "bfloat16", "float16")


def is_run_dir(source) -> bool:
    """A flaxgpt training run: meta.json or checkpoints/, or a config.json with a `model` entry
    (a Hugging Face config.json has `model_type` instead)."""
    path = Path(source)
    if (path / "meta.json").is_file() or (path / "checkpoints").is_dir():
        return True
    try:
        return "model" in json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False


def require_run(source) -> None:
    """A one-line RunError unless `source` is a training run's directory: where the user named a run
    (--out_dir), before `load`, which would look a missing directory's name up on the hub."""
    from flaxgpt.runs.run_dir import HINT, RunError

    if not is_run_dir(source):
        what = "is not a training run" if Path(source).is_dir() else "is not a directory"
        raise RunError(f"{source} {what}; {HINT}")


def load(
    source,
    *,
    step: int | None = None,
    dtype: str | None = None,
    quantize: str | None = None,
    adapter: str | None = None,
) -> Run:
    """The model at `source` as a Run(kind, config, params, tokenizer), params on one local device.

    `source`: a training run's directory (checkpoint `step`, default the latest), a Hugging Face
    directory (GPT-2 or Llama family: config.json + safetensors), or a hub name (gpt2 .. gpt2-xl)
    found in the HF cache or downloaded. `dtype` casts the weights and sets the compute dtype (decoding
    is bound by reading weights); `quantize` ("int8" | "bf16", GPT models) then gives weight-only
    quantized weights that decode through the quantized matmuls. `adapter`: a PEFT LoRA directory
    merged into pretrained weights; a LoRA run's directory loads its base with its own adapters merged.
    """
    from flaxgpt.models.quantize import check_mode

    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {DTYPES}")
    if quantize is not None:
        check_mode(quantize)  # before reading any weights
    from flaxgpt.hf import peft

    if is_run_dir(source):
        from flaxgpt.runs import run_dir

        if adapter is not None:
            raise ValueError(f"adapter={adapter} goes with pretrained weights; the run {source} has its own")
        run = (
            peft.load_lora_run(source, step) if peft.lora_section(source) else run_dir.load_run(source, step)
        )
    else:
        if step is not None:
            raise ValueError(f"step={step} applies to a training run; {source} is pretrained weights")
        if Path(source).is_dir() and not (Path(source) / "config.json").is_file():
            raise FileNotFoundError(
                f"{source} is neither a flaxgpt training run (config.json, meta.json, checkpoints/) nor "
                "a Hugging Face model directory (config.json, model.safetensors)"
            )
        from flaxgpt.hf import gpt2 as hf

        config, params = peft.load_pretrained(str(source), adapter=adapter)
        run = Run("gpt", config, params, hf.load_tokenizer(str(source)))
    if quantize is not None and run.kind != "gpt":
        raise ValueError(f"{source} holds a {run.kind} model; quantize applies to GPT models")
    return compact(run, dtype=dtype, quantize=quantize)


def compact(run: Run, *, dtype: str | None = None, quantize: str | None = None) -> Run:
    """The run as it decodes: weights cast to `dtype` (`with_dtype`), then quantized (GPT models).
    `load` ends here; sample.py calls it itself after drawing an attention map of the float32 weights."""
    if dtype is not None:
        run = with_dtype(run, dtype)
    if quantize is not None:
        from flaxgpt.models.gpt import quantize_params

        config, params = quantize_params(run.config, run.params, quantize)
        run = run._replace(config=config, params=params)
    return run


def with_dtype(run: Run, dtype: str) -> Run:
    """The run with weights cast to `dtype` and computing in it."""
    import jax
    import jax.numpy as jnp

    config = dataclasses.replace(run.config, dtype=dtype, param_dtype=dtype)
    params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), run.params)
    return run._replace(config=config, params=params)


__all__ = ["DTYPES", "Run", "compact", "is_run_dir", "load", "require_run", "with_dtype"]
