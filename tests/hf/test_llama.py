"""Llama, Mistral and Qwen2 import/export against transformers (PyTorch CPU), both directions.

Tiny random models of each family saved to temporary directories stand in for published
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

from flaxgpt import hf_cli
from flaxgpt.decode.sampling import generate
from flaxgpt.hf import families
from flaxgpt.hf import llama as hf_llama
from flaxgpt.hf import pretrained as hf
from flaxgpt.models.cache import KVCache
from flaxgpt.models.gpt import GPT, GPTConfig
from flaxgpt.models.gpt import step_fn as gpt_step_fn

V = 300
TINY = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
)
FAMILIES = {  # model_type -> (config class, model class, what this family's tiny model exercises)
    "llama": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            rope_theta=500000.0,  # Llama 3's rope scaling, rescaled to the tiny context
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    # heads wider than hidden_size / heads (Mistral-NeMo's shape: refused until 2026-12-01)
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(sliding_window=6, head_dim=24),
    ),
    "qwen2": (  # linear rope scaling: positions / factor, both ways
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(tie_word_embeddings=True, rope_scaling=dict(rope_type="linear", factor=2.0)),
    ),
}
TOKENS = np.random.RandomState(0).randint(0, V, (2, 24))


def make_hf_model(model_type, directory, max_shard_size=None, **overrides):
    """A tiny random model with every parameter perturbed (norms and Qwen2's qkv biases too)."""
    config_cls, model_cls, extra = FAMILIES[model_type]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**TINY, **extra, **overrides})).eval()
    with torch.no_grad():
        for p in model.parameters():  # peaked logits: no argmax ties in the greedy comparisons
            p.add_(0.15 * torch.randn_like(p))
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kw)
    return model


def ref_logits(model, tokens=TOKENS):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def flax_logits(config, params, tokens=TOKENS):
    return np.asarray(jax.jit(lambda p, t: GPT(config).apply({"params": p}, t))(params, jnp.asarray(tokens)))


def flax_greedy(config, params, prompt, n):
    cache = KVCache.for_config(config, batch=1, max_len=64)
    out, _ = generate(
        gpt_step_fn(config, params), cache, np.asarray([prompt], np.int32), [len(prompt)],
        max_new_tokens=n, rng=jax.random.key(0), temperature=0.0,
    )  # fmt: skip
    return [int(t) for t in out[0, :n]]


def torch_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(model_type, directory, transformers model); Llama's files are sharded with an index."""
    model_type = request.param
    directory = str(tmp_path_factory.mktemp(model_type))
    model = make_hf_model(model_type, directory, max_shard_size="60KB" if model_type == "llama" else None)
    return model_type, directory, model


def test_import_logits_and_greedy_tokens_match_transformers(family):
    model_type, directory, model = family
    if model_type == "llama":
        assert os.path.exists(os.path.join(directory, "model.safetensors.index.json"))
    config, params = hf.load_pretrained(directory)
    assert (config.n_kv_head, config.pos_embedding, config.norm, config.glu) == (2, "rope", "rmsnorm", True)
    np.testing.assert_allclose(flax_logits(config, params), ref_logits(model), atol=1e-4, rtol=0)
    prompt = [int(t) for t in TOKENS[0, :5]]
    assert flax_greedy(config, params, prompt, 12) == torch_greedy(model, prompt, 12)


def test_info_cli(family, capsys):
    model_type, directory, _ = family
    assert hf_cli.main(["info", directory]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["n_kv_head"], info["norm"], info["qkv_bias"]) == (2, "rmsnorm", model_type == "qwen2")


def test_attention_maps_match_transformers(family):
    """Grouped-query heads (and Mistral's window) in the attention map equal transformers' eager weights."""
    from flaxgpt.tools.attention_map import attention_weights

    _, directory, model = family
    config, params = hf.load_pretrained(directory)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = model(torch.tensor(TOKENS[:1, :12]), output_attentions=True).attentions  # L x [1, H, T, T]
    ours = attention_weights(config, params, TOKENS[0, :12])
    np.testing.assert_allclose(ours, np.stack([a[0].numpy() for a in ref]), atol=1e-5)


