"""Batches as pure functions of (seed, step), for both model kinds; a process takes its slice.

GPT (TokenData, get_batch): a batch is a dict of host-local NumPy arrays: random windows of
block_size + 1 tokens cut from the memmapped token file (nanoGPT's sampler), inputs = window[:-1],
targets = window[1:]. Encoder-decoder (ParallelData, Batcher): padded pairs from a folder written by
flaxgpt.data.prepare_seq2seq; the epoch's order is a seeded shuffle, sorted by length within groups of
batches so that little of each batch is padding. Nothing is remembered between calls, so resuming at
step k needs only k, and every process reads only its own rows of the same global batch, whatever the
number of processes. `to_global` turns the host-local rows into one sharded jax.Array.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import jax
import numpy as np

from flaxgpt.data.tokenizers import BOS_ID, EOS_ID, PAD_ID

PREPARE_HINT = (
    "prepare it with: flaxgpt prepare --dataset text --input FILE --out_dir {dir}"  # hints.py: a recipe's
)
TRAIN_STREAM, VAL_STREAM, TRAIN_EVAL_STREAM = 0, 1, 2  # separate random streams per purpose


AGAIN = "prepare the dataset again (with --overwrite)"
SCAN_ALL = 2**30  # token files up to this many tokens are checked whole when opened; longer ones sampled


def read_meta(data_dir: Path, hint: str) -> dict:
    """data_dir/meta.json, checked: a JSON object with an unsigned integer `dtype` and a `vocab_size`.
    Every problem is a one-line error naming the file."""
    path = data_dir / "meta.json"
    if not path.exists():
        raise FileNotFoundError(f"no prepared dataset in {data_dir} (meta.json missing); {hint}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{path} cannot be read ({type(e).__name__}: {e}); {AGAIN}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path} holds a JSON {type(meta).__name__}, not an object; {AGAIN}")
    for key in ("dtype", "vocab_size"):
        if key not in meta:
            raise ValueError(f"{path} has no {key!r} entry; {AGAIN}")
    try:
        dtype = np.dtype(meta["dtype"])
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind != "u":
        raise ValueError(f"{path}: dtype {meta['dtype']!r} is not uint16 or uint32; {AGAIN}")
    if not isinstance(meta["vocab_size"], int) or meta["vocab_size"] < 1:
        raise ValueError(f"{path}: vocab_size {meta['vocab_size']!r} is not a positive integer; {AGAIN}")
    return meta


def open_tokens(
    path: Path, dtype: np.dtype, n_expected: int | None, vocab_size: int, hint: str, counted_in="meta.json"
):
    """A token file memmapped (None when empty), its size checked against its dtype and meta.json's
    count, and its ids against the vocabulary (all of them, or spread samples past SCAN_ALL tokens)."""
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; {hint}")
    nbytes = path.stat().st_size
    if nbytes % dtype.itemsize:
        raise ValueError(
            f"{path} has {nbytes} bytes, not a multiple of {dtype.itemsize} ({dtype.name} tokens, "
            f"meta.json's dtype): it is truncated or from another preparation; {AGAIN}"
        )
    n = nbytes // dtype.itemsize
    if n_expected is not None and n != n_expected:
        raise ValueError(
            f"{path} has {n} tokens but {counted_in} says {n_expected}: the files are from different "
            f"preparations (or truncated); {AGAIN}"
        )
    if not n:
        return None
    tokens = np.memmap(path, dtype=dtype, mode="r", shape=(n,))
    chunk = 2**24
    starts = range(0, n, chunk) if n <= SCAN_ALL else np.linspace(0, n - chunk, 64).astype(np.int64)
    for start in starts:
        part = tokens[start : start + chunk]
        top = int(part.max())
        if top >= vocab_size:
            at = int(start) + int(np.argmax(part >= vocab_size))
            raise ValueError(
                f"{path} holds token id {top} (first at token {at}) but meta.json's vocab_size is "
                f"{vocab_size}: the token files do not belong to this meta.json; {AGAIN}"
            )
    return tokens


class TokenData:
    """The memmapped train/val token files of one prepared dataset and its meta.json, checked on opening:
    meta.json's fields, each file's size (a whole number of tokens, the count meta.json records) and
    every id < vocab_size (ids past the vocabulary would train on garbage)."""

    def __init__(self, data_dir: str | Path, hint: str | None = None):
        """hint: 'prepare it with: COMMAND', the recipe's (flaxgpt.data.hints)."""
        self.dir = Path(data_dir)
        hint = hint or PREPARE_HINT.format(dir=shlex.quote(str(self.dir)))
        self.meta = read_meta(self.dir, hint)
        dtype = np.dtype(self.meta["dtype"])
        again = hint + " --overwrite"  # meta.json is there: prepare refuses to write over it without
        self.splits = {
            split: open_tokens(
                self.dir / f"{split}.bin", dtype, self.meta.get(f"{split}_tokens"), self.vocab_size, again
            )
            for split in ("train", "val")
        }

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def check(self, block_size: int, model_vocab_size: int) -> None:
        """The one-line errors for data that cannot train this model."""
        for split, tokens in self.splits.items():
            n = 0 if tokens is None else len(tokens)
            if n < block_size + 1:
                raise ValueError(
                    f"{self.dir}/{split}.bin has {n} tokens, fewer than block_size + 1 = "
                    f"{block_size + 1}; use more text or a smaller --config.model.block_size"
                )
        if self.vocab_size > model_vocab_size:
            raise ValueError(
                f"the dataset's vocabulary ({self.vocab_size}) is larger than the model's "
                f"vocab_size ({model_vocab_size}); set --config.model.vocab_size=0 to use "
                "the dataset's"
            )


