"""The family table: one entry per Hugging Face model_type, saying how its checkpoint maps onto
flaxgpt's GPT. Adding a family (DeepSeek, ...) is one entry here, with its key table and
config mapping in a module of its own.

    family = family_for(hf_config)          # config.json's model_type -> its Family (one-line error if none)
    model_type = family_of(gpt_config)      # the model_type that expresses a GPTConfig (export)
    config = config_from_hf(hf_config)      # config.json -> GPTConfig, through the family's mapping
    preset = preset_for("path/to/Meta-Llama-3-8B")   # a published name -> its GPTConfig preset, or None

Each Family holds: `architecture` (config.json's architectures[0]), `layer_keys` (HF name in layer i ->
flaxgpt path in h_{i} and the part of a fused tensor it fills), `config_from_hf(hf, family, **fields)`
and `config_to_hf(config, model_type, family, special_ids)` (the config mapping both ways), `load`
and `export_state` (the weight loop for the family's layout: flaxgpt.hf.gpt2's or flaxgpt.hf.rotary's),
and the flags its mapping reads (`qkv_bias`, `qk_norm`); a mixture of experts' family also its
`sparse_keys` (the router and per-expert tensors of its sparse layers). `export_config` is the one way a
config.json is written: config_to_hf, proven by reading it back (flaxgpt.hf.roundtrip).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from flaxgpt.hf import files, gemma, gpt2, llama, moe, rotary, roundtrip
from flaxgpt.models.gpt_config import GPTConfig


@dataclasses.dataclass(frozen=True)
class Family:
    architecture: str
    layer_keys: dict
    config_from_hf: Callable  # (config.json dict, Family, **free GPTConfig fields) -> GPTConfig
    config_to_hf: Callable  # (GPTConfig, model_type, Family, special ids | None) -> config.json dict
    load: Callable  # (directory, config.json dict, Family, **layout) -> (GPTConfig, params)
    export_state: Callable  # (GPTConfig, params, model_type, Family, special ids) -> (config.json, tensors)
    qkv_bias: bool = False  # Qwen2: biases on q, k and v
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head's queries and keys
    # mixtures of experts: a sparse layer's MLP tensors ("{e}" = each expert), replacing layer_keys'
    # MLP entries in that layer (flaxgpt.hf.moe); None: the family has no experts
    sparse_keys: dict | None = None
    # (GPTConfig) -> the GPTConfig an export holds when its weights carry what config.json does not
    # (GPT-2: zero biases, a learned table of sinusoids); None: the config itself
    written_as: Callable | None = None

    def export_config(self, config: GPTConfig, model_type: str, special_ids: dict | None = None) -> dict:
        """config_to_hf, read back: the config.json, or a one-line error naming each field this family
        would not hold, with the family to export as instead when there is one."""
        hf, refused = roundtrip.read_back(self, config, model_type, special_ids)
        if refused:
            other = family_of(config)
            holds = other != model_type and not roundtrip.read_back(FAMILIES[other], config, other)[1]
            fix = f"export it as {other}" if holds else "no family flaxgpt exports holds it"
            raise ValueError(f"{refused}; {fix}")
        return hf


def _rotary(architecture, layer_keys, mapping, **flags) -> Family:
    return Family(
        architecture,
        layer_keys,
        mapping.config_from_hf,
        mapping.config_to_hf,
        rotary.load_rotary,
        rotary.export_state,
        **flags,
    )


FAMILIES = {
    "gpt2": Family(
        "GPT2LMHeadModel",
        gpt2.BLOCK_KEYS,
        gpt2.config_from_hf,
        gpt2.config_to_hf,
        gpt2.load_gpt2,
        gpt2.export_state,
        written_as=gpt2.written_as,
    ),
    "llama": _rotary("LlamaForCausalLM", llama.LLAMA_LAYER_KEYS, llama),
    "mistral": _rotary("MistralForCausalLM", llama.LLAMA_LAYER_KEYS, llama),
    "qwen2": _rotary("Qwen2ForCausalLM", llama.QWEN2_LAYER_KEYS, llama, qkv_bias=True),
    "qwen3": _rotary("Qwen3ForCausalLM", llama.QWEN3_LAYER_KEYS, llama, qk_norm=True),
    "gemma2": _rotary("Gemma2ForCausalLM", gemma.GEMMA2_LAYER_KEYS, gemma),
    "gemma3_text": _rotary("Gemma3ForCausalLM", gemma.GEMMA3_LAYER_KEYS, gemma, qk_norm=True),
    "mixtral": _rotary(
        "MixtralForCausalLM", llama.LLAMA_LAYER_KEYS, moe, sparse_keys=moe.MIXTRAL_SPARSE_KEYS
    ),
    "qwen2_moe": _rotary(
        "Qwen2MoeForCausalLM",
        llama.QWEN2_LAYER_KEYS,
        moe,
        qkv_bias=True,
        sparse_keys=moe.QWEN2_MOE_SPARSE_KEYS,
    ),
    "qwen3_moe": _rotary(
        "Qwen3MoeForCausalLM",
        llama.QWEN3_LAYER_KEYS,
        moe,
        qk_norm=True,
        sparse_keys=moe.QWEN3_MOE_SPARSE_KEYS,
    ),
}


# published model names (a directory's or hub repo's last part, lowercased) -> the GPTConfig preset of
# their shape, so a recipe's init_from is read without its files (flaxgpt aot); a preset's own name is
# one too. Instruction-tuned variants have their base's shape.
PUBLISHED = {
    "smollm2-135m-instruct": "smollm2-135m",
    "llama-3.2-1b-instruct": "llama-3.2-1b",
    "meta-llama-3-8b": "llama-3-8b",
    "meta-llama-3-8b-instruct": "llama-3-8b",
    "meta-llama-3.1-8b": "llama-3-8b",  # 3.1's RoPE scaling is its config.json's; the shapes are 3's
    "meta-llama-3.1-8b-instruct": "llama-3-8b",
    "qwen2.5-0.5b-instruct": "qwen2.5-0.5b",
    "mistral-7b-instruct-v0.1": "mistral-7b-v0.1",
    "gemma-2-2b-it": "gemma-2-2b",
    "gemma-2-9b-it": "gemma-2-9b",
    "gemma-3-1b-pt": "gemma-3-1b",
    "gemma-3-1b-it": "gemma-3-1b",
    "mixtral-8x7b-v0.1": "mixtral-8x7b",
    "mixtral-8x7b-instruct-v0.1": "mixtral-8x7b",
    "qwen1.5-moe-a2.7b-chat": "qwen1.5-moe-a2.7b",
}


def preset_for(name_or_path) -> str | None:
    """The GPTConfig preset a model's name says it has (PUBLISHED, or the preset's own name); None when
    the name is neither."""
    name = os.path.basename(os.path.normpath(str(name_or_path))).lower()
    return name if name in GPTConfig.PRESETS else PUBLISHED.get(name)


def family_for(hf: dict) -> Family:
    """The Family of a config.json (as a dict); an unknown model_type is a one-line error listing the
    supported ones."""
    if not isinstance(hf, dict):
        raise ValueError(f"a config.json holds an object of the model's settings, not a {type(hf).__name__}")
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(FAMILIES)}")
    files.require_numbers(model_type, hf)  # every family's reads after this
    return FAMILIES[model_type]


def family_of(config: GPTConfig) -> str:
    """The model_type that expresses a GPTConfig: GPT-2 for learned or sinusoidal positions; for
    rotary ones a mixture of experts is Qwen3-MoE with QK-norm, Qwen2-MoE with a shared expert or qkv
    biases, else Mixtral; Gemma has post-norms
    (Gemma 3 QK-norm too), Qwen3 QK-norm, Qwen2 qkv biases, Mistral a window, else Llama."""
    if config.pos_embedding != "rope":
        return "gpt2"
    if config.num_experts:
        if config.qk_norm:
            return "qwen3_moe"
        return "qwen2_moe" if config.shared_expert_hidden or config.qkv_bias else "mixtral"
    if config.post_norms:
        return "gemma3_text" if config.qk_norm else "gemma2"
    if config.qk_norm:
        return "qwen3"
    return "qwen2" if config.qkv_bias else "mistral" if config.sliding_window or config.hf_window else "llama"


def config_from_hf(hf: dict, **fields) -> GPTConfig:
    """config.json (as a dict) -> GPTConfig through its family's mapping; `fields` set the free fields."""
    family = family_for(hf)
    return family.config_from_hf(hf, family, **fields)


def config_to_hf(config: GPTConfig, model_type: str, special_ids: dict | None = None) -> dict:
    """GPTConfig -> the config.json of `model_type`; a config that family does not hold is a one-line
    error naming the fields (Family.export_config)."""
    if model_type not in FAMILIES:
        raise ValueError(f"cannot export model_type {model_type!r}; supported: {', '.join(FAMILIES)}")
    return FAMILIES[model_type].export_config(config, model_type, special_ids)
