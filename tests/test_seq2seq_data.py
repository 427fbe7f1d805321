"""Parallel text: reading, bad input, the synthetic tasks, token files, and pure length-grouped batches."""

import json

import numpy as np
import pytest

from flaxgpt import seq2seq_data as sd
from flaxgpt.prepare import PrepareError
from flaxgpt.tokenizers import CharTokenizer


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
        assert sd.number_to_words(n) == words


def test_synthetic_tasks_hold_out_their_validation_inputs():
    for task in ("reverse", "numbers"):
        train, val, base = sd.synthetic_split(task, 3000, 300, seed=0)
        assert len(train) == 3000 and len(val) == 300
        assert not {s for s, _ in train} & {s for s, _ in val}
        tok = sd.Seq2SeqTokenizer(base)
        for s, t in train[:50] + val[:50]:  # every character of every pair is in the fixed alphabet
            assert tok.decode(tok.encode(t)) == t and tok.decode(tok.encode(s)) == s
    assert all(t == s[::-1] for s, t in sd.reverse_pairs(100, 3))


def test_tokenizer_reserves_pad_bos_eos_and_decodes_up_to_eos():
    tok = sd.Seq2SeqTokenizer(CharTokenizer(list("abc")))
    assert tok.vocab_size == 6 and tok.encode("cab") == [5, 3, 4]
    assert tok.decode([sd.BOS_ID, 5, 3, sd.EOS_ID, 4, 4]) == "ca"
    assert tok.decode([5, sd.PAD_ID, 4]) == "cb"
    assert sd.Seq2SeqTokenizer.from_meta(tok.to_meta()).decode([3, 4]) == "ab"
    with pytest.raises(ValueError, match="not a seq2seq vocabulary"):
        sd.Seq2SeqTokenizer.from_meta({"kind": "char", "chars": ["a"]})