def window_starts(
    n_tokens: int,
    block_size: int,
    n_rows: int,
    seed: int,
    stream: int,
    step: int,
    process_index: int = 0,
    process_count: int = 1,
) -> np.ndarray:
    """Start offsets in [0, n_tokens - block_size - 1] (every window of T + 1 tokens fits) of this
    process's n_rows: a slice of the whole step's draw, so the batch is the same on any number of
    processes (a run resumed on another host count sees the same data)."""
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not one of {process_count} processes")
    rng = np.random.default_rng([seed, stream, step, 0])  # the 0 was the process: one process draws as before
    starts = rng.integers(0, n_tokens - block_size, size=n_rows * process_count)  # high is exclusive
    return starts[process_index * n_rows : (process_index + 1) * n_rows]


def get_batch(
    tokens: np.ndarray,
    block_size: int,
    n_rows: int,
    seed: int,
    step: int,
    process_index: int = 0,
    stream: int = TRAIN_STREAM,
    process_count: int = 1,
) -> dict[str, np.ndarray]:
    """This process's rows of the batch at `step`: {"inputs", "targets"} int32 [n_rows, T]."""
    starts_B = window_starts(
        len(tokens), block_size, n_rows, seed, stream, step, process_index, process_count
    )
    idx_BT1 = starts_B[:, None] + np.arange(block_size + 1)  # [B, T + 1]
    windows = np.asarray(tokens[idx_BT1], dtype=np.int32)
    return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


