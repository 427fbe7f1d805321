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

Sliding-window layers (Mistral, Gemma 2 / 3) keep only their window: a ring buffer of R = W +
`rewind` slots, [batch * heads, R, head_dim], position p in slot p % R, and `pos` [batch, R] the
position each slot holds (EMPTY: none), so memory stays bounded however long a generation runs and
the attention masks by stored positions (models/attention.py, `ring_attend`). A call's tokens at or
after the first position it writes replace what the ring held there (a row may go back and write
again: speculative decoding, the sampler's re-prefill), so a row may take back at most `rewind` of
the positions it wrote (`rewind` slots keep what they would otherwise lose). Layers with a window
as long as the cache, or none, keep a full-length buffer and `pos` None. Padding written at
positions past `max_len`, or marked by a prefill's `logits_at`, never enters a ring.

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

EMPTY = -(2**30)  # the position of a ring slot never written: outside every query's window


@struct.dataclass
class KVCache:
    k: tuple[jax.Array, ...]  # L x [B*H, S, K]; a window layer's ring: [B*H, R, K]
    v: tuple[jax.Array, ...]  # L x [B*H, S, K]
    n_head: int = struct.field(pytree_node=False)  # heads stored (the key/value heads): B*H rows
    pos: tuple = ()  # L x ([B, R] int32 positions a ring holds, or None: a full-length buffer)
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

    def layer(self, i: int) -> tuple:
        """Layer i's buffers, what its attention block reads and returns: (k, v), [B*H, S, K] each,
        or a ring's (k, v, pos)."""
        if self.pos and self.pos[i] is not None:
            return self.k[i], self.v[i], self.pos[i]
        return self.k[i], self.v[i]

    def with_layers(self, kv_layers) -> KVCache:
        """This cache holding the blocks' returned buffers ((k, v) or a ring's (k, v, pos)); a paged
        cache has its own (serve/paged.py)."""
        pos = tuple(kv[2] if len(kv) == 3 else None for kv in kv_layers)
        return self.replace(k=tuple(kv[0] for kv in kv_layers), v=tuple(kv[1] for kv in kv_layers), pos=pos)

    @classmethod
    def from_layers(cls, kv_layers, n_head: int) -> KVCache:
        """A full-length cache made of (k, v) pairs, one per layer (a paged slot's row, serve/paged.py)."""
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
