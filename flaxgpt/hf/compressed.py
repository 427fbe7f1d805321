"""int4 checkpoints in compressed-tensors' `pack-quantized` format (what llm-compressor writes and vLLM
and transformers read for W4A16 models), both ways, for the rotary families without experts.

    config, params = compressed.load(directory)       # int4 linear layers as quantize.QuantizedWeight
    compressed.export(config, params, out_dir)       # params from gpt.quantize_params(..., "int4")
    compressed.holds(directory)                      # config.json names a quantization_config

flaxgpt.load (and so sample.py, serve.py, `flaxgpt hf export --quantize int4`) reads such a directory
here: the loader asks `holds`, this module reads the weights.

Why this format: it is the one vLLM, transformers and llm-compressor share for int4 weights (GPTQ and AWQ
runs save into it too), its groups are ours (symmetric, a scale per output channel and group of inputs,
no zero points), and its packing is kernels/int4.py's bytes: each linear layer's `weight` becomes
`weight_packed` int32 [N, K/8] (eight 4-bit values a word, the first in the lowest bits, stored + 8),
`weight_scale` [N, K/group] and `weight_shape` [2]; config.json's `quantization_config` names the
scheme. Reading is a reinterpretation of the words as bytes (little-endian hosts), never a repack;
fused layers (q | k | v, gate | up) are the rows of their parts, stacked. Embeddings, norms and the
LM head are written in float32 (the head in `ignore`, as llm-compressor's recipes leave it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import jax
import numpy as np
from flax import linen as nn

from flaxgpt.hf import families, pretrained, rotary
from flaxgpt.hf import files as hf_files
from flaxgpt.hf.files import get_path, set_path
from flaxgpt.models import gpt, quantize
from flaxgpt.models.quantize import QuantizedWeight, dequantize_rows

FORMAT = "pack-quantized"


def scheme(group: int) -> dict:
    """config.json's quantization_config for int4 weights in groups of `group` (W4A16, symmetric)."""
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group}
    return {
        "quant_method": "compressed-tensors",
        "format": FORMAT,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
        "ignore": ["lm_head"],
        "quantization_status": "compressed",  # else transformers builds dense layers, missing our tensors
    }


