"""GPT-2 in the family table (flaxgpt.hf.families): its key table, its config.json both ways, and
the weight loop for its layout.

GPT-2 stores its Linear layers as Conv1D, whose weight is [in, out]: the same layout as
a flax Dense kernel, so blocks copy without transposes. Only an untied lm_head
(torch Linear, [out, in]) is transposed. Finding and opening the files: flaxgpt.hf.files;
loading and exporting any family by its model_type: flaxgpt.hf.pretrained.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from flaxgpt import sharding
from flaxgpt.hf import files as hf_files
from flaxgpt.hf.files import get_path, open_tensors, put_tree, set_path
from flaxgpt.models.gpt import GPTConfig, abstract_params, unstack_layers
from flaxgpt.models.layers import sinusoidal_positions

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


def config_from_hf(hf: dict, family=None, **fields) -> GPTConfig:
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


def written_as(config: GPTConfig) -> GPTConfig:
    """The GPTConfig a GPT-2 export holds: the same function, with the zero biases export_state writes
    for a bias-free model and the learned table it writes for sinusoidal positions."""
    pos = "learned" if config.pos_embedding == "sinusoidal" else config.pos_embedding
    return dataclasses.replace(config, pos_embedding=pos, bias=True, qkv_bias=True)


def config_to_hf(config: GPTConfig, model_type: str = "gpt2", family=None, special_ids=None) -> dict:
    """GPTConfig -> GPT-2 config.json, what GPT-2 holds of it: what it has no key for is left out
    (families.Family.export_config reads the file back and refuses a model that changed); an
    activation it has no name for is a one-line error."""
    if config.activation not in ACT_TO_HF:
        have = ", ".join(ACT_TO_HF)
        raise ValueError(f"a gpt2 checkpoint cannot hold activation={config.activation!r} (it has {have})")
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


def load_gpt2(
    directory: str,
    hf: dict,
    family=None,
    *,
    scan_layers=False,
    pad_vocab_multiple=1,
    param_dtype="float32",
    place=None,
    **overrides,
):
    """A GPT-2 directory (its config.json already read into `hf`) -> (GPTConfig, params), each leaf
    put onto its devices by `place` (a sharding.Placement; default: the default device).
    `overrides`: GPTConfig fields that do not change the architecture (block_size <= n_positions...)."""
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
    # over a mesh its shardings are made here: a mesh that does not divide the model fails before any read
    put = (place or sharding.Placement()).putter(lambda: abstract_params(config))

    with open_tensors(directory) as table:
        expected = set(TOP_KEYS) | {f"h.{i}.{k}" for i in range(L) for k in BLOCK_KEYS}
        if not config.tie_embeddings:
            expected.add("lm_head.weight")
        what = f"{directory} is not a GPT-2 checkpoint for its config"
        # a tied file may still carry lm_head; the attention-mask buffers are not weights
        hf_files.check_names(table, expected, what, optional={"lm_head.weight"}, ignore=BUFFER_RE)
        params: dict = {}
        # host numpy work in 64-byte-aligned buffers, then one put per leaf (a device_put on one
        # device, which on CPU adopts such a buffer without a copy): no per-shape compiles, host
        # memory ~ model size
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
        params = put_tree(put, params)
        for key, path in BLOCK_KEYS.items():
            shape = get_path(shapes["h_0"], path).shape
            if scan_layers:  # one [L, ...] host buffer per leaf kind, filled layer by layer
                stacked = hf_files.aligned_empty((L, *shape), dtype)
                for i in range(L):
                    stacked[i] = hf_files.read(table, f"h.{i}.{key}", shape, dtype)
                set_path(params, ("h", "block") + path, put(("h", "block") + path, stacked))
                del stacked
            else:
                for i in range(L):
                    x = hf_files.read(table, f"h.{i}.{key}", shape, dtype)
                    set_path(params, (f"h_{i}",) + path, put((f"h_{i}",) + path, x))
    return config, params


# ---------------------------------------------------------------- export


def export_state(config, params, model_type: str, family, special_ids=None) -> tuple[dict, dict]:
    """(config.json dict, {HF name: float32 numpy array}) for a flaxgpt GPT that GPT-2 holds."""
    hf = family.export_config(config, model_type, special_ids)  # refuses what GPT-2 does not hold
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
    return hf, tensors
