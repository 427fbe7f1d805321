"""flaxgpt.load: a run directory, a Hugging Face GPT-2 directory, dtype then quantize, one-line errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flaxgpt
from flaxgpt import loader, sharding
from flaxgpt.data.tokenizers import CharTokenizer
from flaxgpt.models import gpt, quantize
from flaxgpt.models.cache import KVCache
from flaxgpt.models.seq2seq import TransformerConfig
from flaxgpt.runs.run_dir import RunError, load_run, write_run_files
from tests.hf.test_hf import flax_logits, make_hf_model, ref_logits
from tests.runs.test_run_dir import CHARS, assert_same, data_dir, save


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loader")
    cfg = gpt.GPTConfig(vocab_size=len(CHARS), block_size=8, n_layer=1, n_head=2, n_embd=16)
    write_run_files(tmp / "run", {"model": cfg}, data_dir(tmp, CharTokenizer(CHARS)))
    params = {s: gpt.init_params(cfg, jax.random.key(s)) for s in (1, 2)}
    for step, p in params.items():
        save(tmp / "run", p, step)
    return tmp / "run", cfg, params


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf") / "gpt2-tiny"
    return directory, make_hf_model(directory)


def test_the_public_names():
    assert flaxgpt.load is loader.load and flaxgpt.Run is loader.Run


def test_a_run_directory(run_dir):
    out, cfg, params = run_dir
    run = flaxgpt.load(out)
    assert isinstance(run, flaxgpt.Run) and run.kind == "gpt" and run.config == cfg
    assert_same(run.params, params[2])  # the latest step
    assert_same(flaxgpt.load(str(out), step=1).params, params[1])
    assert run.tokenizer.decode(run.tokenizer.encode("jihg")) == "jihg"
    # overrides that change how it runs, not its weights, are taken
    assert flaxgpt.load(out, overrides={"attention_impl": "xla", "dropout": 0.1}).config.dropout == 0.1


def test_a_hugging_face_gpt2_directory(hf_dir):
    directory, model = hf_dir
    kind, config, params, tokenizer = flaxgpt.load(directory)
    assert kind == "gpt" and (config.n_layer, config.n_embd, config.vocab_size) == (2, 64, 1000)
    assert tokenizer.eot_id == 50256  # GPT-2's BPE
    np.testing.assert_allclose(flax_logits(config, params), ref_logits(model), atol=1e-4, rtol=1e-4)


def test_dtype_then_quantize(run_dir, hf_dir):
    out, _, params = run_dir
    run = flaxgpt.load(out, dtype="bfloat16")
    assert (run.config.dtype, run.config.param_dtype) == ("bfloat16", "bfloat16")
    assert {x.dtype for x in jax.tree_util.tree_leaves(run.params)} == {jnp.dtype("bfloat16")}
    assert loader.with_dtype(load_run(out), "bfloat16").config == run.config
    run = flaxgpt.load(hf_dir[0], dtype="bfloat16", quantize="int8")
    assert quantize.is_quantized(run.params) and run.config.dtype == "bfloat16"
    x, pos = jnp.arange(6)[None], jnp.arange(6)[None]
    logits, _ = gpt.step_fn(run.config, run.params)(x, pos, KVCache.for_config(run.config, 1, 8))
    plain = flaxgpt.load(hf_dir[0])
    want = gpt.GPT(plain.config).apply({"params": plain.params}, x)
    # int8 weights of bfloat16 ones: close to the float32 model, not equal
    corr = np.corrcoef(np.asarray(logits, np.float32).ravel(), np.asarray(want).ravel())[0, 1]
    assert corr > 0.99, corr


def test_bad_sources_are_one_line(tmp_path, run_dir, hf_dir):
    (tmp_path / "empty").mkdir()
    cases = [
        (FileNotFoundError, "is neither a flaxgpt training run", dict(source=tmp_path / "empty")),
        (ValueError, "init_from is empty; give scratch", dict(source="")),  # was "error:  is neither"
        (ValueError, "dtype 'float8' is not one of", dict(source=run_dir[0], dtype="float8")),
        (ValueError, "unknown quantization mode 'fp8'", dict(source=run_dir[0], quantize="fp8")),
        (ValueError, "step=3 applies to a training run", dict(source=hf_dir[0], step=3)),
        (FileNotFoundError, "is not a directory", dict(source=str(tmp_path / "missing"))),
        # a run's weights are what they are: an override that would reshape them (a Flax traceback once)
        (
            ValueError,
            "['n_layer'] would change the weights of",
            dict(source=run_dir[0], overrides={"n_layer": 5}),
        ),
    ]
    for error, message, kw in cases:
        with pytest.raises(error) as e:
            flaxgpt.load(kw.pop("source"), **kw)
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    # where a run was named (--out_dir): no hub look-up for a missing directory
    with pytest.raises(RunError, match=r"missing is not a directory; point out_dir at a flaxgpt"):
        loader.require_run(tmp_path / "missing")
    with pytest.raises(RunError, match=r"empty is not a training run; point out_dir"):
        loader.require_run(tmp_path / "empty")
    loader.require_run(run_dir[0])


def _placed_like_serve_rules(run, one, mesh) -> set[str]:
    """Asserts every leaf of `run` sits in SERVE_RULES' sharding over `mesh`, each device holding one
    slice of that sharding's shape, with the one-device load's values -> the leaves that are split."""
    want = sharding.param_shardings(gpt.abstract_params(run.config), mesh, sharding.SERVE_RULES)
    leaves = jax.tree_util.tree_leaves_with_path(run.params)
    split = set()
    for (path, x), s, y in zip(leaves, jax.tree.leaves(want), jax.tree.leaves(one.params), strict=True):
        name = jax.tree_util.keystr(path)
        assert x.sharding.is_equivalent_to(s, x.ndim), name
        shard = s.shard_shape(x.shape)
        assert [sh.data.shape for sh in x.addressable_shards] == [shard] * mesh.size, name
        split |= {name} if shard != x.shape else set()
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
    return split


@pytest.mark.devices(8)
def test_placed_over_a_mesh_each_device_gets_only_its_slices(run_dir, hf_dir):
    """flaxgpt.load / loader.init with place=Placement(mesh): Hugging Face files, a run's checkpoint
    and random weights land split as SERVE_RULES say (MLP and vocabulary over the devices: an eighth
    of each such weight per device, never the whole), with the one-device values; int8 quantizing
    keeps the split; a mesh that does not divide the vocabulary is a one-line error."""
    eight, two = sharding.make_mesh(1, 8), sharding.make_mesh(1, 2, jax.devices()[:2])
    mlp_and_vocab = {"['h_0']['mlp']['c_fc']['kernel']", "['h_0']['mlp']['c_proj']['kernel']"}
    mlp_and_vocab |= {"['wte']['embedding']", "['h_0']['mlp']['c_fc']['bias']"}
    many = flaxgpt.load(hf_dir[0], place=sharding.Placement(eight))
    assert mlp_and_vocab <= _placed_like_serve_rules(many, flaxgpt.load(hf_dir[0]), eight)
    many = flaxgpt.load(run_dir[0], place=sharding.Placement(two))  # vocabulary 10: 2 devices
    assert mlp_and_vocab <= _placed_like_serve_rules(many, flaxgpt.load(run_dir[0]), two)
    cfg = gpt.GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)
    many = loader.init(cfg, place=sharding.Placement(eight))
    assert mlp_and_vocab <= _placed_like_serve_rules(many, loader.init(cfg), eight)

    one = flaxgpt.load(hf_dir[0], quantize="int8")
    many = flaxgpt.load(hf_dir[0], quantize="int8", place=sharding.Placement(eight))
    jax.tree.map(
        lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), many.params, one.params
    )
    for w in (many.params["h_0"]["mlp"]["c_fc"]["kernel"].w, many.params["lm_head"]["kernel"].w):
        assert w.dtype == jnp.int8 and w.addressable_shards[0].data.shape[0] * 8 == w.shape[0]

    with pytest.raises(sharding.IndivisibleError, match=r"^parameter \['wte'\]\['embedding'\] dim 10 is not"):
        flaxgpt.load(run_dir[0], place=sharding.Placement(eight))


def _same_shapes(a, b):
    shape = lambda t: jax.tree.map(lambda x: (x.shape, jnp.dtype(x.dtype)), t)  # noqa: E731
    assert shape(a) == shape(b)


def test_resolve_init_is_one_answer_for_every_source(run_dir, hf_dir):
    """loader.resolve_init: the recipe's own model when fresh; a run's model as saved and a pretrained
    checkpoint's architecture in the recipe's layout, both with the recipe's run-time fields; abstract
    (flaxgpt aot) gives the same config and the parameters' shapes without reading a weight."""
    recipe = gpt.GPTConfig(vocab_size=1000, block_size=16, n_layer=3, n_head=2, n_embd=32, dropout=0.1,
                           scan_layers=True, pad_vocab_multiple=64, remat="full")  # fmt: skip
    for abstract in (False, True):
        fresh = loader.resolve_init("scratch", recipe, abstract=abstract)
        assert (fresh.kind, fresh.config, fresh.tokenizer) == ("fresh", recipe, None)
        assert (fresh.params is None) != abstract
    seq2seq = TransformerConfig(vocab_size=64, block_size=8, n_enc_layer=1, n_dec_layer=1, n_embd=16)
    assert loader.resolve_init("auto", seq2seq, abstract=True).config == seq2seq  # any model kind's recipe
    out, cfg, params = run_dir
    run, shapes = (loader.resolve_init(out, recipe, abstract=a) for a in (False, True))
    assert run.kind == shapes.kind == "run" and run.config == shapes.config
    assert run.config.n_layer == cfg.n_layer and (run.config.dropout, run.config.remat) == (0.1, "full")
    assert run.layout == {f: getattr(cfg, f) for f in loader.LAYOUT_FIELDS}  # as saved
    assert_same(run.params, params[2])
    _same_shapes(run.params, shapes.params)
    assert run.tokenizer.decode(run.tokenizer.encode("jihg")) == "jihg" and shapes.tokenizer is None

    directory = str(hf_dir[0])
    hf, shapes = (loader.resolve_init(directory, recipe, abstract=a, tokenizer=False) for a in (0, 1))
    assert hf.kind == "pretrained" and hf.config == shapes.config and hf.tokenizer is None
    assert hf.layout == {f: getattr(recipe, f) for f in loader.LAYOUT_FIELDS}  # the recipe's layout
    assert (hf.config.n_layer, hf.config.dropout, hf.config.remat) == (2, 0.1, "full")
    assert shapes.where == f"{directory}/config.json"
    _same_shapes(hf.params, shapes.params)
    assert loader.resolve_init(directory).tokenizer.eot_id == 50256  # `load`'s: GPT-2's BPE
    assert [loader.init_kind(s) for s in ("auto", out, directory)] == ["fresh", "run", "pretrained"]


