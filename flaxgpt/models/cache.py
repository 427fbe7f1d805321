"""The decoding caches: one interface (`Cache`) that every kind of KV cache implements.

A cache is a pytree passed into the model and handed back, so `jit` sees arrays and the decoders can
donate the buffers (updated in place rather than copied). Every kind answers the same calls, and code
picks a kind's behaviour by calling them (the layer kinds by their type), never by probing attributes:

  max_len, batch, rewind    positions per row, rows, positions a row may take back (None: any)
  layer(i), with_layers     layer i's KVLayer, whose `attend` the attention block calls (the kind
                            writes the call's keys and values and attends over its own layout), and
                            the cache holding the layers the blocks return
  take_rows(rows_R)         the cache of those rows in that order (beam search follows its beams)
  insert_row(row, slot)     a one-row KVCache (a prefill's) copied into row `slot` (the serving engine)
  row(slot)                 row `slot` as a one-row contiguous KVCache (the prefix cache reads it)
  has_rings                 some layer keeps only its window (a prefix cache cannot be served from it)

The kinds of layer storage, all behind `KVLayer.attend(q, k, v, positions, ...) -> (y, layer)`:

ContiguousLayer (KVCache): [batch * heads, max_len, head_dim] keys and values (row b * J + j is
key/value head j of sequence b), position p at index p. Heads before positions: a decoding step reads
a layer's keys as B*J matrices [S, K] as they lie (with [B, S, J, K] XLA transposes every layer's keys
and values on every step). An array per layer: the attention reads it in place (a slice of one stacked
[L, ...] buffer is copied out first on CPU, 24 copies of the cache per GPT-2 step). Batch and heads
merged: at batch 1 a [1, J, S, K] buffer reaches the attention as [J, S, K], and XLA then updates it
twice, copying it each time. A decoding step on one GPU writes and attends in one kernel
(kernels/pallas_decode_attention.py, where models.linear.decode_kernels takes the decode kernels).

RingLayer (KVCache, sliding-window layers: Mistral, Gemma 2 / 3): only the window, a ring of R = W +
`rewind` slots, [batch * heads, R, head_dim], position p in slot p % R, and `pos` [batch, R] the
position each slot holds (EMPTY: none), so memory stays bounded however long a generation runs and
the mask comes from the stored positions. A call's tokens at or after the first position it writes
replace what the ring held there (a row may go back and write again: speculative decoding, the
sampler's re-prefill), so a row may take back at most `rewind` of the positions it wrote (`rewind`
slots keep what they would otherwise lose). Layers with a window as long as the cache, or none, keep a
contiguous buffer. Padding written at positions past `max_len`, or marked by a prefill's `logits_at`
(`real_BT` False), never enters a ring.

AdapterCache: any kind with each row's LoRA adapter slot beside it (models/multi_lora.py reads it), moved
with the row by take_rows and insert_row.

PagedLayer (PagedKVCache, models/paged.py): pages of `page` positions in a pool, read through a block
table per row; the layout of JAX's Pallas paged-attention kernels.

No kind writes anything at positions >= its max_len (a scatter drops them): the sampler's re-prefill
feeds other rows there.

Seq2SeqCache (encoder-decoder): the decoder's KVCache plus each layer's cross-attention keys and
values of the source, [rows, S, H, K], one row per decoded row (a source repeated once per beam),
and each row's source index. Rows of one source hold the same cross keys/values, so when taken
rows stay with their sources (beam search's beams always do) those arrays need not move, and
`take_rows` leaves them where they are (copying them would cost every beam search step).
"""

from __future__ import annotations

import abc
import math

import jax
import jax.numpy as jnp
from flax import struct

from flaxgpt.kernels import pallas_decode_attention, target
from flaxgpt.models.attention import attend_cached, causal_mask

EMPTY = -(2**30)  # the position of a ring slot never written: outside every query's window


