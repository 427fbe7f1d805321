"""The weight loop of every rotary family (Llama, Mistral, Qwen2, Qwen3, Gemma 2 and 3, Mixtral,
Qwen2-MoE, Qwen3-MoE): a Hugging Face checkpoint -> flaxgpt params and back, driven by a families.Family's key
table (and in a mixture of experts' sparse layers by its sparse_keys: each expert's tensors fill
that expert's slice of the stacked [E, ...] weights).

flaxgpt fuses q | k | v into c_attn and gate | up into c_fc (one matmul each), so several Hugging
Face tensors fill column ranges of one kernel. torch Linear weights are [out, in] and become
[in, out] kernels by a transpose. Every tensor is shape-checked against the config.

Shape letters: D n_embd, H heads, J key/value heads, K head dim, F MLP hidden, V vocabulary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from flaxgpt import sharding
from flaxgpt.hf import files as hf_files
from flaxgpt.hf.files import get_path, put_tree, set_path
from flaxgpt.models.gpt import GPTConfig, abstract_params, unstack_layers

TOP_KEYS = {
    "model.embed_tokens.weight": ("wte", "embedding"),  # [V, D]; flaxgpt may pad rows
    "model.norm.weight": ("ln_f", "scale"),  # [D]
}
HEAD_KEY = "lm_head.weight"  # [V, D] torch Linear; flaxgpt's lm_head kernel is [D, V]


# ---------------------------------------------------------------- fused columns


def _columns(config: GPTConfig, part: str | None, width: int) -> slice:
    """The columns (last axis, `width` of them) of a fused flaxgpt tensor that a Hugging Face part
    fills: q / k / v of c_attn, or gate / up, the halves of a gated MLP's [D, 2F] (the dense MLP's, an
    expert's or the shared expert's)."""
    HK, JK = config.n_head * config.head_dim, config.kv_heads * config.head_dim
    F = width // 2
    return {
        None: slice(None),
        "q": slice(0, HK),
        "k": slice(HK, HK + JK),
        "v": slice(HK + JK, HK + 2 * JK),
        "gate": slice(0, F),
        "up": slice(F, 2 * F),
    }[part]


def _part(leaf, config: GPTConfig, part):
    """The view of a flaxgpt leaf that one Hugging Face tensor fills: `part` is a fused part (see
    _columns), or (e, part) for expert e of a stacked [E, ...] expert tensor."""
    if isinstance(part, tuple):
        e, part = part
        leaf = leaf[e]
    return leaf[..., _columns(config, part, leaf.shape[-1])]


def layer_keys(family, config: GPTConfig, i: int) -> dict:
    """HF name in layer i -> (flaxgpt path in h_{i}, part): the family's layer_keys, with a sparse
    layer's MLP entries replaced by its router and one entry per expert tensor (part (e, part))."""
    if not config.layer_is_sparse(i):
        return family.layer_keys
    if family.sparse_keys is None:
        raise ValueError(
            f"{family.architecture} has no experts; this model has num_experts={config.num_experts}"
        )
    keys = {name: entry for name, entry in family.layer_keys.items() if entry[0][0] != "mlp"}
    for name, (path, part) in family.sparse_keys.items():
        if "{e}" not in name:
            keys[name] = (path, part)
            continue
        keys.update({name.format(e=e): (path, (e, part)) for e in range(config.num_experts)})
    return keys


def _by_path(layer_keys: dict) -> dict:
    """flaxgpt path -> [(HF name, part)]: the tensors that make up each flaxgpt leaf."""
    out: dict = {}
    for name, (path, part) in layer_keys.items():
        out.setdefault(path, []).append((name, part))
    return out


# ---------------------------------------------------------------- import


def load_rotary(
    directory, hf, family, *, scan_layers=False, pad_vocab_multiple=1, param_dtype="float32", place=None, **kw
):
    """A rotary family's directory (its config.json already read into `hf`) -> (GPTConfig, params),
    each leaf put onto its devices by `place` (a sharding.Placement; default: the default device)."""
    config = family.config_from_hf(
        hf,
        family,
        scan_layers=scan_layers,
        pad_vocab_multiple=pad_vocab_multiple,
        param_dtype=param_dtype,
        **kw,
    )
    flat = dataclasses.replace(config, scan_layers=False, pad_vocab_multiple=1)
    shapes = nn.unbox(abstract_params(flat))
    dtype, L, D, PV = jnp.dtype(param_dtype), config.n_layer, config.n_embd, config.padded_vocab_size
    # over a mesh its shardings are made here: a mesh that does not divide the model fails before any read
    put = (place or sharding.Placement()).putter(lambda: abstract_params(config))
    with hf_files.open_tensors(directory) as table:
        keys = [layer_keys(family, config, i) for i in range(L)]
        expected = set(TOP_KEYS) | {f"model.layers.{i}.{k}" for i in range(L) for k in keys[i]}
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
        params = put_tree(put, params)
        # a leaf at a time over the layers that have it (dense and sparse layers' MLPs differ;
        # scan_layers needs every layer alike, see GPTConfig)
        by_path = [_by_path(k) for k in keys]
        for path in dict.fromkeys(p for layer in by_path for p in layer):
            layers = [i for i in range(L) if path in by_path[i]]
            shape = get_path(shapes[f"h_{layers[0]}"], path).shape
            # one host buffer per leaf (stacked [L, ...] for scan_layers), filled one tensor at a time
            stacked = hf_files.aligned_empty((L, *shape), dtype) if scan_layers else None
            for i in layers:
                leaf = stacked[i] if scan_layers else hf_files.aligned_empty(shape, dtype)
                for name, part in by_path[i][path]:
                    cols = _part(leaf, config, part)
                    hf_shape = cols.shape[::-1]  # torch Linear [out, in]; a 1-D tensor as is
                    cols[...] = hf_files.read(table, f"model.layers.{i}.{name}", hf_shape, dtype).T
                if not scan_layers:
                    set_path(params, (f"h_{i}",) + path, put((f"h_{i}",) + path, leaf))
            if scan_layers:
                set_path(params, ("h", "block") + path, put(("h", "block") + path, stacked))
    return config, params


# ---------------------------------------------------------------- export


def export_state(config: GPTConfig, params, model_type: str, family, special_ids=None) -> tuple[dict, dict]:
    """(config.json dict, {HF name: float32 numpy array}) of a GPT that `family` (model_type) expresses."""
    hf = family.export_config(config, model_type, special_ids)  # refuses what the family does not hold
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
        for name, (path, part) in layer_keys(family, config, i).items():
            x = _part(get((f"h_{i}",) + path, get_path(shapes[f"h_{i}"], path).shape), config, part)
            tensors[f"model.layers.{i}.{name}"] = np.ascontiguousarray(x.T)
    return hf, tensors
