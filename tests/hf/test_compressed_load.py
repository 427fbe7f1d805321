"""compressed-tensors int4 directories through the loader and the tools (flaxgpt.load, sample.py,
`flaxgpt hf export --quantize int4`): a file compressed by compressed-tensors loads straight into its
int4 words (nothing dequantized and quantized again) and gives the logits of its own decompressed
weights; our export is read back by transformers (through compressed-tensors) with our logits, and
sample.py decodes it into transformers' greedy tokens; other schemes are one-line refusals."""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import numpy as np
import pytest
import torch
import transformers

from flaxgpt import hf_cli, loader
from flaxgpt.data.hf_tokenizer import HFTokenizer
from flaxgpt.hf.files import open_tensors
from flaxgpt.models import gpt
from flaxgpt.models.quantize import QuantizedWeight, dequantize_rows, modes

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import sample  # noqa: E402
from tests.hf.test_compressed import CONFIG, TOKENS, _parts, compress_with_compressed_tensors  # noqa: E402
from tests.hf.test_llama import flax_logits, make_hf_model, ref_logits, torch_greedy  # noqa: E402
from tests.hf.test_llama_cli import make_tokenizer  # noqa: E402
from tests.serve.test_serve import serving_in_thread  # noqa: E402


@pytest.fixture(scope="module")
def ct(tmp_path_factory):
    """(directory compressed by compressed-tensors, {tensor: torch tensor} it holds, its scheme)."""
    root = tmp_path_factory.mktemp("ct")
    params = gpt.init_params(CONFIG, jax.random.key(0))
    out, sch = compress_with_compressed_tensors(params, root / "float", root / "ct")
    make_tokenizer(str(root / "ct"))  # flaxgpt.load reads a Llama's own tokenizer (its ids unused here)
    return root / "ct", out, sch


def test_load_keeps_the_words_and_decodes_their_dequantized_model(ct, tmp_path):
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from safetensors.torch import save_file

    directory, out, sch = ct
    run = loader.load(str(directory))
    assert run.kind == "gpt" and modes(run.params) == {"int4_g32"}
    # the reference: the same model with every linear weight as compressed-tensors decompresses it
    dense = {k: v for k, v in out.items() if not k.endswith(("_packed", "_scale", "_shape"))}
    for i in range(CONFIG.n_layer):
        for part, path, rows in _parts(i):
            key = f"model.layers.{i}.{part}."
            q = run.params[f"h_{i}"][path[0]][path[1]]["kernel"]
            assert isinstance(q, QuantizedWeight)  # the file's words as bytes: no requantization
            np.testing.assert_array_equal(
                np.asarray(q.w)[rows], out[key + "weight_packed"].numpy().view(np.uint8)
            )
            parts = {k: out[key + k] for k in ("weight_packed", "weight_scale", "weight_shape")}
            dense[key + "weight"] = PackedQuantizationCompressor.decompress(parts, sch)["weight"].contiguous()
    ref_dir = tmp_path / "dequantized"
    os.makedirs(ref_dir)
    save_file(dense, str(ref_dir / "model.safetensors"))
    hf = json.load(open(directory / "config.json"))
    del hf["quantization_config"]
    json.dump(hf, open(ref_dir / "config.json", "w"))
    make_tokenizer(str(ref_dir))
    ref = loader.load(str(ref_dir))
    want, got = flax_logits(ref.config, ref.params, TOKENS), flax_logits(run.config, run.params, TOKENS)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()

    # --dtype casts the float layers alone; the same --quantize is a no-op, another one an error
    bf16 = loader.load(str(directory), dtype="bfloat16", quantize="int4_g32")
    q, q16 = run.params["h_0"]["attn"]["c_attn"]["kernel"], bf16.params["h_0"]["attn"]["c_attn"]["kernel"]
    np.testing.assert_array_equal(np.asarray(q16.w), np.asarray(q.w))
    assert q16.scale.dtype == np.float32 and bf16.params["wte"]["embedding"].dtype == jax.numpy.bfloat16
    with pytest.raises(
        ValueError, match="already int4_g32 .*drop --quantize int8 or pass --quantize int4_g32"
    ):
        loader.load(str(directory), quantize="int8")


