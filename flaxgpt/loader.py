"""One loader for every model flaxgpt can run: a training run, Hugging Face weights, or a GPT-2 name.

    run = flaxgpt.load("out/shakespeare_char")                    # a run directory: the latest step
    run = flaxgpt.load("out/run", step=2000, dtype="bfloat16")    # weights cast, computing in bfloat16
    run = flaxgpt.load("gpt2", quantize="int8")                   # GPT-2 from the HF cache or the hub
    run = flaxgpt.load("path/to/SmolLM2-135M")                    # a GPT-2 or Llama-family HF directory
    run = flaxgpt.load("path/to/Llama-W4A16")                     # compressed-tensors int4: kept int4
    kind, config, params, tokenizer = run                         # Run: "gpt" | "seq2seq"
    config, params = flaxgpt.load_pretrained("base", adapter="adapter_dir", quantize="int8")
    spec, adapters = loader.load_adapter("adapter_dir or a LoRA run", config)   # unmerged
    run = loader.init("gpt2", dtype="bfloat16")                   # a preset's random weights
    run = flaxgpt.load("path/to/Llama", place=sharding.Placement(mesh))   # split over a mesh as it loads
    init = loader.resolve_init("path/to/Llama", recipe)            # where a run starts: Init(kind, config,
    init = loader.resolve_init("gpt2", recipe, abstract=True)      # params or their shapes, tokenizer, where)

sample.py, serve.py, `flaxgpt eval`, `flaxgpt hf export`, `flaxgpt attention-map` and
`flaxgpt summary --run` load through `load`; `load`, the trainer (init_from), `flaxgpt aot` (abstract:
no weight read) and the config check (`init_kind`) resolve a source through `resolve_init`, one answer
for every source. `compact` is the one place that casts (`dtype`) and then quantizes (`quantize`).
A Hugging Face directory whose config.json names a quantization_config is read by hf.compressed
(pack-quantized int4 straight into int4 weights, the words' bytes kept; any other scheme a one-line
refusal) and decodes only: `compact` keeps those weights (the same `quantize` is a no-op, another one
an error; `dtype` casts the float layers alone); the trainer refuses it as init_from. A
LoRA run (runs.lora_run) is its base's weights with its adapters merged, as is pretrained weights plus
a PEFT `adapter`; `load_adapter` reads either kind of adapter unmerged (a server applies many per batch
row: models.multi_lora). Bad input is a one-line ValueError / OSError.
`place` (a sharding.Placement, built by the caller) is where every leaf goes as it loads: by default
whole onto one device; over a mesh each device receives only its slices (Hugging Face files read a
tensor at a time on the host, a run's checkpoint restored by orbax into the shardings, random weights
initialized by a jit with those out_shardings), and casting and quantizing keep the placement.

May import: flaxgpt.runs, flaxgpt.hf, flaxgpt.models, flaxgpt.data.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from flaxgpt.runs.run_dir import FRESH_STARTS, Run, is_run_dir, require_run

DTYPES = ("float32", "bfloat16", "float16")
# the GPTConfig fields a pretrained checkpoint's arrays are read with, a recipe's (or a LoRA run's base's):
# the window, scanned layers, padded vocabulary rows and the parameters' dtype
LAYOUT_FIELDS = ("block_size", "scan_layers", "pad_vocab_multiple", "param_dtype")


@dataclasses.dataclass(frozen=True)
class Init:
    """Where a model starts: resolve_init's answer for one source."""

    kind: str  # init_kind's: "fresh" | "run" | "pretrained"
    config: Any  # the GPTConfig (TransformerConfig) to build: the source's, the recipe's layout / run-time
    params: Any  # the weights; ShapeDtypeStructs when abstract; None when fresh (the trainer draws them)
    tokenizer: Any  # the source's own (a run's, pretrained weights'); None when fresh, abstract or not asked
    where: str  # where the architecture was read (a config.json, a preset, the recipe): for reports

    @property
    def layout(self) -> dict:
        """The LAYOUT_FIELDS of the config: how the parameters' arrays are laid out."""
        return {f: getattr(self.config, f) for f in LAYOUT_FIELDS if hasattr(self.config, f)}


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
    pretrained = init_kind(source) == "pretrained"
    if pretrained and dtype is not None and adapter is None and "param_dtype" not in overrides:
        # read straight into the dtype: a float32 copy first would hold twice the weights
        overrides = {**overrides, "param_dtype": dtype}
    init = resolve_init(source, step=step, adapter=adapter, overrides=overrides, place=place)
    from flaxgpt.models import registry as models

    run = Run(models.kind_of(init.config), init.config, init.params, init.tokenizer)
    if quantize is not None and run.kind != "gpt":
        raise ValueError(f"{source} holds a {run.kind} model; quantize applies to GPT models")
    return compact(run, dtype=dtype, quantize=quantize)


