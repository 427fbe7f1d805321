"""The KV cache: fixed-size key and value buffers, allocated once per generation.

A plain pytree passed into the model and handed back, so `jit` sees arrays and
the sampler can donate the buffers (updated in place rather than copied).

One buffer per layer, [batch * heads, max_len, head_dim] each (row b * H + h is head
h of sequence b). Heads before positions: a decoding step reads a layer's keys as
B*H matrices [S, K] as they lie (with [B, S, H, K] XLA transposes every layer's keys
and values on every step). An array per layer: the attention reads it in place (a
slice of one stacked [L, ...] buffer is copied out first on CPU, 24 copies of the
cache per GPT-2 step). Batch and heads merged: at batch 1 a [1, H, S, K] buffer
reaches the attention as [H, S, K], and XLA then updates it twice, copying it each time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    k: tuple[jax.Array, ...]  # L x [B*H, S, K]
    v: tuple[jax.Array, ...]  # L x [B*H, S, K]
    n_head: int = struct.field(pytree_node=False)  # to tell batch from heads in the B*H rows

    @classmethod
    def init(
        cls, n_layer: int, batch: int, max_len: int, n_head: int, head_dim: int, dtype=jnp.float32
    ) -> KVCache:
        shape = (batch * n_head, max_len, head_dim)
        zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(n_layer))  # noqa: E731
        return cls(k=zeros(), v=zeros(), n_head=n_head)

    @classmethod
    def for_config(cls, config, batch: int, max_len: int, dtype=None) -> KVCache:
        """A cache sized for a GPTConfig (or any config with n_layer, n_head, head_dim)."""
        dtype = jnp.dtype(dtype or config.dtype)
        return cls.init(config.n_layer, batch, max_len, config.n_head, config.head_dim, dtype)

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0] // self.n_head

    def take_rows(self, rows_R: jax.Array) -> KVCache:
        """The cache of rows `rows_R` (in that order): beam search follows its beams with it."""
        H = self.n_head

        def take(x_NSK):
            x_BHSK = x_NSK.reshape(-1, H, *x_NSK.shape[1:])
            return jnp.take(x_BHSK, rows_R, axis=0).reshape(-1, *x_NSK.shape[1:])

        return jax.tree_util.tree_map(take, self)