def test_export_loads_in_transformers_with_the_same_logits_and_tokens(family, tmp_path):
    """flaxgpt -> Hugging Face: a model flaxgpt made (here: the import) exported, then loaded by
    transformers' AutoModelForCausalLM; scanned layers and a padded vocabulary are undone."""
    model_type, directory, _ = family
    config, params = hf.load_pretrained(directory, scan_layers=True, pad_vocab_multiple=64)
    params = jax.tree_util.tree_map(lambda x: x * 1.1, params)  # not the file we read
    hf.write(config, params, str(tmp_path), model_type, max_shard_bytes=100_000)
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert type(model).__name__ == families.FAMILIES[model_type].architecture
    np.testing.assert_allclose(ref_logits(model), flax_logits(config, params), atol=1e-4, rtol=0)
    prompt = [int(t) for t in TOKENS[1, :4]]
    assert torch_greedy(model, prompt, 10) == flax_greedy(config, params, prompt, 10)


def test_a_run_on_shorter_rows_exports_the_checkpoints_context_and_window(family, tmp_path):
    """Fine-tuning at block_size 5 (below Mistral's window of 6, the context of 128) keeps what the
    checkpoint declares: the export is the same architecture, context and window, so transformers
    computes the original's logits from it over 24 tokens (past the window) and it loads again at any
    block_size; before, it was a Llama with full attention and a context of 5."""
    model_type, directory, model = family
    config, params = hf.load_pretrained(directory, block_size=5)
    assert (config.block_size, config.hf_context, config.sliding_window) == (5, 128, 0)
    hf.write(config, params, str(tmp_path))  # the family export picks, as `flaxgpt hf export`
    written = json.loads((tmp_path / "config.json").read_text())
    source = json.loads(open(os.path.join(directory, "config.json")).read())
    for key in ("architectures", "max_position_embeddings", "sliding_window"):
        assert written.get(key) == source.get(key), key
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    np.testing.assert_allclose(ref_logits(exported), ref_logits(model), atol=1e-5, rtol=0)
    assert hf.load_pretrained(str(tmp_path), block_size=64)[0].block_size == 64


OPTION_SETS = {  # every option of the modern decoder, in two combinations
    "gqa_qknorm_softcap_untied": dict(n_kv_head=2, qk_norm=True, logit_softcap=30.0, tie_embeddings=False),
    "mqa_scan_remat_window_qwen_bias": dict(
        n_kv_head=1,
        scan_layers=True,
        remat="full",
        sliding_window=5,
        qkv_bias=True,
        rope_scaling="llama3",
        rope_factor=8.0,
        rope_original_max_len=32,
    ),  # fmt: skip
}


@pytest.mark.parametrize("options", list(OPTION_SETS))
def test_options_compose_with_the_kv_cache(options):
    """Prefill + one decode step over the cache equal the full forward; the cache holds J heads."""
    base = dict(GPTConfig.PRESETS["smollm2-135m"], vocab_size=V, block_size=64, n_layer=2, n_embd=48)
    config = GPTConfig(**{**base, "n_head": 6, "mlp_hidden": 64, **OPTION_SETS[options]})
    params = jax.jit(lambda r: GPT(config).init(r, jnp.zeros((1, 8), jnp.int32))["params"])(jax.random.key(0))
    tokens = jnp.asarray(TOKENS[:, :10])
    full = jax.jit(lambda p, t: GPT(config).apply({"params": p}, t))(params, tokens)
    cache = KVCache.for_config(config, batch=2, max_len=16)
    J = config.kv_heads
    # [B*J, S, K]: n_head / J times smaller than multi-head; a window layer keeps a ring of its window
    S = [min(config.layer_window(i) or 16, 16) for i in range(config.n_layer)]
    assert [k.shape for k in cache.k] == [(2 * J, s, 8) for s in S]
    assert sum(x.nbytes for x in cache.k + cache.v) == sum(2 * 2 * J * s * 8 * 4 for s in S)  # K+V, B, fp32
    step = jax.jit(lambda p, t, pos, c: GPT(config).apply({"params": p}, t, positions=pos, cache=c))
    _, cache = step(params, tokens[:, :9], jnp.broadcast_to(jnp.arange(9), (2, 9)), cache)
    last, _ = step(params, tokens[:, 9:], jnp.full((2, 1), 9), cache)
    np.testing.assert_allclose(last[:, 0], full[:, 9], atol=1e-5)
    if config.logit_softcap:
        assert float(jnp.abs(full).max()) < config.logit_softcap


