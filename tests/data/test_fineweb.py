"""The speedrun's token shards: format and errors, batches (consecutive or from document starts),
the fixed val set, and preparing shards from a small local dataset (multiprocess, resumable)."""

import json

import numpy as np
import pytest

from flaxgpt.data import fineweb, prepare
from flaxgpt.data.fineweb import BOS_ID, ShardData, ShardError, read_shard, write_shard


def documents(n, seed=0, vocab=1000):
    """n documents of 3..40 tokens, each starting with <|endoftext|>."""
    rng = np.random.default_rng(seed)
    return [np.r_[BOS_ID, rng.integers(0, vocab, rng.integers(2, 40))] for _ in range(n)]


@pytest.fixture
def shards(tmp_path):
    train = [np.concatenate(documents(60, seed=s)) for s in (1, 2)]
    val = np.concatenate(documents(40, seed=3))
    write_shard(tmp_path / "fineweb_val_000000.bin", val)
    for i, tokens in enumerate(train, 1):
        write_shard(tmp_path / f"fineweb_train_{i:06d}.bin", tokens)
    with pytest.raises(
        ShardError, match="has shards but no meta.json; .* python -m flaxgpt.data.fineweb --write_meta"
    ):
        ShardData(tmp_path, block_size=8, val_tokens=200)
    fineweb.main(["--write_meta", str(tmp_path)])
    return tmp_path, train, val


def test_shard_round_trip_and_one_line_errors(tmp_path):
    path = tmp_path / "a.bin"
    write_shard(path, np.arange(100))
    np.testing.assert_array_equal(read_shard(path), np.arange(100))
    header = np.fromfile(path, np.int32, 256)
    assert list(header[:3]) == [20240520, 1, 100] and not header[3:].any()
    assert path.stat().st_size == 1024 + 200
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(
        ShardError, match=r"a.bin is truncated: its header says 100 tokens but the file holds 50;"
    ):
        read_shard(path)
    path.write_bytes(data[:1000])
    with pytest.raises(ShardError, match="shorter than the 1024-byte header"):
        read_shard(path)
    path.write_bytes(np.int32(20240521).tobytes() + data[4:])
    with pytest.raises(ShardError, match="^.*a.bin is not a token shard: magic 20240521, expected 20240520$"):
        read_shard(path)
    with pytest.raises(ShardError, match="must fit uint16"):
        write_shard(path, [70000])


def test_consecutive_windows_follow_the_step_and_the_process(shards):
    d, train, val = shards
    data = ShardData(d, block_size=8, val_tokens=200)
    b = data.batch("train", 2, n_rows=4)  # rows 8..11 of the first shard
    first = train[0]
    for r in range(4):
        g = 8 + r
        np.testing.assert_array_equal(b["inputs"][r], first[g * 8 : g * 8 + 8])
        np.testing.assert_array_equal(b["targets"][r], first[g * 8 + 1 : g * 8 + 9])
    # two processes with 2 rows each read the 4 rows of one process, in process order
    halves = [ShardData(d, 8, val_tokens=200).batch("train", 2, 2, p, process_count=2) for p in (0, 1)]
    np.testing.assert_array_equal(np.concatenate([h["inputs"] for h in halves]), b["inputs"])
    # past the first shard the second follows; past the last, the first again
    n0, n1 = (len(first) - 9) // 8 + 1, (len(train[1]) - 9) // 8 + 1
    np.testing.assert_array_equal(data.batch("train", n0, 1)["inputs"][0], train[1][:8])
    np.testing.assert_array_equal(data.batch("train", n0 + n1, 1)["inputs"][0], first[:8])


def test_windows_from_document_starts(shards):
    d, train, _ = shards
    data = ShardData(d, block_size=16, align_to_bos=True, val_tokens=200)
    rows = data.batch("train", 0, 20)["inputs"]
    starts = fineweb.window_starts(train[0], 16, align_to_bos=True)[:20]
    for row, start in zip(rows, starts):
        np.testing.assert_array_equal(row, train[0][start : start + 16])
    assert (rows[:, 0] == BOS_ID).all()
    bos = np.flatnonzero(train[0] == BOS_ID)
    for a, b in zip(starts, starts[1:]):  # the first document after each window: none read twice
        assert b == bos[bos >= a + 16][0]