def holds(directory) -> bool:
    """Whether a model directory's config.json names a quantization_config: its weights are then
    read by `load` (pack-quantized int4) or refused in one line (`group_of`), never as float weights."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return False
    with open(path) as fh:
        return bool(json.load(fh).get("quantization_config"))


def group_of(hf: dict) -> int:
    """The group size of a pack-quantized int4 config.json; one line naming what is not that (other
    formats: float8, naive-quantized, int8; asymmetric groups; quantized activations)."""
    qc = hf.get("quantization_config") or {}
    groups = list((qc.get("config_groups") or {}).values())
    g = groups[0] if len(groups) == 1 else {}
    w = g.get("weights") or {}
    found = (qc.get("quant_method"), qc.get("format"), w.get("num_bits"), w.get("type"), w.get("strategy"))
    activations = g.get("input_activations") or g.get("output_activations")
    if found != ("compressed-tensors", FORMAT, 4, "int", "group") or not w.get("symmetric") or activations:
        raise ValueError(
            f"flaxgpt reads compressed-tensors {FORMAT} int4 symmetric group weights only (W4A16: one "
            f"config group, no activation quantization); this config.json's quantization_config is "
            f"{json.dumps(qc)[:200]}: load the float model, or dequantize it with transformers"
        )
    return int(w["group_size"])


def _linear_parts(family, config, i):
    """{flaxgpt kernel path: [(HF name without 'weight', part)] in column order} of layer i."""
    out = {}
    for path, entries in rotary._by_path(rotary.layer_keys(family, config, i)).items():
        if path[-1] == "kernel":
            order = lambda e: rotary._columns(config, e[1], 1 << 30).start or 0  # noqa: E731
            out[path] = [(name.removesuffix("weight"), part) for name, part in sorted(entries, key=order)]
    return out


INT4_TENSORS = ("weight_packed", "weight_scale", "weight_shape")  # a pack-quantized layer's three


def family_of(config):
    """(model_type, family) of an int4 export: a one-line refusal for GPT-2 and mixtures of experts."""
    model_type = families.family_of(config)
    family = families.FAMILIES[model_type]
    if model_type == "gpt2" or family.sparse_keys is not None:
        raise ValueError(
            f"int4 {FORMAT} checkpoints are written for dense rotary families (llama, mistral, qwen2, "
            f"qwen3, gemma); this model exports as {model_type}: drop --quantize for a float export"
        )
    return model_type, family


def quantize_blocks(config, params, mode: str):
    """(config, params) with the decoder blocks' linear layers int4 (`mode`) and the token table and
    head float: what an llm-compressor W4A16 recipe writes (gpt.quantize_params also rounds the table,
    which decoding reads as a quantized matmul). The config as gpt.quantized_config's, tie kept.
    Quantized weights (an int4 source) come back as they are."""
    if quantize.modes(params):
        return config, params
    if config.scan_layers:
        params = gpt.unstack_layers(params, config.n_layer)
    top = {k: v for k, v in params.items() if k in ("wte", "lm_head")}
    blocks = quantize.quantize_tree({k: v for k, v in params.items() if k not in top}, mode, keep=("router",))
    return dataclasses.replace(gpt.quantized_config(config), tie_embeddings=config.tie_embeddings), {
        **blocks,
        **top,
    }


def export(config, qparams, out_dir: str, tokenizer=None) -> str:
    """Write out_dir/config.json + model.safetensors of gpt.quantize_params' int4 weights (one group
    size), with the tokenizer's files when `tokenizer` is the model's own tokenizer.json (as
    pretrained.write). No target check: pretrained.check_export_target is the caller's."""
    model_type, family = family_of(config)
    modes = quantize.modes(qparams)
    if len(modes) != 1 or not next(iter(modes)).startswith("int4"):
        raise ValueError(
            f"export takes int4 weights of one group size (gpt.quantize_params 'int4'), found {sorted(modes)}"
        )
    mode = modes.pop()  # any group a file held (16 too), not only the groups --quantize names
    group = 128 if mode == "int4" else int(mode.split("_g")[1])
    special = pretrained.special_ids(tokenizer, model_type)
    floats = _dequantized(qparams)  # the float view: names, shapes and the float tensors of the family
    hf, tensors = family.export_state(config, floats, model_type, family, special)
    for i in range(config.n_layer):
        for path, parts in _linear_parts(family, config, i).items():
            q = get_path(qparams[f"h_{i}"], path)
            if not isinstance(q, QuantizedWeight) or q.w.dtype != np.uint8:
                raise ValueError(
                    f"h_{i}/{'/'.join(path)} is not int4: quantize with gpt.quantize_params 'int4'"
                )
            w, scale = np.asarray(q.w), np.asarray(q.scale, np.float32)
            for name, part in parts:
                rows = rotary._columns(config, part, w.shape[0])
                key = f"model.layers.{i}.{name}"
                packed = np.ascontiguousarray(w[rows])
                del tensors[key + "weight"]
                tensors[key + "weight_packed"] = packed.view("<i4")  # the bytes as compressed-tensors' words
                tensors[key + "weight_scale"] = np.ascontiguousarray(scale[rows])
                tensors[key + "weight_shape"] = np.array([packed.shape[0], packed.shape[1] * 2], np.int64)
    hf["quantization_config"] = scheme(group)
    os.makedirs(out_dir, exist_ok=True)
    hf_files.write_safetensors(tensors, out_dir)
    hf_files.write_json(hf, os.path.join(out_dir, "config.json"))
    pretrained.copy_tokenizer(tokenizer, special, out_dir)
    return out_dir


