"""Batches: pure in (seed, step, process), windows never past the end, global arrays, errors;
parallel text padded and grouped by length."""

import json

import jax
import numpy as np
import pytest

from flaxgpt import sharding
from flaxgpt.data import batches as data
from flaxgpt.data import prepare_seq2seq
from flaxgpt.data.tokenizers import BOS_ID, EOS_ID, PAD_ID


def _dataset(tmp_path, n_train=500, n_val=100, vocab=50):
    rng = np.random.default_rng(0)
    for name, n in (("train", n_train), ("val", n_val)):
        rng.integers(0, vocab, n).astype(np.uint16).tofile(tmp_path / f"{name}.bin")
    meta = {"vocab_size": vocab, "dtype": "uint16", "tokenizer": {"kind": "char", "chars": []}}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    return data.TokenData(tmp_path)


def test_batches_are_deterministic_in_seed_step_process():
    tokens = np.arange(1000, dtype=np.uint16)
    b = data.get_batch(tokens, 16, 4, seed=1, step=7, process_index=0)
    np.testing.assert_array_equal(b["inputs"], data.get_batch(tokens, 16, 4, 1, 7, 0)["inputs"])
    for other in ((2, 7), (1, 8)):
        assert not np.array_equal(b["inputs"], data.get_batch(tokens, 16, 4, *other)["inputs"])
    # two processes' rows are one process's batch cut in two: any host count sees the same data
    whole = data.get_batch(tokens, 16, 8, 1, 7)["inputs"]
    halves = [data.get_batch(tokens, 16, 4, 1, 7, i, process_count=2)["inputs"] for i in range(2)]
    np.testing.assert_array_equal(np.concatenate(halves), whole)
    np.testing.assert_array_equal(whole[:4], b["inputs"])  # one process draws as it did
    assert b["inputs"].shape == (4, 16) and b["inputs"].dtype == np.int32
    np.testing.assert_array_equal(b["targets"][:, :-1], b["inputs"][:, 1:])  # shifted by one
    np.testing.assert_array_equal(b["targets"], b["inputs"] + 1)  # contiguous windows


def test_sampler_never_reads_past_the_end():
    T = 8
    tokens = np.arange(T + 3, dtype=np.uint16)  # only 2 valid window starts: 0, 1, 2 -> 0..2
    seen = set()
    for step in range(200):
        b = data.get_batch(tokens, T, 5, seed=0, step=step)
        assert b["targets"].max() <= len(tokens) - 1
        seen.update(b["inputs"][:, 0].tolist())
    assert seen == {0, 1, 2}  # every valid start is drawn, none beyond
    exact = np.arange(T + 1, dtype=np.uint16)  # exactly block_size + 1 tokens: one window
    assert data.get_batch(exact, T, 3, 0, 0)["inputs"][:, 0].tolist() == [0, 0, 0]


def test_errors_for_missing_short_and_wide_data(tmp_path):
    with pytest.raises(FileNotFoundError, match="flaxgpt prepare"):
        data.TokenData(tmp_path / "nothing")
    d = _dataset(tmp_path, n_train=40, n_val=100, vocab=50)
    with pytest.raises(ValueError, match="train.bin has 40 tokens.*block_size"):
        d.check(block_size=64, model_vocab_size=100)
    with pytest.raises(ValueError, match=r"vocabulary \(50\) is larger.*\(32\)"):
        d.check(block_size=16, model_vocab_size=32)
    d.check(block_size=16, model_vocab_size=64)


@pytest.mark.parametrize(
    "meta, message",
    [
        ("{not json", r"meta.json cannot be read \(JSONDecodeError"),
        ("[1, 2]", "meta.json holds a JSON list, not an object"),
        ('{"vocab_size": 50}', "meta.json has no 'dtype' entry"),
        ('{"dtype": "uint16"}', "meta.json has no 'vocab_size' entry"),
        ('{"dtype": "float99", "vocab_size": 50}', "meta.json: dtype 'float99' is not uint16 or uint32"),
        ('{"dtype": "float32", "vocab_size": 50}', "meta.json: dtype 'float32' is not uint16 or uint32"),
    ],
)
def test_garbage_meta_json_names_the_file(tmp_path, meta, message):
    _dataset(tmp_path)
    (tmp_path / "meta.json").write_text(meta)
    with pytest.raises(ValueError, match=message) as e:
        data.TokenData(tmp_path)
    assert str(tmp_path / "meta.json") in str(e.value) and "\n" not in str(e.value)


def test_token_files_are_checked_against_meta_json(tmp_path):
    _dataset(tmp_path, vocab=50)
    with open(tmp_path / "train.bin", "ab") as f:  # half a uint16 token
        f.write(b"\x01")
    with pytest.raises(ValueError, match="train.bin has 1001 bytes, not a multiple of 2"):
        data.TokenData(tmp_path)
    d = _dataset(tmp_path, vocab=50)  # meta.json records no counts: sizes only
    meta = {**d.meta, "train_tokens": 500, "val_tokens": 99}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="val.bin has 100 tokens but meta.json says 99"):
        data.TokenData(tmp_path)
    _dataset(tmp_path, vocab=50)
    tokens = np.fromfile(tmp_path / "train.bin", np.uint16)
    tokens[321] = 77  # an id past the vocabulary: not "lower the learning rate" at step 1000
    tokens.tofile(tmp_path / "train.bin")
    with pytest.raises(ValueError, match="train.bin holds token id 77 .first at token 321. but meta.json's "):
        data.TokenData(tmp_path)


