"""Llama, Mistral, Qwen2 and Qwen3 in the family table (flaxgpt.hf.families): their key tables and
their config.json both ways.

The four are one architecture in flaxgpt's GPT (pos_embedding="rope", norm="rmsnorm", a SwiGLU MLP,
grouped-query attention); they differ in what their config.json may say, in Qwen2's q/k/v biases
and in Qwen3's QK-norm. Their weights load and export through flaxgpt.hf.rotary (one loop for every
rotary family), which fuses q | k | v into c_attn and gate | up into c_fc.

Shape letters: D n_embd, H heads, J key/value heads, K head dim, F MLP hidden, V vocabulary.
"""

from __future__ import annotations

from flaxgpt.hf import files as hf_files
from flaxgpt.models.gpt_config import GPTConfig
from flaxgpt.models.rope import yarn_attention_factor

# HF name inside layer i (after "model.layers.{i}.") -> (flaxgpt path inside h_{i}, the part of a
# fused flaxgpt tensor it fills: q / k / v columns of c_attn, gate / up columns of c_fc, or None)
LLAMA_LAYER_KEYS = {
    "input_layernorm.weight": (("ln_1", "scale"), None),  # [D]
    "self_attn.q_proj.weight": (("attn", "c_attn", "kernel"), "q"),  # [H*K, D]
    "self_attn.k_proj.weight": (("attn", "c_attn", "kernel"), "k"),  # [J*K, D]
    "self_attn.v_proj.weight": (("attn", "c_attn", "kernel"), "v"),  # [J*K, D]
    "self_attn.o_proj.weight": (("attn", "c_proj", "kernel"), None),  # [D, H*K]
    "post_attention_layernorm.weight": (("ln_2", "scale"), None),  # [D]
    "mlp.gate_proj.weight": (("mlp", "c_fc", "kernel"), "gate"),  # [F, D]
    "mlp.up_proj.weight": (("mlp", "c_fc", "kernel"), "up"),  # [F, D]
    "mlp.down_proj.weight": (("mlp", "c_proj", "kernel"), None),  # [D, F]
}
QWEN2_LAYER_KEYS = {
    **LLAMA_LAYER_KEYS,
    "self_attn.q_proj.bias": (("attn", "c_attn", "bias"), "q"),  # [H*K]
    "self_attn.k_proj.bias": (("attn", "c_attn", "bias"), "k"),  # [J*K]
    "self_attn.v_proj.bias": (("attn", "c_attn", "bias"), "v"),  # [J*K]
}
QWEN3_LAYER_KEYS = {
    **LLAMA_LAYER_KEYS,
    "self_attn.q_norm.weight": (("attn", "q_norm", "scale"), None),  # [K], RMSNorm per head
    "self_attn.k_norm.weight": (("attn", "k_norm", "scale"), None),  # [K]
}


# rope types flaxgpt implements, transformers' names ("default": rope_scaling="none")
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")
NOT_IMPLEMENTED = {"longrope": "Phi-3's LongRoPE; no family flaxgpt loads uses it"}
WINDOWED = ("mistral", "mixtral")  # the families whose config.json's sliding_window is the attention's
# GPTConfig fields a checkpoint fixes; the others (dropout, dtype, remat, block_size, ...) are free
ARCH_FIELDS = tuple(
    "vocab_size n_layer n_head n_kv_head n_embd mlp_hidden pos_embedding norm activation glu "
    "tie_embeddings bias qkv_bias layer_norm_epsilon rope_theta rope_scaling rope_factor "
    "rope_low_freq_factor rope_high_freq_factor rope_original_max_len rope_attention_factor "
    "rope_beta_fast rope_beta_slow rope_truncate sliding_window qk_norm "
    "logit_softcap head_size window_pattern rope_local_theta query_pre_attn_scalar attn_softcap post_norms "
    "embed_scale".split()
)


# ---------------------------------------------------------------- configs


