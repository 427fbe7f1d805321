"""GPT-2 import/export against the reference implementation (transformers, PyTorch CPU).

A small randomly initialised GPT-2 saved to a temporary directory stands in for OpenAI's
weights: nothing is downloaded.
"""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never touch the network, even by accident

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import linen as nn
from safetensors.numpy import load_file, save_file

from flaxgpt import hf_cli
from flaxgpt.decode.sampling import generate
from flaxgpt.hf import files as hf_files
from flaxgpt.hf import pretrained as hf
from flaxgpt.models.cache import KVCache
from flaxgpt.models.gpt import GPT, GPTConfig, abstract_params
from flaxgpt.models.gpt import step_fn as gpt_step_fn

SMALL = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128)
TOKENS = np.random.RandomState(0).randint(0, 1000, (3, 40))


def make_hf_model(directory, **overrides):
    """A random GPT-2 with every parameter perturbed (LayerNorms too), saved as safetensors."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(**{**SMALL, **overrides}, bos_token_id=None, eos_token_id=None)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # bigger than the 0.02 init: peaked logits, no argmax ties
            p.add_(0.15 * torch.randn_like(p))
    model.save_pretrained(directory, safe_serialization=True)
    return model


def ref_logits(model, tokens=TOKENS):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def flax_logits(config, params, tokens=TOKENS):
    forward = jax.jit(lambda p, t: GPT(config).apply({"params": p}, t))  # one compile, not one per op
    return np.asarray(forward(params, jnp.asarray(tokens)))


def random_params(config, seed=0):
    """Random values in flaxgpt's tree (from abstract_params: no init compile); LayerNorms too."""
    rs = np.random.RandomState(seed)
    shapes = nn.unbox(abstract_params(config))
    return jax.tree_util.tree_map(lambda x: rs.normal(0, 0.2, x.shape).astype(np.float32), shapes)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt2_small")
    model = make_hf_model(directory)
    return str(directory), model, ref_logits(model)


def test_logits_match_transformers(small):
    directory, _, ref = small
    config, params = hf.load_pretrained(directory)
    assert (config.n_layer, config.n_embd, config.n_head, config.vocab_size, config.block_size) == (
        2,
        64,
        4,
        1000,
        128,
    )
    assert config.activation == "gelu" and config.tie_embeddings and "lm_head" not in params
    np.testing.assert_allclose(flax_logits(config, params), ref, atol=1e-4, rtol=0)


def test_greedy_continuation_matches_transformers(small):
    directory, model, _ = small
    prompt = TOKENS[:, :8]
    with torch.no_grad():
        want = model.generate(
            torch.tensor(prompt),
            attention_mask=torch.ones(prompt.shape, dtype=torch.long),
            max_new_tokens=20,
            do_sample=False,
            pad_token_id=0,
        ).numpy()[:, 8:]
    config, params = hf.load_pretrained(directory)
    forward = jax.jit(lambda p, t: GPT(config).apply({"params": p}, t))
    buf = np.zeros((prompt.shape[0], 28), np.int32)  # fixed size: causal, so the zeros ahead are unseen
    buf[:, :8] = prompt
    for t in range(8, 28):
        buf[:, t] = np.asarray(forward(params, jnp.asarray(buf)))[:, t - 1].argmax(-1)
    np.testing.assert_array_equal(buf[:, 8:], want)
    # and through the KV-cache sampler that sample.py uses
    cache = KVCache.for_config(config, batch=3, max_len=64)
    got, lengths = generate(
        gpt_step_fn(config, params),
        cache,
        prompt,
        np.full(3, 8),
        max_new_tokens=20,
        rng=jax.random.key(0),
        temperature=0.0,
    )
    np.testing.assert_array_equal(got, want)


def test_scanned_layout_and_padded_vocab(small):
    directory, _, ref = small
    config, params = hf.load_pretrained(directory, scan_layers=True, pad_vocab_multiple=64)
    assert config.scan_layers and config.padded_vocab_size == 1024
    assert params["h"]["block"]["attn"]["c_attn"]["kernel"].shape == (2, 64, 192)
    wte = np.asarray(params["wte"]["embedding"])
    assert wte.shape == (1024, 64) and not wte[1000:].any()  # padding rows are zeros
    np.testing.assert_allclose(flax_logits(config, params), ref, atol=1e-4, rtol=0)


