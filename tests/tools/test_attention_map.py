"""flaxgpt.tools.attention_map: the sown weights against a float64 NumPy forward pass, and valid PNGs."""

import dataclasses
import json
import math

import jax
import matplotlib.image
import numpy as np
import pytest
from flax import linen as nn

from flaxgpt.data.tokenizers import CharTokenizer
from flaxgpt.models import gpt
from flaxgpt.models.gpt import GPTConfig
from flaxgpt.tools import attention_map

CFG = GPTConfig(vocab_size=40, block_size=16, n_layer=3, n_head=2, n_embd=16)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def params():
    """Weights of the model's shapes, drawn wider than GPT-2's init so the maps are far from uniform."""
    rng = np.random.default_rng(3)
    shapes = nn.unbox(gpt.abstract_params(CFG))  # no compile: the tests' time goes to the real paths
    return jax.tree_util.tree_map(lambda s: rng.normal(0.0, 0.3, s.shape).astype(np.float32), shapes)


def np_attention_maps(cfg: GPTConfig, params, ids) -> np.ndarray:
    """[L, H, T, T] by an independent float64 forward pass (pre-LN GPT-2 blocks)."""
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    T, D, H = len(ids), cfg.n_embd, cfg.n_head
    K = D // H

    def ln(x, q):
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + cfg.layer_norm_epsilon) * q["scale"] + q["bias"]

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

    x = p["wte"]["embedding"][ids] + p["wpe"]["embedding"][:T]
    maps = []
    for i in range(cfg.n_layer):
        b = p[f"h_{i}"]
        a = b["attn"]
        qkv = ln(x, b["ln_1"]) @ a["c_attn"]["kernel"] + a["c_attn"]["bias"]
        q, k, v = (m.reshape(T, H, K).transpose(1, 0, 2) for m in np.split(qkv, 3, axis=-1))
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(K)
        scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
        w = np.exp(scores - scores.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        maps.append(w)
        y = (w @ v).transpose(1, 0, 2).reshape(T, D)
        x = x + y @ a["c_proj"]["kernel"] + a["c_proj"]["bias"]
        m = b["mlp"]
        h = gelu(ln(x, b["ln_2"]) @ m["c_fc"]["kernel"] + m["c_fc"]["bias"])
        x = x + h @ m["c_proj"]["kernel"] + m["c_proj"]["bias"]
    return np.stack(maps)


def test_weights_match_reference_and_are_causal(params):
    ids = np.array([5, 1, 17, 39, 0, 8, 8, 22, 3, 11])
    w = attention_weights = attention_map.attention_weights(CFG, params, ids)
    assert attention_weights.shape == (3, 2, 10, 10) and w.dtype == np.float32
    np.testing.assert_allclose(w, np_attention_maps(CFG, params, ids), atol=2e-6)
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-6)  # every row is a distribution
    assert np.all(w[..., np.triu_indices(10, 1)[0], np.triu_indices(10, 1)[1]] == 0.0)  # no future keys
    assert np.all(np.diagonal(w, axis1=-2, axis2=-1) > 0)


def test_scanned_layout_gives_the_same_maps(params):
    ids = np.arange(12) % CFG.vocab_size
    scanned = dataclasses.replace(CFG, scan_layers=True)
    w_scan = attention_map.attention_weights(scanned, gpt.stack_layers(params, CFG.n_layer), ids)
    np.testing.assert_allclose(w_scan, attention_map.attention_weights(CFG, params, ids), atol=1e-6)


def test_parse_indices(tmp_path):
    assert attention_map.parse_indices("all", 4) == [0, 1, 2, 3]
    assert attention_map.parse_indices("0,3", 4) == [0, 3]
    assert attention_map.parse_indices("-1", 4) == [3]
    assert attention_map.parse_indices("1:3", 4) == [1, 2]
    assert attention_map.parse_indices([2, 0], 4) == [2, 0]
    with pytest.raises(ValueError, match="bad layer '5'.*has 4"):
        attention_map.parse_indices("0,5", 4, "layer")
    with pytest.raises(
        ValueError, match="layers '1:0' select none of the model's 4"
    ):  # matplotlib's error once
        attention_map.parse_indices("1:0", 4, "layer")
    w = np.full((1, 1, 2, 2), 0.5, np.float32)  # a path without an extension: the file matplotlib writes
    written = attention_map.save_attention_png(w, ["a", "b"], "all", "all", tmp_path / "map")
    assert written == str(tmp_path / "map.png") and (tmp_path / "map.png").is_file()
    tok = CharTokenizer(list("ab \n"))
    assert attention_map.token_labels(tok, tok.encode("a b\n")) == ["a", "·", "b", "⏎"]


def test_cli_random_init(tmp_path, capsys):
    out = tmp_path / "attn.png"
    argv = "--init_from random --preset gpt2 --n_layer=1 --n_embd=16 --n_head=2 --layers 0 --heads -1"
    w = attention_map.main([*argv.split(), "--prompt", "The quick brown fox", "--out", str(out)])
    assert w.shape == (1, 2, 4, 4)  # GPT-2 BPE: The, ·quick, ·brown, ·fox
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    assert f"wrote {out}" in capsys.readouterr().out


def test_cli_from_a_run_directory(params, tmp_path):
    from flaxgpt.runs.checkpoint import Checkpointer

    run = tmp_path / "run"
    run.mkdir()
    tok = CharTokenizer(list("abcdefghij klmnopqrstuvwxyz.,!?'\nABCDEFG"))
    (run / "config.json").write_text(json.dumps({"model": {"kind": "gpt", **CFG.to_dict()}}))
    (run / "meta.json").write_text(json.dumps({"tokenizer": tok.to_meta(), "vocab_size": tok.vocab_size}))
    ckpt = Checkpointer(run, async_save=False)
    ckpt.save(1, {"params": params, "step": np.int32(1)}, extra={})
    ckpt.close()
    out = tmp_path / "attn.png"
    argv = ["--init_from", str(run), "--prompt", "to be,\nor not", "--layers", "0,-1", "--out", str(out)]
    w = attention_map.main(argv)
    ids = tok.encode("to be,\nor not")
    np.testing.assert_allclose(w, attention_map.attention_weights(CFG, params, ids), atol=1e-6)
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    height, width = matplotlib.image.imread(out).shape[:2]
    assert width > height > 400  # two layers by two heads of 13 labelled tokens, plus the colour bar


def test_cli_from_imported_gpt2_weights(params, tmp_path):
    from flaxgpt.hf.pretrained import export_pretrained

    export_pretrained(CFG, params, str(tmp_path / "hf"))  # a GPT-2 directory (config + safetensors)
    out = tmp_path / "attn.png"
    w = attention_map.main(["--init_from", str(tmp_path / "hf"), "--prompt", "A+B=C?", "--out", str(out)])
    ids = [32, 10, 33, 28, 34, 30]  # GPT-2's BPE ids of A + B = C ?
    np.testing.assert_allclose(w, attention_map.attention_weights(CFG, params, ids), atol=1e-6)
    assert out.read_bytes()[:8] == PNG_SIGNATURE