def load(directory: str, **fields):
    """A pack-quantized int4 directory -> (config, params) that decode as they are: linear layers int4
    QuantizedWeights, embeddings, norms and the head float32 host arrays (config: gpt.quantized_config's,
    untied; `fields`: the free GPTConfig fields, as pretrained.load_pretrained's overrides)."""
    with open(os.path.join(directory, "config.json")) as fh:
        hf = json.load(fh)
    group = group_of(hf)
    family = families.family_for(hf)
    config = family.config_from_hf(hf, family, **fields)
    family_of(config)
    shapes = nn.unbox(gpt.abstract_params(dataclasses.replace(config, pad_vocab_multiple=1)))
    V, D = config.vocab_size, config.n_embd
    f32 = np.float32
    with hf_files.open_tensors(directory) as table:
        params: dict = {}
        expected = set(rotary.TOP_KEYS)  # every tensor read: any other is an error, not dropped
        for name, path in rotary.TOP_KEYS.items():
            set_path(params, path, hf_files.read(table, name, get_path(shapes, path).shape, f32))
        if rotary.HEAD_KEY in table:  # a float head (llm-compressor's recipes ignore it)
            expected.add(rotary.HEAD_KEY)
            params["lm_head"] = {
                "kernel": np.ascontiguousarray(hf_files.read(table, rotary.HEAD_KEY, (V, D), f32).T)
            }
        elif not config.tie_embeddings:  # an int4 head (ignore: []): a quantized matmul like the rest
            params["lm_head"] = {
                "kernel": _read_int4(table, "lm_head.", [("", None)], (D, V), group, expected)
            }
        else:  # tied: the head reads the table's rows (quantized_config unties them)
            params["lm_head"] = {"kernel": np.ascontiguousarray(params["wte"]["embedding"].T)}
        for i in range(config.n_layer):
            layer = shapes[f"h_{i}"]
            kernels = _linear_parts(family, config, i)
            for path, entries in rotary._by_path(rotary.layer_keys(family, config, i)).items():
                shape = get_path(layer, path).shape
                if path in kernels:
                    leaf = _read_int4(table, f"model.layers.{i}.", kernels[path], shape, group, expected)
                else:
                    leaf = np.empty(shape, f32)
                    for name, part in entries:
                        cols = rotary._part(leaf, config, part)
                        expected.add(f"model.layers.{i}.{name}")
                        cols[...] = hf_files.read(table, f"model.layers.{i}.{name}", cols.shape[::-1], f32).T
                set_path(params, (f"h_{i}",) + path, leaf)
        what = f"{directory} is not a {hf['model_type']} {FORMAT} checkpoint for its config"
        hf_files.check_names(table, expected, what)
    return gpt.quantized_config(config), params


def _read_int4(table, prefix: str, parts, shape_KN, group: int, seen: set) -> QuantizedWeight:
    """The parts' packed rows stacked in column order -> one int4 QuantizedWeight of a [K, N] kernel
    (the names read added to `seen`)."""
    K = shape_KN[0]
    ws, scales = [], []
    for name, _ in parts:
        key = prefix + name
        missing = [key + t for t in INT4_TENSORS if key + t not in table]
        if missing:
            raise ValueError(
                f"{missing[0]} is missing: every int4 layer has {', '.join(INT4_TENSORS)} ({FORMAT})"
            )
        seen.update(key + t for t in INT4_TENSORS)
        n = int(table[key + "weight_packed"][0].get_slice(table[key + "weight_packed"][1]).get_shape()[0])
        ws.append(hf_files.read(table, key + "weight_packed", (n, K // 8), np.int32).view(np.uint8))
        scales.append(hf_files.read(table, key + "weight_scale", (n, K // group), np.float32))
        shape = hf_files.read(table, key + "weight_shape", (2,), np.int64)
        if tuple(shape) != (n, K):
            raise ValueError(f"{key}weight_shape is {tuple(shape)}, expected {(n, K)} from the config")
    w, scale = np.concatenate(ws), np.concatenate(scales)
    if w.shape[0] != shape_KN[1]:
        raise ValueError(f"{prefix}{parts[0][0]}... hold {w.shape[0]} output rows, the config {shape_KN[1]}")
    return QuantizedWeight(w, scale)


def _dequantized(qparams):
    """Every QuantizedWeight as the float32 leaf it stands for: a kernel [K, N], the table's rows [V, D]."""

    def one(path, x):
        if not isinstance(x, QuantizedWeight):
            return x
        w = np.asarray(dequantize_rows(x))
        return w if path[-1].key == "embedding" else w.T

    return jax.tree_util.tree_map_with_path(one, qparams, is_leaf=lambda x: isinstance(x, QuantizedWeight))


if sys.byteorder != "little":  # the words' bytes are read as nibble pairs in this order
    raise ImportError("flaxgpt.hf.compressed reads int4 words as little-endian bytes")