def init_kind(source) -> str:
    """What `source` (an init_from value) is, read from its name and directory alone: "fresh" (auto,
    resume, scratch: the recipe's own model), "run" (a flaxgpt training run) or "pretrained"."""
    if str(source) in FRESH_STARTS:
        return "fresh"
    return "run" if is_run_dir(source) else "pretrained"


def data_tokenizer(source) -> str | None:
    """The tokenizer the training data of a model starting from `source` (an init_from value) is
    written with: None for a fresh model (any: prepare's default), "gpt2" for a GPT-2 model by name
    (the family table's; flaxgpt ships its BPE), else the source itself (a run's or a Hugging Face
    model's own tokenizer). For `flaxgpt prepare` commands in errors (data.hints)."""
    if not str(source) or init_kind(source) == "fresh":
        return None
    if not Path(source).exists():
        from flaxgpt.hf import families
        from flaxgpt.models.gpt_config import GPTConfig

        preset = families.preset_for(source)
        if preset is not None and families.family_of(GPTConfig.preset(preset)) == "gpt2":
            return "gpt2"
    return str(source)


def resolve_init(
    source,
    recipe=None,
    *,
    abstract: bool = False,
    step: int | None = None,
    adapter: str | None = None,
    overrides: dict | None = None,
    tokenizer: bool = True,
    place=None,
) -> Init:
    """What a model starting from `source` is (the trainer's init_from, `load`'s source, `flaxgpt aot`'s
    recipe), as an Init: `init_kind`'s answer, the model config, its parameters and tokenizer.

    `recipe`: the recipe's model config; a pretrained checkpoint is then read with its layout
    (LAYOUT_FIELDS) and both a checkpoint and a run take its run-time fields (models.RUNTIME_FIELDS).
    Without one, the checkpoint's own config with `overrides` (`load`'s). `abstract`: shapes only, no
    weight read (flaxgpt aot): a run's saved model section, a Hugging Face directory's config.json, or
    a name the family table knows (hf.families.preset_for); params are ShapeDtypeStructs. Otherwise a
    run's checkpoint `step` (a LoRA run's adapters merged into its base), pretrained weights with a
    PEFT `adapter` merged, `place`d as `load` says, and the source's tokenizer (for pretrained weights
    only when `tokenizer`: a Llama-family directory without tokenizer.json is an error then).
    """
    from flaxgpt.models import registry as models

    if not str(source):  # "" reads as the current directory: "error:  is neither a run nor ..."
        raise ValueError("init_from is empty; give scratch, resume, a run directory or Hugging Face weights")
    kind, source = init_kind(source), str(source)
    if kind == "fresh":
        if recipe is None:
            raise ValueError(f"init_from={source!r} builds the recipe's own model; name a run or weights")
        return Init(kind, recipe, _shapes(recipe) if abstract else None, None, "the recipe")
    runtime = {} if recipe is None else {f: getattr(recipe, f) for f in models.RUNTIME_FIELDS}
    overrides = overrides or {}
    if kind == "run":
        if adapter is not None:
            raise ValueError(f"adapter={adapter} goes with pretrained weights; the run {source} has its own")
        if abstract:
            from flaxgpt.runs import run_dir

            config, params, tok = models.config_from(run_dir.model_section(source), saved=True), None, None
        else:
            config, params, tok = _load_run(source, step, place)[1:]
        try:
            changed = dataclasses.replace(config, **{**runtime, **overrides})
        except TypeError:
            fields, what = sorted({**runtime, **overrides}), models.kind_of(config)
            raise ValueError(f"{fields} are not fields of {source}'s {what} model") from None
        if overrides and _layout(_shapes(changed)) != _layout(_shapes(config)):
            raise ValueError(
                f"{sorted(overrides)} would change the weights of {source}'s model (their shapes or "
                "layout); a run's overrides change only how it runs (attention_impl, remat, dropout, ...)"
            )
        config = changed
        return Init(kind, config, _shapes(config) if abstract else params, tok, f"{source}/config.json")
    if step is not None:
        raise ValueError(f"step={step} applies to a training run; {source} is pretrained weights")
    if Path(source).is_dir() and not (Path(source) / "config.json").is_file():
        raise FileNotFoundError(
            f"{source} is neither a flaxgpt training run (config.json, meta.json, checkpoints/) nor "
            "a Hugging Face model directory (config.json, model.safetensors)"
        )
    if recipe is not None and _int4_checkpoint(source):
        raise ValueError(
            f"init_from={source} holds int4 weights (compressed-tensors), which decode (sample.py, "
            "serve.py, flaxgpt.load) but do not train; start from the float model"
        )
    layout = {} if recipe is None else {f: getattr(recipe, f) for f in LAYOUT_FIELDS}
    fields = {**layout, **overrides}  # read with these; the recipe's run-time fields are set after
    if abstract:
        config, where = _pretrained_config(source, fields)
        config = dataclasses.replace(config, **runtime)
        return Init(kind, config, _shapes(config), None, where)
    from flaxgpt.hf import pretrained

    config, params = load_pretrained(source, adapter=adapter, place=place, **fields)
    tok = pretrained.load_tokenizer(source) if tokenizer else None
    return Init(kind, dataclasses.replace(config, **runtime), params, tok, source)


