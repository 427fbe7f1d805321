"""flaxgpt.load: a run directory, a Hugging Face GPT-2 directory, dtype then quantize, one-line errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flaxgpt
from flaxgpt import loader
from flaxgpt.data.tokenizers import CharTokenizer
from flaxgpt.models import gpt, quantize
from flaxgpt.models.cache import KVCache
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
        (ValueError, "dtype 'float8' is not one of", dict(source=run_dir[0], dtype="float8")),
        (ValueError, "unknown quantization mode 'fp8'", dict(source=run_dir[0], quantize="fp8")),
        (ValueError, "step=3 applies to a training run", dict(source=hf_dir[0], step=3)),
        (FileNotFoundError, "is not a directory", dict(source=str(tmp_path / "missing"))),
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
