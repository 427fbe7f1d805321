"""The KV cache: fixed-size key and value buffers, allocated once per generation.

A plain pytree passed into the model and handed back, so `jit` sees arrays and
the sampler can donate the buffers (updated in place rather than copied).

Layout [layers, batch, heads, max_len, head_dim]: heads before positions, so each
decoding step's attention reads a layer's keys as [B, H, S, K] batched matrices as
they lie. With [L, B, S, H, K] XLA copies every layer's [B, S, H, K] keys and values
into that order on every step (on CPU at batch 8 that copy was most of the step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, H, S, K]
    v: jax.Array  # [L, B, H, S, K]

    @classmethod
    def init(
        cls, n_layer: int, batch: int, max_len: int, n_head: int, head_dim: int, dtype=jnp.float32
    ) -> KVCache:
        shape = (n_layer, batch, n_head, max_len, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    @classmethod
    def for_config(cls, config, batch: int, max_len: int, dtype=None) -> KVCache:
        """A cache sized for a GPTConfig (or any config with n_layer, n_head, head_dim)."""
        dtype = jnp.dtype(dtype or config.dtype)
        return cls.init(config.n_layer, batch, max_len, config.n_head, config.head_dim, dtype)

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def batch(self) -> int:
        return self.k.shape[1]
