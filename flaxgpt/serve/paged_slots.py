"""The paged engine's slots (serve.py --kv_cache paged): what serve.engine.Engine delegates to when its
slots cache is a models.paged.PagedKVCache, whose one page pool the slots and the prefix cache share
(serve/pages.py keeps who holds which page).

    paged = PagedSlots(pool_cache, slots=8, block=16, blocks=256, mesh=None, body=_prefill_body)
    cache = paged.attach(pool_cache)                                  # every row on the scratch page
    hit, table_M, digests = paged.open(prompt_ids, last, finished_B)  # a prefill job's table
    state, prefix = paged.prefill(step_fn, state, table_M, chunk_1P, start, size, rows, max_k)
    prefix = paged.prefilled(job, prefix)       # after the last chunk: the pages move to the Prefix
    paged.assign(slot, prefix.pages); state = paged.upload(state)     # insert, then before a step
    paged.keep(slot, tokens) / paged.end(slot)  # the request's end: its pages given back

A request's block table maps its cached prefix's pages in place and fresh pages after them; its
prefill chunks are written straight into the pool through that table (no one-row cache, no insert
copy: `insert` sets the slot's row of the block table); the prompt's full blocks and, at `keep`, the
reply's stay where they are, now held by the prefix cache too. `keep` and `release` give a slot's
pages back (and a prefill short of pages takes back those of slots the last `generate` said were
done); `cancel` gives back a prefill job's that never reached a slot. The block table is an array
the compiled step reads, so all of this changes the host's table and uploads it before the next
step: nothing recompiles, no keys or values move.

Shape letters: B slots, M blocks (pages) per slot, P prompt bucket.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from flaxgpt.models.paged import PagedKVCache
from flaxgpt.serve.pages import SCRATCH, OutOfPages, SharedPages
from flaxgpt.serve.prefix_cache import block_digests


@functools.partial(jax.jit, static_argnames=("body", "max_k"), donate_argnames=("state",))
def _prefill_pages(body, step_fn, state, table_1M, chunk_1P, start, size, rows, max_k: int):
    """The engine's prefill `body` straight into the slots' page pool through one request's table: its
    cached prefix is read where it lies, its new positions go to its own pages -> (state, Prefix
    without a cache)."""
    # `body` is the engine's own (one definition of a prefill chunk; static: one function, one program
    # per bucket), handed in because the engine imports this module, not the other way round
    pool = state.cache
    prefix = body(step_fn, pool.replace(table_BM=table_1M), chunk_1P, start, size, rows, max_k)
    return state.replace(cache=pool.replace(k=prefix.cache.k, v=prefix.cache.v)), prefix._replace(cache=None)


class PagedSlots:
    """The paged engine's host side: the pool's bookkeeping (`pages`), the slots' block table and when
    the device's copy of it is stale; see the module docstring."""

    def __init__(self, cache: PagedKVCache, *, slots: int, block: int, blocks: int, mesh, body):
        """cache: the slots cache (its pool holds the slots' windows, the prefix cache's `blocks` blocks
        of `block` positions and the scratch page); body: the engine's _prefill_body (a prefill chunk)."""
        page = cache.k[0].shape[2]
        if mesh is not None:
            raise ValueError("the paged cache is one device's: serve it without a mesh")
        if blocks and block != page:
            raise ValueError(f"the prefix cache's blocks are the pages: prefix_block {block} != page {page}")
        self.pages = SharedPages(
            pool=cache.k[0].shape[1], page=page, slots=slots, M=cache.table_BM.shape[1], capacity=blocks
        )
        self.body = body
        self.dirty = False  # the host's block table changed since the device's copy
        # read at /metrics scrapes from another thread: sizes now, not the (donated) buffers then;
        # a window's pages (the pool also holds the prefix cache's)
        self.slot_bytes = sum(x.nbytes for x in (*cache.k, *cache.v)) // self.pages.pool * self.pages.M

    @property
    def prefix_cache(self) -> SharedPages | None:
        """The prefix cache: the pool's own bookkeeping of cached blocks (None: off)."""
        return self.pages if self.pages.capacity else None

    def attach(self, cache: PagedKVCache) -> PagedKVCache:
        """The slots cache reading the host's block table: every row starts on the scratch page."""
        return cache.replace(table_BM=jnp.asarray(self.pages.rows))

    def open(self, prompt_ids, last: int, finished_B) -> tuple[int, np.ndarray, list[bytes]]:
        """A prefill job's table [M] up to position `last` (pages.open); short of pages, the slots the
        last generate said were done (finished_B [B]) are ended first -> (hit, table_M, digests)."""
        try:
            return self.pages.open(prompt_ids, last=last)
        except OutOfPages:  # finished slots that no keep or release ended still hold pages
            for slot in np.flatnonzero(finished_B):
                self.end(slot)
            return self.pages.open(prompt_ids, last=last)

    def prefill(self, step_fn, state, table_M, chunk_1P, start, size, rows, max_k: int):
        """One prefill chunk into the shared pool through a job's table -> (state, Prefix)."""
        return _prefill_pages(
            self.body, step_fn, state, np.array(table_M[None]), chunk_1P, start, size, rows, max_k=max_k
        )

    def prefilled(self, job, prefix):
        """After a job's last chunk: the prompt's full blocks join the prefix cache in place, and the
        pages move to the Prefix (given back at once if its first token finished it: never inserted)."""
        if self.prefix_cache is not None:
            self.pages.offer(job.pages, job.digests)
        pages, job.pages = job.pages, None
        if bool(prefix.done):
            self.pages.release(pages)
            return prefix
        return prefix._replace(pages=pages)

    def cancel(self, job):
        """Give back the pages of a prefill job that never reached a slot."""
        if job.pages is not None:
            self.pages.release(job.pages)
            job.pages = None

    def assign(self, slot: int, table_M):
        """A prefix's pages (None: it gave them back, finished) become slot `slot`'s row."""
        self.pages.assign(slot, np.full(self.pages.M, SCRATCH, np.int32) if table_M is None else table_M)
        self.dirty = True

    def keep(self, slot: int, tokens) -> int:
        """Engine.keep: the slot's full blocks stay where they are, now the prefix cache's too, and the
        slot ends. -> blocks newly kept."""
        digests = block_digests(tokens, self.pages.block)
        new = self.pages.offer(self.pages.rows[slot], digests) if self.prefix_cache is not None else 0
        self.end(slot)
        return new

    def end(self, slot: int):
        """Slot `slot`'s pages given back; its row idles on the scratch page."""
        self.pages.end(slot)
        self.dirty = True

    def upload(self, state):
        """The state with the host's block table, if it changed since the last upload."""
        if not self.dirty:
            return state
        # a copy: the host table changes in place while the step may still run
        table_BM = jax.device_put(np.array(self.pages.rows), state.cache.table_BM.sharding)
        self.dirty = False
        return state.replace(cache=state.cache.replace(table_BM=table_BM))

    def memory(self) -> dict:
        """Engine.kv_memory: a slot's window's bytes and the pool's pages (the slots' and the prefix
        cache's), those held by no one and those held more than once (shared in place)."""
        return {
            "bytes_per_slot": self.slot_bytes,
            "blocks": self.pages.pool,
            "free_blocks": len(self.pages.free),
            "shared_blocks": self.pages.shared,
        }

    @staticmethod
    def refuse(what: str):
        """Engine.fork and insert_group put one prefix into several slots: a paged prefix's pages have
        one owner, so the paged engine has neither."""
        raise ValueError(f"Engine.{what} needs a contiguous slots cache, not the paged one")
