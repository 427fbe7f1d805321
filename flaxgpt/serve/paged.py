"""A paged KV cache for the engine's slots: keys and values in pages, read through per-slot block tables.

    cache = PagedKVCache.for_slots(config, 16, 1024, page=16, impl=paged_impl("tpu", config.head_dim))
    engine = Engine(step_fn, make_cache, slots=16, slots_cache=cache)   # prefills stay contiguous

Layout: per layer, k and v as [J, P, page, K] (J key/value heads, P pages in the pool, page
positions each), the layout of JAX's Pallas paged-attention kernels, with a table [B, M] of the
page holding each slot's m-th block of `page` positions (M = max_len / page). Position s of slot b
lies at page table[b, s // page], offset s % page. Here the table is the identity (slot b owns pages
b*M .. b*M + M - 1), so a slot's pages are as many as its window; but it is an array the step reads,
not a constant, so pages could be shared between slots (a prefix cache's blocks read in place, as
vLLM does) without recompiling.

The model sees this cache through the step_fn protocol: `layer(i)` hands each attention a
PagedLayer, whose `attend` writes the step's new keys and values into their pages and attends over
the row's pages, on one of three paths (`impl`):
  xla         plain JAX: gather the row's pages into [B*J, S, K] and attend as the contiguous cache
              does (any query length; the reference, and what CPUs run)
  pallas_tpu  jax.experimental.pallas.ops.tpu.paged_attention (one query per row: decoding)
  pallas_gpu  jax.experimental.pallas.ops.gpu.paged_attention (one query per row: decoding)
A prefill (more than one query per row) or a sliding window takes the xla path on every target.
jax 0.10.2 also ships ragged_paged_attention for TPU (prefill and decode queries of many sequences
in one call, keys and values interleaved [P, page, 2J, K]); the engine prefills alone into a
contiguous row, so decoding is what needs a kernel, and paged_attention is that one.

Shape letters: B rows (slots), T queries per row, H query heads, J key/value heads, K head dim,
P pages, M pages per row, S = M * page positions per row.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from flaxgpt.models.attention import attend_cached, causal_mask
from flaxgpt.models.cache import KVCache

IMPLS = ("xla", "pallas_tpu", "pallas_gpu")


def paged_impl(platform: str, head_dim: int) -> str:
    """The decode attention path a platform takes: JAX's Pallas paged-attention kernel where it ships
    one that lowers for this head size. jax 0.10.2's TPU kernel needs head_dim a multiple of 128 (its
    blocks' last dimension; GPT-2's 64 fails to lower), so GPT-2 takes the xla path on TPU and
    Llama-class models (128) the kernel; the GPU (Triton) kernel lowers for both."""
    if platform == "tpu":
        return "pallas_tpu" if head_dim % 128 == 0 else "xla"
    return "pallas_gpu" if platform in ("gpu", "cuda") else "xla"


def _largest_divisor(n: int, most: int) -> int:
    return max(d for d in range(1, min(n, most) + 1) if n % d == 0)


@struct.dataclass
class PagedLayer:
    """One layer's pages and the rows' block table: what an attention block receives and returns."""

    k_JPpK: jax.Array
    v_JPpK: jax.Array
    table_BM: jax.Array
    impl: str = struct.field(pytree_node=False)

    def attend(self, q_BTHK, k_BTJK, v_BTJK, positions_BT, scale=0.0, softcap=0.0, window=0):
        """Write the new keys/values at `positions_BT`, attend over each row's pages -> (y_BTHK, layer)."""
        J, P, page, K = self.k_JPpK.shape
        page_BT = jnp.take_along_axis(self.table_BM, positions_BT // page, axis=1, mode="clip")
        slot_BT = page_BT * page + positions_BT % page  # its row of the pages seen as [J, P*page, K]

        def put(buf_JPpK, new_BTJK):  # one index into [J, P*page, K]: scattering at (page, offset)
            # made TPU lay the pages out otherwise than the kernel reads them (a copy per layer and step)
            flat_JNK = buf_JPpK.reshape(J, P * page, K)
            flat_JNK = flat_JNK.at[:, slot_BT].set(
                jnp.transpose(new_BTJK, (2, 0, 1, 3)).astype(buf_JPpK.dtype)
            )
            return flat_JNK.reshape(J, P, page, K)

        layer = self.replace(k_JPpK=put(self.k_JPpK, k_BTJK), v_JPpK=put(self.v_JPpK, v_BTJK))
        B, T, H, _ = q_BTHK.shape
        if self.impl == "xla" or T > 1 or window:
            return layer._attend_xla(q_BTHK, positions_BT, scale, softcap, window), layer
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

            k_splits = _largest_divisor(M, 16)
            y_BHK = paged_attention(
                q_BHK, layer.k_JPpK, layer.v_JPpK, self.table_BM, lengths_B, attn_logits_soft_cap=cap,
                k_splits=k_splits, pages_per_compute_block=_largest_divisor(M // k_splits, 8),
            )  # fmt: skip
        else:
            raise ValueError(f"paged attention impl {self.impl!r} is not one of {IMPLS}")
        return y_BHK[:, None].astype(q_BTHK.dtype), layer

    def rows_NSK(self):
        """Each row's pages in order as the contiguous cache lays them out: ([B*J, S, K], [B*J, S, K])."""

        def gather(buf_JPpK):
            J, _, page, K = buf_JPpK.shape
            B, M = self.table_BM.shape
            x_JBMpK = jnp.take(buf_JPpK, self.table_BM, axis=1, mode="clip")
            return jnp.transpose(x_JBMpK, (1, 0, 2, 3, 4)).reshape(B * J, M * page, K)

        return gather(self.k_JPpK), gather(self.v_JPpK)

    def _attend_xla(self, q_BTHK, positions_BT, scale, softcap, window):
        k_NSK, v_NSK = self.rows_NSK()
        mask_BHTS = causal_mask(positions_BT, k_NSK.shape[1], window)
        return attend_cached(q_BTHK, k_NSK, v_NSK, mask_BHTS, None, scale, softcap)


@struct.dataclass
class PagedKVCache:
    k: tuple[jax.Array, ...]  # L x [J, P, page, K]
    v: tuple[jax.Array, ...]  # L x [J, P, page, K]
    table_BM: jax.Array  # [B, M] int32: the page of each row's m-th block
    n_head: int = struct.field(pytree_node=False)  # J, the key/value heads stored
    impl: str = struct.field(pytree_node=False)  # the decode attention path (see the module docstring)

    @classmethod
    def for_slots(cls, config, slots: int, max_len: int, *, page: int = 16, impl: str = "xla", dtype=None):
        """Pages for `slots` rows of max_len positions each (identity table: slot b owns M pages)."""
        if max_len % page:
            raise ValueError(f"the window {max_len} is not a multiple of the page size {page}")
        if impl not in IMPLS:
            raise ValueError(f"paged attention impl {impl!r} is not one of {IMPLS}")
        J, M = getattr(config, "kv_heads", config.n_head), max_len // page
        shape = (J, slots * M, page, config.head_dim)
        dtype = jnp.dtype(dtype or config.dtype)
        zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layer))  # noqa: E731
        table = jnp.arange(slots * M, dtype=jnp.int32).reshape(slots, M)
        return cls(k=zeros(), v=zeros(), table_BM=table, n_head=J, impl=impl)

    @property
    def max_len(self) -> int:
        return self.table_BM.shape[1] * self.k[0].shape[2]

    @property
    def batch(self) -> int:
        return self.table_BM.shape[0]

    def layer(self, i: int) -> PagedLayer:
        return PagedLayer(self.k[i], self.v[i], self.table_BM, self.impl)

    def with_layers(self, kv_layers) -> PagedKVCache:
        """The cache made of the attention blocks' returned PagedLayers."""
        return self.replace(k=tuple(x.k_JPpK for x in kv_layers), v=tuple(x.v_JPpK for x in kv_layers))

    def insert_row(self, row: KVCache, slot) -> PagedKVCache:
        """Copy a one-row contiguous cache (a prefill's) into slot `slot`'s pages."""
        pages_M = self.table_BM[slot]
        M, page = self.table_BM.shape[1], self.k[0].shape[2]

        def put(buf_JPpK, row_JSK):
            J, _, K = row_JSK.shape
            return buf_JPpK.at[:, pages_M].set(row_JSK.reshape(J, M, page, K).astype(buf_JPpK.dtype))

        return self.replace(k=tuple(map(put, self.k, row.k)), v=tuple(map(put, self.v, row.v)))

    def row(self, slot) -> KVCache:
        """Slot `slot`'s keys and values as a one-row contiguous cache (for the prefix cache)."""
        one = PagedKVCache(self.k, self.v, self.table_BM[slot][None], self.n_head, self.impl)
        kv = [one.layer(i).rows_NSK() for i in range(len(self.k))]
        return KVCache.from_layers(kv, self.n_head)
