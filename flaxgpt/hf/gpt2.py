"""GPT-2 weights from and to Hugging Face: an explicit key table, a shape check per tensor.

    config, params = load_pretrained("gpt2")            # hub or its cache (needs huggingface_hub)
    config, params = load_pretrained("path/to/dir")     # config.json + model.safetensors
    export_pretrained(config, params, "out/hf")         # then GPT2LMHeadModel.from_pretrained("out/hf")


`flaxgpt hf export` and `flaxgpt hf info` are flaxgpt.hf.cli.
GPT-2 stores its Linear layers as Conv1D, whose weight is [in, out]: the same layout as
a flax Dense kernel, so blocks copy without transposes. Only an untied lm_head
(torch Linear, [out, in]) is transposed. Finding and opening the files: flaxgpt.hf.files.
load_pretrained, export and info also take Llama, Mistral and Qwen2 (their key tables are in
flaxgpt.hf.llama), choosing by config.json's model_type (export: by the GPTConfig).

Export never writes into a training run's directory (one with config.json and checkpoints/ or
meta.json, or anything inside one), and replaces an existing non-empty directory's files only with
--overwrite (`overwrite=True`); each file is written to a temporary name and renamed when complete.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from flaxgpt.hf import files as hf_files
from flaxgpt.hf.files import CONFIG_FILE, WEIGHTS_FILE, get_path, open_tensors, resolve, set_path
from flaxgpt.models.gpt import GPTConfig, abstract_params, quantize_params, unstack_layers
from flaxgpt.models.layers import sinusoidal_positions
from flaxgpt.models.quantize import check_mode

# flaxgpt activation <-> transformers ACT2FN name
ACT_TO_HF = {"gelu": "gelu_new", "gelu_exact": "gelu", "relu": "relu"}
HF_TO_ACT = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_exact", "relu": "relu"}

# GPTConfig fields a GPT-2 checkpoint fixes; the others (dropout, dtype, remat, ...) are free
ARCH_FIELDS = tuple(
    "vocab_size n_layer n_head n_embd pos_embedding activation tie_embeddings bias qkv_bias "
    "layer_norm_epsilon".split()
)

# HF name inside block i (after "h.{i}.") -> flaxgpt path inside h_{i}; Conv1D weight == Dense kernel
BLOCK_KEYS = {
    "ln_1.weight": ("ln_1", "scale"),
    "ln_1.bias": ("ln_1", "bias"),
    "attn.c_attn.weight": ("attn", "c_attn", "kernel"),  # [D, 3D], columns q | k | v, heads inside each
    "attn.c_attn.bias": ("attn", "c_attn", "bias"),
    "attn.c_proj.weight": ("attn", "c_proj", "kernel"),  # [D, D]
    "attn.c_proj.bias": ("attn", "c_proj", "bias"),
    "ln_2.weight": ("ln_2", "scale"),
    "ln_2.bias": ("ln_2", "bias"),
    "mlp.c_fc.weight": ("mlp", "c_fc", "kernel"),  # [D, 4D]
    "mlp.c_fc.bias": ("mlp", "c_fc", "bias"),
    "mlp.c_proj.weight": ("mlp", "c_proj", "kernel"),  # [4D, D]
    "mlp.c_proj.bias": ("mlp", "c_proj", "bias"),
}
TOP_KEYS = {
    "wte.weight": ("wte", "embedding"),  # [V, D]; flaxgpt may pad rows to padded_vocab_size
    "wpe.weight": ("wpe", "embedding"),  # [n_positions, D]; flaxgpt keeps the first block_size rows
    "ln_f.weight": ("ln_f", "scale"),
    "ln_f.bias": ("ln_f", "bias"),
}
# causal-mask buffers some GPT-2 files carry: not parameters
BUFFER_RE = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")


# ---------------------------------------------------------------- configs


def config_from_hf(hf: dict, **fields) -> GPTConfig:
    """A GPT-2 config.json (as a dict) -> GPTConfig; `fields` set the non-architecture fields."""
    if hf.get("model_type") != "gpt2":
        raise ValueError(f"not a GPT-2 config: model_type is {hf.get('model_type')!r}, expected 'gpt2'")
    act = hf.get("activation_function", "gelu_new")
    D = hf.get("n_embd", 768)
    unsupported = {
        "activation_function": act if act not in HF_TO_ACT else None,
        "n_inner": hf.get("n_inner") if hf.get("n_inner") not in (None, 4 * D) else None,
        "scale_attn_weights": False if hf.get("scale_attn_weights", True) is False else None,
        "scale_attn_by_inverse_layer_idx": True if hf.get("scale_attn_by_inverse_layer_idx") else None,
        "add_cross_attention": True if hf.get("add_cross_attention") else None,
    }
    n_positions = hf.get("n_positions", 1024)
    block_size = hf_files.checked_block_size(
        "GPT-2", unsupported, fields, ARCH_FIELDS, n_positions, "n_positions"
    )
    return GPTConfig(
        vocab_size=hf.get("vocab_size", 50257),
        block_size=block_size,
        n_layer=hf.get("n_layer", 12),
        n_head=hf.get("n_head", 12),
        n_embd=D,
        activation=HF_TO_ACT[act],
        tie_embeddings=hf.get("tie_word_embeddings", True),
        layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
        **fields,
    )


def config_to_hf(config: GPTConfig) -> dict:
    """GPTConfig -> GPT-2 config.json. Everything a GPTConfig describes maps (see export_pretrained)."""
    eos = 50256 if config.vocab_size > 50256 else None  # GPT-2's <|endoftext|>, only with its tokenizer
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.block_size,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,
        "activation_function": ACT_TO_HF[config.activation],
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "tie_word_embeddings": config.tie_embeddings,
        "embd_pdrop": config.embd_dropout,
        "attn_pdrop": config.attn_dropout,
        "resid_pdrop": config.resid_dropout,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "dtype": "float32",
    }


# ---------------------------------------------------------------- import


def llama_family(hf: dict):
    """flaxgpt.hf.llama when config.json is a Llama / Mistral / Qwen2 / Qwen3 / Gemma 2 / Gemma 3 text
    one, None for GPT-2; any other model_type is a one-line error listing the supported ones."""
    from flaxgpt.hf import llama as hf_llama

    model_type = hf.get("model_type")
    if model_type == "gpt2":
        return None
    if model_type not in hf_llama.FAMILIES:
        supported = ", ".join(["gpt2", *hf_llama.FAMILIES])
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {supported}")
    return hf_llama


def read_config(name_or_path: str, cache_dir: str | None = None) -> GPTConfig:
    """The GPTConfig of a GPT-2 name or a Hugging Face directory, from its config.json alone (no weights)."""
    with open(os.path.join(resolve(name_or_path, cache_dir), CONFIG_FILE)) as fh:
        hf = json.load(fh)
    family = llama_family(hf)
    return family.config_from_hf(hf) if family else config_from_hf(hf)


def load_pretrained(
    name_or_path: str,
    *,
    scan_layers: bool = False,
    pad_vocab_multiple: int = 1,
    param_dtype: str = "float32",
    cache_dir: str | None = None,
    quantize: str | None = None,
    **overrides,
):
    """GPT-2 or Llama-family weights -> (GPTConfig, params) for `GPT(config).apply(...)`.

    `name_or_path`: a directory with config.json + model.safetensors (or the index and its
    shards), or a hub name (gpt2, gpt2-medium, gpt2-large, gpt2-xl) found in the HF cache or
    downloaded. config.json's model_type picks the key table: gpt2 here, llama / mistral / qwen2
    in hf_llama.py.
    `overrides`: GPTConfig fields that do not change the architecture (dtype, dropout,
    block_size <= n_positions, attention_impl, remat).
    `quantize`: "int8" or "bf16" weights for decoding with `gpt.step_fn` (`gpt.quantize_params`).
    """
    if quantize is not None:
        check_mode(quantize)  # before reading any weights
    directory = resolve(name_or_path, cache_dir)
    cfg_file = os.path.join(directory, CONFIG_FILE)
    if not os.path.exists(cfg_file):
        raise FileNotFoundError(
            f"no {CONFIG_FILE} in {directory}; a GPT-2 directory holds {CONFIG_FILE} and {WEIGHTS_FILE}"
        )
    with open(cfg_file) as fh:
        hf = json.load(fh)
    if llama_family(hf):
        kw = dict(scan_layers=scan_layers, pad_vocab_multiple=pad_vocab_multiple, param_dtype=param_dtype)
        return llama_family(hf).load_llama(directory, hf, **kw, **overrides)
    config = config_from_hf(
        hf,
        scan_layers=scan_layers,
        pad_vocab_multiple=pad_vocab_multiple,
        param_dtype=param_dtype,
        **overrides,
    )
    n_positions = hf.get("n_positions", 1024)
    flat = dataclasses.replace(config, scan_layers=False, pad_vocab_multiple=1, block_size=n_positions)
    shapes = nn.unbox(abstract_params(flat))  # the HF shapes: unpadded vocab, all n_positions rows
    dtype = jnp.dtype(param_dtype)
    L = config.n_layer

    with open_tensors(directory) as table:
        expected = set(TOP_KEYS) | {f"h.{i}.{k}" for i in range(L) for k in BLOCK_KEYS}
        if not config.tie_embeddings:
            expected.add("lm_head.weight")
        what = f"{directory} is not a GPT-2 checkpoint for its config"
        # a tied file may still carry lm_head; the attention-mask buffers are not weights
        hf_files.check_names(table, expected, what, optional={"lm_head.weight"}, ignore=BUFFER_RE)
        params: dict = {}
        # host numpy work in 64-byte-aligned buffers, then one device_put per leaf, which on CPU
        # adopts such a buffer without a copy: no per-shape compiles, host memory ~ model size
        for name, path in TOP_KEYS.items():
            set_path(params, path, hf_files.read(table, name, get_path(shapes, path).shape, dtype))
        params["wpe"]["embedding"] = params["wpe"]["embedding"][: config.block_size]
        D, PV = config.n_embd, config.padded_vocab_size
        # padded rows are never seen (logits are sliced); zeros keep them inert
        params["wte"]["embedding"] = hf_files.aligned_copy(params["wte"]["embedding"], dtype, (PV, D))
        if not config.tie_embeddings:  # a tied file's lm_head is ignored, as transformers does
            # torch Linear: [out, in]
            w_VD = hf_files.read(table, "lm_head.weight", (config.vocab_size, D), dtype)
            params["lm_head"] = {"kernel": hf_files.aligned_copy(w_VD.T, dtype, (D, PV))}
        params = jax.tree_util.tree_map(jax.device_put, params)
        for key, path in BLOCK_KEYS.items():
            shape = get_path(shapes["h_0"], path).shape
            if scan_layers:  # one [L, ...] host buffer per leaf kind, filled layer by layer
                stacked = hf_files.aligned_empty((L, *shape), dtype)
                for i in range(L):
                    stacked[i] = hf_files.read(table, f"h.{i}.{key}", shape, dtype)
                set_path(params, ("h", "block") + path, jax.device_put(stacked))
                del stacked
            else:
                for i in range(L):
                    x = hf_files.read(table, f"h.{i}.{key}", shape, dtype)
                    set_path(params, (f"h_{i}",) + path, jax.device_put(x))
    if quantize is not None:
        return quantize_params(config, params, quantize)
    return config, params


def load_tokenizer(name_or_path: str, cache_dir: str | None = None):
    """The tokenizer of a pretrained model: GPT-2's BPE (shipped with flaxgpt, offline) for GPT-2,
    the directory's tokenizer.json for a Llama-family model (an error when it has none)."""
    from flaxgpt.data import tokenizers
    from flaxgpt.hf.tokenizer import TOKENIZER_FILE, HFTokenizer

    directory = resolve(name_or_path, cache_dir)
    with open(os.path.join(directory, CONFIG_FILE)) as fh:
        model_type = json.load(fh).get("model_type")
    if model_type == "gpt2":
        return tokenizers.get_tokenizer("gpt2")
    if not os.path.exists(os.path.join(directory, TOKENIZER_FILE)):
        raise FileNotFoundError(f"no {TOKENIZER_FILE} in {directory}; a {model_type} model needs its own")
    return HFTokenizer(directory)


