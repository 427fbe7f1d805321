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

Storage is the paged cache kind's pool (models/paged.py, `PagedKVCache.pool`): a block is a page of
`block` positions, [J, capacity, block, K] per layer, written from a row (`write_pages`) and read into a
one-row contiguous cache (`read_into`) by two jitted programs (save, restore) whose block lists are
fixed-length [M] arrays (M = W // block, the row's blocks; unused entries point past the pool: a save
drops them). A save reads its row through the cache interface (`cache.row(slot)`), so it takes a
prefilled row or any kind of slots cache alike.
The table is LRU: a hit moves a block to the back, a new block evicts from the front when the
pool is full. Evicting a block another request matched earlier is harmless: `restore` already
copied it into that request's own cache.
"""

from __future__ import annotations

import collections
import functools
import hashlib

import jax
import numpy as np

from flaxgpt.models.cache import KVCache
from flaxgpt.models.paged import PagedKVCache


def block_digests(tokens, block: int) -> list[bytes]:
    """The chain digest of each full block of `tokens`."""
    out, prev = [], b""
    for j in range(len(tokens) // block):
        prev = hashlib.sha256(prev + np.asarray(tokens[j * block : (j + 1) * block], np.int64).tobytes())
        prev = prev.digest()
        out.append(prev)
    return out


@functools.partial(jax.jit, donate_argnames=("pool",))
def _save(pool: PagedKVCache, cache, row, ids_M) -> PagedKVCache:
    return pool.write_pages(cache.row(row), ids_M)


@jax.jit
def _restore(pool: PagedKVCache, empty: KVCache, ids_M) -> KVCache:
    # positions past the hit hold other blocks' KV (finite): the prefill and decoding write
    # every position before any query can see it
    return pool.read_into(empty, ids_M)


class PrefixCache:
    def __init__(self, empty_row: KVCache, *, block: int, capacity: int):
        """empty_row: an empty one-row contiguous cache (what `restore` returns); capacity in blocks."""
        W = empty_row.max_len
        if block < 1 or capacity < 1 or W < block:
            raise ValueError(
                f"prefix cache: block {block} and capacity {capacity} must be >= 1 and block <= window {W}"
            )
        if empty_row.has_rings:
            raise ValueError("the prefix cache keeps every position's keys and values; rings keep a window")
        self.block, self.capacity, self.M = block, capacity, W // block
        self.empty = empty_row
        self.pool = PagedKVCache.pool(empty_row, pages=capacity, page=block)
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
        return _restore(self.pool, self.empty, ids_M)

    def save(self, cache, digests: list[bytes], first: int = 0, row: int = 0):
        """Keep blocks first.. of row `row` of a cache (a prefilled one-row cache, or a slot of the
        slots cache after decoding: any cache kind) that are not already kept; digests: the row's
        full blocks."""
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
            self.pool = _save(self.pool, cache, np.int32(row), ids_M)
        return new
