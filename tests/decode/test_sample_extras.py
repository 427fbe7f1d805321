"""sample.py beyond GPT sampling: translating with an encoder-decoder run, attention-map PNGs."""

import json
import sys
from pathlib import Path

import jax
import pytest

from flaxgpt.data.tokenizers import CharTokenizer, Seq2SeqTokenizer
from flaxgpt.decode import translate
from flaxgpt.models import seq2seq
from flaxgpt.models.gpt import GPTConfig, init_params
from flaxgpt.runs import run_dir
from flaxgpt.runs.checkpoint import Checkpointer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import sample  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def save_run(out: Path, model: dict, tokenizer_meta: dict, params):
    (out / "config.json").write_text(json.dumps({"model": model}))
    (out / "meta.json").write_text(json.dumps({"tokenizer": tokenizer_meta}))
    ckpt = Checkpointer(out, async_save=False)
    ckpt.save(1, {"params": params}, extra={})
    ckpt.close()
    return out


@pytest.fixture(scope="module")
def seq2seq_run(tmp_path_factory):
    """Random weights are enough: the CLI must hand each line to the translator and print its answer."""
    tok = Seq2SeqTokenizer(CharTokenizer(list("abcdefghij")))
    cfg = seq2seq.TransformerConfig(
        vocab_size=tok.vocab_size, block_size=10, n_enc_layer=1, n_dec_layer=1, n_embd=16, d_ff=32, n_head=2
    )
    params = seq2seq.init_params(cfg, jax.random.key(0))
    model = {"kind": "seq2seq", **cfg.to_dict()}
    return save_run(tmp_path_factory.mktemp("s2s"), model, tok.to_meta(), params)


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    chars = sorted(set("abcdefghij ROMEO:\n"))
    cfg = GPTConfig(vocab_size=len(chars), block_size=16, n_layer=2, n_head=2, n_embd=16)
    model = {"kind": "gpt", **cfg.to_dict()}
    params = init_params(cfg, jax.random.key(0))
    return save_run(tmp_path_factory.mktemp("gpt"), model, CharTokenizer(chars).to_meta(), params)


def run(capsys, *args):
    code = sample.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("beam_size", [1, 4])
def test_seq2seq_prints_one_translation_per_line(seq2seq_run, tmp_path, capsys, beam_size):
    lines = ["abc", "jihgf", "aabbccdd"]
    loaded = run_dir.load_run(seq2seq_run)
    expected = translate.translate(*loaded[1:], lines, beam_size=beam_size, alpha=0.6)
    (tmp_path / "src.txt").write_text("abc\n\njihgf\naabbccdd\n")  # blank lines are skipped
    src = tmp_path / "src.txt"
    for source in (["--prompts_file", src], ["--start", f"FILE:{src}"]):
        code, out, err = run(capsys, "--out_dir", seq2seq_run, *source, "--beam_size", beam_size)
        assert code == 0 and out.split("\n") == [*expected, ""] and err == "", err
    code, out, err = run(capsys, "--out_dir", seq2seq_run, "--start", "abc", "--beam_size", beam_size)
    assert code == 0 and out == expected[0] + "\n", err


def test_seq2seq_options_reach_the_translator(seq2seq_run, capsys, monkeypatch):
    """A random model's output ignores its source, so stand-ins check which run, step, lines and
    options sample.py hands over, and that the answers come out in order."""
    loads, calls = [], []
    load_run = run_dir.load_run

    def spy_load(out_dir, step=None, **kw):
        loads.append((str(out_dir), step))
        return load_run(out_dir, step, **kw)

    def fake(config, params, tokenizer, lines, **kw):
        assert isinstance(config, seq2seq.TransformerConfig) and isinstance(tokenizer, Seq2SeqTokenizer)
        calls.append((list(lines), kw))
        return [line[::-1] for line in lines]

    monkeypatch.setattr(run_dir, "load_run", spy_load)
    monkeypatch.setattr(translate, "translate", fake)
    args = ["--out_dir", seq2seq_run, "--start", "abc\n\nhij  \n"]
    args += ["--beam_size", 3, "--alpha", 0, "--step", 1]
    code, out, err = run(capsys, *args, "--truncate")
    assert code == 0 and out == "cba\n  jih\n", err
    assert loads == [(str(seq2seq_run), 1)]
    assert calls == [(["abc", "hij  "], dict(beam_size=3, alpha=0.0, truncate=True))]
    code, out, err = run(capsys, *args[:-6], "--temperature", 0.5)
    assert code == 0 and loads[-1] == (str(seq2seq_run), None)
    assert calls[-1][1] == dict(beam_size=4, alpha=0.6, truncate=False)
    assert "warning: --temperature applies to GPT models" in err
    # --max_new_tokens bounds a translation (it was dropped: translations ran to block_size); the
    # sources of a file split at newlines alone (a U+2028 in a sentence made two translations)
    code, out, err = run(capsys, *args[:-6], "--max_new_tokens", 3, "--heads", "0")
    assert code == 0 and calls[-1][1] == dict(beam_size=4, alpha=0.6, truncate=False, max_len=3)
    assert "warning: --heads applies to GPT models" in err
    code, out, err = run(capsys, "--out_dir", seq2seq_run, "--start", "ab\u2028c\nhij")
    assert code == 0 and calls[-1][0] == ["ab\u2028c", "hij"]
    # the recipe's seq2seq.beam_size / alpha ("for translating (sample.py)") where no flag says (never read)
    saved = (seq2seq_run / "config.json").read_text()
    recipe = {**json.loads(saved), "seq2seq": {"beam_size": 2, "alpha": 1.5}}
    (seq2seq_run / "config.json").write_text(json.dumps(recipe))
    try:
        assert run(capsys, *args[:-6])[0] == 0 and calls[-1][1] == dict(
            beam_size=2, alpha=1.5, truncate=False
        )
        assert run(capsys, *args[:-6], "--beam_size", 5)[0] == 0 and calls[-1][1]["beam_size"] == 5
        # a recipe's alpha written as an int must not make --alpha 0.5 an int (it became 0)
        (seq2seq_run / "config.json").write_text(json.dumps({**recipe, "seq2seq": {"alpha": 1}}))
        assert run(capsys, *args[:-6], "--alpha", 0.5)[0] == 0 and calls[-1][1]["alpha"] == 0.5
    finally:
        (seq2seq_run / "config.json").write_text(saved)


