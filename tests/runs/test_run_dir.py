"""flaxgpt.runs.run_dir: write a run's files, load a GPT and a seq2seq run back, one-line errors."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxgpt import loader
from flaxgpt.data.tokenizers import CharTokenizer, Seq2SeqTokenizer, TiktokenTokenizer
from flaxgpt.decode import translate
from flaxgpt.models import gpt, seq2seq
from flaxgpt.models import registry as models
from flaxgpt.runs.checkpoint import Checkpointer, CheckpointError
from flaxgpt.runs.run_dir import Run, RunError, load_run, write_run_files

CHARS = list("abcdefghij")


def data_dir(tmp_path, tokenizer) -> str:
    d = tmp_path / "data"
    d.mkdir(exist_ok=True)
    (d / "meta.json").write_text(json.dumps({"tokenizer": tokenizer.to_meta(), "vocab_size": 10}))
    return d


def save(out, params, step):
    ckpt = Checkpointer(out, async_save=False)
    ckpt.save(step, {"params": params, "step": np.int32(step)}, extra={})
    ckpt.close()


def assert_same(a, b):
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpt")
    cfg = gpt.GPTConfig(vocab_size=len(CHARS), block_size=8, n_layer=1, n_head=2, n_embd=16)
    config_dict = {"model": cfg, "seed": 3, "out_dir": str(tmp / "run")}
    write_run_files(tmp / "run", config_dict, data_dir(tmp, CharTokenizer(CHARS)))
    params = {s: gpt.init_params(cfg, jax.random.key(s)) for s in (1, 2)}
    for step, p in params.items():
        save(tmp / "run", p, step)
    return tmp / "run", cfg, params


def test_write_run_files(gpt_run):
    out, cfg, _ = gpt_run
    saved = json.loads((out / "config.json").read_text())
    assert saved["model"] == models.section_of(cfg) == {"kind": "gpt", **cfg.to_dict()}
    assert saved["seed"] == 3
    assert json.loads((out / "meta.json").read_text())["tokenizer"] == CharTokenizer(CHARS).to_meta()
    assert not list(out.glob(".*.tmp"))  # written through a temporary file, then renamed


def test_load_a_gpt_run(gpt_run):
    out, cfg, params = gpt_run
    run = load_run(out)
    assert isinstance(run, Run) and run.kind == "gpt" and run.config == cfg
    assert_same(run.params, params[2])  # the latest step
    assert run.tokenizer.decode(run.tokenizer.encode("jihg")) == "jihg"
    assert_same(load_run(str(out), step=1).params, params[1])
    logits = gpt.GPT(run.config).apply({"params": run.params}, jnp.arange(4)[None])
    assert logits.shape == (1, 4, len(CHARS))


def test_dtype_casts_weights_and_compute(gpt_run):
    out, cfg, _ = gpt_run
    run = loader.load(out, dtype="bfloat16")
    assert (run.config.dtype, run.config.param_dtype) == ("bfloat16", "bfloat16")
    assert {x.dtype for x in jax.tree_util.tree_leaves(run.params)} == {jnp.dtype("bfloat16")}
    assert loader.with_dtype(load_run(out), "bfloat16").config == run.config


def test_load_a_seq2seq_run(tmp_path):
    tok = Seq2SeqTokenizer(CharTokenizer(CHARS))
    cfg = seq2seq.TransformerConfig(
        vocab_size=tok.vocab_size, block_size=8, n_enc_layer=1, n_dec_layer=1, n_embd=16, d_ff=32, n_head=2
    )
    write_run_files(tmp_path / "run", {"model": models.section_of(cfg)}, data_dir(tmp_path, tok))
    params = seq2seq.init_params(cfg, jax.random.key(0))
    save(tmp_path / "run", params, 5)
    run = load_run(tmp_path / "run")
    assert run.kind == "seq2seq" and run.config == cfg and isinstance(run.tokenizer, Seq2SeqTokenizer)
    assert run.tokenizer.to_meta() == tok.to_meta()
    assert_same(run.params, params)
    out = translate.translate(run.config, run.params, run.tokenizer, ["abc", "ji"], beam_size=1)
    assert len(out) == 2 and all(isinstance(s, str) for s in out)


def test_a_gpt2_vocabulary_run(tmp_path):
    cfg = gpt.GPTConfig(vocab_size=50257, block_size=8, n_layer=1, n_head=2, n_embd=16)
    write_run_files(tmp_path / "run", {"model": cfg}, data_dir(tmp_path, TiktokenTokenizer("gpt2")))
    save(tmp_path / "run", gpt.init_params(cfg, jax.random.key(0)), 1)
    run = load_run(tmp_path / "run")
    assert run.tokenizer.eot_id == 50256 and run.config.vocab_size == 50257


def one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert len(text.splitlines()) == 1, text
    return text


def test_missing_or_broken_files_are_one_line_errors(gpt_run, tmp_path):
    src, cfg, _ = gpt_run
    with pytest.raises(RunError, match="is not a directory; point out_dir at a flaxgpt training run") as e:
        load_run(tmp_path / "nothing")
    assert str(tmp_path / "nothing") in one_line(e)
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(RunError, match=r"config.json is missing; point out_dir") as e:
        load_run(run)
    one_line(e)
    (run / "config.json").write_text("{not json")
    with pytest.raises(RunError, match="config.json cannot be read") as e:
        load_run(run)
    one_line(e)
    (run / "config.json").write_text(json.dumps({"seed": 1}))
    with pytest.raises(RunError, match="has no 'model' entry"):
        load_run(run)
    (run / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(RunError, match=r"meta.json is missing") as e:
        load_run(run)
    one_line(e)
    (run / "meta.json").write_text(json.dumps({"vocab_size": 10}))
    with pytest.raises(RunError, match="has no 'tokenizer' entry; copy the data directory's meta.json"):
        load_run(run)
    (run / "meta.json").write_text((src / "meta.json").read_text())
    with pytest.raises(CheckpointError, match="has no checkpoints directory") as e:
        load_run(run)
    one_line(e)
    (run / "checkpoints").mkdir()  # a run stopped before its first checkpoint: sample.py's advice (#55)
    with pytest.raises(CheckpointError, match="has no checkpoint yet .*; train it further, or point") as e:
        load_run(run)
    assert "init_from" not in one_line(e)
    with pytest.raises(CheckpointError, match="has no checkpoint for step 7; it has steps \\[1, 2\\]"):
        load_run(src, step=7)
    (run / "config.json").write_text(json.dumps({"model": {"kind": "rnn"}}))
    with pytest.raises(ValueError, match="model.kind='rnn' is not one of"):
        load_run(run)


def test_write_run_files_refuses_another_vocabulary(gpt_run, tmp_path):
    out, cfg, _ = gpt_run
    other = data_dir(tmp_path, CharTokenizer(list("xyz")))
    with pytest.raises(RunError, match="differs from .*meta.json; resume with the data the run was"):
        write_run_files(out, {"model": cfg}, other)
    with pytest.raises(RunError, match="cannot be read .*prepare the dataset first"):
        write_run_files(tmp_path / "new", {"model": cfg}, tmp_path / "no_data")


RECIPES = sorted(
    p for p in (Path(__file__).resolve().parents[2] / "configs").glob("*.py") if p.stem != "__init__"
)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_resuming_a_recipe_unchanged_reports_no_changed_settings(path):
    """The checkpoint holds the run config as JSON (tuples read back as lists): no change to report (#55)."""
    from flaxgpt.runs.run_dir import check_resume
    from flaxgpt.train import config_check

    tiny = gpt.GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=2, n_embd=8)
    now = config_check.load_recipe(str(path)).to_dict()
    saved = json.loads(json.dumps({**now, "model": models.section_of(tiny)}))
    assert check_resume({"config": saved}, 5, tiny, {}, now) == []


