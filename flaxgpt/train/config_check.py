"""A run config checked once, up front: every nonsense value is a one-line error before any file is
written or anything is compiled.

    config = config_check.load_recipe("configs/reverse.py")   # get_config() of a recipe file
    config_check.check(config)                                 # trainer.train's first line

Each message names the flag to change (`--config.batch_size=0 ...`), what the value must be and why.
The data, mesh, lora, dpo and grpo sections are read as sections.Sections (their types and rules are
there); here are the run's own keys, the optim, model and seq2seq sections and the rules that read
init_from (fresh_start: loader.init_kind), batch_size or the data. The model section is also mapped
through models.config_from, so the model configs' own checks (n_embd divisible by n_head, known
activations ...) run here too.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import ml_collections

from flaxgpt import errors
from flaxgpt.train import sections
from flaxgpt.train.sections import ConfigError, typed

# the run's own keys and the optim, model and seq2seq sections (data, mesh, lora, dpo and grpo are typed:
# flaxgpt.train.sections). key: (lowest allowed value, what it is). Integers.
INTS = {
    "batch_size": (1, "sequences per optimizer step"),
    "grad_accum": (1, "micro-batches per step"),
    "max_iters": (1, "optimizer steps to train to; 0 would leave an empty run"),
    "eval_interval": (1, "steps between evaluations"),
    "eval_iters": (1, "batches per split in each evaluation"),
    "log_interval": (1, "steps between log lines"),
    "ckpt_interval": (0, "steps between checkpoints; 0 = only at the end"),
    "keep_checkpoints": (1, "checkpoints kept on disk"),
    "optim.warmup_steps": (0, "warmup steps"),
    "optim.decay_steps": (0, "steps of the cosine decay; 0 = max_iters"),
    "optim.loss_chunk": (0, "positions per chunk of the chunked cross-entropy; 0 = plain"),
    "optim.loss_block": (0, "vocabulary columns per block of the fused loss; 0 = the default"),
    "optim.muon_ns_steps": (1, "Muon's Newton-Schulz iterations (0 would not orthogonalise)"),
    "optim.muon_momentum_warmup": (0, "Muon's momentum warmup steps; 0 = off"),
    "seq2seq.eval_pairs": (0, "val pairs decoded at each evaluation"),
    "seq2seq.eval_batch": (1, "sources decoded at once"),
    "seq2seq.eval_beam_size": (1, "beam width during evaluation"),
    "seq2seq.beam_size": (1, "beam width for translating"),
}
# key: (low, high, low included, high included, what it is). Finite floats.
FLOATS = {
    "optim.learning_rate": (0.0, math.inf, False, False, "the peak learning rate"),
    "optim.min_lr": (0.0, math.inf, True, False, "the final learning rate"),
    "optim.weight_decay": (0.0, math.inf, True, False, "AdamW's weight decay"),
    "optim.beta1": (0.0, 1.0, True, False, "AdamW's first-moment decay"),
    "optim.beta2": (0.0, 1.0, True, False, "AdamW's second-moment decay"),
    "optim.eps": (0.0, math.inf, False, False, "AdamW's epsilon"),
    "optim.grad_clip": (0.0, math.inf, True, False, "the gradient-norm clip; 0 = off"),
    "optim.label_smoothing": (0.0, 1.0, True, False, "label smoothing"),
    "optim.z_loss": (0.0, math.inf, True, False, "the z-loss coefficient"),
    "optim.muon_learning_rate": (0.0, math.inf, False, False, "Muon's peak learning rate"),
    "optim.muon_momentum": (0.0, 1.0, True, False, "Muon's momentum"),
    "optim.muon_momentum_start": (0.0, 1.0, True, False, "Muon's momentum at step 0"),
    "optim.muon_weight_decay": (0.0, math.inf, True, False, "Muon's weight decay"),
    "optim.embed_learning_rate": (
        0.0,
        math.inf,
        True,
        False,
        "the embeddings' learning rate; 0 = learning_rate",
    ),
    "optim.head_learning_rate": (
        0.0,
        math.inf,
        True,
        False,
        "the lm_head's learning rate; 0 = learning_rate",
    ),
    "peak_flops": (0.0, math.inf, True, False, "per-device peak FLOP/s; 0 = guess"),
    "seq2seq.alpha": (0.0, math.inf, True, False, "the length penalty"),
    "model.dropout": (0.0, 1.0, True, False, "a dropout rate"),
    "model.layer_norm_epsilon": (0.0, math.inf, False, False, "LayerNorm's epsilon"),
}
# dropout rates where -1 means "model.dropout"
DEFAULTED_RATES = ("model.embd_dropout", "model.attn_dropout", "model.resid_dropout")
DTYPES = ("float32", "bfloat16", "float16", "float64")


def _get(config, key: str):
    node = config
    for part in key.split("."):
        if not hasattr(node, "keys") or part not in node:
            return None
        node = node[part]
    return node


def check(config) -> None:
    """Raises ConfigError naming the first value that cannot train (nothing is read or written)."""
    if not isinstance(config, ml_collections.ConfigDict):
        raise ConfigError(
            f"the run config is of type {type(config).__name__}, not an ml_collections.ConfigDict; "
            "get_config() must return one (start from configs/default.py)"
        )
    for key, (low, what) in INTS.items():
        if (value := _get(config, key)) is not None:
            typed(key, value, int, {"why": what, "range": (low, None, True, False)})
    rates = {key: (0.0, 1.0, True, False, "a dropout rate; -1 = model.dropout") for key in DEFAULTED_RATES}
    for key, (*bounds, what) in {**FLOATS, **rates}.items():
        value = _get(config, key)
        if value is not None and not (key in DEFAULTED_RATES and value == -1):
            typed(key, value, float, {"why": what, "range": (*bounds,)})
    if config.get("batch_size") and config.get("grad_accum"):
        micro_batch(config)
    o = config.get("optim") or {}
    decay, warmup = o.get("decay_steps") or config.get("max_iters") or 0, o.get("warmup_steps", 0)
    if o.get("schedule") in ("cosine", "wsd") and decay and decay <= warmup:  # optim.make_schedule's rule
        which = "optim.decay_steps" if o.get("decay_steps") else "max_iters (optim.decay_steps=0)"
        raise ConfigError(
            f"the {o['schedule']} decay ends at {which} = {decay}, not after the warmup "
            f"(--config.optim.warmup_steps={warmup}): lower warmup_steps or raise {which.split(' ')[0]}"
        )
    lr, floor = o.get("learning_rate"), o.get("min_lr")
    if o.get("schedule") in ("cosine", "wsd") and lr is not None and floor is not None and floor > lr:
        raise ConfigError(  # the decay would climb from learning_rate up to min_lr
            f"optim.min_lr {floor:g} is above optim.learning_rate {lr:g}: the {o['schedule']} decay would "
            f"raise the learning rate; lower it, e.g. --config.optim.min_lr={lr / 10:g}"
        )
    impl = _get(config, "optim.loss_impl")
    if impl is not None and impl not in ("logits", "fused"):  # train.losses.LOSS_IMPLS
        raise ConfigError(f"--config.optim.loss_impl={impl!r} is not one of logits, fused")
    s = sections.of(config)  # data, mesh, lora, dpo, grpo: their types and rules
    if s.lora.rank:
        if fresh_start(config):
            raise ConfigError(
                f"lora.rank={s.lora.rank} adapts a pretrained model, not init_from={config.init_from!r};"
                " set --config.init_from to a Hugging Face model directory or a GPT-2 name"
            )
        if config.get("eval_tasks"):
            raise ConfigError(
                "eval_tasks are not scored during LoRA training; merge the adapter and evaluate"
            )
        if s.lora.base_dtype == "int8" and _get(config, "model.fp8"):
            raise ConfigError(
                "model.fp8 multiplies float weights in float8, and lora.base_dtype=int8 quantizes the "
                "base: set --config.lora.base_dtype=float32 (the base in float8) or --config.model.fp8=False"
            )
    if s.data.format == "pairs":
        _check_dpo(config)
    if s.data.format == "prompts":
        _check_grpo(config, s)
    if "model" not in config:
        raise ConfigError("the run config has no `model` section (start from configs/default.py)")
    for key in ("dtype", "param_dtype"):
        value = config.model.get(key)
        if value is not None and value not in DTYPES:
            raise ConfigError(f"--config.model.{key}={value!r} is not one of {DTYPES}")
        if value == "float64":
            import jax  # (here: load_recipe stays light)

            if not jax.config.jax_enable_x64:  # jax would make every float64 array float32
                raise ConfigError(
                    f"--config.model.{key}=float64 needs 64-bit jax: run with JAX_ENABLE_X64=1 "
                    "(without it every array is float32)"
                )
    from flaxgpt.models import (
        registry as models,  # (here: load_recipe stays light for train.py's flag parsing)
    )

    try:
        models.config_from(config.model)  # the model config's own checks (choices, divisibility)
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None


def _check_dpo(config) -> None:
    """data.format = pairs: a pretrained policy to tune, a decoder-only model (the dpo section's own
    rules are sections.DPOSection's)."""
    if fresh_start(config):
        raise ConfigError(
            f"DPO tunes a pretrained model, not init_from={config.init_from!r}; set --config.init_from "
            "to a Hugging Face directory (the SFT model: also the reference)"
        )
    if config.model.get("kind", "gpt") != "gpt":
        raise ConfigError("data.format=pairs (DPO) trains a decoder-only model (model.kind gpt)")


def _check_grpo(config, s: sections.Sections) -> None:
    """data.format = prompts: batches of whole groups, rewards that load, a reference when beta > 0,
    and prompts + completions that fit the window (the prepared data's longest prompt); the grpo
    section's own rules are sections.GRPOSection's."""
    from flaxgpt.train import rewards  # (here: load_recipe stays light)

    g, G = s.grpo, s.grpo.num_generations
    if config.batch_size % G or micro_batch(config) % G:
        raise ConfigError(
            f"batch_size {config.batch_size} (completions) and batch_size // grad_accum must be multiples "
            f"of grpo.num_generations {G}: a micro-batch holds whole groups"
        )
    # an episode group takes G slots of one replica at once (grpo_episodes); a replica has
    # ceil(batch_size / k) slots (grpo_rollout.Replicas)
    k, B = g.engine_replicas, config.batch_size
    slots = lambda j: -(-B // j)  # noqa: E731
    if g.env and k > 1 and slots(k) < G:
        most = max(j for j in range(1, k) if slots(j) >= G) if B >= G else 1
        raise ConfigError(
            f"--config.grpo.engine_replicas={k} gives each engine ceil(batch_size / {k}) = "
            f"{slots(k)} slots, fewer than a group's {G} episodes (grpo.env plays a group "
            f"at once): lower engine_replicas to at most {most}"
        )
    try:  # none is the section's rule to judge (an environment may score alone)
        if g.reward_funcs:
            rewards.Rewards.make(list(g.reward_funcs), list(g.reward_weights) or None)
    except ValueError as e:
        raise ConfigError(f"--config.grpo.reward_funcs: {e}") from None
    if g.beta and not s.lora.rank and fresh_start(config):
        raise ConfigError(
            f"grpo.beta={g.beta} needs a reference: LoRA (the base) or init_from a pretrained model "
            f"(its weights), not init_from={config.init_from!r}"
        )
    meta = Path(s.data.dir) / "meta.json"  # the window: the longest prompt + a whole completion
    try:
        longest = int(json.loads(meta.read_text()).get("max_prompt_tokens", 0))
    except (OSError, ValueError):
        return  # no dataset yet: the task names it when it opens the data
    T = config.model.get("block_size", 0)
    if T and longest + g.max_completion_length > T:
        raise ConfigError(
            f"{s.data.dir} has a prompt of {longest} tokens: + grpo.max_completion_length "
            f"{g.max_completion_length} > model.block_size {T}; shorten either or raise block_size"
        )


def fresh_start(config) -> bool:
    """init_from builds the recipe's own model (auto, resume, scratch: loader.init_kind), no weights."""
    from flaxgpt import loader  # (here: load_recipe stays light)

    return loader.init_kind(config.get("init_from", "auto")) == "fresh"


def micro_batch(config) -> int:
    """batch_size // grad_accum: the sequences of one micro-batch (all devices); an error unless exact."""
    if config.batch_size % config.grad_accum:
        raise ConfigError(
            f"batch_size {config.batch_size} is not divisible by grad_accum {config.grad_accum}"
        )
    return config.batch_size // config.grad_accum


def load_recipe(path: str):
    """get_config() of a configs/<recipe>.py file (`file.py:arg` passes arg to get_config), with
    one-line errors for a missing file, a syntax error, no get_config, or a result that is no config."""
    path, _, arg = str(path).partition(":")
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file {path!r} not found; pass e.g. configs/default.py")
    # recipes import their base as `from configs import default`: the repository root is importable
    # while the recipe runs (and only then: loading a recipe leaves sys.path as it was)
    root = str(file.resolve().parent.parent)
    sys.path.insert(0, root)
    spec = importlib.util.spec_from_file_location(f"_flaxgpt_config_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise ConfigError(f"config file {e.filename}:{e.lineno}: {e.msg}") from None
    except Exception as e:  # an import or name error while the recipe runs
        raise ConfigError(f"config file {path} failed to load ({type(e).__name__}: {e})") from None
    finally:
        sys.path.remove(root)
    if not callable(getattr(module, "get_config", None)):
        raise ConfigError(
            f"config file {path} has no get_config(); a recipe defines get_config() returning "
            "an ml_collections.ConfigDict (see configs/default.py)"
        )
    try:
        config = module.get_config(arg) if arg else module.get_config()
    except Exception as e:
        raise ConfigError(f"{path}: get_config() failed ({type(e).__name__}: {e})") from None
    if not isinstance(config, ml_collections.ConfigDict):
        raise ConfigError(
            f"{path}: get_config() returned a value of type {type(config).__name__}, not an "
            "ml_collections.ConfigDict "
            "(start from configs/default.py)"
        )
    return config


def flat_keys(config, prefix: str = "") -> list[str]:
    """Every dotted key of a config: `batch_size`, `optim.learning_rate`, `model.n_layer`, ..."""
    out = []
    for k in config.keys():
        v = config[k]
        if isinstance(v, ml_collections.ConfigDict):
            out += flat_keys(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}")
    return out


def suggest_key(config, key: str) -> str | None:
    """The existing key a misspelt or misplaced `key` most likely means, across sections:
    `learning_rate` -> `optim.learning_rate` (nanoGPT's flat spelling), `optim.lerning_rate` ->
    `optim.learning_rate`, `n_layr` -> `model.n_layer`; None when nothing is close."""
    keys = flat_keys(config)
    leaf = key.rpartition(".")[2]
    same_leaf = [k for k in keys if k.rpartition(".")[2] == leaf and k != key]
    if same_leaf:
        return same_leaf[0]
    leaves = {k.rpartition(".")[2]: k for k in reversed(keys)}  # a leaf: its first key
    return errors.nearest(key, keys, cutoff=0.75) or errors.nearest(leaf, leaves, cutoff=0.75)


def overrides(argv) -> dict[str, str]:
    """{dotted key: value} of the `--config.key=value` arguments (value "" when not given with =)."""
    out = {}
    for arg in argv:
        if arg.startswith(("--config.", "-config.")):
            key, _, value = arg.split("config.", 1)[1].partition("=")
            out[key] = value
    return out


def unknown_override(config, argv) -> str | None:
    """`unknown config key 'learning_rate'; did you mean optim.learning_rate?` for the first
    --config.key override that names no key of `config`, or None when every key exists."""
    keys = set(flat_keys(config))
    for key in overrides(argv):
        if key not in keys and not any(k.startswith(key + ".") for k in keys):
            near = suggest_key(config, key)
            return f"unknown config key {key!r}" + (f"; {errors.suggest(near)}" if near else "")
    return None


def ignored_model_override(config, argv) -> str | None:
    """One line for a `--config.model.X` override that the source's weights would silently replace: with
    init_from a Hugging Face model (a directory or a name the family table knows) or a flaxgpt run,
    the architecture is the checkpoint's; only the run-time fields are the recipe's, and for pretrained
    weights the layout too (loader.resolve_init)."""
    from flaxgpt import loader
    from flaxgpt.models import registry as models

    source = str(config.get("init_from") or "")
    kind = loader.init_kind(source) if source else "fresh"
    if kind == "fresh":
        return None
    where = Path(source).expanduser()
    if not where.exists() and (
        source.startswith(("/", ".", "~")) or ("/" in source and where.parent.is_dir())
    ):
        return f"init_from={source} does not exist; give a run directory, Hugging Face weights, or scratch"
    free = set(models.RUNTIME_FIELDS) | (set(loader.LAYOUT_FIELDS) if kind == "pretrained" else set())
    for key in overrides(argv):
        section, _, field = key.partition(".")
        if section == "model" and field and field not in free:
            return (
                f"--config.model.{field}: init_from={source} fixes the model's architecture ({field} is "
                f"the checkpoint's); drop the flag (the recipe's model applies with init_from=scratch)"
            )
    return None


KINDS = {bool: "True or False", int: "an integer", float: "a number"}  # what an override must be


def override_type_error(config, argv) -> str | None:
    """`--config.batch_size=abc must be an integer (the recipe has 64)` for the first `--config.key=value`
    override that cannot become its key's type (int, float, bool), or None when every one can."""
    for key, value in overrides(argv).items():
        node = config
        for part in key.split("."):
            node = node[part] if hasattr(node, "keys") and part in node else None
        kind = next((k for k in KINDS if type(node) is k), None)  # bool before int: exact types only
        if kind is None or not any(a.startswith((f"--config.{key}=", f"-config.{key}=")) for a in argv):
            continue
        try:
            if kind is bool:
                ok = value.strip().lower() in ("true", "false", "t", "f", "1", "0")
            else:
                ok = kind(value.strip()) is not None
        except ValueError:
            ok = False
        if not ok:
            return f"--config.{key}={value} must be {KINDS[kind]} (the recipe has {node!r})"
    return None


def schedule_note(config, schedule) -> str | None:
    """One line when max_iters cuts the learning-rate schedule short (the run ends inside the warmup,
    or before a cosine / wsd decay reaches min_lr), with the lr the last step gets; else None.
    `schedule(step) -> lr` is the run's own (train.optim.make_schedule's)."""
    o, end = config.optim, config.max_iters
    if end <= 0 or config.get("eval_only"):
        return None
    last = float(schedule(end - 1))
    if end < o.warmup_steps:
        return (
            f"note: max_iters {end} ends inside the warmup (optim.warmup_steps {o.warmup_steps}): the "
            f"learning rate reaches {last:.2e} of {o.learning_rate:g}"
        )
    decay = o.decay_steps or end
    if o.schedule in ("cosine", "wsd") and decay > end:
        return (
            f"note: max_iters {end} stops before the learning-rate decay ends (optim.decay_steps {decay}): "
            f"the last step's lr is {last:.2e}, not min_lr {o.min_lr:g}; "
            f"--config.optim.decay_steps={end} fits it to the run"
        )
    return None
