"""Prefix caching: the KV of prompt prefixes already computed, kept in blocks and reused by later prompts.

    pc = PrefixCache(engine.make_cache(1), block=16, capacity=256)    # 256 blocks of 16 positions
    hit, ids_M, digests = pc.match(prompt_ids)     # the longest cached prefix: `hit` tokens
    cache = pc.restore(ids_M)                      # a one-row cache holding those positions' KV
    ... prefill positions hit .. n-1 into `cache` ...
    pc.save(cache, digests, first=hit // 16)       # its full blocks, for the next prompt

Why it is exact: with causal attention the keys and values at position i depend only on tokens
0..i, so two prompts that agree on their first k * block tokens have the same KV there, whoever
computed it. A block is named by a chain digest, sha256(previous digest + its tokens), so a block
matches only when every token before it matches too. A prompt reuses at most its first n - 1
tokens' KV (the last token's logits must be computed), in whole blocks.

Storage is one pool per cache leaf, [capacity, R, block, ...] (R rows per sequence: the KV heads),
written and read by two jitted programs (save, restore) whose block lists are fixed-length [M]
arrays (M = W // block, the row's blocks; unused entries point past the pool: a save drops them).
The table is LRU: a hit moves a block to the back, a new block evicts from the front when the
pool is full. Evicting a block another request matched earlier is harmless: `restore` already
copied it into that request's own cache.
"""

from __future__ import annotations

import collections
import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np


def block_digests(tokens, block: int) -> list[bytes]:
    """The chain digest of each full block of `tokens`."""
    out, prev = [], b""
    for j in range(len(tokens) // block):
        prev = hashlib.sha256(prev + np.asarray(tokens[j * block : (j + 1) * block], np.int64).tobytes())
        prev = prev.digest()
        out.append(prev)
    return out


@functools.partial(jax.jit, static_argnames=("block",), donate_argnames=("pool",))
def _save(pool, cache, row, ids_M, block: int):
    def put(pool_NRL, buf_BRS):  # L = the block's positions and what follows them in a leaf
        R, M = pool_NRL.shape[1], ids_M.shape[0]
        row_RS = jax.lax.dynamic_slice_in_dim(buf_BRS, row * R, R, axis=0)  # sequence `row`'s rows
        blocks = row_RS[:, : M * block].reshape(R, M, block, *row_RS.shape[2:])
        return pool_NRL.at[ids_M].set(jnp.moveaxis(blocks, 1, 0).astype(pool_NRL.dtype), mode="drop")

    return jax.tree_util.tree_map(put, pool, cache)


@functools.partial(jax.jit, static_argnames=("block",))
def _restore(pool, empty, ids_M, block: int):
    def take(pool_NRL, row_RS):
        blocks = jnp.take(pool_NRL, ids_M, axis=0, mode="clip")  # [M, R, block, ...]
        R, M = row_RS.shape[0], ids_M.shape[0]
        rows = jnp.moveaxis(blocks, 0, 1).reshape(R, M * block, *row_RS.shape[2:])
        # positions past the hit hold other blocks' KV (finite): the prefill and decoding write
        # every position before any query can see it
        return row_RS.at[:, : M * block].set(rows.astype(row_RS.dtype))

    return jax.tree_util.tree_map(take, pool, empty)


class PrefixCache:
    def __init__(self, empty_row, *, block: int, capacity: int):
        """empty_row: an empty one-row cache (the pytree `restore` returns); capacity in blocks."""
        leaves = jax.tree_util.tree_leaves(empty_row)
        W = leaves[0].shape[1]
        if block < 1 or capacity < 1 or W < block:
            raise ValueError(
                f"prefix cache: block {block} and capacity {capacity} must be >= 1 and block <= window {W}"
            )
        self.block, self.capacity, self.M = block, capacity, W // block
        self.empty = empty_row
        self.pool = jax.tree_util.tree_map(
            lambda x: jnp.zeros((capacity, x.shape[0], block, *x.shape[2:]), x.dtype), empty_row
        )
        self.table: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # LRU first
        self.free = list(range(capacity - 1, -1, -1))
        self.bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(self.pool))

    def __len__(self) -> int:
        return len(self.table)

    def clear(self):
        """Forget every block (the pool's contents are simply overwritten later)."""
        self.table.clear()
        self.free = list(range(self.capacity - 1, -1, -1))

    def match(self, prompt_ids) -> tuple[int, np.ndarray, list[bytes]]:
        """-> (hit tokens, block ids [M] for restore, the digests of the prompt's full blocks)."""
        digests = block_digests(prompt_ids, self.block)[: self.M]
        ids_M = np.full(self.M, self.capacity, np.int32)  # past the pool: "no block"
        usable = (len(prompt_ids) - 1) // self.block  # the last token is always prefilled
        hits = 0
        for d in digests[:usable]:
            if d not in self.table:
                break
            self.table.move_to_end(d)
            ids_M[hits] = self.table[d]
            hits += 1
        return hits * self.block, ids_M, digests

    def restore(self, ids_M):
        return _restore(self.pool, self.empty, ids_M, block=self.block)

    def save(self, cache, digests: list[bytes], first: int = 0, row: int = 0):
        """Keep blocks first.. of row `row` of a cache (a prefilled one-row cache, or a slot of the
        slots cache after decoding) that are not already kept; digests: the row's full blocks."""
        ids_M = np.full(self.M, self.capacity, np.int32)
        new = 0
        for j, d in enumerate(digests[: self.capacity]):  # never evict a block this loop added
            if j < first or d in self.table:
                continue
            if not self.free:
                _, evicted = self.table.popitem(last=False)
                self.free.append(evicted)
            self.table[d] = ids_M[j] = self.free.pop()
            new += 1
        if new:
            self.pool = _save(self.pool, cache, np.int32(row), ids_M, block=self.block)
        return new
