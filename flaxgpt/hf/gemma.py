"""Gemma 2 and Gemma 3 (text) config.json <-> GPTConfig, and their key tables.

Gemma's entries in the family table (flaxgpt.hf.families). The weights load and export through
flaxgpt.hf.rotary (one loop for every rotary family); this module says how Gemma's config.json
reads as GPTConfig fields and how its tensors are named.
Gemma is a Llama-style decoder plus: norms scaled by (1 + w) (norm="rmsnorm_1p"), a norm after
the attention and after the MLP (post_norms), GeGLU (activation="gelu", glu), embeddings times
sqrt(D) (embed_scale), heads of their own width (head_size), logits scaled by
1/sqrt(query_pre_attn_scalar), sliding-window layers in a repeating pattern (window_pattern), and
in Gemma 2 soft-capped attention and final logits, in Gemma 3 QK-norm and a rotary base of their
own for the window layers (rope_local_theta).

Mind the names: Gemma's post_attention_layernorm is the norm on the attention's output
(post_attn_ln), not Llama's norm before the MLP, which Gemma calls pre_feedforward_layernorm (ln_2).
"""

from __future__ import annotations

from flaxgpt.hf import files as hf_files
from flaxgpt.hf import llama as hf_llama
from flaxgpt.hf.llama import ARCH_FIELDS
from flaxgpt.models.gpt_config import GPTConfig

GEMMA2_LAYER_KEYS = {  # HF name in layer i -> (flaxgpt path in h_{i}, part of a fused tensor)
    "input_layernorm.weight": (("ln_1", "scale"), None),  # [D]
    "self_attn.q_proj.weight": (("attn", "c_attn", "kernel"), "q"),  # [H*K, D]
    "self_attn.k_proj.weight": (("attn", "c_attn", "kernel"), "k"),  # [J*K, D]
    "self_attn.v_proj.weight": (("attn", "c_attn", "kernel"), "v"),  # [J*K, D]
    "self_attn.o_proj.weight": (("attn", "c_proj", "kernel"), None),  # [D, H*K]
    "post_attention_layernorm.weight": (("post_attn_ln", "scale"), None),  # [D], on the attention's output
    "pre_feedforward_layernorm.weight": (("ln_2", "scale"), None),  # [D]
    "post_feedforward_layernorm.weight": (("post_mlp_ln", "scale"), None),  # [D]
    "mlp.gate_proj.weight": (("mlp", "c_fc", "kernel"), "gate"),  # [F, D]
    "mlp.up_proj.weight": (("mlp", "c_fc", "kernel"), "up"),  # [F, D]
    "mlp.down_proj.weight": (("mlp", "c_proj", "kernel"), None),  # [D, F]
}
GEMMA3_LAYER_KEYS = {
    **GEMMA2_LAYER_KEYS,
    "self_attn.q_norm.weight": (("attn", "q_norm", "scale"), None),  # [K]
    "self_attn.k_norm.weight": (("attn", "k_norm", "scale"), None),  # [K]
}
REQUIRED = (
    "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads head_dim "
    "query_pre_attn_scalar sliding_window".split()
)
GLOBAL, LOCAL = "full_attention", "sliding_attention"


def _window_pattern(hf: dict, model_type: str) -> int:
    """N such that layer i is global exactly when (i+1) % N == 0, from layer_types (transformers 5)
    or sliding_window_pattern (older Gemma 3 files; Gemma 2 alternates, N = 2)."""
    L = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if not types:
        n = 2 if model_type == "gemma2" else hf.get("sliding_window_pattern", 6)
        return n
    n = types.index(GLOBAL) + 1 if GLOBAL in types else L + 1
    if len(types) != L or types != [GLOBAL if (i + 1) % n == 0 else LOCAL for i in range(L)]:
        raise ValueError(f"{model_type} layer_types {types} are not 'N-1 local, 1 global' repeated")
    return n


def _rope_fields(hf: dict, model_type: str) -> dict:
    """Global and local rotary settings from either config.json format; the global entry's scaling
    is any of llama.ROPE_TYPES, the window layers' unscaled."""
    params = hf.get("rope_parameters") or {}
    if GLOBAL in params:  # transformers 5: one entry per layer type
        glob = params[GLOBAL]
        # transformers reads yarn's truncate from rope_parameters itself, not the layer type's entry
        glob = {**glob, "truncate": params.get("truncate", True)} if "truncate" in glob else glob
        out = hf_llama.rope_fields(glob, glob.get("rope_theta", 10000.0), hf)
        local = params.get(LOCAL, {})
        if local.get("rope_type", "default") != "default":
            raise ValueError(
                f"{model_type}: scaled rotary embeddings on the window layers are not implemented"
            )
        local_theta = float(local.get("rope_theta", out["rope_theta"]))
    else:  # older files: rope_theta + rope_scaling (global), rope_local_base_freq (Gemma 3)
        scaling = hf.get("rope_scaling") or params
        own = scaling.get("rope_theta") if isinstance(scaling, dict) else None  # (rope_fields refuses it)
        theta = own if own is not None else hf.get("rope_theta", params.get("rope_theta", 10000.0))
        out = hf_llama.rope_fields(scaling, theta, hf)
        local_theta = float(hf.get("rope_local_base_freq", out["rope_theta"]))
    if model_type == "gemma3_text":
        out["rope_local_theta"] = local_theta
    elif local_theta != out["rope_theta"]:
        raise ValueError(f"{model_type} has one rotary base; this config.json gives two")
    return out


