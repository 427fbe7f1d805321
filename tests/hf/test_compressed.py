"""hf/compressed.py: int4 checkpoints in compressed-tensors' pack-quantized format. A tiny Llama's int4
weights exported and loaded back are the same bytes and scales, and decode the same logits; a file
compressed by compressed-tensors itself (its PackedQuantizationCompressor and QuantizationConfig) loads
into the weights its own decompress gives, with the integers our quantizer picks from the same float
weights; our export decompresses, by compressed-tensors, into our dequantized weights."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from flaxgpt.hf import compressed, pretrained
from flaxgpt.hf.files import open_tensors
from flaxgpt.models import gpt
from flaxgpt.models.gpt import GPT, GPTConfig
from flaxgpt.models.quantize import QuantizedWeight, dequantize_rows

CONFIG = dataclasses.replace(
    GPTConfig.preset("smollm2-135m"), vocab_size=96, block_size=16, n_layer=2, n_head=4, n_kv_head=2,
    n_embd=64, mlp_hidden=128,
)  # fmt: skip
TOKENS = np.random.RandomState(0).randint(0, 96, (2, 8)).astype(np.int32)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def model():
    params = gpt.init_params(CONFIG, jax.random.key(0))
    return params, gpt.quantize_params(CONFIG, params, "int4_g32")


def kernels(params):
    is_q = lambda x: isinstance(x, QuantizedWeight)  # noqa: E731
    leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=is_q)
    return {jax.tree_util.keystr(p): x for p, x in leaves if is_q(x) and "h_" in jax.tree_util.keystr(p)}


def test_export_then_load_is_the_same_int4_weights_and_logits(model, tmp_path):
    _, (qconfig, qparams) = model
    compressed.export(qconfig, qparams, str(tmp_path))
    hf = json.load(open(tmp_path / "config.json"))
    assert compressed.group_of(hf) == 32 and hf["quantization_config"]["format"] == "pack-quantized"
    with open_tensors(str(tmp_path)) as table:
        assert "model.layers.0.self_attn.q_proj.weight_packed" in table
        assert "model.layers.0.self_attn.q_proj.weight" not in table
    config, params = compressed.load(str(tmp_path))
    want, got = kernels(qparams), kernels(params)
    assert sorted(want) == sorted(got) and len(got) == 4 * CONFIG.n_layer
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k].w), np.asarray(want[k].w))
        np.testing.assert_array_equal(np.asarray(got[k].scale), np.asarray(want[k].scale))
    a = np.asarray(GPT(qconfig).apply({"params": qparams}, TOKENS))
    b = np.asarray(GPT(config).apply({"params": params}, TOKENS))
    assert np.abs(a - b).max() < 1e-5 * np.abs(a).max()


def test_bad_formats_are_one_line():
    with pytest.raises(ValueError, match="reads compressed-tensors pack-quantized int4 symmetric group"):
        compressed.group_of({"quantization_config": {"quant_method": "gptq", "bits": 4}})
    params = gpt.init_params(GPTConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=64), jax.random.key(0))
    qconfig, qparams = gpt.quantize_params(
        GPTConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=64), params, "int4_g32"
    )
    with pytest.raises(ValueError, match="written for dense rotary families.*exports as gpt2"):
        compressed.export(qconfig, qparams, "unused")


def compress_with_compressed_tensors(params, float_dir, ct_dir, group=32):
    """What llm-compressor writes for CONFIG's `params`: a float export, each linear weight compressed
    by compressed-tensors' PackedQuantizationCompressor, its QuantizationConfig in config.json
    -> ({tensor name: torch tensor} as written, the QuantizationScheme)."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file, save_file

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    sch = QuantizationScheme(targets=["Linear"], weights=args)
    pretrained.write(CONFIG, params, str(float_dir), model_type="llama")
    state = load_file(str(float_dir / "model.safetensors"))
    out = {}
    for name, t in state.items():
        if not any(f".{p}.weight" in name for p in LINEARS):
            out[name] = t
            continue
        g = t.reshape(t.shape[0], -1, group)
        scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), args)
        comp = PackedQuantizationCompressor.compress({"weight": t, "weight_scale": scale}, sch)
        out.update({name.removesuffix("weight") + k: v.contiguous() for k, v in comp.items()})
    os.makedirs(ct_dir)
    save_file(out, str(ct_dir / "model.safetensors"))
    hf = json.load(open(float_dir / "config.json"))
    qc = QuantizationConfig(
        config_groups={"group_0": sch},
        format="pack-quantized",
        ignore=["lm_head"],
        quantization_status="compressed",
    )
    hf["quantization_config"] = qc.model_dump(exclude_none=True)
    json.dump(hf, open(ct_dir / "config.json", "w"))
    return out, sch


def test_compressed_tensors_files_both_ways(model, tmp_path):
    torch = pytest.importorskip("torch")

    from compressed_tensors.compressors import PackedQuantizationCompressor
    from safetensors.torch import load_file

    params, (qconfig, qparams) = model
    ct_dir = tmp_path / "ct"
    out, sch = compress_with_compressed_tensors(params, tmp_path / "float", ct_dir)

    _, loaded = compressed.load(str(ct_dir))
    agree = []
    for i in range(CONFIG.n_layer):
        for part, path, rows in _parts(i):
            key = f"model.layers.{i}.{part}."
            dec = PackedQuantizationCompressor.decompress({k: out[key + k] for k in _CT}, sch)["weight"]
            got = np.asarray(dequantize_rows(_get(loaded, path, i)))[rows]
            np.testing.assert_allclose(got, dec.numpy(), rtol=0, atol=1e-7)
            # the same integers from our quantizer on the same float weight (the same rule)
            agree.append(
                np.mean(
                    np.asarray(_get(qparams, path, i).w)[rows]
                    == out[key + "weight_packed"].numpy().view(np.uint8)
                )
            )
    assert min(agree) == 1.0, agree  # every byte: the same rule, division and ties to even

    # ours, read back by compressed-tensors
    exp_dir = tmp_path / "ours"
    compressed.export(qconfig, qparams, str(exp_dir))
    back = load_file(str(exp_dir / "model.safetensors"))
    for i in range(CONFIG.n_layer):
        for part, path, rows in _parts(i):
            key = f"model.layers.{i}.{part}."
            dec = PackedQuantizationCompressor.decompress({k: back[key + k] for k in _CT}, sch)["weight"]
            want = np.asarray(dequantize_rows(_get(qparams, path, i)))[rows]
            np.testing.assert_allclose(dec.to(torch.float32).numpy(), want, rtol=0, atol=1e-7)


_CT = ("weight_packed", "weight_scale", "weight_shape")


def _parts(i):
    """(HF module, flaxgpt path in h_i, its rows of the fused kernel) for the tiny Llama."""
    HK, JK, F = 4 * 16, 2 * 16, 128
    return [
        ("self_attn.q_proj", ("attn", "c_attn"), slice(0, HK)),
        ("self_attn.k_proj", ("attn", "c_attn"), slice(HK, HK + JK)),
        ("self_attn.v_proj", ("attn", "c_attn"), slice(HK + JK, HK + 2 * JK)),
        ("self_attn.o_proj", ("attn", "c_proj"), slice(None)),
        ("mlp.gate_proj", ("mlp", "c_fc"), slice(0, F)),
        ("mlp.up_proj", ("mlp", "c_fc"), slice(F, 2 * F)),
        ("mlp.down_proj", ("mlp", "c_proj"), slice(None)),
    ]


def _get(params, path, i=0):
    return params[f"h_{i}"][path[0]][path[1]]["kernel"]