# ---------------------------------------------------------------- export


def _as_config(config) -> GPTConfig:
    """A GPTConfig, or a run's `model` section (config.json: GPTConfig fields + "kind")."""
    from flaxgpt.models import registry as models

    kind = models.kind_of(config) if dataclasses.is_dataclass(config) else dict(config).get("kind", "gpt")
    if kind != "gpt":
        raise ValueError(f"only GPT models export to GPT-2; this checkpoint is kind={kind!r}")
    return config if isinstance(config, GPTConfig) else models.config_from(config, saved=True)


# fields of GPTConfig whose other values GPT-2 cannot hold: name -> the value(s) it can
GPT2_EXPRESSIBLE = {
    "pos_embedding": ("learned", "sinusoidal"),
    "activation": ("gelu", "gelu_exact", "relu"),
    "norm": "layernorm",
    "qk_norm": False,
    "logit_softcap": 0.0,
    "glu": False,
    "unet_skips": False,
    "value_embeds": 0,
}


def export_state(config, params) -> tuple[dict, dict]:
    """(config.json dict, {HF name: float32 numpy array}) for a flaxgpt GPT.

    Every GPTConfig maps onto GPT-2: no bias -> zero biases, sinusoidal positions -> a
    wpe table holding the same encoding, activations -> their ACT2FN names, an untied
    head -> tie_word_embeddings=False.
    """
    config = _as_config(config)
    beyond = [  # options GPT-2's format has no equivalent for (zero_init_proj is only an init)
        f"{name}={getattr(config, name)!r}"
        for name, plain in GPT2_EXPRESSIBLE.items()
        if getattr(config, name, plain) not in (plain if isinstance(plain, tuple) else (plain,))
    ]
    if beyond:
        raise ValueError(
            f"a GPT-2 checkpoint cannot express {', '.join(beyond)}; export a model without them"
        )
    params = nn.unbox(params)
    if config.scan_layers:
        params = unstack_layers(params, config.n_layer)
    V, PV, D = config.vocab_size, config.padded_vocab_size, config.n_embd
    # with every bias present: a bias-free model exports zeros in their place
    flat = dataclasses.replace(config, scan_layers=False, pad_vocab_multiple=1, bias=True, qkv_bias=True)
    block_shapes = nn.unbox(abstract_params(flat))["h_0"]

    def get(path, shape):
        """params[path] as float32 numpy, shape-checked; an absent bias the config omits is zero."""
        try:
            x = get_path(params, path)
        except KeyError:
            omitted = not config.bias or (path[-2] == "c_attn" and not config.qkv_bias)
            if path[-1] == "bias" and omitted:
                return np.zeros(shape, np.float32)
            raise ValueError(f"params have no {'/'.join(path)}; do they belong to this config?") from None
        x = np.asarray(jax.device_get(x), dtype=np.float32)
        if x.shape != tuple(shape):
            raise ValueError(
                f"param {'/'.join(path)} has shape {x.shape}, expected {tuple(shape)} from the config"
            )
        return x

    tensors = {"transformer.wte.weight": get(("wte", "embedding"), (PV, D))[:V]}  # strip vocab padding
    if config.pos_embedding == "learned":
        tensors["transformer.wpe.weight"] = get(("wpe", "embedding"), (config.block_size, D))
    else:
        pos = sinusoidal_positions(jnp.arange(config.block_size), D, config.sinusoid_layout)
        tensors["transformer.wpe.weight"] = np.asarray(pos, np.float32)
    tensors["transformer.ln_f.weight"] = get(("ln_f", "scale"), (D,))
    tensors["transformer.ln_f.bias"] = get(("ln_f", "bias"), (D,))
    if not config.tie_embeddings:  # torch Linear is [out, in]
        tensors["lm_head.weight"] = np.ascontiguousarray(get(("lm_head", "kernel"), (D, PV))[:, :V].T)
    for i in range(config.n_layer):
        for key, path in BLOCK_KEYS.items():
            tensors[f"transformer.h.{i}.{key}"] = get((f"h_{i}",) + path, get_path(block_shapes, path).shape)
    return config_to_hf(config), tensors


