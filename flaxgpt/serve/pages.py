"""One page pool shared by the slots and the prefix cache (serve.py --kv_cache paged): which page
holds what, kept on the host.

    pages = SharedPages(pool=1 + slots * M + 256, page=16, slots=slots, M=M, capacity=256)
    hit, table_M, digests = pages.open(prompt_ids, last=n + max_new - 1)   # cached blocks mapped in
    ... the prefill writes positions hit.. through table_M (fresh pages) ...
    pages.offer(table_M, digests)      # the prompt's full blocks: now the prefix cache's too
    pages.assign(slot, table_M)        # the slot's row of the block table (the device copy: `rows`)
    pages.offer(pages.rows[slot], block_digests(prompt + reply, 16)); pages.end(slot)   # at its end

A request's table maps its first `hit` positions (whole blocks whose chain digest the prefix cache
knows, models/paged.py's layout) to the cached pages themselves: nothing is copied, the attention
reads them where they are. Its other blocks up to its last position get fresh pages; entries past
it point at page 0, the scratch page, which no one owns: free slots' idle writes and prefill padding
past a request's blocks land there, and nobody reads it but masked-out attention.

No copy-on-write is needed: only full blocks are shared (a cached block covers positions before
its owner's prompt end or reply end), and a request writes only at positions >= its prompt's length
(prefill chunks start at `hit`, a whole block boundary, and decoding follows the prompt); the block
holding a finished row's idle position is never full, so never shared.

Reference counts: each row that maps a page (a slot, a request being prefilled) holds it once and the
prefix cache holds the pages of its blocks; a page nobody holds is free. The cache is LRU over its
blocks and evicts only blocks no row maps. With a pool of 1 + slots * M + capacity pages a request
always finds its pages: rows hold at most M pages each beyond the cache's `capacity` blocks (when
every ended slot was given back: `end`, which the engine's keep and release do).

Shape letters: M blocks (pages) per row.
"""

from __future__ import annotations

import collections

import numpy as np

from flaxgpt.serve.prefix_cache import block_digests

SCRATCH = 0  # the page free rows and padding write into; never allocated


class OutOfPages(RuntimeError):
    pass


class SharedPages:
    def __init__(self, *, pool: int, page: int, slots: int, M: int, capacity: int):
        """pool: pages in the device pool (page 0: scratch); capacity: the prefix cache's most blocks."""
        if pool < 1 + slots * M + capacity:
            raise ValueError(
                f"a pool of {pool} pages cannot hold {slots} slots x {M} pages + {capacity} prefix blocks "
                f"+ the scratch page ({1 + slots * M + capacity})"
            )
        self.page, self.block, self.M, self.capacity = page, page, M, capacity
        self.pool = pool
        self.refs = np.zeros(pool, np.int32)
        self.refs[SCRATCH] = 1  # held for good
        self.free = list(range(pool - 1, SCRATCH, -1))  # pop() gives low ids first
        self.blocks: collections.OrderedDict[bytes, int] = (
            collections.OrderedDict()
        )  # digest -> page, LRU first
        self.rows = np.full((slots, M), SCRATCH, np.int32)  # the slots' block tables

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def shared(self) -> int:
        """Pages held more than once: cached blocks that rows read in place."""
        return int(np.sum(self.refs[1:] >= 2))

    def match(self, prompt_ids) -> tuple[int, list[int], list[bytes]]:
        """-> (hit tokens, the cached pages of those blocks, the digests of the prompt's full blocks);
        the last prompt token is never a hit (its logits must be computed)."""
        digests = block_digests(prompt_ids, self.block)[: self.M]
        hits = []
        for d in digests[: (len(prompt_ids) - 1) // self.block]:
            if d not in self.blocks:
                break
            self.blocks.move_to_end(d)
            hits.append(self.blocks[d])
        return len(hits) * self.block, hits, digests

    def open(self, prompt_ids, last: int) -> tuple[int, np.ndarray, list[bytes]]:
        """A table [M] for a request writing up to position `last`: its cached prefix mapped in place,
        fresh pages for its other blocks, scratch past them -> (hit tokens, table_M, digests)."""
        hit, cached, digests = self.match(prompt_ids)
        table_M = np.full(self.M, SCRATCH, np.int32)
        for j, p in enumerate(cached):
            table_M[j] = p
            self.refs[p] += 1
        try:
            for j in range(len(cached), last // self.page + 1):
                table_M[j] = self._take()
        except OutOfPages:
            self.release(table_M)
            raise
        return hit, table_M, digests

    def _take(self) -> int:
        if not self.free and not self._evict():
            raise OutOfPages(
                f"out of KV pages: all {self.pool} are held by rows and cached blocks in use "
                "(end finished slots: Engine.keep / release)"
            )
        p = self.free.pop()
        self.refs[p] = 1
        return p

    def _evict(self) -> bool:
        """Drop the least recent cached block no row maps (its page freed); False if every one is mapped."""
        for d, p in self.blocks.items():
            if self.refs[p] == 1:
                del self.blocks[d]
                self.release([p])
                return True
        return False

    def offer(self, table_M, digests: list[bytes]) -> int:
        """The prefix cache keeps the full blocks of a row (its table, `digests` its full blocks'),
        in place: it holds their pages too. -> blocks newly kept."""
        new = 0
        for j, d in enumerate(digests[: self.M]):
            p = int(table_M[j])
            if p == SCRATCH:  # an ended row, or blocks past what was written
                break
            if d in self.blocks:  # kept already (this page, or another with the same keys and values)
                self.blocks.move_to_end(d)
                continue
            if len(self.blocks) >= self.capacity and not self._evict():
                break  # a later block alone could never be matched (digests chain)
            self.blocks[d] = p
            self.refs[p] += 1
            new += 1
        return new

    def release(self, table_M):
        """A row lets go of its pages; those nobody else holds are free again."""
        for p in table_M:
            p = int(p)
            if p == SCRATCH:
                continue
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free.append(p)

    def assign(self, slot: int, table_M):
        """Slot `slot`'s row becomes table_M (its previous pages let go)."""
        self.release(self.rows[slot])
        self.rows[slot] = table_M

    def end(self, slot: int):
        """Slot `slot`'s request is over: its pages let go, its row points at the scratch page."""
        self.assign(slot, np.full(self.M, SCRATCH, np.int32))

    def clear(self):
        """Forget every cached block (pages that rows map stay theirs)."""
        for p in self.blocks.values():
            self.release([p])
        self.blocks.clear()