def test_an_untied_int4_head_and_a_layer_missing_a_tensor(ct, tmp_path):
    """An untied model whose head is int4 too (ignore: []) loaded the token table as its head, the
    head's three tensors dropped silently; a layer without its weight_shape was a KeyError traceback."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from safetensors.torch import load_file, save_file

    directory, out, sch = ct
    rng = np.random.RandomState(3)
    head = torch.tensor(rng.normal(0, 0.05, (CONFIG.vocab_size, CONFIG.n_embd)), dtype=torch.float32)
    g = head.reshape(head.shape[0], -1, 32)
    scale = (g.abs().amax(-1) / 7).clamp(min=1e-8)
    parts = PackedQuantizationCompressor.compress({"weight": head, "weight_scale": scale}, sch)
    untied = tmp_path / "untied"
    os.makedirs(untied)
    save_file(
        {**out, **{f"lm_head.{k}": v.contiguous() for k, v in parts.items()}},
        str(untied / "model.safetensors"),
    )
    hf = json.load(open(directory / "config.json"))
    hf["tie_word_embeddings"], hf["quantization_config"]["ignore"] = False, []
    json.dump(hf, open(untied / "config.json", "w"))
    make_tokenizer(str(untied))
    run = loader.load(str(untied))
    q = run.params["lm_head"]["kernel"]
    want = PackedQuantizationCompressor.decompress({k: parts[k] for k in parts}, sch)["weight"].numpy()
    np.testing.assert_allclose(np.asarray(dequantize_rows(q)), want, atol=1e-6)
    # the logits: the same model with the head as compressed-tensors decompresses it, float
    floats = {k: v for k, v in run.params.items() if k != "lm_head"}
    floats["lm_head"] = {"kernel": want.T.copy()}
    ref = flax_logits(run.config, floats, TOKENS)
    assert np.abs(flax_logits(run.config, run.params, TOKENS) - ref).max() <= 1e-5 * np.abs(ref).max()
    # a layer without its weight_shape: one line naming the tensor
    partial = tmp_path / "partial"
    os.makedirs(partial)
    kept = {
        k: v
        for k, v in load_file(str(directory / "model.safetensors")).items()
        if not k.endswith("q_proj.weight_shape")
    }
    save_file(kept, str(partial / "model.safetensors"))
    (partial / "config.json").write_text((directory / "config.json").read_text())
    with pytest.raises(ValueError, match=r"q_proj.weight_shape is missing: every int4 layer has"):
        loader.load(str(partial))


def _with_scheme(directory, tmp_path, name, change):
    """A copy of the directory (its weights linked) whose quantization_config is changed by `change`."""
    other = tmp_path / name
    os.makedirs(other)
    os.symlink(directory / "model.safetensors", other / "model.safetensors")
    hf = json.load(open(directory / "config.json"))
    change(hf["quantization_config"])
    json.dump(hf, open(other / "config.json", "w"))
    return str(other)


def test_other_schemes_and_uses_are_one_line(ct, tmp_path):
    directory, _, _ = ct

    def float8(qc):
        qc["format"] = "float-quantized"
        qc["config_groups"]["group_0"]["weights"].update(num_bits=8, type="float", strategy="channel")

    def naive(qc):
        qc["format"] = "naive-quantized"
        qc["config_groups"]["group_0"]["weights"].update(num_bits=8, strategy="channel")

    def w4a8(qc):
        args = dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
        qc["config_groups"]["group_0"]["input_activations"] = args

    def asymmetric(qc):
        qc["config_groups"]["group_0"]["weights"]["symmetric"] = False

    supported = "reads compressed-tensors pack-quantized int4 symmetric group weights only"
    for change in (float8, naive, w4a8, asymmetric):
        with pytest.raises(ValueError, match=supported) as e:
            loader.load(_with_scheme(directory, tmp_path, change.__name__, change))
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="holds int4 weights .*do not train; start from the float model"):
        loader.resolve_init(str(directory), CONFIG)
    with pytest.raises(ValueError, match="a PEFT adapter merges into float weights"):
        loader.load(str(directory), adapter=str(tmp_path))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(a float Llama directory with its tokenizer, its `flaxgpt hf export --quantize int4_g32`
    directory, transformers' model read from the export)."""
    root = tmp_path_factory.mktemp("llama")
    make_hf_model("llama", str(root / "float"))
    make_tokenizer(str(root / "float"))
    to = root / "w4a16"
    args = ["export", "--init_from", str(root / "float"), "--to", str(to), "--quantize", "int4_g32"]
    assert hf_cli.main(args) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(str(to), dtype=torch.float32)
    return root / "float", to, model.eval()


