"""The block manager: prefix hashes (chained, salted by adapter), LRU eviction, and reference counts that
stay exact over random schedules of admit / fork / preempt / finish / evict (no page freed twice)."""

import numpy as np
import pytest

from flaxgpt.serve.block_manager import SCRATCH, BlockManager, OutOfPages, block_digests


def test_block_digests_chain_and_salt():
    a = list(range(13))
    assert block_digests(a, 4) == block_digests(a[:12] + [99], 4)  # only full blocks count
    # a block matches only when every token before it matches
    assert block_digests([1, 2, 3, 4, 5, 6, 7, 8], 4)[1] != block_digests([0, 2, 3, 4, 5, 6, 7, 8], 4)[1]
    # the same tokens under two adapters are two different blocks
    assert (
        block_digests(a, 4, b"adapter:1")[0] != block_digests(a, 4, b"adapter:2")[0] != block_digests(a, 4)[0]
    )


def test_prefix_blocks_are_mapped_in_place_keyed_by_adapter_and_evicted_lru():
    bm = BlockManager(pages=1 + 2 * 4 + 3, page=4, M=4, capacity=3)
    a = list(range(13))
    assert bm.allocate("r1", a, last=15) == 0
    assert bm.cache("r1", a) == 3 and len(bm.blocks) == 3
    # the same prompt reads r1's pages where they are; the last token is never a hit
    assert bm.allocate("r2", a, last=15) == 12
    assert bm.table("r2")[:3].tolist() == bm.table("r1")[:3].tolist()
    assert bm.memory()["shared_blocks"] == 3
    bm.free("r2")
    # another adapter's request does not see them
    assert bm.allocate("r3", a, last=15, salt=b"adapter:7") == 0
    bm.free("r3")
    bm.free("r1")  # the cache alone holds the 3 blocks now
    assert bm.memory()["free_blocks"] == 12 - 1 - 3
    b = [50] + a[1:]
    bm.allocate("r4", b, last=15)
    assert bm.cache("r4", b) == 3  # the cache is full: 3 new blocks evict a's 3 (least recent, unmapped)
    assert bm.match(a) == [] and len(bm.match(b)) == 3
    bm.check()
    with pytest.raises(KeyError):
        bm.free("r1")  # freed once already: never twice


def test_a_fork_shares_full_blocks_and_copies_the_partial_one():
    bm = BlockManager(pages=1 + 3 * 4, page=4, M=4, capacity=0)
    bm.allocate("p", list(range(10)), last=9)  # positions 0..9: two full blocks and a partial one
    src, dst = bm.fork("p", "c", 10, last=14)
    t_p, t_c = bm.table("p"), bm.table("c")
    assert t_c[:2].tolist() == t_p[:2].tolist() and src == t_p[2] and dst == t_c[2] != src
    assert t_c[3] not in (SCRATCH, *t_p.tolist())  # its own page for positions 12..14
    assert bm.fork("p", "d", 8, last=9) is None  # a prompt of whole blocks: nothing to copy
    bm.move("c", "slot0")
    bm.free("p")
    bm.free("d")
    bm.check()
    assert bm.memory()["free_blocks"] == 12 - 4


def test_random_schedules_keep_every_count_exact():
    """Admit (with shared system prompts, so cached blocks are mapped), fork, preempt (free mid-way),
    finish (cache the reply, then free), evict (by pressure and clear): after every operation each page's
    count equals its holders and the free list is exactly the pages no one holds, once each. Half the
    schedules run beside reserved pages (the engine's slot windows), which are never handed out."""
    rng = np.random.default_rng(0)
    page, M, slots, capacity = 4, 6, 5, 7
    for i in range(20):
        reserved = range(M, M + (i % 2) * slots * M)  # as the engine's: after the scratch page's window
        bm = BlockManager(
            pages=1 + len(reserved) + (slots + 1) * M + capacity, page=page, M=M, capacity=capacity,
            reserved=reserved,
        )  # fmt: skip
        systems = [rng.integers(0, 5, 8).tolist() for _ in range(2)]
        live, n = {}, 0
        for _ in range(120):
            op = rng.choice(
                ["admit", "admit", "fork", "preempt", "finish", "clear"], p=[0.3, 0.2, 0.15, 0.1, 0.2, 0.05]
            )
            if op == "admit" and len(live) < slots:
                prompt = systems[rng.integers(2)] + rng.integers(0, 5, rng.integers(1, 9)).tolist()
                last = min(len(prompt) + int(rng.integers(0, 8)), M * page - 1)
                salt = [b"", b"adapter:1"][rng.integers(2)]
                try:
                    hit = bm.allocate(n, prompt, last, salt)
                except OutOfPages:
                    bm.check()
                    continue
                assert hit % page == 0 and hit < len(prompt)
                bm.cache(n, prompt)
                live[n], n = prompt, n + 1
            elif op == "fork" and live and len(live) < slots:
                src = list(live)[rng.integers(len(live))]
                length = len(live[src])
                try:
                    copy = bm.fork(src, n, length, min(length + 3, M * page - 1))
                except OutOfPages:
                    bm.check()
                    continue
                assert (copy is None) == (length % page == 0)
                live[n], n = live[src], n + 1
            elif op in ("preempt", "finish") and live:
                owner = list(live)[rng.integers(len(live))]
                if op == "finish":
                    bm.cache(owner, live[owner] + rng.integers(0, 5, 4).tolist())
                bm.free(owner)
                del live[owner]
            elif op == "clear":
                bm.clear()
            bm.check()
        for owner in list(live):
            bm.free(owner)
        bm.clear()
        bm.check()
        assert len(bm.free_pages) == bm.pages - 1 - len(reserved)  # all but scratch and reserved came back
        assert not set(bm.free_pages) & set(reserved)