def raises_one_line(kind, match, fn, *args):
    with pytest.raises(kind, match=match) as e:
        fn(*args)
    assert "\n" not in str(e.value)


def test_bad_input_is_one_line_errors(family, tmp_path):
    model_type, directory, _ = family
    with open(os.path.join(directory, "config.json")) as fh:
        cfg = json.load(fh)

    def write(d, **changes):
        os.makedirs(d, exist_ok=True)
        for name in os.listdir(directory):
            if name != "config.json":
                os.symlink(os.path.join(directory, name), os.path.join(d, name))
        with open(os.path.join(d, "config.json"), "w") as fh:
            json.dump({**cfg, **changes}, fh)
        return d

    supported = r"model_type 'gemma' is not supported; supported: gpt2, llama, mistral, qwen2"
    raises_one_line(
        ValueError, supported, hf.load_pretrained, write(str(tmp_path / "gemma"), model_type="gemma")
    )
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    d = write(str(tmp_path / "longrope"), rope_scaling=longrope, rope_parameters=longrope)
    raises_one_line(
        ValueError,
        "rope scaling type 'longrope' is not implemented .*; implemented: default, linear, llama3, yarn, dyn",
        hf.load_pretrained,
        d,
    )
    shapes = r"tensor model\.embed_tokens\.weight has shape \(300, 64\), expected \(301, 64\) from the config"
    raises_one_line(ValueError, shapes, hf.load_pretrained, write(str(tmp_path / "vocab"), vocab_size=V + 1))
    if model_type == "llama":  # sharded: delete one shard
        d = write(str(tmp_path / "shard"))
        shard = sorted(n for n in os.listdir(d) if n.startswith("model-0"))[-1]
        os.remove(os.path.join(d, shard))
        raises_one_line(FileNotFoundError, f"1 are missing: {shard}$", hf.load_pretrained, d)


def test_damaged_files_and_malformed_configs_are_one_line_errors(family, tmp_path):
    """What an interrupted copy or a hand edit leaves: each a one-line error naming the file or key,
    where tracebacks (SafetensorError, KeyError, TypeError, AttributeError) came before."""
    from flaxgpt.hf import peft as hf_peft

    model_type, directory, _ = family
    cfg = json.loads(open(os.path.join(directory, "config.json")).read())

    def copy(name, config_text=None, **changes):
        d = tmp_path / name
        d.mkdir()
        for f in os.listdir(directory):
            if f != "config.json":
                os.symlink(os.path.join(directory, f), d / f)
        (d / "config.json").write_text(
            config_text if config_text is not None else json.dumps({**cfg, **changes})
        )
        return str(d)

    bad = {
        "not JSON": (copy("text", '{"model_type": "llama", '), r"config\.json is not valid JSON \("),
        "a list": (copy("list", "[1, 2]"), r"config\.json holds a JSON list, not a model's config object"),
        "null heads": (
            copy("heads", num_attention_heads=None),
            r"has num_attention_heads=None; it must be an int",
        ),
        "string vocab": (copy("vocab", vocab_size="300"), r"has vocab_size='300'; it must be an integer"),
        "string rope": (
            copy("rope", rope_scaling="llama3"),
            r"rope scaling is 'llama3'; it must be an object",
        ),
        "llama3 rope": (
            copy("llama3", rope_scaling={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}),
            r"llama3 rope scaling has no low_freq_factor; add it to config\.json",
        ),
    }
    for what, (d, match) in bad.items():
        with pytest.raises(ValueError, match=match) as e:
            hf.load_pretrained(d)
        assert "\n" not in str(e.value), what
    if model_type == "llama":  # sharded: an index without its weight map
        d = copy("index")
        os.remove(os.path.join(d, "model.safetensors.index.json"))
        (tmp_path / "index" / "model.safetensors.index.json").write_text('{"metadata": {}}')
        raises_one_line(ValueError, r"index\.json has no 'weight_map' object", hf.load_pretrained, d)
    else:  # one file, cut short by an interrupted copy
        d = copy("truncated")
        weights = os.path.join(d, "model.safetensors")
        data = open(weights, "rb").read()
        os.remove(weights)
        open(weights, "wb").write(data[: len(data) // 2])
        raises_one_line(
            ValueError, r"model\.safetensors is not a readable safetensors file \(", hf.load_pretrained, d
        )
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "lora_alpha": 16}))
    (adapter / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    config = hf.read_config(directory)
    raises_one_line(
        ValueError,
        r"has r=None; a LoRA adapter's r is a positive number",
        hf_peft.load_adapter,
        str(adapter),
        config,
    )
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 16}))
    raises_one_line(
        ValueError,
        r"adapter_model\.safetensors is not a readable safetensors file",
        hf_peft.load_adapter,
        str(adapter),
        config,
    )