class KVLayer(abc.ABC):
    """One layer's share of a cache: what its attention block hands the new keys and values to."""

    @abc.abstractmethod
    def attend(
        self, q_BTHK, k_BTJK, v_BTJK, positions_BT, *, window=0, real_BT=None, kernels=False, **attend_kw
    ):
        """Write the call's keys/values at `positions_BT` and attend to the keys each query may see
        (key position <= its own, within `window`) -> (y_BTHK, this layer updated). `real_BT`: False
        on padding (a ring never takes it in); `kernels`: the step takes the decode kernels (the GPT's
        decision; a contiguous layer's writes and attention as one kernel); attend_kw: sow, scale,
        softcap (attend_cached's)."""


class Cache(abc.ABC):
    """The interface of every KV cache kind (see the module docstring)."""

    rewind = None  # positions a row may take back (None: any); a kind with rings says how many

    @property
    @abc.abstractmethod
    def max_len(self) -> int: ...

    @property
    @abc.abstractmethod
    def batch(self) -> int: ...

    @property
    def has_rings(self) -> bool:
        return False

    @abc.abstractmethod
    def layer(self, i: int) -> KVLayer: ...

    @abc.abstractmethod
    def with_layers(self, layers) -> Cache: ...

    @abc.abstractmethod
    def take_rows(self, rows_R: jax.Array) -> Cache: ...

    @abc.abstractmethod
    def insert_row(self, row: KVCache, slot) -> Cache: ...

    @abc.abstractmethod
    def row(self, slot) -> KVCache: ...


def write_cache(buf_NSK: jax.Array, new_BTJK: jax.Array, pos_BT: jax.Array) -> jax.Array:
    """Scatter new keys or values into one layer's [B*J, S, K] buffer at per-row positions.

    One scatter: a donated buffer is updated in place; positions >= S are dropped.
    """
    B, T, J, K = new_BTJK.shape
    rows_B1J = (jnp.arange(B)[:, None] * J + jnp.arange(J))[:, None, :]  # buffer row of (b, j)
    return buf_NSK.at[rows_B1J, pos_BT[:, :, None]].set(new_BTJK.astype(buf_NSK.dtype))


