"""The KV block manager: which page of the serving pool holds what, kept on the host (vLLM v1's KV-cache
manager). It allocates and frees pages and owns prefix hashing; it never touches the device.

    bm = BlockManager(pages=1 + slots * M + 256, page=16, M=M, capacity=256)
    hit = bm.allocate(job, prompt_ids, last=n + max_new - 1, salt=b"sql")  # cached blocks mapped in
    bm.table(job)                     # [M] the pages of its positions (the runner uploads it)
    bm.cache(job, prompt_ids)         # its prompt's full blocks join the prefix cache, in place
    bm.move(job, ("slot", 3))         # the request takes slot 3: same pages, another owner
    copy = bm.fork(job, other, n, last)   # a second request on the same prompt (shared full blocks)
    bm.cache(("slot", 3), prompt_ids + reply); bm.free(("slot", 3))     # at its end

Owners are any hashable keys (a prefill job, a slot): each holds a block table [M] of the pages of
its positions 0 .. M*page - 1 (page p holds positions j*page .. of its j-th entry). Entries past an
owner's last position point at page 0, the scratch page, which no one owns: idle rows and prefill
padding write there, and only masked-out attention reads it.

Prefix hashing: a block is named by a chain digest, sha256(previous digest + its tokens), started
from the owner's salt (the adapter it decodes with: two adapters give one prompt different keys and
values), so a block matches only when every token before it and the adapter match too. Keys and
values at position i depend only on tokens 0..i (causal attention), so a matched block's pages are
mapped into the new owner's table and read where they are, never copied. A prompt reuses at most
its first n - 1 tokens (the last token's logits must be computed), in whole blocks.

No copy-on-write is needed: only full blocks are shared, and an owner writes only at positions from
its prompt's end (prefill chunks start at the hit, a block boundary; decoding follows the prompt).
`fork` shares a prompt's full blocks and hands back the one page to copy, the partial last block.

Reference counts: each owner holds each page of its table once (scratch aside), the prefix cache
the page of each cached block once; a page nobody holds is free. The cache is LRU over its blocks
and evicts only blocks no owner maps. With pages >= 1 + owners * M + capacity a request always
finds its pages. `check()` recomputes every count from the tables and the cache: the property test
runs it after every operation of random schedules (tests/serve/test_block_manager.py).

Shape letters: M blocks (pages) per owner.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np

SCRATCH = 0  # the page free rows and padding write into; never allocated


class OutOfPages(RuntimeError):
    pass


def block_digests(tokens, block: int, salt: bytes = b"") -> list[bytes]:
    """The chain digest of each full block of `tokens`, the chain started from `salt`."""
    out, prev = [], hashlib.sha256(salt).digest() if salt else b""
    for j in range(len(tokens) // block):
        prev = hashlib.sha256(prev + np.asarray(tokens[j * block : (j + 1) * block], np.int64).tobytes())
        prev = prev.digest()
        out.append(prev)
    return out


class BlockManager:
    def __init__(self, *, pages: int, page: int, M: int, capacity: int, reserved: range = range(0)):
        """pages: the device pool's pages (page 0: scratch); page: positions a page; M: pages an owner's
        table maps (its window / page); capacity: the most blocks the prefix cache keeps (0: off);
        reserved: pages that are not this manager's (the engine's slot windows)."""
        n = len(reserved)
        if page < 1 or M < 1 or capacity < 0 or pages < 1 + n + M + capacity or SCRATCH in reserved:
            raise ValueError(
                f"a pool of {pages} pages of {page} cannot hold one window of {M} pages + {capacity} prefix "
                f"blocks + the scratch page" + (f" + {n} reserved" if n else "")
            )
        self.pages, self.page, self.M, self.capacity, self.reserved = pages, page, M, capacity, reserved
        self.refs = np.zeros(pages, np.int32)
        self.refs[SCRATCH] = 1  # held for good, as the reserved pages
        self.refs[reserved.start : reserved.stop] = 1
        self.free_pages = [p for p in range(pages - 1, SCRATCH, -1) if p not in reserved]  # pop(): low first
        self.blocks: collections.OrderedDict[bytes, int] = (
            collections.OrderedDict()
        )  # digest -> page, LRU first
        self.tables: dict[object, np.ndarray] = {}  # owner -> its table [M]
        self.salts: dict[object, bytes] = {}

    # ------------------------------------------------------------ what an owner holds

    def table(self, owner) -> np.ndarray:
        return self.tables[owner]

    def allocate(self, owner, prompt_ids, last: int, salt: bytes = b"") -> int:
        """A table for `owner`, writing up to position `last`: the longest cached prefix of the prompt
        mapped in place, fresh pages after it, scratch past `last` -> hit tokens. OutOfPages (nothing
        taken) when the pool cannot hold it."""
        if owner in self.tables:
            raise ValueError(f"{owner!r} already holds pages")
        if not 0 <= last < self.M * self.page:
            raise ValueError(f"position {last} is outside a window of {self.M * self.page}")
        cached = self.match(prompt_ids, salt) if self.capacity else []
        table_M = np.full(self.M, SCRATCH, np.int32)
        table_M[: len(cached)] = cached
        self.refs[cached] += 1
        self._fill(table_M, len(cached), last)
        self.tables[owner], self.salts[owner] = table_M, salt
        return len(cached) * self.page

    def match(self, prompt_ids, salt: bytes = b"") -> list[int]:
        """The pages of the prompt's longest cached block prefix (at most n - 1 tokens), made the most
        recently used."""
        usable = (len(prompt_ids) - 1) // self.page
        hits = []
        for d in block_digests(prompt_ids[: usable * self.page], self.page, salt):
            if d not in self.blocks:
                break
            self.blocks.move_to_end(d)
            hits.append(self.blocks[d])
        return hits

    def fork(self, owner, new_owner, length: int, last: int) -> tuple[int, int] | None:
        """`new_owner` reads `owner`'s first `length` positions (a prompt prefilled once, for another
        request): its full blocks shared in place, fresh pages up to `last`. -> (source page, new page)
        of the partial block the caller must copy (its positions < length), or None."""
        if new_owner in self.tables:
            raise ValueError(f"{new_owner!r} already holds pages")
        src_M, full = self.tables[owner], length // self.page
        table_M = np.full(self.M, SCRATCH, np.int32)
        table_M[:full] = src_M[:full]
        self.refs[table_M[:full]] += 1
        self._fill(table_M, full, last)
        self.tables[new_owner], self.salts[new_owner] = table_M, self.salts[owner]
        if length % self.page == 0:
            return None
        return int(src_M[full]), int(table_M[full])

    def move(self, owner, new_owner):
        """`new_owner` takes over `owner`'s pages (whatever it held before let go)."""
        if new_owner in self.tables:
            self.free(new_owner)
        self.tables[new_owner] = self.tables.pop(owner)
        self.salts[new_owner] = self.salts.pop(owner)

    def free(self, owner):
        """`owner` lets go of its pages (KeyError if it holds none: nothing is freed twice)."""
        table_M = self.tables.pop(owner)
        del self.salts[owner]
        self._release(table_M)

    def holds(self, owner) -> bool:
        return owner in self.tables

    # ------------------------------------------------------------ the prefix cache

    def cache(self, owner, tokens) -> int:
        """Offer `owner`'s full blocks of `tokens` (the tokens at its positions 0..) to the prefix cache,
        where they are: their pages are now the cache's too. -> blocks newly cached."""
        if not self.capacity:
            return 0
        table_M, new = self.tables[owner], 0
        digests = block_digests(tokens[: self.M * self.page], self.page, self.salts[owner])
        for j, d in enumerate(digests):
            p = int(table_M[j])
            if d in self.blocks or p == SCRATCH:
                continue
            if len(self.blocks) >= self.capacity and not self._evict():
                break  # every cached block is mapped by an owner: a later block alone could never match
            self.blocks[d] = p
            self.refs[p] += 1
            new += 1
        return new

    def clear(self):
        """Forget every cached block (pages that owners map stay theirs)."""
        for p in self.blocks.values():
            self._release([p])
        self.blocks.clear()

    # ------------------------------------------------------------ counts

    def memory(self) -> dict:
        """Pages in the pool, held by no one, and held more than once (cached blocks read in place)."""
        return {
            "blocks": self.pages,
            "free_blocks": len(self.free_pages),
            "shared_blocks": int(np.sum(self.refs[1:] >= 2)),
        }

    def check(self):
        """Every reference count equals the holders it counts; the free list is the pages no one holds,
        each once (AssertionError otherwise)."""
        want = np.zeros(self.pages, np.int64)
        want[SCRATCH] = 1
        want[self.reserved.start : self.reserved.stop] = 1
        for table_M in self.tables.values():
            np.add.at(want, table_M[table_M != SCRATCH], 1)
        np.add.at(want, np.asarray(list(self.blocks.values()), np.int64), 1)
        assert np.array_equal(want, self.refs), "reference counts differ from the holders"
        assert len(set(self.free_pages)) == len(self.free_pages), "a page is free twice"
        assert sorted(self.free_pages) == np.flatnonzero(want == 0).tolist(), "free list != unheld pages"

    # ------------------------------------------------------------ inside

    def _fill(self, table_M, first: int, last: int):
        """Fresh pages into table_M[first .. last // page] (all or none)."""
        try:
            for j in range(first, last // self.page + 1):
                table_M[j] = self._take()
        except OutOfPages:
            self._release(table_M)
            raise

    def _take(self) -> int:
        if not self.free_pages and not self._evict():
            raise OutOfPages(
                f"out of KV pages: all {self.pages} are held by requests and cached blocks in use"
            )
        p = self.free_pages.pop()
        self.refs[p] = 1
        return p

    def _evict(self) -> bool:
        """Drop the least recently used cached block no owner maps -> whether one was dropped."""
        for d, p in self.blocks.items():
            if self.refs[p] == 1:
                del self.blocks[d]
                self._release([p])
                return True
        return False

    def _release(self, table_M):
        for p in table_M:
            p = int(p)
            if p == SCRATCH:
                continue
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free_pages.append(p)
