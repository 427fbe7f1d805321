"""The modded-nanogpt speedrun's token shards: reading, batching, and writing them from FineWeb.

    flaxgpt prepare --dataset fineweb --out_dir data/fineweb10B       # HF datasets, streamed
    python -m flaxgpt.data.fineweb --write_meta data/fineweb10B    # meta.json beside shards made elsewhere
    data = ShardData("data/fineweb10B")                                          # *_train_*.bin, *_val_*.bin
    batch = data.batch("train", step, n_rows=8, block_size=1024, process_index=0)  # {"inputs", "targets"}
    val = data.batch("val", i, 8, 1024)        # row r of the fixed val set (the first 10,485,760 val tokens)

A shard (llm.c's and the speedrun's format): a header of 256 int32 (magic 20240520, version 1, the
token count, zeros), then the tokens as uint16. Every document starts with <|endoftext|> (50256).

Batches are pure functions of (split, step, rows, process): row g of the whole run (g = step * global
rows + this process's offset + r) is the g-th window of block_size + 1 tokens of the shards read in
order (inputs = window[:-1], targets = window[1:]). Windows follow each other (the last token of one
is the first of the next, as llm.c and the speedrun cut them), or with align_to_bos=True each window
starts at a document's first token: the next document that starts at or after the end of the previous
window (a document longer than a window loses its tail, as the speedrun's BOS-aligned loader does).
A run resumed at step k therefore reads exactly what it would have read; after the last shard the
train windows start again from the first. Validation is always the first `val_tokens` tokens of the
val shards, cut into consecutive windows (10,485,760 = the speedrun's fixed set).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np

MAGIC, VERSION, HEADER_INTS = 20240520, 1, 256
HEADER_BYTES = 4 * HEADER_INTS
BOS_ID = 50256  # GPT-2's <|endoftext|>, which begins every document
SPEEDRUN_VAL_TOKENS = 10_485_760
GPT2_META = {"vocab_size": 50257, "tokenizer": {"kind": "tiktoken", "name": "gpt2", "vocab_size": 50257}}


class ShardError(ValueError):
    """A shard that cannot be read; the message is one line and names the file."""


def write_shard(path: str | Path, tokens) -> None:
    """The header, then the tokens as uint16; written to path.tmp and renamed (never half a shard)."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise ShardError(f"{path}: token ids must fit uint16, got {tokens.min()}..{tokens.max()}")
    header = np.zeros(HEADER_INTS, np.int32)
    header[:3] = MAGIC, VERSION, len(tokens)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(np.uint16).tobytes())
    tmp.replace(path)


def read_shard(path: str | Path) -> np.ndarray:
    """The tokens of one shard, memory-mapped (uint16); a bad header or a short file is a ShardError."""
    path = Path(path)
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise ShardError(f"{path} is truncated: {size} bytes, shorter than the {HEADER_BYTES}-byte header")
    header = np.fromfile(path, dtype=np.int32, count=HEADER_INTS)
    if header[0] != MAGIC:
        raise ShardError(f"{path} is not a token shard: magic {header[0]}, expected {MAGIC}")
    if header[1] != VERSION:
        raise ShardError(f"{path} has shard version {header[1]}; this reader knows version {VERSION}")
    n, have = int(header[2]), (size - HEADER_BYTES) // 2
    if have < n:
        raise ShardError(
            f"{path} is truncated: its header says {n:,} tokens but the file holds {have:,}; "
            "download or prepare it again"
        )
    return np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER_BYTES, shape=(n,))


def window_starts(tokens: np.ndarray, block_size: int, align_to_bos: bool) -> np.ndarray:
    """Offsets of the windows of block_size + 1 tokens that one shard yields, in order."""
    last = len(tokens) - block_size - 1  # the last offset whose window fits
    if last < 0:
        return np.zeros(0, np.int64)
    if not align_to_bos:
        return np.arange(0, last + 1, block_size, dtype=np.int64)
    bos = np.flatnonzero(np.asarray(tokens) == BOS_ID)
    bos = bos[bos <= last]
    starts, i = [], 0
    while i < len(bos):  # greedy: the next document starting at or after this window's end
        starts.append(bos[i])
        i = int(np.searchsorted(bos, bos[i] + block_size, side="left"))
    return np.asarray(starts, np.int64)