def test_tsv_errors_name_the_line(tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_text("hello\tbonjour\n\nno tab here\n")
    with pytest.raises(PrepareError, match=r"pairs.tsv:3 has no tab"):
        sd.read_tsv(path)
    path.write_text("hello\tbonjour\n\tvide\n")
    pairs = sd.read_tsv(path)
    tok = sd.Seq2SeqTokenizer(CharTokenizer.from_text("hellobonjurvide"))
    with pytest.raises(PrepareError, match=r"pairs.tsv:2: empty source"):
        sd.encode_pairs(pairs, tok, 32, truncate=False)
    (tmp_path / "a.txt").write_text("x\ny\n")
    (tmp_path / "b.txt").write_text("x\n")
    with pytest.raises(PrepareError, match="has 2 lines but .* has 1"):
        sd.read_aligned(tmp_path / "a.txt", tmp_path / "b.txt")


def test_too_long_pairs_are_an_error_or_truncated_with_a_warning():
    tok = sd.Seq2SeqTokenizer(CharTokenizer(list("ab")))
    pairs = [("ab", "ba"), ("abababab", "b", "f.tsv:7")]
    with pytest.raises(PrepareError, match=r"f.tsv:7: 8 tokens, more than max_len - 1 = 4"):
        sd.encode_pairs(pairs, tok, 5, truncate=False)
    with pytest.warns(UserWarning, match="truncated 1 of 2 pairs"):
        src, tgt = sd.encode_pairs(pairs, tok, 5, truncate=True)
    assert [len(s) for s in src] == [2, 4] and tgt[1] == [4]


def test_cli_prepares_tsv_and_refuses_to_overwrite(tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_text("".join(f"{'ab' * (i % 5 + 1)}\t{'c' * (i % 3 + 1)}\n" for i in range(40)))
    out = tmp_path / "data"
    meta = sd.main(["--task", "tsv", "--input", str(path), "--out_dir", str(out), "--val_fraction", "0.1"])
    assert meta["train_pairs"] == 36 and meta["val_pairs"] == 4
    assert meta["max_src_len"] == 11 and meta["max_tgt_len"] == 4  # 10 chars + EOS, 3 chars + BOS/EOS
    data = sd.ParallelData(out, "train")
    tok = sd.Seq2SeqTokenizer.from_meta(json.loads((out / "meta.json").read_text())["tokenizer"])
    for i in (0, 7, 35):
        s, t = data.pair(i)
        assert (tok.decode(s), tok.decode(t)) == ("ab" * (i % 5 + 1), "c" * (i % 3 + 1))
    with pytest.raises(PrepareError, match="pass --overwrite"):
        sd.main(["--task", "tsv", "--input", str(path), "--out_dir", str(out)])


@pytest.fixture(scope="module")
def reverse_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("d") / "rev"
    sd.main(["--task", "reverse", "--out_dir", str(out), "--n_train", "2000", "--n_val", "50"])
    return out


def test_batches_are_pure_functions_of_seed_and_step(reverse_dir):
    data = sd.ParallelData(reverse_dir, "train")
    a = sd.Batcher(data, 32, seed=3, src_len=13, tgt_len=13)
    first = [a.batch(s) for s in (0, 5, 70, 5)]  # 62 batches per epoch: 70 is in the second epoch
    b = sd.Batcher(data, 32, seed=3, src_len=13, tgt_len=13)  # a fresh one, e.g. after a restart
    for step, want in zip((0, 5, 70, 5), first):
        for key, value in b.batch(step).items():
            np.testing.assert_array_equal(value, want[key])
    np.testing.assert_array_equal(first[1]["src"], first[3]["src"])
    assert not np.array_equal(sd.Batcher(data, 32, 4, 13, 13).batch(5)["src"], first[1]["src"])
    # processes each take their own slice of the same global batch
    halves = [a.batch(5, process_index=p, process_count=2) for p in (0, 1)]
    np.testing.assert_array_equal(np.concatenate([h["src"] for h in halves]), first[1]["src"])
    # every pair appears once per epoch
    rows = np.concatenate([a.rows(s) for s in range(a.n_per_epoch)])
    assert len(set(rows.tolist())) == len(rows) == a.n_per_epoch * 32


def test_batch_layout_and_length_grouping(reverse_dir):
    data = sd.ParallelData(reverse_dir, "train")
    b = sd.Batcher(data, 16, seed=0, src_len=13, tgt_len=13).batch(2)
    for r in range(16):
        n = b["src_lengths"][r]
        assert b["src"][r, n - 1] == sd.EOS_ID and np.all(b["src"][r, n:] == sd.PAD_ID)
        m = int(b["loss_mask"][r].sum())
        assert b["inputs"][r, 0] == sd.BOS_ID and b["targets"][r, m - 1] == sd.EOS_ID
        np.testing.assert_array_equal(b["inputs"][r, 1:m], b["targets"][r, : m - 1])
    # grouping: lengths within a batch vary far less than across the data
    lengths = np.maximum(data.src_lengths, data.tgt_lengths)
    order = sd.epoch_order(lengths, 16, seed=0, epoch=0)
    assert np.mean(np.ptp(lengths[order], axis=1)) < 0.25 * np.ptp(lengths)
    bucketed = sd.Batcher(data, 16, seed=0, src_len=13, tgt_len=13, bucket=4).batch(2)
    assert bucketed["src"].shape[1] % 4 == 0 or bucketed["src"].shape[1] == 13
    assert bucketed["src"].shape[1] <= 13


def test_eval_rows_cover_the_split_once():
    rows, keep = zip(*(sd.eval_rows(10, 4, i) for i in range(3)))
    rows, keep = np.concatenate(rows), np.concatenate(keep)
    assert sorted(rows[keep > 0].tolist()) == list(range(10)) and keep.sum() == 10


def test_hf_translation_data_offline_is_a_clear_error(tmp_path, monkeypatch):
    import types

    fake = types.ModuleType("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach the Hugging Face Hub")

    fake.load_dataset = offline
    monkeypatch.setitem(__import__("sys").modules, "datasets", fake)
    with pytest.raises(PrepareError, match="could not load Hugging Face dataset 'wmt14'/'de-en'.*network"):
        sd.main(["--task", "hf", "--tokenizer", "gpt2", "--out_dir", str(tmp_path / "wmt")])
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)  # not installed
    with pytest.raises(PrepareError, match="pip install"):
        sd.main(["--task", "hf", "--tokenizer", "gpt2", "--out_dir", str(tmp_path / "wmt")])