def test_openai_layout_without_prefix_with_buffers(small, tmp_path):
    """OpenAI's files have no 'transformer.' prefix and carry the attn.bias mask buffers."""
    directory, _, ref = small
    tensors = {
        k.removeprefix("transformer."): v
        for k, v in load_file(os.path.join(directory, "model.safetensors")).items()
    }
    for i in range(2):
        tensors[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, 128, 128), np.float32))
        tensors[f"h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(open(os.path.join(directory, "config.json")).read())
    config, params = hf.load_pretrained(str(tmp_path), block_size=64)
    assert config.block_size == 64 and params["wpe"]["embedding"].shape == (64, 64)
    np.testing.assert_allclose(flax_logits(config, params), ref, atol=1e-4, rtol=0)


def test_untied_head_and_exact_gelu_import(tmp_path):
    model = make_hf_model(tmp_path, tie_word_embeddings=False, activation_function="gelu")
    config, params = hf.load_pretrained(str(tmp_path), pad_vocab_multiple=64)
    assert not config.tie_embeddings and config.activation == "gelu_exact"
    assert params["lm_head"]["kernel"].shape == (64, 1024)
    np.testing.assert_allclose(flax_logits(config, params), ref_logits(model), atol=1e-4, rtol=0)


EXPORT_CASES = [
    dict(),
    dict(scan_layers=True, pad_vocab_multiple=64, tie_embeddings=False, activation="gelu_exact"),
    dict(bias=False, activation="relu", pos_embedding="sinusoidal"),
    dict(qkv_bias=False, layer_norm_epsilon=1e-6),
]


@pytest.mark.parametrize("fields", EXPORT_CASES, ids=lambda f: ",".join(f) or "gpt2")
def test_export_loads_in_transformers(fields, tmp_path):
    config = GPTConfig(vocab_size=500, block_size=64, n_layer=2, n_head=4, n_embd=64, **fields)
    params = random_params(config)
    tokens = TOKENS[:, :32] % 500
    hf.export_pretrained(config, params, str(tmp_path))
    model = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path)).eval()
    assert model.config.tie_word_embeddings == config.tie_embeddings
    want = flax_logits(config, params, tokens)
    np.testing.assert_allclose(ref_logits(model, tokens), want, atol=1e-4, rtol=0)
    if config.pos_embedding == "learned" and config.bias and config.qkv_bias:  # exact round trip
        back_config, back = hf.load_pretrained(
            str(tmp_path), scan_layers=config.scan_layers, pad_vocab_multiple=config.pad_vocab_multiple
        )
        assert back_config == config
        V = config.vocab_size  # padded vocabulary rows come back as zeros: compare the real ones
        unpad = lambda path, x: (
            x[..., :V, :] if path[0].key == "wte" else x[..., :V] if path[0].key == "lm_head" else x
        )
        jax.tree_util.tree_map_with_path(
            lambda path, a, b: np.testing.assert_array_equal(unpad(path, a), unpad(path, b)), back, params
        )


def test_export_run_config_dict_and_refusals(tmp_path):
    config = GPTConfig(vocab_size=300, block_size=32, n_layer=1, n_head=2, n_embd=32)
    params = random_params(config)
    run_model = {**config.to_dict(), "kind": "gpt"}
    hf.export_pretrained(run_model, params, str(tmp_path / "ok"))
    assert json.loads((tmp_path / "ok" / "config.json").read_text())["vocab_size"] == 300
    with pytest.raises(ValueError, match="kind='seq2seq'"):
        hf.export_pretrained({**run_model, "kind": "seq2seq"}, params, str(tmp_path / "no"))
    with pytest.raises(ValueError, match=r"param wte/embedding has shape \(300, 32\), expected \(300, 64\)"):
        hf.export_pretrained(GPTConfig(**{**config.to_dict(), "n_embd": 64}), params, str(tmp_path / "no"))