class ShardStream:
    """The shards of one split read in order, as a sequence of windows of block_size + 1 tokens."""

    def __init__(self, paths: list[Path], block_size: int, align_to_bos: bool, limit: int | None = None):
        self.paths, self.T, self.align = paths, block_size, align_to_bos
        self.limit = limit  # only the first `limit` tokens (+1 for the last target) count
        self._shards: list[tuple[np.ndarray, np.ndarray]] = []  # (tokens, window starts), opened lazily
        self._ends: list[int] = []  # cumulative window counts

    def _open_next(self) -> bool:
        if len(self._shards) == len(self.paths):
            return False
        tokens = read_shard(self.paths[len(self._shards)])
        if self.limit is not None:
            before = sum(len(t) for t, _ in self._shards)
            tokens = tokens[: max(0, self.limit + 1 - before)]
        starts = window_starts(tokens, self.T, self.align)
        self._shards.append((tokens, starts))
        self._ends.append((self._ends[-1] if self._ends else 0) + len(starts))
        return True

    def __len__(self) -> int:
        while self._open_next():
            pass
        return self._ends[-1] if self._ends else 0

    def windows(self, rows: np.ndarray, wrap: bool) -> np.ndarray:
        """[n, T + 1] int32 windows of the given global row indices (modulo all windows if wrap)."""
        while (not self._ends or rows.max() >= self._ends[-1]) and self._open_next():
            pass  # shards are opened as the rows reach them: a run's start reads one shard
        total = self._ends[-1] if self._ends else 0
        if rows.max() >= total:
            if not wrap or total == 0:
                raise ShardError(
                    f"window {rows.max()} asked of the {total} windows of {self.T + 1} tokens in "
                    f"{', '.join(p.name for p in self.paths)}"
                )
            rows = rows % total
        out = np.empty((len(rows), self.T + 1), np.int32)
        for i, g in enumerate(rows):
            s = int(np.searchsorted(self._ends, g, side="right"))
            tokens, starts = self._shards[s]
            start = starts[g - (self._ends[s - 1] if s else 0)]
            out[i] = tokens[start : start + self.T + 1]
        return out


def shard_paths(data_dir: str | Path, split: str) -> list[Path]:
    paths = sorted(Path(data_dir).glob(f"*_{split}_*.bin"))
    if not paths:
        raise ShardError(
            f"no {split} shards (*_{split}_*.bin) in {data_dir}; "
            "prepare them with: flaxgpt prepare --dataset fineweb --out_dir " + str(data_dir)
        )
    return paths


class ShardData:
    """Train and val shards of one folder, batched as pure functions of (split, step, process)."""

    def __init__(
        self,
        data_dir: str | Path,
        block_size: int,
        align_to_bos: bool = False,
        val_tokens: int = SPEEDRUN_VAL_TOKENS,
    ):
        self.dir = Path(data_dir)
        self.block_size = block_size
        self.train = ShardStream(shard_paths(self.dir, "train"), block_size, align_to_bos)
        self.val = ShardStream(shard_paths(self.dir, "val"), block_size, False, limit=val_tokens)
        len(self.val)  # opens the val shards (up to val_tokens)
        have = sum(len(tokens) for tokens, _ in self.val._shards)
        if have < val_tokens + 1:
            raise ShardError(
                f"the val shards in {self.dir} hold {have:,} tokens, fewer than val_tokens + 1 = "
                f"{val_tokens + 1:,}; prepare more or lower data.val_tokens"
            )
        meta = self.dir / "meta.json"
        if not meta.exists():  # the run directory copies it: the tokenizer that decodes the run
            raise ShardError(
                f"{self.dir} has shards but no meta.json; if they hold GPT-2 tokens (as the speedrun's "
                f"do) write it with: python -m flaxgpt.data.fineweb --write_meta {self.dir}"
            )
        self.meta = json.loads(meta.read_text())

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def val_rows(self) -> int:
        """Windows in the fixed val set: an evaluation covers all of them."""
        return len(self.val)

    def batch(self, split: str, step: int, n_rows: int, process_index: int = 0, process_count: int = 1):
        """This process's rows at `step`: {"inputs", "targets"} int32 [n_rows, block_size]."""
        first = (step * process_count + process_index) * n_rows
        rows = np.arange(first, first + n_rows)
        windows = (self.val if split == "val" else self.train).windows(rows, wrap=split != "val")
        return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