def config_from_hf(hf: dict, family, **fields) -> GPTConfig:
    """A Gemma 2 / Gemma 3 text config.json (as a dict) -> GPTConfig; `fields` set the free fields."""
    model_type = hf["model_type"]
    missing = [key for key in REQUIRED if hf.get(key) is None]
    if missing:
        raise ValueError(
            f"{model_type} config.json has no {', '.join(missing)}; flaxgpt needs them to load it"
        )
    sizes = [key for key in REQUIRED if key != "query_pre_attn_scalar"]  # (a scalar may be a float)
    hf_files.require_ints(model_type, hf, sizes, optional=("max_position_embeddings", "num_key_value_heads"))
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    unsupported = {
        "hidden_activation": act if act != "gelu_pytorch_tanh" else None,
        "attention_bias": True if hf.get("attention_bias") else None,
        "use_bidirectional_attention": True if hf.get("use_bidirectional_attention") else None,
    }
    max_len = hf.get("max_position_embeddings") or 8192  # null: the default
    rope = _rope_fields(hf, model_type)
    window = hf["sliding_window"]
    if window > max_len:
        raise ValueError(
            f"{model_type} sliding_window {window} is longer than max_position_embeddings {max_len}; "
            "fix config.json (a window covers at most the context)"
        )
    fields["block_size"] = fields.get("block_size") or max_len  # yarn, dynamic may run longer if asked
    block_size = hf_files.checked_block_size(
        model_type, unsupported, fields, ARCH_FIELDS, *hf_llama.rope_reach(rope, max_len)
    )
    softcaps = {
        key: float(hf.get(key) or 0.0) for key in ("attn_logit_softcapping", "final_logit_softcapping")
    }
    if model_type == "gemma3_text":  # transformers' Gemma 3 keeps the field but never caps attention
        softcaps["attn_logit_softcapping"] = 0.0  # (its published configs: null); Gemma 2 does
    return GPTConfig(
        vocab_size=hf["vocab_size"],
        block_size=block_size,
        n_layer=hf["num_hidden_layers"],
        n_head=hf["num_attention_heads"],
        n_kv_head=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        n_embd=hf["hidden_size"],
        head_size=hf["head_dim"],
        mlp_hidden=hf["intermediate_size"],
        pos_embedding="rope",
        norm="rmsnorm_1p",
        activation="gelu",
        glu=True,
        bias=False,
        qkv_bias=False,
        qk_norm=model_type == "gemma3_text",
        post_norms=True,
        embed_scale=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        layer_norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        sliding_window=min(window, block_size),  # a window of the whole context is the same model
        **hf_llama.hidden_context(max_len, window, block_size),
        window_pattern=_window_pattern(hf, model_type),
        query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]),
        attn_softcap=softcaps["attn_logit_softcapping"],
        logit_softcap=softcaps["final_logit_softcapping"],
        **rope,
        **fields,
    )


def config_to_hf(config: GPTConfig, model_type: str, family, special_ids: dict | None = None) -> dict:
    """GPTConfig -> a Gemma 2 / Gemma 3 text config.json (transformers 5's format), what it holds of it:
    what it has no key for is left out (families.Family.export_config reads the file back and refuses
    a model that changed)."""
    c = config
    types = [GLOBAL if not c.layer_window(i) else LOCAL for i in range(c.n_layer)]
    glob = hf_llama.rope_parameters(c)
    if model_type == "gemma3_text":
        local = {"rope_type": "default", "rope_theta": c.rope_local_theta or c.rope_theta}
        rope = {GLOBAL: glob, LOCAL: local}
    else:
        rope = glob
    scalar = c.query_pre_attn_scalar or c.head_dim
    return {
        **hf_llama.shape_fields(c, model_type, family),
        "head_dim": c.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_parameters": rope,
        "query_pre_attn_scalar": int(scalar)
        if scalar == int(scalar)
        else scalar,  # transformers wants an int
        # a window covers at most the context; the checkpoint's own when block_size hid it
        "sliding_window": c.hf_window or min(c.sliding_window or c.block_size, c.block_size),
        "layer_types": types,
        # Gemma 3 written with it would load uncapped: left out, the round trip refuses such a model
        "attn_logit_softcapping": (c.attn_softcap or None) if model_type != "gemma3_text" else None,
        "final_logit_softcapping": c.logit_softcap or None,
        "attention_bias": False,
        "attention_dropout": c.attn_dropout,
        "initializer_range": 0.02,
        "dtype": "float32",
        **(special_ids or {}),
    }
