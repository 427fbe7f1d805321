"""Packing: several examples (conversations, documents) in one row of block_size, with segment ids.

    rows = pack([(inputs, targets, loss_mask), ...], block_size)   # {inputs, targets, loss_mask,
                                                                    #  segment_ids}: [R, T] each
    data = PackedData("data/chat")                                 # the files flaxgpt.data.prepare wrote
    batch = data.batch("train", step, n_rows, seed, process_index, process_count)

An example is next-token pairs (inputs = ids[:-1], targets = ids[1:], loss_mask on the targets that
count: assistant tokens for chat SFT, every token for plain text). Rows are filled best-fit
decreasing (longest example first, into the fullest row it fits), so little of a row is padding.
Segment ids number the examples of a row 1, 2, ...; padding is segment 0, with loss mask 0. The
model (GPT(..., segment_ids_BT=...)) keeps attention inside a segment and restarts positions at
each, so an example's loss packed equals its loss alone.

Files of a packed dataset (prepare writes them, meta.json last): {split}.{inputs,targets,loss_mask,
segment_ids}.npy ([R, T], memmapped when read) and meta.json ({"kind": "packed", block_size,
vocab_size, rows and padding fraction per split, the tokenizer}). Batches are a pure function of
(seed, step, process): epoch e's row order is a permutation seeded by (seed, e); a step takes the
next global batch of it and each process its own slice. Eval batches read the rows in order.
"""

from __future__ import annotations

import bisect
from pathlib import Path

import numpy as np

from flaxgpt.data.batches import TRAIN_EVAL_STREAM, read_meta

FIELDS = ("inputs", "targets", "loss_mask", "segment_ids")
HINT = "prepare it with: flaxgpt prepare --dataset chat --input convs.jsonl --hf_dir MODEL"
PAIRS_HINT = "prepare it with: flaxgpt prepare --dataset pairs --input pairs.jsonl --hf_dir MODEL"


def example(ids, mask=None):
    """(inputs, targets, loss_mask) of one sequence; mask[i] = 1 where token i is to be predicted."""
    ids = np.asarray(ids, np.int64)
    mask = np.ones(len(ids), np.uint8) if mask is None else np.asarray(mask, np.uint8)
    return ids[:-1], ids[1:], mask[1:]