@struct.dataclass
class ContiguousLayer(KVLayer):
    k: jax.Array  # [B*J, S, K]
    v: jax.Array  # [B*J, S, K]

    def attend(
        self, q_BTHK, k_BTJK, v_BTJK, positions_BT, *, window=0, real_BT=None, kernels=False, **attend_kw
    ):
        if (
            kernels
            and not window
            and attend_kw.get("sow") is None
            and self._kernel_takes(q_BTHK, k_BTJK, v_BTJK)
        ):
            return self._attend_kernel(q_BTHK, k_BTJK, v_BTJK, positions_BT, **attend_kw)
        layer = ContiguousLayer(
            write_cache(self.k, k_BTJK, positions_BT), write_cache(self.v, v_BTJK, positions_BT)
        )
        mask_BHTS = causal_mask(positions_BT, layer.k.shape[1], window)
        return attend_cached(q_BTHK, layer.k, layer.v, mask_BHTS, **attend_kw), layer

    def _kernel_takes(self, q_BTHK, k_BTJK, v_BTJK) -> bool:
        """One position a row, in dtypes and shapes kernels.pallas_decode_attention tiles: the writes
        and the attention as one kernel."""
        (_, T, H, K), (N, S, _), J = q_BTHK.shape, self.k.shape, k_BTJK.shape[2]
        dtypes = {jnp.dtype(a.dtype) for a in (q_BTHK, k_BTJK, v_BTJK)}
        cached = {jnp.dtype(a.dtype) for a in (self.k, self.v)}
        floats = {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)}
        return (
            T == 1
            and len(dtypes) == 1
            and dtypes | cached <= floats
            and not pallas_decode_attention.why_not(N, H // J, S, K)
        )

    def _attend_kernel(self, q_BTHK, k_BTJK, v_BTJK, positions_BT, sow=None, scale=0.0, softcap=0.0):
        # q | k | v as one array: XLA writes it in one fusion with rope's (or it is c_attn's output as
        # it lies), where three arrays took a kernel each
        qkv_BCK = jnp.concatenate([q_BTHK, k_BTJK, v_BTJK], axis=2)[:, 0]
        y_BHK, k_NSK, v_NSK = pallas_decode_attention.attend(
            qkv_BCK, positions_BT[:, 0], self.k, self.v, scale=scale or 1 / math.sqrt(q_BTHK.shape[-1]),
            softcap=softcap, interpret=target.platform() != "gpu",
        )  # fmt: skip
        return y_BHK[:, None], ContiguousLayer(k_NSK, v_NSK)


@struct.dataclass
class RingLayer(KVLayer):
    k: jax.Array  # [B*J, R, K]
    v: jax.Array  # [B*J, R, K]
    pos: jax.Array  # [B, R] int32: the position each slot holds (EMPTY: none)

    def attend(
        self, q_BTHK, k_BTJK, v_BTJK, positions_BT, *, window=0, real_BT=None, kernels=False, **attend_kw
    ):
        """One token per row (decoding) is written first and attends over the ring as it lies. Longer
        calls (prefills, speculative verification) attend over [the ring as it was | their own keys],
        slots holding positions this call rewrites hidden, then write their last R real tokens: a
        prompt longer than the ring goes in one call."""
        pos_BT = positions_BT
        B, T, J, K = k_BTJK.shape
        R = self.pos.shape[1]
        real_BT = jnp.ones((B, T), bool) if real_BT is None else real_BT
        # each row's last R real tokens (contiguous positions: distinct slots); R = past the ring, dropped
        last_B1 = jnp.max(jnp.where(real_BT, pos_BT, -1), axis=1, keepdims=True)
        slot_BT = jnp.where(real_BT & (pos_BT > last_B1 - R), pos_BT % R, R)
        rows_B1J = (jnp.arange(B)[:, None] * J + jnp.arange(J))[:, None, :]

        def write(buf_NRK, new_BTJK):
            return buf_NRK.at[rows_B1J, slot_BT[:, :, None]].set(new_BTJK.astype(buf_NRK.dtype), mode="drop")

        new = RingLayer(
            write(self.k, k_BTJK),
            write(self.v, v_BTJK),
            self.pos.at[jnp.arange(B)[:, None], slot_BT].set(pos_BT, mode="drop"),
        )
        if T == 1:  # the slot written held position p - R, outside p's window
            k_NSK, v_NSK, key_pos_BS = new.k, new.v, new.pos
        else:
            first_B1 = jnp.min(jnp.where(real_BT, pos_BT, jnp.iinfo(jnp.int32).max), axis=1, keepdims=True)
            to_NTK = lambda x: jnp.swapaxes(x, 1, 2).reshape(B * J, T, K).astype(self.k.dtype)  # noqa: E731
            k_NSK = jnp.concatenate([self.k, to_NTK(k_BTJK)], axis=1)  # S = R + T
            v_NSK = jnp.concatenate([self.v, to_NTK(v_BTJK)], axis=1)
            old_BR = jnp.where(self.pos >= first_B1, EMPTY, self.pos)  # positions this call writes again
            key_pos_BS = jnp.concatenate([old_BR, jnp.where(real_BT, pos_BT, EMPTY)], axis=1)
        q_BT1, key_B1S = pos_BT[:, :, None], key_pos_BS[:, None, :]
        mask_BHTS = ((key_B1S <= q_BT1) & (key_B1S > q_BT1 - window))[:, None]
        return attend_cached(q_BTHK, k_NSK, v_NSK, mask_BHTS, **attend_kw), new


@struct.dataclass
class KVCache(Cache):
    """Contiguous and ring layers (see the module docstring), one buffer pair per layer."""

    k: tuple[jax.Array, ...]  # L x [B*J, S, K]; a window layer's ring: [B*J, R, K]
    v: tuple[jax.Array, ...]  # L x [B*J, S, K]
    n_head: int = struct.field(pytree_node=False)  # heads stored (the key/value heads): B*J rows
    pos: tuple = ()  # L x ([B, R] int32 positions a ring holds, or None: a contiguous buffer)
    length: int = struct.field(pytree_node=False, default=0)  # S, positions covered; 0 = k[0]'s
    rewind: int | None = struct.field(
        pytree_node=False, default=None
    )  # positions a row may take back (None: any)

    @classmethod
    def init(
        cls,
        n_layer: int,
        batch: int,
        max_len: int,
        n_head: int,
        head_dim: int,
        dtype=jnp.float32,
        windows=(),
        rewind: int = 0,
    ) -> KVCache:
        """Zeroed buffers; `windows` (one per layer, 0 = none) give sliding-window layers a ring
        of window + rewind slots when that is shorter than max_len."""
        windows = tuple(windows) or (0,) * n_layer
        if len(windows) != n_layer or rewind < 0:
            raise ValueError(f"{len(windows)} windows for {n_layer} layers, rewind {rewind} (must be >= 0)")
        lengths = [w + rewind if 0 < w and w + rewind < max_len else max_len for w in windows]
        zeros = lambda: tuple(jnp.zeros((batch * n_head, S, head_dim), dtype) for S in lengths)  # noqa: E731
        pos = tuple(jnp.full((batch, S), EMPTY, jnp.int32) if S < max_len else None for S in lengths)
        rings = any(p is not None for p in pos)
        return cls(
            k=zeros(), v=zeros(), n_head=n_head, pos=pos, length=max_len, rewind=rewind if rings else None
        )

    @classmethod
    def for_config(cls, config, batch: int, max_len: int, dtype=None, *, ring=True, rewind=0) -> KVCache:
        """A cache sized for a GPTConfig (or any config with n_layer, n_head, head_dim): it stores
        the config's key/value heads (`kv_heads`, fewer than n_head with grouped-query attention).
        Sliding-window layers get rings (`ring`=False: full-length buffers, for callers that write
        right-padded rows without a prefill's `logits_at`); `rewind`: see the module docstring."""
        dtype = jnp.dtype(dtype or config.dtype)
        heads = getattr(config, "kv_heads", config.n_head)
        windows = ()
        if ring and hasattr(config, "layer_window"):
            windows = tuple(config.layer_window(i) for i in range(config.n_layer))
        return cls.init(config.n_layer, batch, max_len, heads, config.head_dim, dtype, windows, rewind)

    @property
    def max_len(self) -> int:
        return self.length or self.k[0].shape[1]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0] // self.n_head

    @property
    def has_rings(self) -> bool:
        return any(p is not None for p in self.pos)

    def layer(self, i: int) -> KVLayer:
        """Layer i's buffers, what its attention block reads and returns."""
        if self.pos and self.pos[i] is not None:
            return RingLayer(self.k[i], self.v[i], self.pos[i])
        return ContiguousLayer(self.k[i], self.v[i])

    def with_layers(self, layers) -> KVCache:
        """This cache holding the blocks' returned layers."""
        pos = tuple(x.pos if isinstance(x, RingLayer) else None for x in layers)
        return self.replace(k=tuple(x.k for x in layers), v=tuple(x.v for x in layers), pos=pos)

    @classmethod
    def from_layers(cls, kv_layers, n_head: int) -> KVCache:
        """A contiguous cache made of (k, v) pairs, one per layer (a paged row, models/paged.py)."""
        k, v = tuple(k for k, _ in kv_layers), tuple(v for _, v in kv_layers)
        return cls(k=k, v=v, n_head=n_head, pos=(None,) * len(k), length=k[0].shape[1])  # as for_config's

    def take_rows(self, rows_R: jax.Array) -> KVCache:
        """The cache of rows `rows_R` (in that order): beam search follows its beams with it."""
        H = self.n_head

        def take(x_NSK):
            x_BHSK = x_NSK.reshape(-1, H, *x_NSK.shape[1:])
            return jnp.take(x_BHSK, rows_R, axis=0).reshape(-1, *x_NSK.shape[1:])

        pos = tuple(None if p is None else jnp.take(p, rows_R, axis=0) for p in self.pos)
        return self.replace(k=tuple(map(take, self.k)), v=tuple(map(take, self.v)), pos=pos)

    def insert_row(self, row: KVCache, slot) -> KVCache:
        """A one-row cache of the same layout copied into row `slot`."""

        def put(buf, x):  # each leaf is [batch * rows_per_seq, ...]: sequence b is a block of rows
            return jax.lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), slot * x.shape[0], axis=0)

        return jax.tree_util.tree_map(put, self, row)

    def row(self, slot) -> KVCache:
        return self.take_rows(jnp.reshape(slot, (1,)))