def test_a_run_saved_before_the_export_only_fields_resumes():
    """A LoRA fine-tune saved before GPTConfig.hf_context / hf_window existed: its record holds neither,
    the init_from now gives 128, and the model computes the same: it resumes, no change reported; a
    field the model reads (block_size) is still refused."""
    from flaxgpt.runs.run_dir import RunError, check_resume

    now_config = gpt.GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=2, n_embd=8, hf_context=128)
    saved_model = json.loads(json.dumps(models.section_of(now_config)))
    for field in models.EXPORT_ONLY_FIELDS:
        del saved_model[field]
    config = {"optim": {"learning_rate": 1e-4}}
    assert check_resume({"config": {**config, "model": saved_model}}, 5, now_config, {}, config) == []
    longer = dataclasses.replace(now_config, block_size=16)
    with pytest.raises(RunError, match=r"model\.block_size \(8 in the checkpoint, 16 now\)"):
        check_resume({"config": {**config, "model": saved_model}}, 5, longer, {}, config)


def test_resuming_with_a_real_change_reports_it():
    from flaxgpt.runs.run_dir import check_resume

    tiny = gpt.GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=2, n_embd=8)
    saved = {"grpo": {"reward_funcs": ["answer"]}, "optim": {"learning_rate": 6e-4}}
    saved["model"] = json.loads(json.dumps(models.section_of(tiny)))
    now = {"grpo": {"reward_funcs": ("answer", "format")}, "optim": {"learning_rate": 1e-4}}
    assert check_resume({"config": saved}, 5, tiny, {}, now) == [
        "grpo.reward_funcs: ['answer'] -> ['answer', 'format']",
        "optim.learning_rate: 0.0006 -> 0.0001",
    ]


def test_resuming_a_lora_run_with_another_alpha_is_refused():
    """A LoRA run's adapters mean what rank, alpha and targets made them: another alpha would rescale
    what they learned (a shape check catches only rank and targets); dropout may change."""
    from flaxgpt.runs.run_dir import RunError, check_resume

    tiny = gpt.GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=2, n_embd=8)
    lora = {"rank": 4, "alpha": 16.0, "dropout": 0.0, "targets": "all-linear", "base_dtype": "float32"}
    saved = {"lora": lora, "model": json.loads(json.dumps(models.section_of(tiny)))}
    assert check_resume({"config": saved}, 5, tiny, {}, {"lora": {**lora, "dropout": 0.1}}) == [
        "lora.dropout: 0.0 -> 0.1"
    ]
    with pytest.raises(RunError, match=r"lora\.alpha \(16\.0 in the checkpoint, 32\.0 now\)"):
        check_resume({"config": saved}, 5, tiny, {}, {"lora": {**lora, "alpha": 32.0}})