# ----------------------------------------------------------------------------- preparing FineWeb

FINEWEB = ("HuggingFaceFW/fineweb", "sample-10BT")  # the speedrun's source (about 10B GPT-2 tokens)
SHARD_TOKENS = 100_000_000  # the speedrun's shard size
PROGRESS = "progress.json"  # documents consumed by the finished shards: where a restart continues

_encode = None  # the tokenizer of a worker process


def _init_worker():
    global _encode
    from flaxgpt.data.tokenizers import get_tokenizer

    _encode = get_tokenizer("gpt2").enc.encode_ordinary  # text only: "<|endoftext|>" in it is text


def _tokenize(texts: list[str]) -> list[np.ndarray]:
    """Each document as <|endoftext|> followed by its tokens (the speedrun's fineweb.py)."""
    return [np.asarray([BOS_ID, *_encode(t)], np.uint16) for t in texts]


def _documents(path: str, config: str | None, data_files: str | None, skip: int):
    """The documents' texts, streamed (nothing is downloaded whole), from document `skip` on."""
    import datasets

    local = Path(path)
    try:
        if local.is_dir() and (local / "dataset_info.json").exists():  # datasets.Dataset.save_to_disk
            ds = datasets.load_from_disk(str(local)).to_iterable_dataset()
        else:
            ds = datasets.load_dataset(path, config, data_files=data_files, split="train", streaming=True)
        docs = iter(ds.skip(skip) if skip else ds)
        first = next(docs, None)  # a missing file or an offline name fails here, not mid-shard
    except Exception as e:  # offline, unknown name, missing data files: all mean "cannot get it"
        why = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ShardError(
            f"could not load Hugging Face dataset {path!r} ({type(e).__name__}: {why}); check the name, "
            "--hf_data_files and the network"
        ) from None
    if first is not None and "text" not in first:
        raise ShardError(
            f"dataset {path!r} has no 'text' column (it has {', '.join(first)}); shards tokenize 'text'"
        )
    if first is not None:
        yield first["text"]
    for doc in docs:
        yield doc["text"]


