"""One loader for every model flaxgpt can run: a training run, Hugging Face weights, or a GPT-2 name.

    run = flaxgpt.load("out/shakespeare_char")                    # a run directory: the latest step
    run = flaxgpt.load("out/run", step=2000, dtype="bfloat16")    # weights cast, computing in bfloat16
    run = flaxgpt.load("gpt2", quantize="int8")                   # GPT-2 from the HF cache or the hub
    run = flaxgpt.load("path/to/SmolLM2-135M")                    # a GPT-2 or Llama-family HF directory
    kind, config, params, tokenizer = run                         # Run: "gpt" | "seq2seq"
    config, params = flaxgpt.load_pretrained("base", adapter="adapter_dir", quantize="int8")
    spec, adapters = loader.load_adapter("adapter_dir or a LoRA run", config)   # unmerged
    run = loader.init("gpt2", dtype="bfloat16")                   # a preset's random weights
    run = flaxgpt.load("path/to/Llama", place=sharding.Placement(mesh))   # split over a mesh as it loads

sample.py, serve.py, `flaxgpt eval`, `flaxgpt hf export`, `flaxgpt attention-map` and
`flaxgpt summary --run` load through `load`; `compact` is the one place that casts (`dtype`) and then
quantizes (`quantize`). A LoRA run (runs.lora_run) is its base's weights with its adapters merged, as
is pretrained weights plus a PEFT `adapter`; `load_adapter` reads either kind of adapter unmerged (a
server applies many per batch row: models.multi_lora). Bad input is a one-line ValueError / OSError.
`place` (a sharding.Placement, built by the caller) is where every leaf goes as it loads: by default
whole onto one device; over a mesh each device receives only its slices (Hugging Face files read a
tensor at a time on the host, a run's checkpoint restored by orbax into the shardings, random weights
initialized by a jit with those out_shardings), and casting and quantizing keep the placement.

May import: flaxgpt.runs, flaxgpt.hf, flaxgpt.models, flaxgpt.data.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from flaxgpt.runs.run_dir import Run, is_run_dir, require_run

DTYPES = ("float32", "bfloat16", "float16")
# GPTConfig fields a LoRA run's base is read with: the layout its adapters were trained on
BASE_LAYOUT = ("scan_layers", "pad_vocab_multiple", "param_dtype", "block_size")


def load(
    source,
    *,
    step: int | None = None,
    dtype: str | None = None,
    quantize: str | None = None,
    adapter: str | None = None,
    overrides: dict | None = None,
    place=None,
) -> Run:
    """The model at `source` as a Run(kind, config, params, tokenizer), params on one local device.

    `source`: a training run's directory (checkpoint `step`, default the latest), a Hugging Face
    directory (GPT-2 or Llama family: config.json + safetensors), or a hub name (gpt2 .. gpt2-xl)
    found in the HF cache or downloaded. `dtype` casts the weights and sets the compute dtype (decoding
    is bound by reading weights); `quantize` ("int8" | "bf16", GPT models) then gives weight-only
    quantized weights that decode through the quantized matmuls. `adapter`: a PEFT LoRA directory
    merged into pretrained weights; a LoRA run's directory loads its base with its own adapters merged.
    `overrides`: GPTConfig fields that do not change the weights (attention_impl, remat, ...): a run's
    replace its saved ones, a Hugging Face checkpoint's are checked by its family's config mapping.
    `place`: a sharding.Placement (default: one device); see the module docstring.
    """
    _check(dtype, quantize)
    overrides = overrides or {}
    if is_run_dir(source):
        if adapter is not None:
            raise ValueError(f"adapter={adapter} goes with pretrained weights; the run {source} has its own")
        run = _load_run(source, step, place)
        try:
            run = run._replace(config=dataclasses.replace(run.config, **overrides))
        except TypeError:
            raise ValueError(f"{sorted(overrides)} are not fields of {source}'s {run.kind} model") from None
    else:
        if step is not None:
            raise ValueError(f"step={step} applies to a training run; {source} is pretrained weights")
        if Path(source).is_dir() and not (Path(source) / "config.json").is_file():
            raise FileNotFoundError(
                f"{source} is neither a flaxgpt training run (config.json, meta.json, checkpoints/) nor "
                "a Hugging Face model directory (config.json, model.safetensors)"
            )
        from flaxgpt.hf import pretrained

        if dtype is not None and adapter is None and "param_dtype" not in overrides:
            # read straight into the dtype: a float32 copy first would hold twice the weights
            overrides = {**overrides, "param_dtype": dtype}
        config, params = load_pretrained(str(source), adapter=adapter, place=place, **overrides)
        run = Run("gpt", config, params, pretrained.load_tokenizer(str(source)))
    if quantize is not None and run.kind != "gpt":
        raise ValueError(f"{source} holds a {run.kind} model; quantize applies to GPT models")
    return compact(run, dtype=dtype, quantize=quantize)


def _check(dtype, quantize) -> None:
    """Bad settings, named before any weight is read."""
    from flaxgpt.models.quantize import check_mode

    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {DTYPES}")
    if quantize is not None:
        check_mode(quantize)


def _load_run(source, step, place=None) -> Run:
    """A run directory's checkpoint; a LoRA run's adapters merged into the base they were trained on."""
    from flaxgpt.runs import lora_run, run_dir

    if not lora_run.lora_section(source):
        return run_dir.load_run(source, step, place=place)
    from flaxgpt.hf import pretrained
    from flaxgpt.models import lora

    lr = lora_run.read_lora_run(source, step)
    if is_run_dir(lr.base):  # LoRA over a flaxgpt run (an SFT run's weights, as saved)
        base = _load_run(lr.base, None, place=place).params
    else:
        layout = {f: getattr(lr.config, f) for f in BASE_LAYOUT}
        _, base = pretrained.load_pretrained(lr.base, place=place, **layout)
    return Run("gpt", lr.config, lora.merge(lr.config, lr.spec, base, lr.adapters), lr.tokenizer)


def load_pretrained(name_or_path: str, *, adapter: str | None = None, quantize: str | None = None, **kw):
    """GPT-2 or Llama-family weights -> (GPTConfig, params) of a plain GPT (flaxgpt.load_pretrained),
    with a PEFT `adapter` directory merged into the base (W + scale A B) before any `quantize`.
    `kw`: flaxgpt.hf.pretrained.load_pretrained's (layout, dtype, free GPTConfig fields)."""
    _check(None, quantize)
    from flaxgpt.hf import peft, pretrained

    config, params = pretrained.load_pretrained(name_or_path, **kw)
    if adapter is not None:
        from flaxgpt.models import lora

        spec, adapters = peft.load_adapter(adapter, config)
        params = lora.merge(config, spec, params, adapters)
    run = compact(Run("gpt", config, params, None), quantize=quantize)
    return run.config, run.params