@struct.dataclass
class AdapterCache(Cache):
    """Any cache kind with each row's adapter slot (models/multi_lora.py: 0 = no adapter). The index
    lives with the row's keys and values, so it follows the row wherever the decoders and the engine
    move rows (a prefill's one-row cache inserted into a slot, beam search's take_rows) while they
    still see only step_fn(tokens, positions, cache); the multi-LoRA step_fn reads it and unwraps."""

    inner: Cache
    adapter_B: jax.Array  # [batch] int32

    @classmethod
    def wrap(cls, inner: Cache, adapter: int = 0) -> AdapterCache:
        return cls(inner, jnp.full((inner.batch,), adapter, jnp.int32))

    @property
    def max_len(self) -> int:
        return self.inner.max_len

    @property
    def batch(self) -> int:
        return self.inner.batch

    @property
    def rewind(self):
        return self.inner.rewind

    @property
    def has_rings(self) -> bool:
        return self.inner.has_rings

    def layer(self, i: int) -> KVLayer:
        return self.inner.layer(i)

    def with_layers(self, layers) -> AdapterCache:
        return self.replace(inner=self.inner.with_layers(layers))

    def take_rows(self, rows_R: jax.Array) -> AdapterCache:
        return AdapterCache(self.inner.take_rows(rows_R), jnp.take(self.adapter_B, rows_R, axis=0))

    def insert_row(self, row: AdapterCache, slot) -> AdapterCache:
        """A one-row AdapterCache (a prefill's) into row `slot`: its keys, values and adapter."""
        adapter_B = self.adapter_B.at[slot].set(jnp.reshape(row.adapter_B, ()))
        return AdapterCache(self.inner.insert_row(row.inner, slot), adapter_B)

    def row(self, slot) -> KVCache:
        return self.inner.row(slot)


