"""The paged kind of KV cache (models/cache.py's interface): keys and values in pages, read through
per-row block tables.

    cache = PagedKVCache.for_slots(config, 16, 1024, page=16, impl=paged_impl("tpu", config.head_dim))
    tokens_BN, lengths_B = sampling.generate(step_fn, cache, ...)       # any decoder takes it
    engine = serve.engine.Engine(step_fn, config, slots=16, max_len=1024)  # the server's one cache

Layout: per layer, k and v as [J, P, page, K] (J key/value heads, P pages in the pool, page
positions each), the layout of JAX's Pallas paged-attention kernels, with a table [B, M] of the
page holding each row's m-th block of `page` positions (M = max_len / page). Position s of row b
lies at page table[b, s // page], offset s % page; positions >= S are not written. `for_slots` gives
the identity table (row b owns pages b*M .. b*M + M - 1); the table is an array the step reads, not a
constant: the serving engine (serve/block_manager.py) maps one cached prefix's pages into several
rows at once and writes a prefill through a one-row table, without recompiling. `take_rows` copies
pages' contents (each page belongs to one row).

Windows in place (`windows_at` >= 0): the table is known to be the identity from page `windows_at`
(row b's m-th page is windows_at + b*M + m: `for_slots`, and the engine's slot windows for GRPO's
rollouts), so attention reads each row's pages from the pool seen as windows ([J, P/M, M, page, K], a
reshape: P and windows_at multiples of M), not through a gather: on XLA:CPU the gather of every window
at every layer and step made decoding over the pool about 1.2x slower than the contiguous cache. A
table set through `with_table` is read as a table again (windows_at = -1).

The model sees this cache through the step_fn protocol: `layer(i)` hands each attention a
PagedLayer, whose `attend` writes the step's new keys and values into their pages and attends over
the row's pages, on one of three paths (`impl`):
  xla         plain JAX: each row's pages a group at a time (128 positions; 32 decoding through a
              table), an online softmax over the groups (any query length; what CPUs run, as fast as
              the contiguous cache)
  pallas_tpu  jax.experimental.pallas.ops.tpu.paged_attention (one query per row: decoding)
  pallas_gpu  jax.experimental.pallas.ops.gpu.paged_attention (one query per row: decoding)
A prefill (more than one query per row) or a sliding window takes the xla path on every target.
jax 0.10.2 also ships ragged_paged_attention for TPU (prefill and decode queries of many sequences
in one call, keys and values interleaved [P, page, 2J, K]); the engine prefills one request at a time
(its chunks through a one-row table: the xla path), so decoding is what needs a kernel, and
paged_attention is that one.

Shape letters: B rows (slots), T queries per row, H query heads, J key/value heads, K head dim,
P pages, M pages per row, S = M * page positions per row.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from flaxgpt.kernels import target
from flaxgpt.models.attention import attend_cached, causal_mask
from flaxgpt.models.cache import Cache, KVCache, KVLayer

IMPLS = ("xla", "pallas_tpu", "pallas_gpu")


def paged_impl(platform: str, head_dim: int, devices: int = 1) -> str:
    """The decode attention path a platform takes: JAX's Pallas paged-attention kernel where it ships
    one that lowers for this head size. jax 0.10.2's TPU kernel needs head_dim a multiple of 128 (its
    blocks' last dimension; GPT-2's 64 fails to lower), so GPT-2 takes the xla path on TPU and
    Llama-class models (128) the kernel; the GPU (Triton) kernel lowers for both. An engine over
    several `devices` takes the xla path, which XLA partitions: the Pallas kernels are custom calls it
    cannot split ("Mosaic kernels cannot be automatically partitioned": serve.generate over 2 of a
    v5p-8's devices did not compile), and wrapping them in a shard_map is not done yet."""
    if devices > 1:
        return "xla"
    if platform == "tpu":
        return "pallas_tpu" if head_dim % 128 == 0 else "xla"
    return "pallas_gpu" if platform in ("gpu", "cuda") else "xla"


def _largest_divisor(n: int, most: int) -> int:
    return max(d for d in range(1, min(n, most) + 1) if n % d == 0)


def gpu_blocks(pages: int) -> tuple[int, int]:
    """(k_splits, pages_per_compute_block) for the Triton paged kernel over a row's `pages`: up to 16
    splits, each read in blocks of a power of two of pages, at most 8 (Triton's tiles are powers of
    two: 80 pages split 16 x 5 did not compile for h100-1)."""
    k_splits = _largest_divisor(pages, 16)
    return k_splits, max(b for b in (1, 2, 4, 8) if (pages // k_splits) % b == 0)


def gather_rows(buf_JPpK, table_BM):
    """Each table row's pages in order, laid out as a contiguous cache's buffer: [B*J, M*page, K]."""
    J, _, page, K = buf_JPpK.shape
    B, M = table_BM.shape
    x_JBMpK = jnp.take(buf_JPpK, table_BM, axis=1, mode="clip")
    return jnp.transpose(x_JBMpK, (1, 0, 2, 3, 4)).reshape(B * J, M * page, K)


@struct.dataclass
class PagedLayer(KVLayer):
    """One layer's pages and the rows' block table: what an attention block receives and returns."""

    k_JPpK: jax.Array
    v_JPpK: jax.Array
    table_BM: jax.Array
    impl: str = struct.field(pytree_node=False)
    windows_at: int = struct.field(pytree_node=False, default=-1)  # see the module docstring

    def attend(
        self, q_BTHK, k_BTJK, v_BTJK, positions_BT, *, window=0, real_BT=None, kernels=False, **attend_kw
    ):
        """Write the new keys/values at `positions_BT`, attend over each row's pages -> (y_BTHK, layer)."""
        J, P, page, K = self.k_JPpK.shape
        B, T, H, _ = q_BTHK.shape
        # the pages a row's T consecutive positions touch: one when decoding, else at most (T-1)//page + 2
        n = 1 if T == 1 else (T - 1) // page + 2
        m_Bn = positions_BT[:, :1] // page + jnp.arange(n)
        page_Bn = jnp.take_along_axis(self.table_BM, m_Bn, axis=1, mode="clip")
        page_Bn = jnp.where(m_Bn < self.table_BM.shape[1], page_Bn, P)  # past the row: dropped
        local_BT = positions_BT - m_Bn[:, :1] * page  # each position's place in its row's n pages
        # XLA:CPU decoding (one query a row) writes single positions and reads the pages without a
        # transposed copy (_attend_blocks' products): whole-page writes and the dot's [J, B, S, K]
        # operand copied 16 pages and 8 windows a step for 4 layers; GRPO's rollouts ran 0.79x the contiguous
        # cache's. TPU keeps whole pages (the tiling note in `put`), GPUs and TPUs their kernels.
        rows_path = T == 1 and not window and self.impl == "xla" and target.platform() == "cpu"

        def put(buf_JPpK, new_BTJK):
            if rows_path:  # a CPU decoding step: each row's one new position, in place
                new_JBK = jnp.transpose(new_BTJK[:, 0], (1, 0, 2)).astype(buf_JPpK.dtype)
                return buf_JPpK.at[:, page_Bn[:, 0], local_BT[:, 0]].set(new_JBK, mode="drop")
            # elsewhere read the pages whole, set the positions, write them back whole: TPU tiles a
            # head's page [page, K] as the paged kernel reads it, and writing single positions (a row
            # of a tile) made XLA lay the pool out position-major instead, copying every layer's pages
            # at every step and prefill chunk (docs/aot.md). Rows never write one page together
            # (block_manager.py: shared pages are full; idle rows share only the scratch page, which
            # no one reads); pages read past a row's positions go back as they were
            pages_JBnpK = jnp.take(buf_JPpK, page_Bn, axis=1, mode="clip")
            flat_JBNK = pages_JBnpK.reshape(J, B, n * page, K)
            new_JBTK = jnp.transpose(new_BTJK, (2, 0, 1, 3)).astype(buf_JPpK.dtype)
            flat_JBNK = flat_JBNK.at[:, jnp.arange(B)[:, None], local_BT].set(new_JBTK, mode="drop")
            return buf_JPpK.at[:, page_Bn].set(flat_JBNK.reshape(J, B, n, page, K), mode="drop")

        layer = self.replace(k_JPpK=put(self.k_JPpK, k_BTJK), v_JPpK=put(self.v_JPpK, v_BTJK))
        if attend_kw.get("sow") is not None:  # attention maps need every probability at once
            return layer._attend_xla(q_BTHK, positions_BT, window, attend_kw), layer
        if self.impl == "xla" or T > 1 or window:
            return layer._attend_blocks(q_BTHK, positions_BT, window, products=rows_path, **attend_kw), layer
        scale, softcap = attend_kw.get("scale", 0.0), attend_kw.get("softcap", 0.0)
        q_BHK = (q_BTHK[:, 0] * (scale or 1 / math.sqrt(K))).astype(q_BTHK.dtype)  # the kernels do not scale
        lengths_B = (positions_BT[:, 0] + 1).astype(jnp.int32)
        cap = softcap or None
        M = self.table_BM.shape[1]
        if self.impl == "pallas_tpu":
            from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

            y_BHK = paged_attention(
                q_BHK, layer.k_JPpK, layer.v_JPpK, lengths_B, self.table_BM,
                attn_logits_soft_cap=cap, pages_per_compute_block=_largest_divisor(M, 8),
            )  # fmt: skip
        elif self.impl == "pallas_gpu":
            from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

            k_splits, pages_per_block = gpu_blocks(M)
            y_BHK = paged_attention(
                q_BHK, layer.k_JPpK, layer.v_JPpK, self.table_BM, lengths_B, attn_logits_soft_cap=cap,
                k_splits=k_splits, pages_per_compute_block=pages_per_block,
            )  # fmt: skip
        else:
            raise ValueError(f"paged attention impl {self.impl!r} is not one of {IMPLS}")
        return y_BHK[:, None].astype(q_BTHK.dtype), layer

    def rows_NSK(self):
        """Each row's pages in order as the contiguous cache lays them out: ([B*J, S, K], [B*J, S, K])."""
        return gather_rows(self.k_JPpK, self.table_BM), gather_rows(self.v_JPpK, self.table_BM)

    def _attend_blocks(
        self, q_BTHK, positions_BT, window=0, products=False, scale=0.0, softcap=0.0, sow=None
    ):
        """Attention over each row's pages a group of pages at a time, with an online softmax
        (running max, sum and weighted values per query): the xla path (CPUs; prefills and windows on
        every target). Gathering a row's whole window first ([B*J, S, K], then transposed for the dot)
        copied the cache twice per layer and step and ran 1.7x slower than the contiguous cache on a
        2-core CPU; a group of blocks of 128 positions stays in cache and is read once. Groups past
        every query's position are not visited (the loop's bound is the batch's last position).
        products (XLA:CPU decoding, one query a row): pages read through the table are gathered row by
        row and taken by dots in that layout, rows past their own position read page 0 (see `read`
        and `group_pages`); windows in place are read by dots, as on every other target (their
        batch axes J, B lead: a slice of the pool, no copy)."""
        del sow  # handled by the caller (_attend_xla)
        B, T, H, K = q_BTHK.shape
        J, _, page, _ = self.k_JPpK.shape
        M, G = self.table_BM.shape[1], H // J
        rows_major = products and self.windows_at < 0
        # pages a group: 128 positions keep a prefill's dots busy; one query a row read through the
        # table (rows_major) has no matrix to fill, so small groups of 32 only skip more of the window
        # past the batch's last position (GRPO's rollouts 64 rows x 96: about 1.1x d9de538's
        # contiguous engine, was 0.92x). Windows in place take 128 too: GRPO's benchmark rollout
        # (32 rows, windows of 80 = 5 pages) ran its 1-page groups ~3 loop turns a layer and step;
        # in one group it took 0.79x the CPU time of 1-page groups (both by dots, AVX-512, loaded)
        per = _largest_divisor(M, max(1, (32 if rows_major else 128) // page))
        acc = jnp.promote_types(q_BTHK.dtype, jnp.float32)  # as attend_cached: fp32 at least
        q_JBRK = jnp.transpose(q_BTHK.reshape(B, T, J, G, K), (2, 0, 3, 1, 4)).reshape(J, B, G * T, K)
        qpos_BR = jnp.broadcast_to(positions_BT[:, None, :], (B, G, T)).reshape(B, G * T)  # R = G*T rows
        scale = scale or 1 / math.sqrt(K)
        rows, at = B, 0  # the cache's rows, and where they start among the rows attended
        if self.windows_at >= 0:  # windows in place: every window of the pool is attended, the pool
            # read as [J, P/M, M * page, K] (a reshape: free) and the queries padded to its P/M rows
            # (at position 0, their outputs dropped). Taking the rows' windows out instead (a slice)
            # copied them whole, every layer and step, as the gather did
            B, at = self.k_JPpK.shape[1] // M, self.windows_at // M
            q_JBRK = jnp.pad(q_JBRK, ((0, 0), (at, B - at - rows), (0, 0), (0, 0)))
            qpos_BR = jnp.pad(qpos_BR, ((at, B - at - rows), (0, 0)))

        last_B = positions_BT[:, -1] // page  # each row's last page read

        def group_pages(g):  # group g's page ids of every row: [B, per]
            ids_Bper = jax.lax.dynamic_slice_in_dim(self.table_BM, g * per, per, axis=1)
            if not rows_major:
                return ids_Bper
            # the loop runs to the batch's last position; a row's pages past its own position are all
            # masked, so it reads page 0 there: the same page for every row, in cache after the first
            # read, instead of pages of its window no query sees (GPT-2 124M, 16 rows at 46..261 of
            # 512: the decoding forward ~8% faster)
            past_Bper = (g * per + jnp.arange(per))[None] > last_B[:, None]
            return jnp.where(past_Bper, 0, ids_Bper)

        def pages(buf_JPpK, g):  # group g's pages of every row: [J, B, per * page, K]
            if self.windows_at >= 0:
                w_JBMpK = buf_JPpK.reshape(J, B, M, page, K)
                return jax.lax.dynamic_slice_in_dim(w_JBMpK, g * per, per, axis=2).reshape(
                    J, B, per * page, K
                )
            return jnp.take(buf_JPpK, group_pages(g), axis=1, mode="clip").reshape(J, B, per * page, K)

        def rows_pages(buf_JPpK, g):  # group g's pages of every row, as gathered: [B, n, J, page, K]
            return jnp.moveaxis(jnp.take(buf_JPpK, group_pages(g), axis=1, mode="clip"), 0, 2).astype(acc)

        def read(g):  # group g's scores [J, B, R, N], and its values weighted: [J, B, R, N] -> [J, B, R, K]
            if rows_major:
                # one query a row over gathered pages (XLA:CPU decoding): the pages as the gather lays
                # them out, row by row ([B, n, J, page, K]), into dots whose operand layout XLA chooses
                # (the gather's fusion writes it): the J-major form of `pages` cost a transposed copy of
                # every group's keys and values each layer and step, and products-and-sums over the
                # gathered order (the ninth to eleventh sessions' form) ran the values' sum over two
                # axes at ~1 GFLOP/s: the serving step (GPT-2 124M, 16 rows at 46..261) 288 -> 180 ms,
                # d9de538's contiguous engine 200 ms
                k_BnJpK, v_BnJpK = rows_pages(self.k_JPpK, g), rows_pages(self.v_JPpK, g)
                s_JBRnp = jnp.einsum("jbrk,bnjpk->jbrnp", q_JBRK.astype(acc), k_BnJpK)

                def weigh(p_JBRN):
                    return jnp.einsum("jbrnp,bnjpk->jbrk", p_JBRN.reshape(J, B, -1, per, page), v_BnJpK)

                return s_JBRnp.reshape(J, B, -1, per * page), weigh
            # windows in place on XLA:CPU too: dots, not products and sums (q * k summed over K, p * v
            # over N: YNNPACK's reductions), which took 2.9x the CPU time of the dots for GRPO's
            # benchmark rollout (2026-11-29, jax 0.10.2, AVX-512, loaded; docs/benchmarks.md)
            k_JBNK, v_JBNK = pages(self.k_JPpK, g), pages(self.v_JPpK, g)
            s_JBRN = jnp.einsum(
                "jbrk,jbnk->jbrn", q_JBRK, k_JBNK.astype(q_JBRK.dtype), preferred_element_type=acc
            )
            return s_JBRN, lambda p_JBRN: jnp.einsum(
                "jbrn,jbnk->jbrk", p_JBRN.astype(v_JBNK.dtype), v_JBNK, preferred_element_type=acc
            )

        def group(g, carry):
            max_JBR, sum_JBR, y_JBRK = carry
            s_JBRN, weigh = read(g)
            s_JBRN = s_JBRN * scale
            if softcap:  # as attend_cached
                s_JBRN = softcap * jnp.tanh(s_JBRN / softcap)
            kpos_N = g * per * page + jnp.arange(per * page)
            seen_BRN = kpos_N <= qpos_BR[:, :, None]
            if window:
                seen_BRN &= kpos_N > qpos_BR[:, :, None] - window
            s_JBRN = jnp.where(seen_BRN[None], s_JBRN, -jnp.inf)
            new_JBR = jnp.maximum(max_JBR, s_JBRN.max(-1))
            safe_JBR = jnp.where(jnp.isfinite(new_JBR), new_JBR, 0.0)  # a group a query sees nothing of
            p_JBRN = jnp.exp(s_JBRN - safe_JBR[..., None])
            keep_JBR = jnp.exp(max_JBR - safe_JBR)
            y_JBRK = y_JBRK * keep_JBR[..., None] + weigh(p_JBRN)
            return new_JBR, sum_JBR * keep_JBR + p_JBRN.sum(-1), y_JBRK

        R = G * T
        init = (jnp.full((J, B, R), -jnp.inf, acc), jnp.zeros((J, B, R), acc), jnp.zeros((J, B, R, K), acc))
        if M == per:  # one group: no loop (nothing past the last position to skip)
            _, sum_JBR, y_JBRK = group(0, init)
        else:
            groups = jnp.minimum(jnp.max(positions_BT) // (per * page) + 1, M // per)
            _, sum_JBR, y_JBRK = jax.lax.fori_loop(0, groups, group, init)
        y_JBGTK = (y_JBRK / sum_JBR[..., None])[:, at : at + rows].reshape(J, rows, G, T, K)
        return jnp.transpose(y_JBGTK, (1, 3, 0, 2, 4)).reshape(rows, T, H, K).astype(q_BTHK.dtype)

    def _attend_xla(self, q_BTHK, positions_BT, window, attend_kw):
        k_NSK, v_NSK = self.rows_NSK()
        mask_BHTS = causal_mask(positions_BT, k_NSK.shape[1], window)
        return attend_cached(q_BTHK, k_NSK, v_NSK, mask_BHTS, **attend_kw)


@struct.dataclass
class PagedKVCache(Cache):
    k: tuple[jax.Array, ...]  # L x [J, P, page, K]
    v: tuple[jax.Array, ...]  # L x [J, P, page, K]
    table_BM: jax.Array  # [B, M] int32: the page of each row's m-th block
    n_head: int = struct.field(pytree_node=False)  # J, the key/value heads stored
    impl: str = struct.field(pytree_node=False)  # the decode attention path (see the module docstring)
    # >= 0: the table is the identity from this page, each row's window read in place (module docstring)
    windows_at: int = struct.field(pytree_node=False, default=-1)

    @classmethod
    def for_slots(
        cls, config, slots: int, max_len: int, *, page: int = 16, impl: str = "xla", dtype=None, extra_pages=0
    ):
        """Pages for `slots` rows of max_len positions each (identity table: slot b owns M pages, its
        window read in place), and `extra_pages` more after them (a pool the slots share with the prefix
        cache: serve/block_manager.py)."""
        if max_len % page:
            raise ValueError(f"the window {max_len} is not a multiple of the page size {page}")
        if impl not in IMPLS:
            raise ValueError(f"paged attention impl {impl!r} is not one of {IMPLS}")
        J, M = getattr(config, "kv_heads", config.n_head), max_len // page
        shape = (J, slots * M + extra_pages, page, config.head_dim)
        dtype = jnp.dtype(dtype or config.dtype)
        zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layer))  # noqa: E731
        table = jnp.arange(slots * M, dtype=jnp.int32).reshape(slots, M)
        windows_at = 0 if extra_pages % M == 0 else -1  # the pool seen as windows: whole windows only
        return cls(k=zeros(), v=zeros(), table_BM=table, n_head=J, impl=impl, windows_at=windows_at)

    def with_table(self, table_BM, windows_at: int = -1) -> PagedKVCache:
        """The same pool read through another table (rows: its rows); windows_at >= 0 only where that
        table is the identity from page windows_at (see the module docstring)."""
        (B, M), P = table_BM.shape, self.k[0].shape[1]
        if windows_at >= 0 and (windows_at + B * M > P or windows_at % M or P % M):
            raise ValueError(
                f"{B} windows of {M} pages from page {windows_at} are not whole windows of a {P}-page pool"
            )
        return self.replace(table_BM=table_BM, windows_at=windows_at)

    @property
    def max_len(self) -> int:
        return self.table_BM.shape[1] * self.k[0].shape[2]

    @property
    def batch(self) -> int:
        return self.table_BM.shape[0]

    def layer(self, i: int) -> PagedLayer:
        return PagedLayer(self.k[i], self.v[i], self.table_BM, self.impl, self.windows_at)

    def with_layers(self, layers) -> PagedKVCache:
        """The cache made of the attention blocks' returned PagedLayers."""
        return self.replace(k=tuple(x.k_JPpK for x in layers), v=tuple(x.v_JPpK for x in layers))

    def take_rows(self, rows_R: jax.Array) -> PagedKVCache:
        """Row r's pages take the contents of row rows_R[r]'s (as many rows as the cache has)."""
        if rows_R.shape != (self.batch,):
            raise ValueError(f"a paged cache of {self.batch} rows cannot take {rows_R.shape} rows")
        src_BM = jnp.take(self.table_BM, rows_R, axis=0)

        def move(buf_JPpK):
            return buf_JPpK.at[:, self.table_BM].set(jnp.take(buf_JPpK, src_BM, axis=1))

        return self.replace(k=tuple(map(move, self.k)), v=tuple(map(move, self.v)))

    def write_pages(self, row: KVCache, pages_M) -> PagedKVCache:
        """Positions 0 .. M*page - 1 of a one-row contiguous cache into pages `pages_M` [M]
        (entries past the pool are dropped)."""
        if row.has_rings:
            raise ValueError("a paged cache keeps every position: it cannot take a row of ring buffers")
        page, M = self.k[0].shape[2], pages_M.shape[0]

        def put(buf_JPpK, row_JSK):
            J, _, K = row_JSK.shape
            blocks_JMpK = row_JSK[:, : M * page].reshape(J, M, page, K)
            return buf_JPpK.at[:, pages_M].set(blocks_JMpK.astype(buf_JPpK.dtype), mode="drop")

        return self.replace(k=tuple(map(put, self.k, row.k)), v=tuple(map(put, self.v, row.v)))

    def insert_row(self, row: KVCache, slot) -> PagedKVCache:
        """Copy a one-row contiguous cache (a prefill's) into slot `slot`'s pages."""
        return self.write_pages(row, self.table_BM[slot])

    def row(self, slot) -> KVCache:
        """Slot `slot`'s keys and values as a one-row contiguous cache (for the prefix cache)."""
        table_1M = self.table_BM[slot][None]
        kv = [
            (gather_rows(k, table_1M), gather_rows(v, table_1M)) for k, v in zip(self.k, self.v, strict=True)
        ]
        return KVCache.from_layers(kv, self.n_head)