def test_micro_split_and_global_array():
    tokens = np.arange(5000, dtype=np.uint16)
    b = data.get_batch(tokens, 4, 32, 0, 0)
    m = data.split_micro(b, 4)
    assert m["inputs"].shape == (4, 8, 4)
    np.testing.assert_array_equal(m["inputs"][1], b["inputs"][8:16])
    mesh = sharding.make_mesh(-1, 1)
    g = data.to_global(m, sharding.batch_sharding(mesh, leading_axes=1), batch_axis=1)
    assert g["inputs"].shape == (4, 8, 4) and len(g["inputs"].addressable_shards) == jax.device_count()
    np.testing.assert_array_equal(np.asarray(g["inputs"]), m["inputs"])


# ---- parallel text (the encoder-decoder)


@pytest.fixture(scope="module")
def reverse_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("d") / "rev"
    prepare_seq2seq.main(["--task", "reverse", "--out_dir", str(out), "--n_train", "2000", "--n_val", "50"])
    return out


def test_batches_are_pure_functions_of_seed_and_step(reverse_dir):
    pairs = data.ParallelData(reverse_dir, "train")
    a = data.Batcher(pairs, 32, seed=3, src_len=13, tgt_len=13)
    first = [a.batch(s) for s in (0, 5, 70, 5)]  # 62 batches per epoch: 70 is in the second epoch
    b = data.Batcher(pairs, 32, seed=3, src_len=13, tgt_len=13)  # a fresh one, e.g. after a restart
    for step, want in zip((0, 5, 70, 5), first):
        for key, value in b.batch(step).items():
            np.testing.assert_array_equal(value, want[key])
    np.testing.assert_array_equal(first[1]["src"], first[3]["src"])
    assert not np.array_equal(data.Batcher(pairs, 32, 4, 13, 13).batch(5)["src"], first[1]["src"])
    # processes each take their own slice of the same global batch
    halves = [a.batch(5, process_index=p, process_count=2) for p in (0, 1)]
    np.testing.assert_array_equal(np.concatenate([h["src"] for h in halves]), first[1]["src"])
    # every pair appears once per epoch
    rows = np.concatenate([a.rows(s) for s in range(a.n_per_epoch)])
    assert len(set(rows.tolist())) == len(rows) == a.n_per_epoch * 32


def test_batch_layout_and_length_grouping(reverse_dir):
    pairs = data.ParallelData(reverse_dir, "train")
    b = data.Batcher(pairs, 16, seed=0, src_len=13, tgt_len=13).batch(2)
    for r in range(16):
        n = b["src_lengths"][r]
        assert b["src"][r, n - 1] == EOS_ID and np.all(b["src"][r, n:] == PAD_ID)
        m = int(b["loss_mask"][r].sum())
        assert b["inputs"][r, 0] == BOS_ID and b["targets"][r, m - 1] == EOS_ID
        np.testing.assert_array_equal(b["inputs"][r, 1:m], b["targets"][r, : m - 1])
    # grouping: lengths within a batch vary far less than across the data
    lengths = np.maximum(pairs.src_lengths, pairs.tgt_lengths)
    order = data.epoch_order(lengths, 16, seed=0, epoch=0)
    assert np.mean(np.ptp(lengths[order], axis=1)) < 0.25 * np.ptp(lengths)
    bucketed = data.Batcher(pairs, 16, seed=0, src_len=13, tgt_len=13, bucket=4).batch(2)
    assert bucketed["src"].shape[1] % 4 == 0 or bucketed["src"].shape[1] == 13
    assert bucketed["src"].shape[1] <= 13


def test_eval_rows_cover_the_split_once():
    rows, keep = zip(*(data.eval_rows(10, 4, i) for i in range(3)))
    rows, keep = np.concatenate(rows), np.concatenate(keep)
    assert sorted(rows[keep > 0].tolist()) == list(range(10)) and keep.sum() == 10


def test_parallel_files_are_checked_against_meta_json(reverse_dir, tmp_path):
    import shutil

    bad = tmp_path / "rev"
    shutil.copytree(reverse_dir, bad)
    src = np.fromfile(bad / "val.src.bin", np.uint16)
    src[5] = 500  # past the vocabulary
    src.tofile(bad / "val.src.bin")
    with pytest.raises(ValueError, match="val.src.bin holds token id 500"):
        data.ParallelData(bad, "val")
    src[:-1].tofile(bad / "val.src.bin")  # one token short of the offsets
    with pytest.raises(ValueError, match="val.src.bin has .* tokens but val.idx.npy says"):
        data.ParallelData(bad, "val")