def test_seq2seq_long_source_errors_or_truncates(seq2seq_run, capsys):
    args = ["--out_dir", seq2seq_run, "--start", "abcdefghijabc", "--beam_size", 1]
    code, out, err = run(capsys, *args)
    assert code == 1 and out == "" and err.startswith("error: line 1 has 13 tokens") and "truncate" in err
    assert len(err.strip().splitlines()) == 1
    code, out, err = run(capsys, *args, "--truncate")
    assert code == 0 and len(out.splitlines()) == 1 and "warning: line 1 cut to 9 tokens" in err
    assert out == run(capsys, "--out_dir", seq2seq_run, "--start", "abcdefghi", "--beam_size", 1)[1]


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "is a seq2seq run: give the sources with --start or --prompts_file"),
        (["--start", "  \n"], "has no non-blank line to translate"),
        (["--start", "abc", "--attention_png", "a.png"], "--attention_png draws GPT self-attention"),
        (["--start", "abc", "--beam_size", "0"], "beam_size 0"),  # flaxgpt.decode.beam_search's own words
        (["--start", "abc", "--beam_size", "-2"], "beam_size -2 must be >= 1"),  # (a JAX TypeError once)
        (["--start", "abc", "--alpha", "-1"], "alpha -1.0 must be >= 0"),
    ],
)
def test_seq2seq_bad_input_is_one_line(seq2seq_run, capsys, args, message):
    code, out, err = run(capsys, "--out_dir", seq2seq_run, *args)
    assert code == 1 and out == "" and err.startswith("error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_attention_png_then_sampling(gpt_run, tmp_path, capsys):
    png = tmp_path / "attn.png"
    args = ["--out_dir", gpt_run, "--start", "ROMEO:", "--max_new_tokens", 10, "--seed", 3]
    plain = run(capsys, *args)[1]
    code, out, err = run(capsys, *args, "--attention_png", png, "--layers", "0,1", "--heads", "-1")
    assert code == 0 and out == plain, err  # the map changes nothing about the sample
    assert f"written to {png}" in err and png.read_bytes()[:8] == PNG_SIGNATURE


def test_attention_png_alone(gpt_run, tmp_path, capsys):
    png = tmp_path / "only.png"
    args = ["--out_dir", gpt_run, "--start", "abc", "--max_new_tokens", 0, "--attention_png", png]
    code, out, err = run(capsys, *args)
    assert code == 0 and out == "" and png.read_bytes()[:8] == PNG_SIGNATURE, err
    # an empty prompt is drawn from the token sampling starts from (it said "starting from '\\n'",
    # then refused the map: "the prompt is empty")
    code, _, err = run(capsys, *args[:3], "", *args[4:-1], tmp_path / "empty.png")
    assert code == 0 and (tmp_path / "empty.png").read_bytes()[:8] == PNG_SIGNATURE, err
    code, out, err = run(capsys, *args[:-1], tmp_path / "bad.png", "--layers", "5")
    assert code == 1 and err.startswith("error: bad layer '5'") and len(err.strip().splitlines()) == 1, err
    code, _, err = run(capsys, "--out_dir", gpt_run, "--max_new_tokens", 0)
    assert code == 1 and "0 with --attention_png" in err
    (tmp_path / "latin.txt").write_bytes(b"\xe9t\xe9\n")  # a prompt file that is not UTF-8: named
    code, _, err = run(capsys, "--out_dir", gpt_run, "--start", f"FILE:{tmp_path / 'latin.txt'}")
    assert code == 1 and "latin.txt: not UTF-8 text (" in err and len(err.strip().splitlines()) == 1, err