def load_adapter(source: str, config):
    """A LoRA adapter for the base `config`, unmerged -> (LoraSpec, adapters in the h_0.. layout): a PEFT
    adapter directory (hf.peft) or a LoRA run's directory (its latest adapters, runs.lora_run). A
    one-line ValueError / OSError when it is neither or does not fit the base (shapes, targets)."""
    from flaxgpt.hf import peft
    from flaxgpt.models import lora
    from flaxgpt.models.gpt import unstack_layers

    flat = dataclasses.replace(config, scan_layers=False)
    if not is_run_dir(source):
        return peft.load_adapter(source, flat)
    from flaxgpt.runs import lora_run

    if not lora_run.lora_section(source):
        raise ValueError(f"{source} is a training run without LoRA adapters")
    lr = lora_run.read_lora_run(source)
    adapters = unstack_layers(lr.adapters, lr.config.n_layer) if lr.config.scan_layers else lr.adapters
    s = lr.spec  # its columns again for this base: a target the base lacks is an error here
    spec = lora.LoraSpec.make(flat, s.rank, s.alpha, s.dropout, s.targets, s.rslora)
    lora.check_adapters(flat, spec, adapters, what=f"{source}:")
    return spec, adapters


def init(config, *, seed: int = 0, tokenizer=None, dtype: str | None = None, quantize: str | None = None,
         place=None):  # fmt: skip
    """A GPT with random weights as a Run: `config` a GPTConfig or a preset's name, `tokenizer` by
    default GPT-2's; cast and quantized as `load`'s, placed by `place` (the same weights on any mesh).
    For load tests and attention maps without a download."""
    _check(dtype, quantize)
    import jax

    from flaxgpt.data import tokenizers
    from flaxgpt.models import gpt

    config = gpt.GPTConfig.preset(config) if isinstance(config, str) else config
    shardings = None if place is None else place.shardings(gpt.abstract_params(config))
    placed = {} if shardings is None else {"out_shardings": shardings}  # None: one device, as before
    params = jax.jit(lambda key: gpt.init_params(config, key), **placed)(jax.random.key(seed))
    run = Run("gpt", config, params, tokenizer or tokenizers.get_tokenizer("gpt2"))
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


__all__ = [
    "DTYPES",
    "Run",
    "compact",
    "init",
    "is_run_dir",
    "load",
    "load_adapter",
    "load_pretrained",
    "require_run",
    "with_dtype",
]