def _is_run(directory: Path) -> bool:
    """A flaxgpt training run: config.json beside checkpoints/ or meta.json."""
    return (directory / "config.json").is_file() and (
        (directory / "checkpoints").is_dir() or (directory / "meta.json").is_file()
    )


def check_export_target(to, overwrite: bool = False, run=None) -> None:
    """Refuses, in one line, to export into the training run `run`, into any training run's directory
    (or below it), into a file, or into an existing non-empty directory unless `overwrite`."""
    target = Path(to).resolve()
    if run is not None and Path(run).resolve() in (target, *target.parents):
        where = "is" if Path(run).resolve() == target else "is inside"
        raise ValueError(f"--to {to} {where} the training run being exported; export to another directory")
    for directory in (target, *target.parents):
        if _is_run(directory):
            where = "is" if directory == target else f"is inside {directory},"
            raise ValueError(f"{to} {where} a flaxgpt training run; export to a directory outside it")
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{to} is a file, not a directory; choose another --to")
    if not overwrite and target.is_dir() and any(target.iterdir()):
        raise FileExistsError(
            f"{to} exists and is not empty; pass --overwrite to replace its {CONFIG_FILE} and "
            f"{WEIGHTS_FILE}, or choose another --to"
        )


def export_pretrained(config, params, out_dir: str, overwrite: bool = False, tokenizer=None) -> str:
    """Write out_dir/config.json + model.safetensors for transformers.GPT2LMHeadModel.from_pretrained,
    or, for a model with rotary positions, the Llama-family model that expresses it (hf_llama.py,
    with the tokenizer's files when `tokenizer` is the model's own tokenizer.json).
    Refuses a training run's directory, and an existing non-empty out_dir unless `overwrite`."""
    from safetensors.numpy import save_file

    check_export_target(out_dir, overwrite)
    config = _as_config(config)
    if config.pos_embedding == "rope":
        from flaxgpt.hf import llama as hf_llama

        return hf_llama.export_llama(config, params, out_dir, tokenizer=tokenizer)
    hf, tensors = export_state(config, params)
    os.makedirs(out_dir, exist_ok=True)
    weights, config_file = os.path.join(out_dir, WEIGHTS_FILE), os.path.join(out_dir, CONFIG_FILE)
    save_file(tensors, weights + ".tmp", metadata={"format": "pt"})
    with open(config_file + ".tmp", "w") as fh:
        json.dump(hf, fh, indent=2)
    os.replace(weights + ".tmp", weights)  # a failed export leaves no half-written file behind
    os.replace(config_file + ".tmp", config_file)
    return out_dir
