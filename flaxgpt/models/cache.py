"""The decoding caches: fixed-size buffers allocated once per generation, one entry per layer.

A cache is a plain pytree passed into the model and handed back, so `jit` sees arrays and the
decoders can donate the buffers (updated in place rather than copied). Each block receives its
own layer's entry and returns it; the decoders only ever call `take_rows` (beam search follows
its beams with it) and read `max_len` / `batch`.

KVCache (self-attention): one buffer per layer, [batch * heads, max_len, head_dim] each (row
b * H + h is head h of sequence b). Heads before positions: a decoding step reads a layer's keys
as B*H matrices [S, K] as they lie (with [B, S, H, K] XLA transposes every layer's keys and
values on every step). An array per layer: the attention reads it in place (a slice of one
stacked [L, ...] buffer is copied out first on CPU, 24 copies of the cache per GPT-2 step).
Batch and heads merged: at batch 1 a [1, H, S, K] buffer reaches the attention as [H, S, K],
and XLA then updates it twice, copying it each time.

Seq2SeqCache (encoder-decoder): the decoder's KVCache plus each layer's cross-attention keys and
values of the source, [rows, S, H, K], one row per decoded row (a source repeated once per beam),
and each row's source index. Rows of one source hold the same cross keys/values, so when taken
rows stay with their sources (beam search's beams always do) those arrays need not move, and
`take_rows` leaves them where they are (copying them would cost every beam search step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    k: tuple[jax.Array, ...]  # L x [B*H, S, K]
    v: tuple[jax.Array, ...]  # L x [B*H, S, K]
    n_head: int = struct.field(pytree_node=False)  # heads stored (the key/value heads): B*H rows

    @classmethod
    def init(
        cls, n_layer: int, batch: int, max_len: int, n_head: int, head_dim: int, dtype=jnp.float32
    ) -> KVCache:
        shape = (batch * n_head, max_len, head_dim)
        zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(n_layer))  # noqa: E731
        return cls(k=zeros(), v=zeros(), n_head=n_head)

    @classmethod
    def for_config(cls, config, batch: int, max_len: int, dtype=None) -> KVCache:
        """A cache sized for a GPTConfig (or any config with n_layer, n_head, head_dim): it stores
        the config's key/value heads (`kv_heads`, fewer than n_head with grouped-query attention)."""
        dtype = jnp.dtype(dtype or config.dtype)
        heads = getattr(config, "kv_heads", config.n_head)
        return cls.init(config.n_layer, batch, max_len, heads, config.head_dim, dtype)

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0] // self.n_head

    def layer(self, i: int) -> tuple[jax.Array, jax.Array]:
        """Layer i's (k, v) buffers, [B*H, S, K] each: what its attention block reads and returns."""
        return self.k[i], self.v[i]

    @classmethod
    def from_layers(cls, kv_layers, n_head: int) -> KVCache:
        """The cache made of the blocks' returned (k, v) pairs, one per layer."""
        return cls(k=tuple(k for k, _ in kv_layers), v=tuple(v for _, v in kv_layers), n_head=n_head)

    def with_layers(self, kv_layers) -> KVCache:
        """This cache with the blocks' returned (k, v) pairs (a paged cache has its own, serve/paged.py)."""
        return KVCache.from_layers(kv_layers, self.n_head)

    def take_rows(self, rows_R: jax.Array) -> KVCache:
        """The cache of rows `rows_R` (in that order): beam search follows its beams with it."""
        H = self.n_head

        def take(x_NSK):
            x_BHSK = x_NSK.reshape(-1, H, *x_NSK.shape[1:])
            return jnp.take(x_BHSK, rows_R, axis=0).reshape(-1, *x_NSK.shape[1:])

        return jax.tree_util.tree_map(take, self)


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