def test_export_command_is_read_back_by_flaxgpt_and_transformers(exported, tmp_path, capsys):
    source, to, model = exported
    assert json.load(open(to / "config.json"))["quantization_config"]["format"] == "pack-quantized"
    assert (to / "tokenizer.json").is_file()
    # the int4 weights flaxgpt.load quantizes, written as they are and read back byte for byte
    want, got = loader.load(str(source), quantize="int4_g32"), loader.load(str(to))
    for i in range(2):
        for path in (("attn", "c_attn"), ("attn", "c_proj"), ("mlp", "c_fc"), ("mlp", "c_proj")):
            a, b = (r.params[f"h_{i}"][path[0]][path[1]]["kernel"] for r in (want, got))
            np.testing.assert_array_equal(np.asarray(b.w), np.asarray(a.w))
            np.testing.assert_array_equal(np.asarray(b.scale), np.asarray(a.scale))
    # transformers reads it through compressed-tensors (decompressing the words): our logits
    tokens = np.random.RandomState(1).randint(0, 300, (2, 12))
    theirs, ours = ref_logits(model, tokens), flax_logits(got.config, got.params, tokens)
    assert np.abs(theirs - ours).max() <= 1e-5 * np.abs(theirs).max()

    # the embeddings and the head are written as the source holds them (llm-compressor's W4A16 leaves
    # them float): they were int4-rounded floats
    with open_tensors(str(source)) as a, open_tensors(str(to)) as b:
        for name in ("model.embed_tokens.weight",) + (("lm_head.weight",) if "lm_head.weight" in a else ()):
            x, y = (np.asarray(t[name][0].get_tensor(t[name][1])) for t in (a, b))
            np.testing.assert_array_equal(y, x)

    # bad input: one line each
    args = ["export", "--init_from", str(source), "--to", str(to), "--quantize", "int4"]
    for bad, line in (
        (args[:5], "add --quantize int4"),
        (args + ["--out_dir", str(source)], "name one source"),
        (args, "exists and is not empty"),
    ):
        assert hf_cli.main(bad) == 1
        assert line in capsys.readouterr().err


def _greedy_text(model, tok, prompt, n=8):
    ids = [tok.bos_id] + tok.encode(prompt)
    new = torch_greedy(model, ids, n)
    return ids, new[: new.index(tok.eos_id)] if tok.eos_id in new else new  # flaxgpt stops at EOS


def test_sample_py_decodes_transformers_tokens(exported, capsys):
    _, to, model = exported
    tok = HFTokenizer(to)
    ids, new = _greedy_text(model, tok, "the quick")
    argv = ["--init_from", str(to), "--start", "the quick", "--temperature", "0", "--max_new_tokens", "8"]
    assert sample.main(argv) == 0
    assert capsys.readouterr().out == tok.decode(ids + new) + "\n"


def test_serve_py_decodes_transformers_tokens(exported):
    import httpx

    from flaxgpt.serve import launch, server

    _, to, model = exported
    tok = HFTokenizer(to)
    _, new = _greedy_text(model, tok, "the quick")
    run, name = launch.load(init_from=str(to), quantize="int4_g32")  # the same mode: kept as it is
    assert modes(run.params) == {"int4_g32"}
    sched = launch.scheduler_for(run.config, run.params, run.tokenizer, slots=2, max_len=64, prefill_chunk=32)
    sched.start()
    app = server.create_app(sched, run.tokenizer, model=name, max_len=64, vocab_size=run.config.vocab_size)
    with serving_in_thread(app) as url:
        assert sched.ready.wait(timeout=300)
        body = {"model": name, "prompt": "the quick", "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    sched.close()
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tok.decode(new)
