"""Llama, Mistral and Qwen2 weights from and to Hugging Face: a key table per family, shape checks.

    config, params = load_llama("path/to/hf_dir")    # config.json + safetensors (sharded or not)
    export_llama(config, params, "out/hf", model_type="llama")   # then AutoModelForCausalLM

`flaxgpt.hf.gpt2.load_pretrained` dispatches here on config.json's model_type. The three families
are one architecture in flaxgpt's GPT (pos_embedding="rope", norm="rmsnorm", a SwiGLU MLP,
grouped-query attention); they differ in what their config.json may say and in Qwen2's q/k/v
biases. flaxgpt fuses q | k | v into c_attn and gate | up into c_fc (one matmul each), so
several Hugging Face tensors fill column ranges of one kernel. torch Linear weights are
[out, in] and become [in, out] kernels by a transpose.

Shape letters: D n_embd, H heads, J key/value heads, K head dim, F MLP hidden, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from flaxgpt.hf import files as hf_files
from flaxgpt.hf import gemma as hf_gemma
from flaxgpt.hf.files import get_path, set_path
from flaxgpt.models.gpt import GPTConfig, abstract_params, unstack_layers

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
TOP_KEYS = {
    "model.embed_tokens.weight": ("wte", "embedding"),  # [V, D]; flaxgpt may pad rows
    "model.norm.weight": ("ln_f", "scale"),  # [D]
}
HEAD_KEY = "lm_head.weight"  # [V, D] torch Linear; flaxgpt's lm_head kernel is [D, V]


@dataclasses.dataclass(frozen=True)
class Family:
    architecture: str
    layer_keys: dict
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's queries and keys; head_dim its own


FAMILIES = {
    "llama": Family("LlamaForCausalLM", LLAMA_LAYER_KEYS),
    "mistral": Family("MistralForCausalLM", LLAMA_LAYER_KEYS),
    "qwen2": Family("Qwen2ForCausalLM", QWEN2_LAYER_KEYS, qkv_bias=True),
    "qwen3": Family("Qwen3ForCausalLM", QWEN3_LAYER_KEYS, qk_norm=True),
    # gemma2, gemma3_text: their config.json maps in flaxgpt/hf/gemma.py
    **{model_type: Family(arch, keys) for model_type, (arch, keys) in hf_gemma.FAMILIES.items()},
}
ROPE_TYPES = ("default", "llama3")  # rope_scaling types flaxgpt implements
# GPTConfig fields a checkpoint fixes; the others (dropout, dtype, remat, block_size, ...) are free
ARCH_FIELDS = tuple(
    "vocab_size n_layer n_head n_kv_head n_embd mlp_hidden pos_embedding norm activation glu "
    "tie_embeddings bias qkv_bias layer_norm_epsilon rope_theta rope_scaling rope_factor "
    "rope_low_freq_factor rope_high_freq_factor rope_original_max_len sliding_window qk_norm "
    "logit_softcap head_size window_pattern rope_local_theta query_pre_attn_scalar attn_softcap post_norms "
    "embed_scale".split()
)


# ---------------------------------------------------------------- configs


def _rope_fields(hf: dict) -> dict:
    """rope_theta and scaling from either config.json format: transformers < 5 (rope_theta,
    rope_scaling) or >= 5 (rope_parameters holding both)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    if kind not in ROPE_TYPES:
        implemented = ", ".join(ROPE_TYPES)
        raise ValueError(f"rope scaling type {kind!r} is not implemented; implemented: {implemented}")
    out = {"rope_theta": float(theta)}
    if kind == "llama3":
        out.update(
            rope_scaling="llama3",
            rope_factor=float(scaling["factor"]),
            rope_low_freq_factor=float(scaling["low_freq_factor"]),
            rope_high_freq_factor=float(scaling["high_freq_factor"]),
            rope_original_max_len=int(scaling["original_max_position_embeddings"]),
        )
    return out


def config_from_hf(hf: dict, **fields) -> GPTConfig:
    """A Llama / Mistral / Qwen2 config.json (as a dict) -> GPTConfig; `fields` set the free fields."""
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not a Llama-family model: {', '.join(FAMILIES)}")
    if model_type in hf_gemma.FAMILIES:
        return hf_gemma.config_from_hf(hf, ARCH_FIELDS, **fields)
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [key for key in required if key not in hf]
    if missing:
        raise ValueError(f"{model_type} config.json has no {', '.join(missing)}")
    D, H = hf["hidden_size"], hf["num_attention_heads"]
    family = FAMILIES[model_type]
    if family.qk_norm and "head_dim" not in hf:
        raise ValueError(
            f"{model_type} config.json has no head_dim (Qwen3 heads are not hidden_size / heads)"
        )
    unsupported = {
        "hidden_act": hf.get("hidden_act", "silu") if hf.get("hidden_act", "silu") != "silu" else None,
        "head_dim": hf.get("head_dim")
        if hf.get("head_dim") not in (None, D // H) and not family.qk_norm
        else None,
        "attention_bias": True if hf.get("attention_bias") else None,
        "mlp_bias": True if hf.get("mlp_bias") else None,
        "use_sliding_window": True
        if model_type.startswith("qwen") and hf.get("use_sliding_window")
        else None,
    }
    max_len = hf.get("max_position_embeddings", 2048)
    block_size = hf_files.checked_block_size(
        model_type, unsupported, fields, ARCH_FIELDS, max_len, "max_position_embeddings"
    )
    window = hf.get("sliding_window") if model_type == "mistral" else None
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
        head_size=hf["head_dim"] if family.qk_norm else 0,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        layer_norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        sliding_window=window if window and window < block_size else 0,  # a window >= the context is none
        **_rope_fields(hf),
        **fields,
    )