def test_bad_directories(small, tmp_path):
    directory, _, _ = small
    config_text = open(os.path.join(directory, "config.json")).read()
    (tmp_path / "config.json").write_text(config_text)
    with pytest.raises(FileNotFoundError, match=r"no model.safetensors in .* \(found: config.json\)"):
        hf.load_pretrained(str(tmp_path))

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma", "hidden_size": 64}))
    with pytest.raises(ValueError, match="model_type 'gemma' is not supported; supported: gpt2, llama"):
        hf.load_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ValueError, match="llama config.json has no vocab_size, intermediate_size, num_"):
        hf.load_pretrained(str(tmp_path))

    tensors = load_file(os.path.join(directory, "model.safetensors"))
    tensors["transformer.h.1.mlp.c_fc.weight"] = tensors["transformer.h.1.mlp.c_fc.weight"][:, :200]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(config_text)
    with pytest.raises(
        ValueError,
        match=r"transformer.h.1.mlp.c_fc.weight has shape \(64, 200\), "
        r"expected \(64, 256\)",
    ):
        hf.load_pretrained(str(tmp_path))

    with pytest.raises(FileNotFoundError, match="not a directory"):
        hf.load_pretrained(str(tmp_path / "missing"))


def test_hub_names_offline(small, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    empty = str(tmp_path / "empty_cache")
    for name in ("gpt2-xl", "not-a-gpt2-size"):
        with pytest.raises(
            ConnectionError,
            match=r"needs the network \(once, into that cache: hf download .*\), or pass a local directory",
        ):
            hf.load_pretrained(name, cache_dir=empty)
    # a hub cache laid out as huggingface_hub writes it is found without the network
    directory, _, ref = small
    commit = "0" * 40
    snapshot = tmp_path / "cache" / "models--gpt2" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (tmp_path / "cache" / "models--gpt2" / "refs").mkdir()
    (tmp_path / "cache" / "models--gpt2" / "refs" / "main").write_text(commit)
    for f in ("config.json", "model.safetensors"):
        os.symlink(os.path.join(directory, f), snapshot / f)
    config, params = hf.load_pretrained("gpt2", cache_dir=str(tmp_path / "cache"))
    np.testing.assert_allclose(flax_logits(config, params), ref, atol=1e-4, rtol=0)


def test_info_cli_and_package_names(small, capsys):
    import flaxgpt
    from flaxgpt import loader

    # flaxgpt.load_pretrained is hf.load_pretrained with an optional PEFT `adapter` merged in
    assert flaxgpt.load_pretrained is loader.load_pretrained
    assert flaxgpt.export_pretrained is hf.export_pretrained
    directory, _, _ = small
    assert hf_cli.main(["info", directory]) == 0
    assert json.loads(capsys.readouterr().out)["n_embd"] == 64
    assert hf_cli.main(["info", "/no/such/dir"]) == 1
    assert "not a directory" in capsys.readouterr().err


def test_export_cli_from_training_run(tmp_path, capsys):
    from flaxgpt.runs.checkpoint import Checkpointer

    config = GPTConfig(
        vocab_size=300, block_size=32, n_layer=2, n_head=2, n_embd=32, scan_layers=True, pad_vocab_multiple=64
    )
    params = random_params(config, seed=3)
    run = tmp_path / "run"
    ckpt = Checkpointer(run, async_save=False)
    ckpt.save(5, {"params": params}, extra={})
    ckpt.close()
    (run / "config.json").write_text(json.dumps({"model": {"kind": "gpt", **config.to_dict()}}))
    (run / "meta.json").write_text(json.dumps({"tokenizer": {"kind": "char", "chars": ["a"] * 300}}))
    assert hf_cli.main(["export", "--out_dir", str(run), "--to", str(tmp_path / "hf")]) == 0
    model = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    tokens = TOKENS[:, :16] % 300
    np.testing.assert_allclose(
        ref_logits(model, tokens), flax_logits(config, params, tokens), atol=1e-4, rtol=0
    )
    assert hf_cli.main(["export", "--out_dir", str(tmp_path / "nothing"), "--to", str(tmp_path / "x")]) == 1
    assert "nothing is not a directory; point out_dir at a flaxgpt training run" in capsys.readouterr().err


def test_export_never_overwrites_a_run_or_asks_first(tmp_path, capsys):
    from flaxgpt.runs.checkpoint import Checkpointer

    config = GPTConfig(vocab_size=20, block_size=8, n_layer=1, n_head=2, n_embd=16)
    run = tmp_path / "run"
    ckpt = Checkpointer(run, async_save=False)
    ckpt.save(5, {"params": random_params(config)}, extra={})
    ckpt.close()
    run_config = json.dumps({"model": {"kind": "gpt", **config.to_dict()}})
    (run / "config.json").write_text(run_config)
    (run / "meta.json").write_text(
        json.dumps({"tokenizer": {"kind": "char", "chars": list("abcdefghijklmnopqrst")}})
    )
    other = tmp_path / "other_run"
    other.mkdir()
    (other / "config.json").write_text(run_config)
    (other / "checkpoints").mkdir()

    def export(to, *flags):
        code = hf_cli.main(["export", "--out_dir", str(run), "--to", str(to), *flags])
        return code, capsys.readouterr().err.strip()

    refusals = {
        run: "is the training run being exported; export to another directory",
        run / ".": "is the training run being exported",
        run / "hf": "is inside the training run being exported",
        other: "is a flaxgpt training run; export to a directory outside it",
        other / "checkpoints": f"is inside {other}, a flaxgpt training run",
        run / "meta.json": "is inside the training run being exported",
    }
    for to, message in refusals.items():
        for flags in ((), ("--overwrite",)):  # --overwrite never reaches into a run
            code, err = export(to, *flags)
            assert code == 1 and err.startswith("error: ") and message in err and "\n" not in err, err
    assert (run / "config.json").read_text() == run_config and not (run / "hf").exists()
    assert sorted(p.name for p in other.iterdir()) == ["checkpoints", "config.json"]

    code, err = export(tmp_path / "hf")  # a character tokenizer has no tokenizer.json: said
    assert code == 0 and err.startswith("note: the run's char tokenizer has no tokenizer.json form"), err
    code, err = export(tmp_path / "hf")
    assert code == 1 and err == (
        f"error: {tmp_path / 'hf'} exists and is not empty; pass --overwrite to replace its config.json "
        "and model.safetensors, or choose another --to"
    )
    assert export(tmp_path / "hf", "--overwrite")[0] == 0
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]


