"""The paged cache kind: its layers read any block table, and write nothing past a row's positions."""

import jax
import numpy as np
import pytest

from flaxgpt.models.attention import attend_cached, causal_mask
from flaxgpt.models.cache import write_cache
from flaxgpt.models.gpt import GPTConfig
from flaxgpt.models.paged import PagedKVCache, gpu_blocks

CFG = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=32, vocab_size=40, n_kv_head=2)


@pytest.mark.parametrize("table", ["shuffled", "windows in place"])
def test_paged_layer_reads_any_block_table(table):
    """Pages in any order (a shuffled table, read through it) or each row's own consecutive pages
    (for_slots' identity, read in place: windows_at): each step's attention equals the contiguous
    cache's."""
    rng = np.random.default_rng(1)
    B, J, H, K, page, M = 2, 2, 4, 8, 4, 3
    cache = PagedKVCache.for_slots(CFG, B, page * M, page=page, extra_pages=M)
    assert cache.windows_at == 0
    if table == "shuffled":
        cache = cache.with_table(rng.permutation(B * M + M)[: B * M].astype(np.int32).reshape(B, M))
    else:  # the windows after a window of other pages, as the engine's slot windows follow its scratch
        cache = cache.with_table(M + np.arange(B * M, dtype=np.int32).reshape(B, M), windows_at=M)
    layer = cache.layer(0)
    k_NSK = v_NSK = jax.numpy.zeros((B * J, page * M, K))
    for t in range(page * M):
        k, v = (rng.standard_normal((B, 1, J, K)).astype(np.float32) for _ in range(2))
        q = rng.standard_normal((B, 1, H, K)).astype(np.float32)
        pos_B1 = np.array([[t], [max(t - 3, 0)]], np.int32)  # rows at different positions
        y, layer = layer.attend(q, k, v, pos_B1)
        k_NSK, v_NSK = write_cache(k_NSK, k, pos_B1), write_cache(v_NSK, v, pos_B1)
        want = attend_cached(q, k_NSK, v_NSK, causal_mask(pos_B1, page * M))
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


def test_nothing_is_written_past_a_row_and_rows_move_with_their_pages():
    """Positions >= max_len are dropped (the sampler's re-prefill feeds other rows there; both
    a prefill's positions and a decoding step's, each written by rewriting its pages whole), and
    take_rows copies pages' contents, as the contiguous cache copies rows."""
    rng = np.random.default_rng(2)
    J, H, K, page = 2, 4, 8, 4
    cache = PagedKVCache.for_slots(CFG, 2, 2 * page, page=page)  # 2 rows of 8 positions
    k, v = (rng.standard_normal((2, 2, J, K)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((2, 2, H, K)).astype(np.float32)
    pos_BT = np.array([[6, 8], [7, 9]], np.int32)  # 8 and 9: past each row
    _, layer = cache.layer(0).attend(q, k, v, pos_BT)
    cache = cache.with_layers([layer, cache.layer(1)])
    rows_k = np.asarray(cache.row(0).k[0]), np.asarray(cache.row(1).k[0])  # [J, 8, K] each
    for b, (p, _) in enumerate(pos_BT):
        np.testing.assert_array_equal(rows_k[b][:, p], k[b, 0])
        assert np.count_nonzero(np.delete(rows_k[b], p, axis=1)) == 0  # nothing else written
    # one position a row (decoding rewrites each row's page whole): 8 is past row 0, 3 inside row 1
    k1 = rng.standard_normal((2, 1, J, K)).astype(np.float32)
    _, layer = cache.layer(0).attend(q[:, :1], k1, k1, np.array([[8], [3]], np.int32))
    after = cache.with_layers([layer, cache.layer(1)])
    np.testing.assert_array_equal(after.row(0).k[0], rows_k[0])
    want = rows_k[1].copy()
    want[:, 3] = k1[1, 0]
    np.testing.assert_array_equal(after.row(1).k[0], want)
    swapped = cache.take_rows(jax.numpy.array([1, 0]))
    np.testing.assert_array_equal(swapped.row(0).k[0], rows_k[1])
    np.testing.assert_array_equal(swapped.row(1).k[0], rows_k[0])


def test_triton_blocks_are_powers_of_two_that_tile_the_row():
    """The GPU kernel's blocks of pages are powers of two (Triton's tiles); splits x blocks tile the
    row's pages exactly (a window of 1,280 tokens in pages of 16: 80 pages, once 16 splits of 5)."""
    assert gpu_blocks(80) == (16, 1) and gpu_blocks(64) == (16, 4) and gpu_blocks(7) == (7, 1)
    for pages in range(1, 300):
        k_splits, per_block = gpu_blocks(pages)
        assert per_block in (1, 2, 4, 8) and k_splits <= 16
        assert pages % (k_splits * per_block) == 0