def _batches(texts, size: int):
    batch = []
    for t in texts:
        batch.append(t)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def prepare_fineweb(
    out_dir,
    hf_name: str = FINEWEB[0],
    hf_config: str | None = FINEWEB[1],
    data_files: str | None = None,
    shard_tokens: int = SHARD_TOKENS,
    num_proc: int = 1,
    max_shards: int = 0,
    prefix: str = "fineweb",
    docs_per_task: int = 64,
    print_fn=print,
) -> dict:
    """Stream a Hugging Face text dataset into shards: {prefix}_val_000000.bin first (the speedrun's
    val shard), then {prefix}_train_000001.bin, ... . Documents are tokenized by `num_proc` processes
    in order; a shard closes before the document that would overflow it (so every shard starts
    with a document). Finished shards are renamed into place and recorded in progress.json; run the
    same command again after an interruption and it continues with the next shard. `max_shards` > 0
    stops after that many shards (val included)."""
    import multiprocessing

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = {
        "hf_name": hf_name,
        "hf_config": hf_config,
        "data_files": data_files,
        "shard_tokens": shard_tokens,
    }
    done = {"docs": 0, "shards": 0, "tokens": 0, **source}
    if (out / PROGRESS).exists():
        done = json.loads((out / PROGRESS).read_text())
        if any(done.get(k) != v for k, v in source.items()):
            raise ShardError(
                f"{out} holds shards of { ({k: done.get(k) for k in source}) }, not of {source}; "
                "use another --out_dir"
            )
        if done.get("complete") or (max_shards and done["shards"] >= max_shards):
            print_fn(f"{out} is complete: {done['shards']} shards, {done['tokens']:,} tokens")
            return done
        print_fn(f"resuming {out} at shard {done['shards']} (document {done['docs']:,})")
    elif any(out.glob(f"{prefix}_*.bin")):
        raise ShardError(f"{out} has shards but no {PROGRESS}; use another --out_dir or empty it")
    elif (out / "meta.json").exists():  # another dataset: its meta.json holds its vocabulary
        raise ShardError(f"{out} already holds a prepared dataset (not these shards); use another --out_dir")

    buffer, n_buffer, docs = [], 0, done["docs"]

    def flush():
        nonlocal buffer, n_buffer
        split = "val" if done["shards"] == 0 else "train"
        write_shard(out / f"{prefix}_{split}_{done['shards']:06d}.bin", np.concatenate(buffer))
        done.update(docs=docs, shards=done["shards"] + 1, tokens=done["tokens"] + n_buffer)
        tmp = out / (PROGRESS + ".tmp")
        tmp.write_text(json.dumps(done, indent=1) + "\n")
        tmp.replace(out / PROGRESS)  # after the shard: a kill in between rewrites the same shard
        print_fn(f"{split} shard {done['shards'] - 1}: {n_buffer:,} tokens ({docs:,} documents)")
        buffer, n_buffer = [], 0
        return bool(max_shards) and done["shards"] >= max_shards

    texts = _documents(hf_name, hf_config, data_files, done["docs"])
    stopped = False
    if num_proc > 1:  # spawn: forking a process that runs JAX's threads can deadlock
        pool = multiprocessing.get_context("spawn").Pool(num_proc, initializer=_init_worker)
        tokenize = lambda chunks: [doc for part in pool.map(_tokenize, chunks) for doc in part]  # noqa: E731
    else:
        pool, _ = contextlib.nullcontext(), _init_worker()
        tokenize = lambda chunks: [doc for part in map(_tokenize, chunks) for doc in part]  # noqa: E731
    with pool:
        for batch in _batches(texts, docs_per_task * num_proc):  # bounded: never the whole stream
            chunks = [batch[i : i + docs_per_task] for i in range(0, len(batch), docs_per_task)]
            for ids in tokenize(chunks):
                if n_buffer and n_buffer + len(ids) > shard_tokens:
                    if stopped := flush():
                        break
                buffer.append(ids)
                n_buffer += len(ids)
                docs += 1
            if stopped:
                break
    if not stopped and n_buffer:
        flush()
    done["complete"] = not stopped
    (out / PROGRESS).write_text(json.dumps(done, indent=1) + "\n")
    meta = {"vocab_size": 50257, "tokenizer": {"kind": "tiktoken", "name": "gpt2", "vocab_size": 50257}}
    (out / "meta.json").write_text(
        json.dumps({**meta, "dtype": "uint16", "format": "shards", **done}, indent=1)
    )
    return done


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(prog="python -m flaxgpt.data.fineweb", description=__doc__.split("\n")[0])
    p.add_argument("--write_meta", metavar="DIR", required=True, help="write DIR/meta.json (GPT-2 tokens)")
    args = p.parse_args(argv)
    shard_paths(args.write_meta, "train")  # a folder of shards, or a one-line error
    (Path(args.write_meta) / "meta.json").write_text(
        json.dumps({**GPT2_META, "format": "shards"}, indent=1) + "\n"
    )


if __name__ == "__main__":
    import sys

    from flaxgpt import errors

    sys.exit(errors.run_cli(main, errors=(ShardError,)))