def split_micro(batch: dict[str, np.ndarray], grad_accum: int) -> dict[str, np.ndarray]:
    """[B, T] -> [grad_accum, B / grad_accum, T]: micro-batch i is rows i*B/k ... (i+1)*B/k - 1."""
    return {k: v.reshape(grad_accum, v.shape[0] // grad_accum, *v.shape[1:]) for k, v in batch.items()}


def to_global(local: dict[str, np.ndarray], sharding, batch_axis: int = 0) -> dict[str, jax.Array]:
    """Host-local rows -> global arrays, the batch axis concatenated across processes; `sharding`
    one for every leaf, or a function from a leaf's ndim to its own (sharding.batch_shardings)."""

    def make(x):
        shape = list(x.shape)
        shape[batch_axis] *= jax.process_count()
        placed = sharding if isinstance(sharding, jax.sharding.Sharding) else sharding(x.ndim)
        return jax.make_array_from_process_local_data(placed, x, tuple(shape))

    return {k: make(v) for k, v in local.items()}


# ----------------------------------------------------------------------------- parallel text


class ParallelData:
    """One split of a prepared folder: pair i's tokens, memmapped."""

    def __init__(self, data_dir: str | Path, split: str, hint: str | None = None):
        self.dir = Path(data_dir)
        hint = (
            hint
            or "prepare it with: flaxgpt prepare-seq2seq --task tsv --input PAIRS.tsv --out_dir "
            + shlex.quote(str(self.dir))
        )
        self.meta = read_meta(self.dir, hint)
        if self.meta.get("kind") != "seq2seq":
            raise ValueError(
                f"{self.dir} holds a GPT dataset, not parallel text; prepare one with flaxgpt prepare-seq2seq"
            )
        idx = self.dir / f"{split}.idx.npy"
        try:
            self.offsets = np.load(idx)
        except (OSError, ValueError) as e:
            raise ValueError(f"{idx} cannot be read ({type(e).__name__}); {AGAIN}") from None
        dtype = np.dtype(self.meta["dtype"])
        self.src, self.tgt = (
            open_tokens(
                self.dir / f"{split}.{side}.bin",
                dtype,
                int(self.offsets[-1, k]),
                self.vocab_size,
                hint,
                counted_in=idx.name,
            )
            for k, side in enumerate(("src", "tgt"))
        )
        self.src, self.tgt = (np.zeros(0, dtype) if x is None else x for x in (self.src, self.tgt))
        self.src_lengths = np.diff(self.offsets[:, 0])
        self.tgt_lengths = np.diff(self.offsets[:, 1])

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def pair(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        (s0, t0), (s1, t1) = self.offsets[i], self.offsets[i + 1]
        return np.asarray(self.src[s0:s1]), np.asarray(self.tgt[t0:t1])


def epoch_order(lengths_N: np.ndarray, batch_size: int, seed: int, epoch: int, group: int = 50):
    """Rows of each batch of one epoch, [n_batches, batch_size]: a seeded shuffle, then sorted by
    length within chunks of `group` batches, then the batches shuffled (the last partial one dropped)."""
    n_batches = len(lengths_N) // batch_size
    if n_batches == 0:
        raise ValueError(f"{len(lengths_N)} pairs are fewer than one batch of {batch_size}")
    rng = np.random.default_rng([seed, epoch])
    perm = rng.permutation(len(lengths_N))[: n_batches * batch_size]
    chunk = batch_size * group
    for i in range(0, len(perm), chunk):
        part = perm[i : i + chunk]
        perm[i : i + chunk] = part[np.argsort(lengths_N[part], kind="stable")]
    return perm.reshape(n_batches, batch_size)[rng.permutation(n_batches)]


def make_batch(data: ParallelData, rows, src_len: int, tgt_len: int) -> dict[str, np.ndarray]:
    """Pairs -> {src [B, S], src_lengths [B], inputs (BOS + target) [B, T], targets (target + EOS),
    loss_mask} padded with PAD_ID to the given lengths."""
    B = len(rows)
    out = {
        "src": np.full((B, src_len), PAD_ID, np.int32),
        "src_lengths": np.zeros(B, np.int32),
        "inputs": np.full((B, tgt_len), PAD_ID, np.int32),
        "targets": np.full((B, tgt_len), PAD_ID, np.int32),
        "loss_mask": np.zeros((B, tgt_len), np.float32),
    }
    for b, i in enumerate(rows):
        s, t = data.pair(int(i))
        s, t = s[: src_len - 1], t[: tgt_len - 1]
        out["src"][b, : len(s) + 1] = np.append(s, EOS_ID)
        out["src_lengths"][b] = len(s) + 1
        out["inputs"][b, : len(t) + 1] = np.append(BOS_ID, t)
        out["targets"][b, : len(t) + 1] = np.append(t, EOS_ID)
        out["loss_mask"][b, : len(t) + 1] = 1.0
    return out


class Batcher:
    """Batch `step` as a pure function of (seed, step): epoch = step // batches_per_epoch.

    `src_len` / `tgt_len` fix the padded shapes (one compiled train step); with `bucket` > 0 each
    batch is instead padded to its own longest pair rounded up to a multiple of `bucket`.
    """

    def __init__(
        self, data: ParallelData, batch_size: int, seed: int, src_len: int, tgt_len: int, bucket: int = 0
    ):
        self.data, self.batch_size, self.seed, self.bucket = data, batch_size, seed, bucket
        self.src_len, self.tgt_len = src_len, tgt_len
        self.lengths = np.maximum(data.src_lengths, data.tgt_lengths)
        self.n_per_epoch = len(data) // batch_size
        if self.n_per_epoch == 0:  # (rows would divide by it)
            raise ValueError(
                f"{data.dir} holds {len(data)} pairs in this split, fewer than one batch of {batch_size}: "
                "lower --config.batch_size or prepare more pairs"
            )
        self._epoch, self._order = None, None  # memo of the current epoch's order (pure: recomputable)

    def rows(self, step: int) -> np.ndarray:
        epoch, j = divmod(step, self.n_per_epoch)
        if epoch != self._epoch:
            self._order = epoch_order(self.lengths, self.batch_size, self.seed, epoch)
            self._epoch = epoch
        return self._order[j]

    def batch(self, step: int, process_index: int = 0, process_count: int = 1) -> dict[str, np.ndarray]:
        rows = self.rows(step)
        S, T = self.src_len, self.tgt_len
        if self.bucket:  # from the whole global batch, so every process pads alike
            S = min(S, up_to(int(self.data.src_lengths[rows].max()) + 1, self.bucket))
            T = min(T, up_to(int(self.data.tgt_lengths[rows].max()) + 1, self.bucket))
        n = len(rows) // process_count
        return make_batch(self.data, rows[process_index * n : (process_index + 1) * n], S, T)


def up_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def eval_rows(n_pairs: int, batch_size: int, i: int) -> tuple[np.ndarray, np.ndarray]:
    """Eval batch i in order, the last one filled with repeats: (rows, example mask)."""
    rows = np.arange(i * batch_size, (i + 1) * batch_size)
    return rows % n_pairs, (rows < n_pairs).astype(np.float32)