def config_to_hf(config: GPTConfig, model_type: str, special_ids: dict | None = None) -> dict:
    """GPTConfig -> the family's config.json; a config the family cannot express is an error."""
    if model_type not in FAMILIES:
        types = ", ".join(FAMILIES)
        raise ValueError(f"cannot export model_type {model_type!r}; Llama-family types: {types}")
    if model_type in hf_gemma.FAMILIES:
        return hf_gemma.config_to_hf(config, model_type, special_ids)
    c = config
    need = {
        "pos_embedding": "rope",
        "norm": "rmsnorm",
        "activation": "silu",
        "glu": True,
        "bias": False,
        "qkv_bias": FAMILIES[model_type].qkv_bias,
        "qk_norm": FAMILIES[model_type].qk_norm,
        "logit_softcap": 0.0,
        "window_pattern": 0,
        "rope_local_theta": 0.0,
        "query_pre_attn_scalar": 0.0,
        "attn_softcap": 0.0,
        "post_norms": False,
        "embed_scale": False,
        "unet_skips": False,
        "value_embeds": 0,
    }
    if model_type != "mistral":
        need["sliding_window"] = 0
    for field, value in need.items():
        if getattr(c, field) != value:
            raise ValueError(f"{model_type} needs {field}={value!r}, this model has {getattr(c, field)!r}")
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling == "llama3":
        rope.update(
            rope_type="llama3",
            factor=c.rope_factor,
            low_freq_factor=c.rope_low_freq_factor,
            high_freq_factor=c.rope_high_freq_factor,
            original_max_position_embeddings=c.rope_original_max_len,
        )
    hf = {
        "architectures": [FAMILIES[model_type].architecture],
        "model_type": model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.n_embd,
        "intermediate_size": c.mlp_hidden or 4 * c.n_embd,
        "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head,
        "num_key_value_heads": c.kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.block_size,
        "rms_norm_eps": c.layer_norm_epsilon,
        "tie_word_embeddings": c.tie_embeddings,
        "rope_theta": c.rope_theta,  # both config.json formats: rope_theta + rope_scaling read everywhere
        "rope_scaling": rope if c.rope_scaling != "none" else None,
        "attention_dropout": c.attn_dropout,
        "initializer_range": 0.02,
        "dtype": "float32",
        **(special_ids or {}),
    }
    if model_type == "mistral":
        hf["sliding_window"] = c.sliding_window or None
    if model_type in ("qwen2", "qwen3"):
        hf["use_sliding_window"] = False
    return hf


def family_of(config: GPTConfig) -> str:
    """The family that expresses a rotary GPTConfig: Gemma has post-norms (Gemma 3 QK-norm too),
    Qwen3 QK-norm, Qwen2 qkv biases, Mistral a window."""
    if config.post_norms:
        return "gemma3_text" if config.qk_norm else "gemma2"
    if config.qk_norm:
        return "qwen3"
    return "qwen2" if config.qkv_bias else "mistral" if config.sliding_window else "llama"


# ---------------------------------------------------------------- fused columns


def _columns(config: GPTConfig, part: str | None) -> slice:
    """The columns (last axis) of a fused flaxgpt tensor that a Hugging Face part fills."""
    HK, JK, F = config.n_head * config.head_dim, config.kv_heads * config.head_dim, config.mlp_hidden
    F = F or 4 * config.n_embd
    return {
        None: slice(None),
        "q": slice(0, HK),
        "k": slice(HK, HK + JK),
        "v": slice(HK + JK, HK + 2 * JK),
        "gate": slice(0, F),
        "up": slice(F, 2 * F),
    }[part]


def _by_path(layer_keys: dict) -> dict:
    """flaxgpt path -> [(HF name, part)]: the tensors that make up each flaxgpt leaf."""
    out: dict = {}
    for name, (path, part) in layer_keys.items():
        out.setdefault(path, []).append((name, part))
    return out


# ---------------------------------------------------------------- import