def rope_fields(scaling: dict, theta: float, hf: dict) -> dict:
    """One rotary entry of a config.json (rope_scaling, or a rope_parameters dict; "rope_type" or the
    older "type") -> GPTConfig's rope fields, read as transformers' modeling_rope_utils reads it.
    `hf`: the whole config.json (max_position_embeddings; a top-level original_max_position_embeddings
    overrides the entry's, as transformers' standardize_rope_params does). Shared by every family."""
    model_type = hf.get("model_type")
    if not isinstance(scaling, dict):
        raise ValueError(f"{model_type} config.json's rope scaling is {scaling!r}; it must be an object")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        why = f" ({NOT_IMPLEMENTED[kind]})" if kind in NOT_IMPLEMENTED else ""
        have = ", ".join(ROPE_TYPES)
        raise ValueError(
            f"{model_type} rope scaling type {kind!r} is not implemented{why}; implemented: {have}"
        )
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"{model_type} partial_rotary_factor {scaling['partial_rotary_factor']} is not supported"
        )
    out = {"rope_theta": float(theta)}
    if kind == "default":
        return out
    max_len = hf.get("max_position_embeddings") or 2048  # null: the default
    original = (
        hf.get("original_max_position_embeddings")
        or scaling.get("original_max_position_embeddings")
        or max_len
    )
    factor = scaling.get("factor")
    if factor is None and kind == "yarn":  # transformers: the ratio of the two lengths (DeepSeek-V3)
        factor = max_len / original
    if factor is None:
        raise ValueError(f"{model_type} {kind} rope scaling has no factor; add it to config.json")
    out.update(rope_scaling=kind, rope_factor=float(factor))
    if kind == "llama3":
        missing = [k for k in ("low_freq_factor", "high_freq_factor") if scaling.get(k) is None]
        if missing:
            raise ValueError(
                f"{model_type} llama3 rope scaling has no {', '.join(missing)}; add it to config.json"
            )
        out.update(
            rope_low_freq_factor=float(scaling["low_freq_factor"]),
            rope_high_freq_factor=float(scaling["high_freq_factor"]),
            rope_original_max_len=int(original),
        )
    if kind == "yarn":
        attention = scaling.get("attention_factor")
        if attention is None and scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention = yarn_attention_factor(factor, scaling["mscale"], scaling["mscale_all_dim"])
        if attention is not None and not attention > 0:
            raise ValueError(f"{model_type} yarn attention_factor must be > 0, got {attention}")
        out.update(
            rope_original_max_len=int(original),
            rope_attention_factor=float(attention or 0.0),  # 0: YaRN's default from the factor
            rope_beta_fast=float(scaling.get("beta_fast") or 32.0),  # transformers' `or`: 0 is the default
            rope_beta_slow=float(scaling.get("beta_slow") or 1.0),
            rope_truncate=bool(scaling.get("truncate", True)),
        )
    if kind == "dynamic":  # transformers scales from max_position_embeddings, not an original length
        out.update(rope_original_max_len=int(max_len))
    return out


def rope_reach(rope: dict, max_len: int) -> tuple[int, str]:
    """(the longest block_size a checkpoint allows, its name in the error): max_position_embeddings, or
    for yarn and dynamic the original context times the factor when longer (Qwen's YaRN configs keep
    max_position_embeddings at the original 32k: the point of the scaling is to run past it)."""
    if rope.get("rope_scaling") not in ("yarn", "dynamic"):
        return max_len, "max_position_embeddings"
    original, factor = rope["rope_original_max_len"], rope["rope_factor"]
    reach = int(original * factor)
    if reach <= max_len:
        return max_len, "max_position_embeddings"
    return reach, f"{rope['rope_scaling']} reach (original {original} x factor {factor})"