def test_resolve_init_reads_names_only_through_the_family_table():
    """Abstract, a name is the preset the family table says (hf.families.preset_for): a preset's own
    name or a published model's; anything else is a one-line error, not a guess."""
    from flaxgpt.hf import families

    assert set(families.PUBLISHED.values()) <= set(gpt.GPTConfig.PRESETS)
    recipe = gpt.GPTConfig(vocab_size=256, block_size=64, param_dtype="bfloat16", dtype="bfloat16")
    for name, preset in [
        ("path/to/Meta-Llama-3-8B", "llama-3-8b"),
        ("path/to/Llama-3.2-1B-Instruct", "llama-3.2-1b"),
        ("path/to/SmolLM2-135M", "smollm2-135m"),
        ("gpt2", "gpt2"),
        ("gemma-3-4b-text", "gemma-3-4b-text"),
    ]:
        init = loader.resolve_init(name, recipe, abstract=True)
        want = gpt.GPTConfig.preset(preset, block_size=64, scan_layers=False, pad_vocab_multiple=1,
                                    param_dtype="bfloat16", dtype="bfloat16")  # fmt: skip
        assert init.config == want and init.where == f"the {preset} preset (init_from={name})", name
    for name in ("path/to/Qwen2.5-1.5B-Instruct", "meta-llama-3.2-1b", "gpt2-chat"):
        with pytest.raises(ValueError, match="nor a model the family table knows") as e:
            loader.resolve_init(name, recipe, abstract=True)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"the family table knows .*; did you mean llama-3-8b\?$"):
        loader.resolve_init("llama-3-8c", recipe, abstract=True)  # a typo of a preset (#55)