def plan(lengths: list[int], block_size: int) -> list[list[int]]:
    """Rows as lists of example indices: best-fit decreasing (each example, longest first, into the
    row with the least room that still holds it). Deterministic: ties keep the input order."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row index), sorted
    for i in order:
        n = lengths[i]
        if n > block_size:
            raise ValueError(f"example {i} has {n} tokens, more than block_size {block_size}")
        at = bisect.bisect_left(free, (n, -1))
        if at == len(free):
            rows.append([i])
            bisect.insort(free, (block_size - n, len(rows) - 1))
        else:
            room, r = free.pop(at)
            rows[r].append(i)
            bisect.insort(free, (room - n, r))
    return rows


def pack(examples, block_size: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """Examples (inputs, targets, loss_mask) -> {inputs, targets, loss_mask, segment_ids} [R, T]."""
    return pack_groups([[x] for x in examples], block_size, pad_id)


def pack_groups(groups, block_size: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """Groups of examples that share a row (a DPO pair's chosen and rejected), each example its own
    segment, a row's groups in input order -> {inputs, targets, loss_mask, segment_ids} [R, T]."""
    rows = plan([sum(len(x[0]) for x in group) for group in groups], block_size)
    R, T = len(rows), block_size
    out = {
        "inputs": np.full((R, T), pad_id, np.int64),
        "targets": np.full((R, T), pad_id, np.int64),
        "loss_mask": np.zeros((R, T), np.uint8),
        "segment_ids": np.zeros((R, T), np.int32),
    }
    for r, members in enumerate(rows):
        t, s = 0, 1
        for i in sorted(members):
            for inputs, targets, mask in groups[i]:
                n = len(inputs)
                out["inputs"][r, t : t + n], out["targets"][r, t : t + n] = inputs, targets
                out["loss_mask"][r, t : t + n], out["segment_ids"][r, t : t + n] = mask, s
                t, s = t + n, s + 1
    return out


def padding_fraction(segment_ids_RT: np.ndarray) -> float:
    return float(np.mean(np.asarray(segment_ids_RT) == 0)) if np.size(segment_ids_RT) else 0.0


class PackedData:
    """A packed dataset's splits, memmapped and checked against meta.json on opening."""

    def __init__(self, data_dir: str | Path, kind: str = "packed", hint: str | None = None):
        """kind: packed (chat SFT, packed documents) | pairs (DPO, flaxgpt.data.preference); hint:
        'prepare it with: COMMAND', the recipe's (flaxgpt.data.hints)."""
        self.dir = Path(data_dir)
        hint = hint or (HINT if kind == "packed" else PAIRS_HINT)
        self.meta = read_meta(self.dir, hint)
        if self.meta.get("kind") != kind:
            held = self.meta.get("kind", "token")
            fmt = held if held in ("packed", "pairs") else "tokens"
            raise ValueError(
                f"{self.dir} holds a {held} dataset, not a {kind} one; "
                f"set --config.data.format={fmt}, or {hint}"
            )
        self.block_size = int(self.meta["block_size"])
        self.splits = {}
        for split in ("train", "val"):
            arrays = {}
            for field in FIELDS:
                path = self.dir / f"{split}.{field}.npy"
                try:
                    arrays[field] = np.load(path, mmap_mode="r")
                except (OSError, ValueError) as e:
                    raise ValueError(
                        f"{path} cannot be read ({type(e).__name__}); {hint} --overwrite"
                    ) from None
                if arrays[field].shape != (self.meta[f"{split}_rows"], self.block_size):
                    raise ValueError(
                        f"{path} has shape {arrays[field].shape}, not meta.json's "
                        f"({self.meta[f'{split}_rows']}, {self.block_size}); {hint} --overwrite"
                    )
            self.splits[split] = arrays

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def check(self, block_size: int, model_vocab_size: int) -> None:
        if block_size != self.block_size:
            raise ValueError(
                f"{self.dir} is packed in rows of {self.block_size} tokens but the model's block_size is "
                f"{block_size}; set --config.model.block_size={self.block_size} or prepare it with "
                f"--block_size {block_size}"
            )
        if self.vocab_size > model_vocab_size:
            raise ValueError(
                f"the dataset's vocabulary ({self.vocab_size}) is larger than the model's "
                f"({model_vocab_size}); prepare it with the model's own tokenizer (--hf_dir)"
            )

    def batch(self, split, step, n_rows, seed, process_index=0, process_count=1, stream=0):
        """This process's n_rows of global batch `step`: {inputs, targets, loss_mask, segment_ids},
        [n_rows, T] each (the loss mask float32, the rest int32)."""
        arrays = self.splits["val" if split == "val" else "train"]
        R = len(arrays["inputs"])
        g = (step * process_count + process_index) * n_rows + np.arange(n_rows)  # global row numbers
        if split == "val":
            rows = g % R  # the same rows at every evaluation
        else:
            stream = TRAIN_EVAL_STREAM if split == "train_eval" else stream
            epochs, at = np.divmod(g, R)
            rows = np.empty(n_rows, np.int64)
            for e in np.unique(epochs):
                perm = np.random.default_rng([seed, stream, int(e)]).permutation(R)
                rows[epochs == e] = perm[at[epochs == e]]
        order = np.argsort(rows)  # memmaps read fastest in order
        out = {f: np.empty((n_rows, self.block_size), np.int32) for f in FIELDS}
        for f in FIELDS:
            out[f][order] = np.asarray(arrays[f][rows[order]], np.int32)
        out["loss_mask"] = out["loss_mask"].astype(np.float32)
        return out