def load_llama(directory, hf, *, scan_layers=False, pad_vocab_multiple=1, param_dtype="float32", **kw):
    """A Llama-family directory (its config.json already read into `hf`) -> (GPTConfig, params)."""
    config = config_from_hf(
        hf, scan_layers=scan_layers, pad_vocab_multiple=pad_vocab_multiple, param_dtype=param_dtype, **kw
    )
    family = FAMILIES[hf["model_type"]]
    flat = dataclasses.replace(config, scan_layers=False, pad_vocab_multiple=1)
    shapes = nn.unbox(abstract_params(flat))
    dtype, L, D, PV = jnp.dtype(param_dtype), config.n_layer, config.n_embd, config.padded_vocab_size
    with hf_files.open_tensors(directory) as table:
        expected = set(TOP_KEYS) | {f"model.layers.{i}.{k}" for i in range(L) for k in family.layer_keys}
        if not config.tie_embeddings:
            expected.add(HEAD_KEY)
        what = f"{directory} is not a {hf['model_type']} checkpoint for its config"
        hf_files.check_names(table, expected, what, optional={HEAD_KEY})  # a tied file may carry lm_head
        params: dict = {}
        for name, path in TOP_KEYS.items():
            set_path(params, path, hf_files.read(table, name, get_path(shapes, path).shape, dtype))
        # padded vocabulary rows are never seen (logits are sliced); zeros keep them inert
        params["wte"]["embedding"] = hf_files.aligned_copy(params["wte"]["embedding"], dtype, (PV, D))
        if not config.tie_embeddings:
            w_VD = hf_files.read(table, HEAD_KEY, (config.vocab_size, D), dtype)
            params["lm_head"] = {"kernel": hf_files.aligned_copy(w_VD.T, dtype, (D, PV))}
        params = jax.tree_util.tree_map(jax.device_put, params)
        for path, sources in _by_path(family.layer_keys).items():
            shape = get_path(shapes["h_0"], path).shape
            # one host buffer per leaf (stacked [L, ...] for scan_layers), filled one tensor at a time
            stacked = hf_files.aligned_empty((L, *shape), dtype) if scan_layers else None
            for i in range(L):
                leaf = stacked[i] if scan_layers else hf_files.aligned_empty(shape, dtype)
                for name, part in sources:
                    cols = leaf[..., _columns(config, part)]
                    hf_shape = cols.shape[::-1]  # torch Linear [out, in]; a 1-D tensor as is
                    cols[...] = hf_files.read(table, f"model.layers.{i}.{name}", hf_shape, dtype).T
                if not scan_layers:
                    set_path(params, (f"h_{i}",) + path, jax.device_put(leaf))
            if scan_layers:
                set_path(params, ("h", "block") + path, jax.device_put(stacked))
    return config, params


# ---------------------------------------------------------------- export


def export_state(config: GPTConfig, params, model_type: str = "llama", special_ids=None) -> tuple[dict, dict]:
    """(config.json dict, {HF name: float32 numpy array}) of a Llama-family flaxgpt GPT."""
    hf = config_to_hf(config, model_type, special_ids)
    params = nn.unbox(params)
    if config.scan_layers:
        params = unstack_layers(params, config.n_layer)
    V, PV, D = config.vocab_size, config.padded_vocab_size, config.n_embd
    shapes = nn.unbox(abstract_params(dataclasses.replace(config, scan_layers=False, pad_vocab_multiple=1)))

    def get(path, shape):
        try:
            x = np.asarray(jax.device_get(get_path(params, path)), dtype=np.float32)
        except KeyError:
            raise ValueError(f"params have no {'/'.join(path)}; do they belong to this config?") from None
        if x.shape != tuple(shape):
            name = "/".join(path)
            raise ValueError(f"param {name} has shape {x.shape}, expected {tuple(shape)} from the config")
        return x

    tensors = {
        "model.embed_tokens.weight": get(("wte", "embedding"), (PV, D))[:V],  # strip vocabulary padding
        "model.norm.weight": get(("ln_f", "scale"), (D,)),
    }
    if not config.tie_embeddings:
        tensors[HEAD_KEY] = np.ascontiguousarray(get(("lm_head", "kernel"), (D, PV))[:, :V].T)
    for i in range(config.n_layer):
        for name, (path, part) in FAMILIES[model_type].layer_keys.items():
            x = get((f"h_{i}",) + path, get_path(shapes["h_0"], path).shape)[..., _columns(config, part)]
            tensors[f"model.layers.{i}.{name}"] = np.ascontiguousarray(x.T)
    return hf, tensors


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
TOKENIZER_FILES += ("generation_config.json",)


def export_llama(config, params, out_dir: str, model_type=None, tokenizer=None, max_shard_bytes=None):
    """Write out_dir/config.json + safetensors that transformers' AutoModelForCausalLM loads.

    `model_type`: llama | mistral | qwen2 (default: family_of(config)). `tokenizer`: an
    HFTokenizer whose files (tokenizer.json, ...) are copied along, with its BOS / EOS ids.
    """
    model_type = model_type or family_of(config)
    special = None
    if tokenizer is not None and hasattr(tokenizer, "file"):
        special = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
    hf, tensors = export_state(config, params, model_type, special)
    hf_files.write_safetensors(tensors, out_dir, max_shard_bytes)  # each file renamed when complete
    hf_files.write_json(hf, os.path.join(out_dir, hf_files.CONFIG_FILE))
    if special is not None:
        for name in TOKENIZER_FILES:
            source = tokenizer.file.parent / name
            if source.is_file():
                shutil.copyfile(source, os.path.join(out_dir, name))
    return out_dir
