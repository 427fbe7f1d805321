"""Rotary position embeddings (RoPE, Su et al. 2021) and Llama 3's frequency scaling.

    rope = RoPE(head_dim=64, theta=500000.0, scaling="llama3", factor=32.0)
    q_BTHK = rope.apply(q_BTHK, positions_BT)      # the same for keys, before they enter the KV cache

Each pair of features (i, i + K/2) of a head is rotated by the angle position * inv_freq[i]:
Hugging Face's "rotate_half" layout, so Llama / Mistral / Qwen2 weights copy without a
permutation. The rotation depends on absolute positions only through the angle, so a query at
position p and a key at position s score as a function of p - s: cached keys are stored rotated.

Shape letters: B batch, T time, H heads, K head dim.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

ROPE_SCALINGS = ("none", "llama3", "linear")


@dataclasses.dataclass(frozen=True)
class RoPE:
    head_dim: int
    theta: float = 10000.0
    scaling: str = (
        "none"  # none | llama3 | linear (every frequency divided by factor: Gemma 3's global layers)
    )
    factor: float = 1.0  # llama3, linear: how much longer the context became
    low_freq_factor: float = 1.0  # llama3: wavelengths above original_max_len / this are divided by factor
    high_freq_factor: float = 4.0  # llama3: wavelengths below original_max_len / this are kept
    original_max_len: int = 8192  # llama3: the context the model was pretrained with

    def __post_init__(self):
        if self.scaling not in ROPE_SCALINGS:
            raise ValueError(f"rope scaling {self.scaling!r} is not implemented; have: {ROPE_SCALINGS}")
        if self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {self.head_dim}")

    def inv_freq(self) -> np.ndarray:
        """[K/2] angular frequencies, computed in float64 numpy (a constant of the compiled function)."""
        K = self.head_dim
        inv_freq = 1.0 / self.theta ** (np.arange(0, K, 2, dtype=np.float64) / K)
        if self.scaling == "llama3":
            inv_freq = _llama3_scaling(inv_freq, self)
        if self.scaling == "linear":  # position interpolation: positions read as position / factor
            inv_freq = inv_freq / self.factor
        return inv_freq

    def apply(self, x_BTHK: jax.Array, positions_BT: jax.Array) -> jax.Array:
        """x rotated by each row's positions; angles, sin and cos in float32 (float64 for float64)."""
        acc = jnp.promote_types(x_BTHK.dtype, jnp.float32)
        angles_BTk = positions_BT[..., None].astype(acc) * self.inv_freq().astype(acc)  # k = K/2
        # cos and sin computed once, [B, T, K/2]: without the barrier XLA fuses them into every consumer
        # (each head, q and k, forward and backward), ~8x the transcendentals, a tenth of a CPU train step
        cos_BTk, sin_BTk = jax.lax.optimization_barrier((jnp.cos(angles_BTk), jnp.sin(angles_BTk)))
        cos_BT1k, sin_BT1k = cos_BTk[:, :, None, :], sin_BTk[:, :, None, :]
        return _rotate(x_BTHK.astype(acc), cos_BT1k, sin_BT1k).astype(x_BTHK.dtype)


@jax.custom_vjp
def _rotate(x_BTHK, cos_BT1k, sin_BT1k):
    """rotate_half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    x1, x2 = jnp.split(x_BTHK, 2, axis=-1)
    return jnp.concatenate([x1 * cos_BT1k - x2 * sin_BT1k, x2 * cos_BT1k + x1 * sin_BT1k], axis=-1)


def _rotate_fwd(x_BTHK, cos_BT1k, sin_BT1k):
    return _rotate(x_BTHK, cos_BT1k, sin_BT1k), (cos_BT1k, sin_BT1k)


def _rotate_bwd(res, dy_BTHK):
    # The transpose of a rotation is the rotation by minus the angle: one fused pass over dy, where
    # autodiff's adds per half and their concatenation were separate passes (cos and sin are constants
    # of the positions: no gradient).
    cos_BT1k, sin_BT1k = res
    return _rotate(dy_BTHK, cos_BT1k, -sin_BT1k), None, None


_rotate.defvjp(_rotate_fwd, _rotate_bwd)


def _llama3_scaling(inv_freq: np.ndarray, r: RoPE) -> np.ndarray:
    """Llama 3.1's long-context scaling: low frequencies slowed by `factor`, high ones kept,
    the band between interpolated smoothly (as transformers' _compute_llama3_parameters)."""
    low_freq_wavelen = r.original_max_len / r.low_freq_factor
    high_freq_wavelen = r.original_max_len / r.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / r.factor, inv_freq)
    smooth = (r.original_max_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
    smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, scaled)
