"""flaxgpt.models.registry: every recipe's `model` section is its dataclass's fields, maps by config_from,
is described by `flaxgpt summary --config` and builds its model (shapes only)."""

import dataclasses
from pathlib import Path

import pytest

from flaxgpt.models import gpt
from flaxgpt.models import registry as models
from flaxgpt.models.gpt import GPTConfig
from flaxgpt.models.seq2seq import TransformerConfig
from flaxgpt.tools import summary
from flaxgpt.train import config_check

RECIPES = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.py"))


def test_there_are_recipes():
    assert {"default", "reverse", "wmt14_ende_base"} <= {p.stem for p in RECIPES}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_maps_summarizes_and_builds(recipe, capsys):
    section = config_check.load_recipe(str(recipe)).model.to_dict()
    cls = models.CONFIGS[section["kind"]]
    # the recipe's names are the dataclass's names, all of them
    assert set(section) - {"kind"} == {f.name for f in dataclasses.fields(cls)}
    config = models.config_from(section, vocab_size=100)
    assert isinstance(config, cls) and config.vocab_size == (section["vocab_size"] or 100)
    assert models.config_from(models.section_of(config)) == config  # config.json reads back the same
    n_params = gpt.count_params(models.abstract_params(config))  # no weights allocated
    s = summary.main(["--config", str(recipe), "--vocab_size=100"])
    capsys.readouterr()
    assert s["kind"] == section["kind"] and s["totals"]["total"] == n_params
    assert (s["config"]["n_embd"], s["config"]["block_size"]) == (section["n_embd"], section["block_size"])


def test_reverse_summary_describes_the_recipes_model(capsys):
    s = summary.main(["--config", str(RECIPES[0].parent / "reverse.py")])
    out = capsys.readouterr().out
    assert "encoder-decoder: 2+2 layers, 4 heads, width 64, context 16" in out
    assert s["flops"]["seq_len"] == 16


def test_old_and_unknown_keys_are_one_line_errors():
    with pytest.raises(ValueError, match=r"^model.d_model is now model.n_embd; rename it") as e:
        models.config_from({"kind": "seq2seq", "d_model": 64})
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="model.share_embeddings is now model.tie_embeddings"):
        models.config_from({"kind": "seq2seq", "share_embeddings": False})
    with pytest.raises(
        ValueError, match=r"unknown GPTConfig fields \['n_layr'\].*fields: vocab_size, block_size"
    ):
        models.config_from({"n_layr": 3})
    with pytest.raises(ValueError, match="model.kind='rnn' is not one of"):
        models.config_from({"kind": "rnn"})
    with pytest.raises(SystemExit):
        summary.main(["--preset", "base", "--d_model=64"])


def test_dropout_minus_one_means_dropout():
    c = GPTConfig(dropout=0.2, attn_dropout=0.0)
    assert (c.embd_dropout, c.attn_dropout, c.resid_dropout) == (0.2, 0.0, 0.2)
    assert models.config_from(models.section_of(c)) == c  # stored rates are the real ones
    assert models.config_from({"dropout": 0.1}).resid_dropout == 0.1


def test_kinds_and_vocab():
    assert models.kind_of(GPTConfig()) == "gpt" and models.kind_of(TransformerConfig()) == "seq2seq"
    assert models.config_from({"vocab_size": 0}, vocab_size=65).vocab_size == 65
    assert models.config_from({"vocab_size": 0}).vocab_size == GPTConfig().vocab_size
    assert models.config_from({"vocab_size": 7}, vocab_size=65).vocab_size == 7
    with pytest.raises(TypeError, match="not a model config"):
        models.kind_of({"kind": "gpt"})


def test_saved_configs_without_the_sinusoid_layout_keep_the_old_one():
    """New configs use the paper's interleaved sinusoids; a run saved before the field existed
    (its config.json / checkpoint config lacks it) is read with the layout it was trained with."""
    for kind, cls in models.CONFIGS.items():
        assert cls().sinusoid_layout == "interleaved"
        saved = {k: v for k, v in models.section_of(cls()).items() if k != "sinusoid_layout"}
        assert models.config_from(saved, saved=True).sinusoid_layout == "halves", kind
        assert models.config_from(saved).sinusoid_layout == "interleaved", kind
        new = models.section_of(cls())  # a section that records the field keeps it
        assert models.config_from(new, saved=True).sinusoid_layout == "interleaved", kind
    with pytest.raises(ValueError, match="sinusoid_layout"):
        GPTConfig(sinusoid_layout="sines_first")


def test_an_old_sinusoidal_run_loads_with_its_layout(tmp_path):
    """run_dir.load_run reads config.json as saved: an old run without the field gets "halves"."""
    import json

    import jax

    from flaxgpt.data.tokenizers import CharTokenizer
    from flaxgpt.runs.checkpoint import Checkpointer
    from flaxgpt.runs.run_dir import load_run, write_run_files

    cfg = GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=16, pos_embedding="sinusoidal")
    (tmp_path / "data").mkdir()
    meta = {"tokenizer": CharTokenizer(list("abcdefghij")).to_meta(), "vocab_size": 10}
    (tmp_path / "data" / "meta.json").write_text(json.dumps(meta))
    write_run_files(tmp_path / "run", {"model": cfg}, tmp_path / "data")
    ckpt = Checkpointer(tmp_path / "run", async_save=False)
    ckpt.save(1, {"params": gpt.init_params(cfg, jax.random.key(0))}, extra={})
    ckpt.close()
    assert load_run(tmp_path / "run").config.sinusoid_layout == "interleaved"
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    del saved["model"]["sinusoid_layout"]  # as written before the field existed
    (tmp_path / "run" / "config.json").write_text(json.dumps(saved))
    assert load_run(tmp_path / "run").config.sinusoid_layout == "halves"
