"""The KV cache: fixed-size key and value buffers, allocated once per generation.

A plain pytree passed into the model and handed back, so `jit` sees arrays and
the sampler can donate the buffers (updated in place rather than copied).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, S, H, K]
    v: jax.Array  # [L, B, S, H, K]

    @classmethod
    def init(
        cls, n_layer: int, batch: int, max_len: int, n_head: int, head_dim: int, dtype=jnp.float32
    ) -> KVCache:
        shape = (n_layer, batch, max_len, n_head, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    @classmethod
    def for_config(cls, config, batch: int, max_len: int, dtype=None) -> KVCache:
        """A cache sized for a GPTConfig (or any config with n_layer, n_head, head_dim)."""
        dtype = jnp.dtype(dtype or config.dtype)
        return cls.init(config.n_layer, batch, max_len, config.n_head, config.head_dim, dtype)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]