def test_export_refuses_what_the_family_cannot_express():
    config = GPTConfig.preset("smollm2-135m", qk_norm=True)
    held = (
        r"^a llama checkpoint cannot hold qk_norm=True \(it would read back as False\); export it as qwen3$"
    )
    with pytest.raises(ValueError, match=held):
        families.config_to_hf(config, "llama")
    with pytest.raises(
        ValueError, match=r"^a qwen2 checkpoint cannot hold qkv_bias=False \(it would read back"
    ):
        families.config_to_hf(GPTConfig.preset("smollm2-135m"), "qwen2")
    with pytest.raises(ValueError, match=r"pos_embedding='rope' \(it would read back as 'learned'\)"):
        families.config_to_hf(GPTConfig.preset("smollm2-135m", activation="relu"), "gpt2")
    with pytest.raises(ValueError, match=r"^a gpt2 checkpoint cannot hold activation='silu' \(it has gelu, "):
        families.config_to_hf(GPTConfig.preset("smollm2-135m"), "gpt2")
    with pytest.raises(ValueError, match="cannot export model_type 'gemma'; supported: gpt2, llama, mistral"):
        families.config_to_hf(GPTConfig.preset("smollm2-135m"), "gemma")


# the published config.json files (architecture entries) and parameter counts of well-known models
PUBLISHED = {
    "smollm2-135m": (
        134_515_008,
        dict(
            model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
            num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
            rms_norm_eps=1e-5, rope_theta=100000.0, rope_scaling=None, tie_word_embeddings=True,
            hidden_act="silu", bos_token_id=0, eos_token_id=0,
        ),
    ),
    "llama-3.2-1b": (
        1_235_814_400,
        dict(
            model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
            num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
            max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
            rope_scaling=dict(
                factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0, original_max_position_embeddings=8192,
                rope_type="llama3",
            ),
            tie_word_embeddings=True, attention_bias=False, mlp_bias=False, hidden_act="silu",
            bos_token_id=128000, eos_token_id=128001,
        ),
    ),
    "qwen2.5-0.5b": (
        494_032_768,
        dict(
            model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
            num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
            max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
            sliding_window=32768, use_sliding_window=False, max_window_layers=24, tie_word_embeddings=True,
            hidden_act="silu",
        ),
    ),
    "mistral-7b-v0.1": (
        7_241_732_096,
        dict(
            model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
            num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
            max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=10000.0,
            sliding_window=4096, tie_word_embeddings=False, hidden_act="silu",
        ),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_have_the_published_shapes_and_parameter_counts(name):
    """The preset equals what its config.json maps to, and flaxgpt's count equals both the
    published figure and transformers' own model built from that config (on the meta device)."""
    from flaxgpt.tools import summary

    total, hf_config = PUBLISHED[name]
    preset = GPTConfig.preset(name)
    mapped = families.config_from_hf(hf_config)
    assert {f: getattr(mapped, f) for f in hf_llama.ARCH_FIELDS} == {
        f: getattr(preset, f) for f in hf_llama.ARCH_FIELDS
    }
    assert summary.summarize(preset)["totals"]["total"] == total
    config_cls = transformers.AutoConfig.for_model(hf_config["model_type"]).__class__
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config_cls(**hf_config))
    assert sum(p.numel() for p in model.parameters()) == total


def test_summary_counts_the_kv_cache_grouped_query_attention_saves(capsys):
    from flaxgpt.tools import summary

    s = summary.main(["--preset", "llama-3.2-1b", "--block_size=8192"])
    assert s["kv_cache"]["per_token"]["bfloat16"] == 2 * 16 * 8 * 64 * 2  # K+V, layers, kv heads, dim, bytes
    assert s["kv_cache"]["per_token_multi_head"]["bfloat16"] == 4 * 2 * 16 * 8 * 64 * 2
    out = capsys.readouterr().out
    assert "32 heads (8 key/value heads)" in out and "(rotary: computed, not learned)" in out
    assert "KV cache, bfloat16: 32.0 KiB per token, 256.0 MB at 8,192 tokens (8 key/value heads; 4x" in out


@pytest.mark.parametrize("scan_layers", [False, True])
def test_fsdp_rules_split_every_big_llama_tensor(scan_layers):
    """Llama-3.2-1B over fsdp=8 (shapes only): every matrix and the embedding is split 8 ways by the
    one rules table; only the norms' scales (and QK-norm's, over head_dim) stay whole."""
    from flaxgpt import sharding
    from flaxgpt.models import gpt

    config = GPTConfig.preset("llama-3.2-1b", scan_layers=scan_layers, qk_norm=True)
    boxed = gpt.abstract_params(config)
    shardings = sharding.param_shardings(boxed, sharding.make_mesh(data=1, fsdp=8))
    flat = jax.tree_util.tree_flatten_with_path(nn.unbox(boxed))[0]
    whole = set()
    for (path, x), s in zip(flat, jax.tree_util.tree_leaves(shardings)):
        name = jax.tree_util.keystr(path)
        if s.shard_shape(x.shape) == x.shape:
            whole.add(name)
        else:
            assert int(np.prod(s.shard_shape(x.shape))) * 8 == int(np.prod(x.shape)), name
    assert whole and all("ln_" in n or "_norm" in n for n in whole), whole


@pytest.mark.parametrize("family", ["llama"], indirect=True)  # the family saved in shards
def test_hub_repo_with_shards_and_tokenizer(family, tmp_path, monkeypatch):
    """A hub name (huggingface_hub's download replaced, nothing touches the network): the index,
    every shard it names and the tokenizer files land in one snapshot directory."""
    import shutil

    import huggingface_hub
    from huggingface_hub import constants, errors

    from flaxgpt.hf import files as hf_files

    _, directory, _ = family
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    fetched = []

    def download(repo, filename, **kw):
        if not os.path.exists(os.path.join(directory, filename)):
            raise errors.EntryNotFoundError("404")
        fetched.append(filename)
        return shutil.copy(os.path.join(directory, filename), tmp_path / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert hf_files.resolve("someone/tiny-llama") == str(tmp_path)
    shards = [n for n in os.listdir(directory) if n.startswith("model-")]
    assert "model.safetensors.index.json" in fetched and set(shards) <= set(fetched) and len(shards) > 1
    config, _ = hf.load_pretrained("someone/tiny-llama")
    assert config.n_kv_head == 2


def test_config_errors_name_the_values():
    base = dict(n_layer=1, n_head=6, n_embd=48, pos_embedding="rope")
    with pytest.raises(ValueError, match="n_head 6 is not divisible by n_kv_head 4"):
        GPTConfig(**base, n_kv_head=4)
    with pytest.raises(
        ValueError, match="rope_scaling='longrope' is not one of \\('none', 'llama3', 'linear', 'yarn'"
    ):
        GPTConfig(**base, rope_scaling="longrope")
    with pytest.raises(ValueError, match="rotary embeddings need an even head_dim, got 7"):
        GPTConfig(**{**base, "n_head": 7, "n_embd": 49})
    with pytest.raises(ValueError, match="norm='batchnorm' is not one of"):
        GPTConfig(**base, norm="batchnorm")


def test_run_time_fields_pass_through(family):
    _, directory, _ = family
    config, _ = hf.load_pretrained(directory, dropout=0.1, dtype="bfloat16", block_size=64, remat="full")
    got = (config.attn_dropout, config.dtype, config.block_size, config.remat)
    assert got == (0.1, "bfloat16", 64, "full")
    with pytest.raises(ValueError, match="n_kv_head is fixed by the pretrained checkpoint"):
        hf.load_pretrained(directory, n_kv_head=1)