def _pretrained_config(source: str, fields: dict):
    """(GPTConfig, where it came from) of pretrained weights without reading them: a directory's
    config.json through its family's mapping, or the preset a name the family table knows has."""
    from flaxgpt.hf import families
    from flaxgpt.hf.files import read_json
    from flaxgpt.models.gpt_config import GPTConfig

    if (Path(source) / "config.json").is_file():
        hf = read_json(str(Path(source) / "config.json"), "a model's config object")
        return families.config_from_hf(hf, **fields), f"{source}/config.json"
    preset = families.preset_for(source)
    if preset is None:
        from flaxgpt.hf.files import near_name

        near = near_name(source, families.PUBLISHED)  # a typo of a preset or a published name
        raise ValueError(
            f"init_from={source!r}: not a flaxgpt run, a Hugging Face directory (config.json) nor a "
            "model the family table knows (hf.families.PUBLISHED, or a preset: "
            f"{', '.join(GPTConfig.PRESETS)}); "
            + (
                near
                or "point it at the model's directory (or train the run it names first) or train from scratch"
            )
        )
    return GPTConfig.preset(preset, **fields), f"the {preset} preset (init_from={source})"


def _shapes(config):
    """The parameters of `config` as ShapeDtypeStructs (unboxed): nothing allocated."""
    from flax import linen as nn

    from flaxgpt.models import registry as models

    return nn.unbox(models.abstract_params(config))


def _layout(shapes) -> tuple:
    """The tree of parameter shapes, dtypes aside: what a run's saved weights must fit."""
    import jax

    return jax.tree_util.tree_structure(shapes), tuple(x.shape for x in jax.tree_util.tree_leaves(shapes))


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
    from flaxgpt.models import lora

    lr = lora_run.read_lora_run(source, step)
    # the base as the LoRA run's trainer resolved it: a run's weights as saved, pretrained weights in
    # the layout the adapters were trained on
    try:
        base = resolve_init(lr.base, lr.config, tokenizer=False, step=lr.base_step, place=place).params
    except run_dir.checkpoint.CheckpointError as e:  # the base run's retention removed that step
        raise run_dir.RunError(
            f"{source}'s adapters were trained on {lr.base} step {lr.base_step}: {e}"
        ) from None
    return Run("gpt", lr.config, lora.merge(lr.config, lr.spec, base, lr.adapters), lr.tokenizer)