def test_hub_unreachable_and_missing_weights_messages(tmp_path, monkeypatch):
    """The online branch, with huggingface_hub's download replaced: nothing touches the network."""
    import huggingface_hub
    from huggingface_hub import constants, errors

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_files, "hub_reachable", lambda *a, **k: True)  # past the quick offline check

    def unreachable(repo, filename, **kw):
        raise errors.LocalEntryNotFoundError("connection error and no cached file")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", unreachable)
    with pytest.raises(ConnectionError, match=r"the hub could not be reached .*needs the network"):
        hf.load_pretrained("gpt2", cache_dir=str(tmp_path))

    def no_safetensors(repo, filename, **kw):
        if filename == "model.safetensors":
            raise errors.EntryNotFoundError("404")
        return str(tmp_path / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_safetensors)
    with pytest.raises(FileNotFoundError, match="hub repo 'someone/old-gpt2' has no model.safetensors"):
        hf.load_pretrained("someone/old-gpt2", cache_dir=str(tmp_path))


def test_sharded_safetensors_with_index(small, tmp_path):
    directory, _, ref = small
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / file), metadata={"format": "pt"})
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(open(os.path.join(directory, "config.json")).read())
    config, params = hf.load_pretrained(str(tmp_path))
    np.testing.assert_allclose(flax_logits(config, params), ref, atol=1e-4, rtol=0)