def test_the_fixed_val_set(shards):
    d, _, val = shards
    data = ShardData(d, block_size=10, val_tokens=200)
    assert data.val_rows == 20
    targets = np.concatenate([data.batch("val", i, 5)["targets"].ravel() for i in range(4)])
    np.testing.assert_array_equal(targets, val[1:201])  # the first val_tokens tokens, each scored once
    with pytest.raises(ShardError, match=f"hold {len(val):,} tokens, fewer than val_tokens"):
        ShardData(d, block_size=10, val_tokens=len(val))
    with pytest.raises(ShardError, match="no train shards"):
        ShardData(d / "nowhere", block_size=10)


def test_prepare_from_a_local_dataset_resumes_where_it_stopped(tmp_path):
    from flaxgpt.data.tokenizers import get_tokenizer

    texts = [f"Document {i}: " + "the quick brown fox " * (i % 7 + 1) for i in range(60)]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    kw = dict(hf_name="json", hf_config=None, data_files=str(src), shard_tokens=300, print_fn=lambda *a: None)
    out = tmp_path / "fw"
    fineweb.prepare_fineweb(out, max_shards=2, **kw)  # stopped after two shards ...
    assert sorted(p.name for p in out.glob("*.bin")) == [
        f"fineweb_{s}.bin" for s in ("train_000001", "val_000000")
    ]
    # ... and the command line (2 tokenizer processes) finishes the job
    args = f"--dataset fineweb --hf_name json --hf_data_files {src} --shard_tokens 300 --num_proc 2"
    done = prepare.main([*args.split(), "--out_dir", str(out)])
    assert done["complete"] and done["docs"] == 60

    # what an uninterrupted run writes: <|endoftext|> + tokens per document, in order, each shard
    # closed before the document that would overflow 300 tokens
    enc = get_tokenizer("gpt2").enc
    want, shard = [], []
    for t in texts:
        ids = [BOS_ID, *enc.encode_ordinary(t)]
        if shard and len(shard) + len(ids) > 300:
            want.append(shard)
            shard = []
        shard += ids
    want.append(shard)
    shards = sorted(out.glob("*.bin"), key=lambda p: p.stem[-6:])  # val 0, train 1, train 2, ...
    assert [p.name for p in shards][:2] == ["fineweb_val_000000.bin", "fineweb_train_000001.bin"]
    assert len(shards) == len(want) == done["shards"]
    for path, tokens in zip(shards, want):
        np.testing.assert_array_equal(read_shard(path), tokens)
    assert json.loads((out / "meta.json").read_text())["tokens"] == sum(map(len, want))
    with pytest.raises(ShardError, match="holds shards of"):
        fineweb.prepare_fineweb(out, **{**kw, "shard_tokens": 500})


def test_the_trainer_on_shards(shards):
    from pathlib import Path

    import jax

    from flaxgpt.train import trainer
    from tests.train.test_trainer import tiny_config

    d, train, _ = shards
    cfg = tiny_config(d, max_iters=3, eval_interval=3, eval_iters=5, batch_size=8, model__block_size=8)
    cfg.data.format, cfg.data.val_tokens = "shards", 320  # 40 windows of 8: 5 batches of 8 rows
    t = trainer.Trainer(cfg, devices=jax.devices()[:2], print_fn=lambda *a: None)
    assert t.task.model_config.vocab_size == 50257 and t.task.splits == ("val",)
    b = jax.device_get(t.global_batch("train", 1, 8, micro=True))
    np.testing.assert_array_equal(b["inputs"][0, 0], train[0][64:72])  # step 1 = windows 8..15
    t.write_run_files()
    out = t.run(t.init_state())
    assert np.isfinite(out["val_loss"]) and "train_loss" not in out
    assert json.loads((Path(cfg.out_dir) / "meta.json").read_text())["tokenizer"]["name"] == "gpt2"
    t.close()
