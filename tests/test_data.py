"""Batches: pure in (seed, step, process), windows never past the end, global arrays, errors."""

import json

import jax
import numpy as np
import pytest

from flaxgpt import data, sharding


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
    for other in ((2, 7, 0), (1, 8, 0), (1, 7, 1)):
        assert not np.array_equal(b["inputs"], data.get_batch(tokens, 16, 4, *other)["inputs"])
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
    with pytest.raises(FileNotFoundError, match="python -m flaxgpt.prepare"):
        data.TokenData(tmp_path / "nothing")
    d = _dataset(tmp_path, n_train=40, n_val=100, vocab=50)
    with pytest.raises(ValueError, match="train.bin has 40 tokens.*block_size"):
        d.check(block_size=64, model_vocab_size=100)
    with pytest.raises(ValueError, match=r"vocabulary \(50\) is larger.*\(32\)"):
        d.check(block_size=16, model_vocab_size=32)
    d.check(block_size=16, model_vocab_size=64)


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
