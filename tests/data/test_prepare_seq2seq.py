"""flaxgpt.data.prepare_seq2seq: reading parallel text, bad input, the synthetic tasks, token files."""

import json

import pytest

from flaxgpt.data import prepare_seq2seq as ps
from flaxgpt.data.batches import ParallelData
from flaxgpt.data.prepare import PrepareError
from flaxgpt.data.tokenizers import CharTokenizer, Seq2SeqTokenizer


def test_number_to_words_matches_hand_written_references():
    cases = {
        0: "zero",
        7: "seven",
        13: "thirteen",
        20: "twenty",
        34: "thirty-four",
        100: "one hundred",
        105: "one hundred five",
        1234: "one thousand two hundred thirty-four",
        90000: "ninety thousand",
        100001: "one hundred thousand one",
        999999: "nine hundred ninety-nine thousand nine hundred ninety-nine",
        2000000: "two million",
        1000000042: "one billion forty-two",
    }
    for n, words in cases.items():
        assert ps.number_to_words(n) == words


def test_synthetic_tasks_hold_out_their_validation_inputs():
    for task in ("reverse", "numbers"):
        train, val, base = ps.synthetic_split(task, 3000, 300, seed=0)
        assert len(train) == 3000 and len(val) == 300
        assert not {s for s, _ in train} & {s for s, _ in val}
        tok = Seq2SeqTokenizer(base)
        for s, t in train[:50] + val[:50]:  # every character of every pair is in the fixed alphabet
            assert tok.decode(tok.encode(t)) == t and tok.decode(tok.encode(s)) == s
    assert all(t == s[::-1] for s, t in ps.reverse_pairs(100, 3))


def test_tsv_errors_name_the_line(tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_text("hello\tbonjour\n\nno tab here\n")
    with pytest.raises(PrepareError, match=r"pairs.tsv:3 has no tab"):
        ps.read_tsv(path)
    path.write_text("hello\tbonjour\n\tvide\n")
    pairs = ps.read_tsv(path)
    tok = Seq2SeqTokenizer(CharTokenizer.from_text("hellobonjurvide"))
    with pytest.raises(PrepareError, match=r"pairs.tsv:2: empty source"):
        ps.encode_pairs(pairs, tok, 32, truncate=False)
    (tmp_path / "a.txt").write_text("x\ny\n")
    (tmp_path / "b.txt").write_text("x\n")
    with pytest.raises(PrepareError, match="has 2 lines but .* has 1"):
        ps.read_aligned(tmp_path / "a.txt", tmp_path / "b.txt")


def test_too_long_pairs_are_an_error_or_truncated_with_a_warning():
    tok = Seq2SeqTokenizer(CharTokenizer(list("ab")))
    pairs = [("ab", "ba"), ("abababab", "b", "f.tsv:7")]
    with pytest.raises(PrepareError, match=r"f.tsv:7: 8 tokens, more than max_len - 1 = 4"):
        ps.encode_pairs(pairs, tok, 5, truncate=False)
    with pytest.warns(UserWarning, match="truncated 1 of 2 pairs"):
        src, tgt = ps.encode_pairs(pairs, tok, 5, truncate=True)
    assert [len(s) for s in src] == [2, 4] and tgt[1] == [4]


def test_cli_prepares_tsv_and_refuses_to_overwrite(tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_text("".join(f"{'ab' * (i % 5 + 1)}\t{'c' * (i % 3 + 1)}\n" for i in range(40)))
    out = tmp_path / "data"
    meta = ps.main(["--task", "tsv", "--input", str(path), "--out_dir", str(out), "--val_fraction", "0.1"])
    assert meta["train_pairs"] == 36 and meta["val_pairs"] == 4
    assert meta["max_src_len"] == 11 and meta["max_tgt_len"] == 4  # 10 chars + EOS, 3 chars + BOS/EOS
    data = ParallelData(out, "train")
    tok = Seq2SeqTokenizer.from_meta(json.loads((out / "meta.json").read_text())["tokenizer"])
    for i in (0, 7, 35):
        s, t = data.pair(i)
        assert (tok.decode(s), tok.decode(t)) == ("ab" * (i % 5 + 1), "c" * (i % 3 + 1))
    with pytest.raises(PrepareError, match="pass --overwrite"):
        ps.main(["--task", "tsv", "--input", str(path), "--out_dir", str(out)])


def test_hf_translation_data_offline_is_a_clear_error(tmp_path, monkeypatch):
    import types

    fake = types.ModuleType("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach the Hugging Face Hub")

    fake.load_dataset = offline
    monkeypatch.setitem(__import__("sys").modules, "datasets", fake)
    with pytest.raises(PrepareError, match="could not load Hugging Face dataset 'wmt14'/'de-en'.*network"):
        ps.main(["--task", "hf", "--tokenizer", "gpt2", "--out_dir", str(tmp_path / "wmt")])
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)  # not installed
    with pytest.raises(PrepareError, match="pip install"):
        ps.main(["--task", "hf", "--tokenizer", "gpt2", "--out_dir", str(tmp_path / "wmt")])


def test_extra_tabs_non_utf8_and_nonsense_counts_are_refused(tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_text("hello\tbonjour\nhow are\tyou\tcomment vas-tu\n")
    with pytest.raises(PrepareError, match=r"pairs.tsv:2 has 2 tabs; .* exactly one tab"):
        ps.read_tsv(path)
    path.write_bytes("hello\tbonjour\ncaf\u00e9\tcaf\u00e9\n".encode("latin-1"))
    with pytest.raises(PrepareError, match=r"pairs.tsv is not UTF-8 text: byte 17 \(line 2\) is 0xe9"):
        ps.main(["--task", "tsv", "--input", str(path), "--out_dir", str(tmp_path / "d")])
    (tmp_path / "b.txt").write_bytes(b"ok\n\xff\n")
    with pytest.raises(PrepareError, match=r"b.txt is not UTF-8 text: byte 3 \(line 2\)"):
        ps.read_aligned(tmp_path / "b.txt", tmp_path / "b.txt")
    for flag, value in (("--n_train", "-5"), ("--n_val", "0"), ("--max_len", "1"), ("--val_fraction", "0")):
        with pytest.raises(PrepareError, match=f"{flag} must be"):
            ps.main(["--task", "reverse", flag, value, "--out_dir", str(tmp_path / "d")])
    # more distinct strings than 2 characters over 10 letters make (110): it looped forever; a number
    # past the billions words cannot say (an OverflowError traceback at 10**20)
    for args, says in (
        (["--task", "reverse", "--max_chars", "2", "--n_train", "100", "--n_val", "11"], "make only 110"),
        (["--task", "numbers", "--max_value", str(10**20)], "--max_value must be below 10\\*\\*12"),
    ):
        with pytest.raises(PrepareError, match=says):
            ps.main([*args, "--out_dir", str(tmp_path / "d")])
    assert not (tmp_path / "d").exists()
