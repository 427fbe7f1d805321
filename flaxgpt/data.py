"""GPT batches as pure functions of (seed, step, process index).

A batch is a dict of host-local NumPy arrays: random windows of block_size + 1 tokens cut from
the memmapped token file (nanoGPT's sampler), inputs = window[:-1], targets = window[1:].
Nothing is remembered between calls, so resuming at step k needs only k, and every process
draws only its own rows. `to_global` turns the host-local rows into one sharded jax.Array.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

PREPARE_HINT = (
    "prepare it with: python -m flaxgpt.prepare --dataset shakespeare_char "
    "--out_dir {dir} (or --dataset text --input FILE --out_dir {dir})"
)
TRAIN_STREAM, VAL_STREAM, TRAIN_EVAL_STREAM = 0, 1, 2  # separate random streams per purpose


class TokenData:
    """The memmapped train/val token files of one prepared dataset and its meta.json."""

    def __init__(self, data_dir: str | Path):
        self.dir = Path(data_dir)
        meta_path = self.dir / "meta.json"
        if not meta_path.exists():
            raise FileNotFoundError(
                f"no prepared dataset in {self.dir} (meta.json missing); " + PREPARE_HINT.format(dir=self.dir)
            )
        self.meta = json.loads(meta_path.read_text())
        dtype = np.dtype(self.meta["dtype"])
        self.splits = {}
        for split in ("train", "val"):
            path = self.dir / f"{split}.bin"
            if not path.exists():
                raise FileNotFoundError(f"{path} is missing; " + PREPARE_HINT.format(dir=self.dir))
            size = path.stat().st_size // dtype.itemsize
            self.splits[split] = np.memmap(path, dtype=dtype, mode="r", shape=(size,)) if size else None

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
    n_tokens: int, block_size: int, n_rows: int, seed: int, stream: int, step: int, process_index: int
) -> np.ndarray:
    """Start offsets in [0, n_tokens - block_size - 1]: every window of T + 1 tokens fits."""
    rng = np.random.default_rng([seed, stream, step, process_index])
    return rng.integers(0, n_tokens - block_size, size=n_rows)  # high is exclusive


def get_batch(
    tokens: np.ndarray,
    block_size: int,
    n_rows: int,
    seed: int,
    step: int,
    process_index: int = 0,
    stream: int = TRAIN_STREAM,
) -> dict[str, np.ndarray]:
    """This process's rows of the batch at `step`: {"inputs", "targets"} int32 [n_rows, T]."""
    starts_B = window_starts(len(tokens), block_size, n_rows, seed, stream, step, process_index)
    idx_BT1 = starts_B[:, None] + np.arange(block_size + 1)  # [B, T + 1]
    windows = np.asarray(tokens[idx_BT1], dtype=np.int32)
    return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


def split_micro(batch: dict[str, np.ndarray], grad_accum: int) -> dict[str, np.ndarray]:
    """[B, T] -> [grad_accum, B / grad_accum, T]: micro-batch i is rows i*B/k ... (i+1)*B/k - 1."""
    return {k: v.reshape(grad_accum, v.shape[0] // grad_accum, *v.shape[1:]) for k, v in batch.items()}


def to_global(
    local: dict[str, np.ndarray], sharding: jax.sharding.NamedSharding, batch_axis: int = 0
) -> dict[str, jax.Array]:
    """Host-local rows -> global arrays, the batch axis concatenated across processes."""

    def make(x):
        shape = list(x.shape)
        shape[batch_axis] *= jax.process_count()
        return jax.make_array_from_process_local_data(sharding, x, tuple(shape))

    return {k: make(v) for k, v in local.items()}