@struct.dataclass
class Seq2SeqCache:
    self_kv: KVCache  # the decoder's self-attention: k, v L x [R*H, T_max, K]
    cross_k: tuple[jax.Array, ...]  # L x [R, S, H, K], projected once from the encoder output
    cross_v: tuple[jax.Array, ...]  # L x [R, S, H, K]
    source_R: jax.Array  # [R] int32: rows with the same source hold the same cross_k / cross_v

    @property
    def max_len(self) -> int:
        return self.self_kv.max_len

    @property
    def batch(self) -> int:
        return self.self_kv.batch

    def take_rows(self, rows_R: jax.Array) -> Seq2SeqCache:
        """The cache of rows `rows_R` (in that order), right for any rows. The cross-attention
        keys and values move only when a row changes source (see the module docstring)."""
        rows_R = jnp.asarray(rows_R)
        source_R = self.source_R[rows_R]

        def take_cross():
            take = lambda x: jnp.take(x, rows_R, axis=0)  # noqa: E731
            return tuple(map(take, self.cross_k)), tuple(map(take, self.cross_v))

        if rows_R.shape != self.source_R.shape:  # a new number of rows (e.g. one per beam)
            cross_k, cross_v = take_cross()
        else:
            unchanged = lambda: (self.cross_k, self.cross_v)  # noqa: E731
            cross_k, cross_v = jax.lax.cond(jnp.all(source_R == self.source_R), unchanged, take_cross)
        return Seq2SeqCache(self.self_kv.take_rows(rows_R), cross_k, cross_v, source_R)
