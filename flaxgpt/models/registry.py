"""The model kinds and the one mapping from a recipe's `model` section to a model config.

    model_config = models.config_from(config.model, vocab_size=data_vocab)  # GPTConfig | TransformerConfig
    section = models.section_of(model_config)  # {"kind": ..., **fields}: config.json's `model` entry
    c.model = ml_collections.ConfigDict(models.recipe_section("gpt", vocab_size=0))  # a recipe's defaults
    boxed = models.abstract_params(model_config)  # shapes only, no weights

A recipe's `model` fields are the dataclass's own fields plus `kind`, so the mapping is
`cls.from_dict(section)`; a saved run's config.json `model` entry maps the same way.
"""

from __future__ import annotations

import dataclasses

from flaxgpt.models import gpt, seq2seq
from flaxgpt.models.gpt import GPTConfig
from flaxgpt.models.seq2seq import TransformerConfig

CONFIGS = {"gpt": GPTConfig, "seq2seq": TransformerConfig}
MODULES = {"gpt": gpt, "seq2seq": seq2seq}  # each provides abstract_params(config), init_params(config, rng)

# model fields that change how the same weights are run, not what they compute: a resume may change
# them, and a fine-tune takes them from its recipe rather than from the pretrained checkpoint
RUNTIME_FIELDS = (
    "dropout",
    "embd_dropout",
    "attn_dropout",
    "resid_dropout",
    "dtype",
    "attention_impl",
    "context_impl",
    "remat",
    "fp8",
    "fp8_experts",
)
# fields the model never reads: what a Hugging Face checkpoint declared beyond block_size, which export
# writes back (GPTConfig.hf_context / hf_window). A resume does not compare them: runs saved before they
# existed hold none, and continue with the values their init_from gives now
EXPORT_ONLY_FIELDS = ("hf_context", "hf_window")

# fields added after runs were saved -> the behaviour those runs had: a saved section (config.json,
# a checkpoint's config) without the field is read with this value (kind -> {field: value})
SAVED_DEFAULTS = {
    "gpt": {"sinusoid_layout": "halves"},  # older runs put all the sines before all the cosines
    "seq2seq": {"sinusoid_layout": "halves"},
}

# keys of older recipes and run configs -> today's field (kind -> {old: new})
RENAMED = {
    "gpt": {},
    "seq2seq": {
        "d_model": "n_embd",
        "max_len": "block_size",
        "share_embeddings": "tie_embeddings",
        "n_layer": "n_enc_layer and n_dec_layer",
    },
}


def config_from(
    section, vocab_size: int | None = None, *, saved: bool = False
) -> GPTConfig | TransformerConfig:
    """A recipe's `model` section (ConfigDict or dict), or a run's config.json `model` entry, ->
    its model config. `kind` defaults to "gpt"; vocab_size 0 or None means `vocab_size` (the
    dataset's), else the dataclass default. `saved`: the section was written by a run, and fields
    it lacks take the value they had before they existed (SAVED_DEFAULTS), not today's default."""
    d = dict(section.to_dict() if hasattr(section, "to_dict") else section)
    kind = d.pop("kind", "gpt")
    if kind not in CONFIGS:
        raise ValueError(f"model.kind={kind!r} is not one of {tuple(CONFIGS)}")
    cls = CONFIGS[kind]
    if saved:
        d = {**SAVED_DEFAULTS[kind], **d}
    for old, new in RENAMED[kind].items():
        if old in d:
            raise ValueError(
                f"model.{old} is now model.{new}; rename it in the recipe (or the run's config.json)"
            )
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ValueError(
            f"unknown {cls.__name__} fields {unknown} for kind {kind!r}; fields: {', '.join(fields)}"
        )
    if not d.get("vocab_size"):
        d.pop("vocab_size", None)
        if vocab_size:
            d["vocab_size"] = vocab_size
    return cls.from_dict(d)


def kind_of(model_config) -> str:
    for kind, cls in CONFIGS.items():
        if isinstance(model_config, cls):
            return kind
    raise TypeError(f"{type(model_config).__name__} is not a model config; known: {list(CONFIGS.values())}")


def recipe_section(kind: str, **changes) -> dict:
    """A recipe's `model` section: `kind` and every field of its dataclass with the dataclass's own
    default (unresolved: a dropout of -1 still follows `dropout`), `changes` applied."""
    cls = CONFIGS[kind]
    section = {"kind": kind, **{f.name: f.default for f in dataclasses.fields(cls)}}
    unknown = sorted(set(changes) - set(section))
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields {unknown}")
    return {**section, **changes}


def section_of(model_config) -> dict:
    """What config.json stores under `model`: the kind and every field (config_from reads it back)."""
    return {"kind": kind_of(model_config), **model_config.to_dict()}


def abstract_params(model_config):
    """Boxed ShapeDtypeStructs (with logical axes) of the model's parameters: nothing allocated."""
    return MODULES[kind_of(model_config)].abstract_params(model_config)


def init_params(model_config, rng):
    return MODULES[kind_of(model_config)].init_params(model_config, rng)