def _rope_fields(hf: dict) -> dict:
    """rope_theta and scaling from either config.json format: transformers < 5 (rope_theta,
    rope_scaling) or >= 5 (rope_parameters holding both); rope_scaling wins, as in transformers."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    # the entry's own rope_theta first: transformers only fills it in from the top-level one
    own = scaling.get("rope_theta") if isinstance(scaling, dict) else None  # (rope_fields refuses a non-dict)
    theta = own if own is not None else hf.get("rope_theta", params.get("rope_theta", 10000.0))
    return rope_fields(scaling, theta, hf)


def rope_parameters(c: GPTConfig) -> dict:
    """transformers' rotary entry (rope_type, rope_theta and what the type reads) for c's global
    rotary embedding; every flaxgpt scaling has a transformers rope_type of the same name."""
    rope = {"rope_type": "default" if c.rope_scaling == "none" else c.rope_scaling}
    if c.rope_scaling != "none":
        rope["factor"] = c.rope_factor
    rope["rope_theta"] = c.rope_theta
    if c.rope_scaling == "llama3":
        rope.update(low_freq_factor=c.rope_low_freq_factor, high_freq_factor=c.rope_high_freq_factor)
    if c.rope_scaling in ("llama3", "yarn"):
        rope["original_max_position_embeddings"] = c.rope_original_max_len
    if c.rope_scaling == "yarn":
        rope.update(beta_fast=c.rope_beta_fast, beta_slow=c.rope_beta_slow, truncate=c.rope_truncate)
        if c.rope_attention_factor:
            rope["attention_factor"] = c.rope_attention_factor
    return rope


def max_position_embeddings(c: GPTConfig, model_type: str) -> int:
    """config.json's max_position_embeddings: the context (block_size, or the imported checkpoint's
    longer one, hf_context), which dynamic NTK also scales from, so a dynamic model is written only
    when the two agree (a one-line refusal otherwise)."""
    context = max(c.block_size, c.hf_context)
    if c.pos_embedding == "rope" and c.rope_scaling == "dynamic" and context != c.rope_original_max_len:
        raise ValueError(
            f"a {model_type} checkpoint cannot hold block_size={context} with rope_scaling='dynamic': "
            f"its max_position_embeddings is both the context and the length dynamic NTK scales from "
            f"(rope_original_max_len={c.rope_original_max_len}); set block_size={c.rope_original_max_len} "
            "to export (the model still runs longer prompts)"
        )
    return context


def hidden_context(max_len: int, window: int, block_size: int) -> dict:
    """hf_context and hf_window: what of the checkpoint's context and window a shorter block_size hides
    (a window >= the context is none, in transformers as here)."""
    return dict(
        hf_context=max_len if max_len > block_size else 0,
        hf_window=window if window and block_size <= window < max_len else 0,
    )


def config_from_hf(hf: dict, family, **fields) -> GPTConfig:
    """A Llama / Mistral / Qwen2 / Qwen3 config.json (as a dict) of `family` (its families.Family)
    -> GPTConfig; `fields` set the free fields."""
    model_type = hf.get("model_type")
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [key for key in required if key not in hf]
    if missing:
        raise ValueError(f"{model_type} config.json has no {', '.join(missing)}")
    hf_files.require_ints(
        model_type,
        hf,
        required,
        optional=("max_position_embeddings", "num_key_value_heads", "head_dim", "sliding_window"),
    )
    D, H = hf["hidden_size"], hf["num_attention_heads"]
    if model_type == "qwen3" and hf.get("head_dim") is None:  # transformers' Qwen3 default is 128
        raise ValueError(
            f"{model_type} config.json has no head_dim (Qwen3 heads are not hidden_size / heads)"
        )
    # heads of another width than hidden_size / heads (Mistral-NeMo's 128 of 5120 / 32): the others'
    # default, as transformers reads it (Qwen3-MoE's config class has no head_dim of its own)
    head_dim = hf.get("head_dim") or D // H
    unsupported = {
        "hidden_act": hf.get("hidden_act", "silu") if hf.get("hidden_act", "silu") != "silu" else None,
        "attention_bias": True if hf.get("attention_bias") else None,
        "mlp_bias": True if hf.get("mlp_bias") else None,
        "use_sliding_window": True
        if model_type.startswith("qwen") and hf.get("use_sliding_window")
        else None,
    }
    max_len = hf.get("max_position_embeddings") or 2048  # null: the default
    rope = _rope_fields(hf)
    fields["block_size"] = fields.get("block_size") or max_len  # yarn, dynamic may run longer if asked
    block_size = hf_files.checked_block_size(
        model_type, unsupported, fields, ARCH_FIELDS, *rope_reach(rope, max_len)
    )
    window = hf.get("sliding_window") if model_type in WINDOWED else None
    return GPTConfig(
        vocab_size=hf["vocab_size"],
        block_size=block_size,
        n_layer=hf["num_hidden_layers"],
        n_head=H,
        n_kv_head=hf.get("num_key_value_heads") or H,
        n_embd=D,
        mlp_hidden=hf["intermediate_size"],
        pos_embedding="rope",
        norm="rmsnorm",
        activation="silu",
        glu=True,
        bias=False,
        qkv_bias=family.qkv_bias,
        qk_norm=family.qk_norm,
        head_size=head_dim if family.qk_norm or head_dim != D // H else 0,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        layer_norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        sliding_window=window if window and window < block_size else 0,  # a window >= the context is none
        **hidden_context(max_len, window or 0, block_size),
        **rope,
        **fields,
    )


def shape_fields(c: GPTConfig, model_type: str, family) -> dict:
    """The config.json keys every Llama-like family (Gemma's too) writes alike: the architecture, the
    sizes, the context, the norm's epsilon and the tied embeddings."""
    return {
        "architectures": [family.architecture],
        "model_type": model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.n_embd,
        "intermediate_size": c.mlp_hidden or 4 * c.n_embd,
        "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head,
        "num_key_value_heads": c.kv_heads,
        "max_position_embeddings": max_position_embeddings(c, model_type),
        "rms_norm_eps": c.layer_norm_epsilon,
        "tie_word_embeddings": c.tie_embeddings,
    }


def config_to_hf(config: GPTConfig, model_type: str, family, special_ids: dict | None = None) -> dict:
    """GPTConfig -> the config.json of `family` (model_type), what it holds of it: what it has no key
    for is left out (families.Family.export_config reads the file back and refuses a model that changed)."""
    c = config
    hf = {
        **shape_fields(c, model_type, family),
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rope_theta": c.rope_theta,  # both config.json formats: rope_theta + rope_scaling read everywhere
        "rope_scaling": None if c.rope_scaling == "none" else rope_parameters(c),
        "attention_dropout": c.attn_dropout,
        "initializer_range": 0.02,
        "dtype": "float32",
        **(special_ids or {}),
    }
    if model_type in WINDOWED:
        hf["sliding_window"] = c.sliding_window or c.hf_window or None
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        hf["use_sliding_window"] = False
    return hf