def load_pretrained(name_or_path: str, *, adapter: str | None = None, quantize: str | None = None, **kw):
    """GPT-2 or Llama-family weights -> (GPTConfig, params) of a plain GPT (flaxgpt.load_pretrained),
    with a PEFT `adapter` directory merged into the base (W + scale A B) before any `quantize`.
    `kw`: flaxgpt.hf.pretrained.load_pretrained's (layout, dtype, free GPTConfig fields)."""
    _check(None, quantize)
    from flaxgpt.hf import peft, pretrained

    if _int4_checkpoint(name_or_path):
        config, params = _load_int4(name_or_path, adapter, **kw)
        run = compact(Run("gpt", config, params, None), quantize=quantize)
        return run.config, run.params
    config, params = pretrained.load_pretrained(name_or_path, **kw)
    if adapter is not None:
        from flaxgpt.models import lora

        spec, adapters = peft.load_adapter(adapter, config)
        params = lora.merge(config, spec, params, adapters)
    run = compact(Run("gpt", config, params, None), quantize=quantize)
    return run.config, run.params


def _int4_checkpoint(source) -> bool:
    """A Hugging Face directory whose config.json names a quantization_config (hf.compressed's rule)."""
    from flaxgpt.hf import compressed

    return Path(source).is_dir() and compressed.holds(source)


def _load_int4(source: str, adapter, *, place=None, scan_layers=False, pad_vocab_multiple=1, **fields):
    """A compressed-tensors int4 directory (hf.compressed) read straight into int4 QuantizedWeights on
    one device: the words' bytes are the weights, nothing dequantized or quantized again. Float
    layers stay float32 (`param_dtype` is compact's cast); a quantization_config other than
    pack-quantized int4 is compressed.group_of's one-line refusal."""
    import jax

    from flaxgpt.hf import compressed

    fields.pop("param_dtype", None)
    fields.pop("cache_dir", None)
    if adapter is not None:
        raise ValueError(
            f"{source} holds int4 weights (compressed-tensors); a PEFT adapter merges into float weights: "
            "serve it unmerged (serve.py --init_from BASE --adapter NAME=DIR) or merge it into the float "
            "model before quantizing"
        )
    if scan_layers or pad_vocab_multiple != 1 or (place is not None and place.mesh is not None):
        raise ValueError(
            f"{source} holds int4 weights (compressed-tensors), loaded unrolled onto one device: "
            "drop --mesh / scan_layers / pad_vocab_multiple"
        )
    config, params = compressed.load(source, **fields)
    return config, jax.device_put(params)


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
        from flaxgpt.models import quantize as quantized
        from flaxgpt.models.gpt import quantize_params

        held = quantized.modes(run.params)  # a quantized checkpoint's (hf.compressed): never again
        if held == {quantize}:
            return run
        if held:
            named = [m for m in sorted(held) if m in quantized.MODES]  # (a group of 16 has no flag)
            raise ValueError(
                f"the weights are already {', '.join(sorted(held))} (a quantized checkpoint); "
                f"drop --quantize {quantize}" + (f" or pass --quantize {named[0]}" if named else "")
            )
        config, params = quantize_params(run.config, run.params, quantize)
        run = run._replace(config=config, params=params)
    return run


def with_dtype(run: Run, dtype: str) -> Run:
    """The run with weights cast to `dtype` and computing in it; quantized weights (an int4
    checkpoint's) stay as they are, their scales float32 as quantize_params makes them."""
    import jax
    import jax.numpy as jnp

    from flaxgpt.models.quantize import QuantizedWeight

    config = dataclasses.replace(run.config, dtype=dtype, param_dtype=dtype)
    is_q = lambda x: isinstance(x, QuantizedWeight)  # noqa: E731
    cast = lambda x: x if is_q(x) else jnp.asarray(x, dtype)  # noqa: E731
    params = jax.tree_util.tree_map(cast, run.params, is_leaf=is_q)
    return run._replace(config=config, params=params)


__all__ = [
    "DTYPES",
    "FRESH_STARTS",
    "Init",
    "LAYOUT_FIELDS",
    "Run",
    "compact",
    "init",
    "init_kind",
    "is_run_dir",
    "load",
    "load_adapter",
    "load_pretrained",
    "require_run",
    "resolve_init",
    "with_dtype",
]
