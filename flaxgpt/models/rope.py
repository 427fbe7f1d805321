"""Rotary position embeddings (RoPE, Su et al. 2021) and the long-context scalings of their frequencies.

    rope = RoPE(head_dim=64, theta=500000.0, scaling="llama3", factor=32.0)
    q_BTHK = rope.apply(q_BTHK, positions_BT)      # the same for keys, before they enter the KV cache

Each pair of features (i, i + K/2) of a head is rotated by the angle position * inv_freq[i]:
Hugging Face's "rotate_half" layout, so Llama / Mistral / Qwen2 weights copy without a
permutation. The rotation depends on absolute positions only through the angle, so a query at
position p and a key at position s score as a function of p - s: cached keys are stored rotated.

The scalings, with transformers' names and formulas (modeling_rope_utils.py): `linear` divides every
frequency by factor; `llama3` (Llama 3.1) slows the low ones and keeps the high ones; `yarn` (Peng et
al. 2023; Qwen2.5 / Qwen3's long-context configs) interpolates low frequencies and extrapolates high
ones with a linear ramp between beta_slow and beta_fast rotations over the original context, and
multiplies cos and sin by an attention factor; `dynamic` (NTK-aware) raises theta with each row's
sequence length once it passes original_max_len. LongRoPE (per-frequency factors) is Phi-3's, a
family flaxgpt does not load: not implemented.

Shape letters: B batch, T time, H heads, K head dim, k = K/2 frequencies.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

ROPE_SCALINGS = ("none", "llama3", "linear", "yarn", "dynamic")


@dataclasses.dataclass(frozen=True)
class RoPE:
    head_dim: int
    theta: float = 10000.0
    scaling: str = "none"  # none | llama3 | linear (Gemma 3's global layers) | yarn | dynamic
    factor: float = 1.0  # llama3, linear, yarn, dynamic: how much longer the context became
    low_freq_factor: float = 1.0  # llama3: wavelengths above original_max_len / this are divided by factor
    high_freq_factor: float = 4.0  # llama3: wavelengths below original_max_len / this are kept
    original_max_len: int = 8192  # llama3, yarn, dynamic: the context the model was pretrained with
    attention_factor: float = 0.0  # yarn: cos and sin times this; 0 = 0.1 ln(factor) + 1 (YaRN's)
    beta_fast: float = 32.0  # yarn: frequencies turning more than this often in original_max_len are kept
    beta_slow: float = 1.0  # yarn: ... less than this often are divided by factor; a ramp between
    truncate: bool = True  # yarn: the ramp's ends rounded to whole frequencies (floor / ceil)

    def __post_init__(self):
        if self.scaling not in ROPE_SCALINGS:
            raise ValueError(f"rope scaling {self.scaling!r} is not implemented; have: {ROPE_SCALINGS}")
        if self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {self.head_dim}")
        if self.scaling == "none":
            return
        if not self.factor > 0:
            raise ValueError(f"rope_factor must be > 0 with rope_scaling={self.scaling!r}, got {self.factor}")
        if self.scaling in ("yarn", "dynamic") and self.factor < 1:
            raise ValueError(f"{self.scaling} rope_factor must be >= 1 (a longer context), got {self.factor}")
        if self.scaling in ("llama3", "yarn", "dynamic") and self.original_max_len < 1:
            raise ValueError(f"rope_original_max_len must be >= 1, got {self.original_max_len}")
        if self.scaling == "dynamic" and self.head_dim <= 2:
            raise ValueError(
                f"dynamic rope scaling needs head_dim > 2 (theta ** (K / (K-2))), got {self.head_dim}"
            )
        if self.scaling == "yarn" and self.attention_factor < 0:
            raise ValueError(f"rope_attention_factor must be >= 0 (0 = YaRN's), got {self.attention_factor}")
        if self.scaling == "yarn" and not 0 < self.beta_slow <= self.beta_fast:
            raise ValueError(
                f"yarn needs 0 < rope_beta_slow <= rope_beta_fast, got {self.beta_slow} and {self.beta_fast}"
            )

    def inv_freq(self) -> np.ndarray:
        """[K/2] angular frequencies, computed in float64 numpy (a constant of the compiled function);
        dynamic's at sequence lengths up to original_max_len (unscaled): longer ones are `apply`'s."""
        K = self.head_dim
        inv_freq = 1.0 / self.theta ** (np.arange(0, K, 2, dtype=np.float64) / K)
        if self.scaling == "llama3":
            inv_freq = _llama3_scaling(inv_freq, self)
        if self.scaling == "linear":  # position interpolation: positions read as position / factor
            inv_freq = inv_freq / self.factor
        if self.scaling == "yarn":
            inv_freq = _yarn_scaling(inv_freq, self)
        return inv_freq

    @property
    def mscale(self) -> float:
        """What cos and sin are multiplied by (YaRN's attention factor; 1 for the other scalings)."""
        if self.scaling != "yarn":
            return 1.0
        return self.attention_factor or yarn_attention_factor(self.factor)

    def apply(
        self, x_BTHK: jax.Array, positions_BT: jax.Array, real_BT: jax.Array | None = None
    ) -> jax.Array:
        """x rotated by each row's positions; angles, sin and cos in float32 (float64 for float64).
        `real_BT` (dynamic only): False on a right-padded prefill's padding, which sets no row's length."""
        acc = jnp.promote_types(x_BTHK.dtype, jnp.float32)
        if self.scaling == "dynamic":
            inv_freq_Bk = self._dynamic_inv_freq(positions_BT, acc, real_BT)
        else:
            inv_freq_Bk = jnp.asarray(self.inv_freq(), acc)[None]
        angles_BTk = positions_BT[..., None].astype(acc) * inv_freq_Bk[:, None, :]
        cos_BTk, sin_BTk = _cos_sin(angles_BTk, x_BTHK)
        if self.mscale != 1.0:  # YaRN: q.k scaled by mscale^2, as transformers' cos/sin are
            cos_BTk, sin_BTk = cos_BTk * self.mscale, sin_BTk * self.mscale
        # cos and sin computed once, [B, T, K/2]: without the barrier XLA fuses them into every consumer
        # (each head, q and k, forward and backward), ~8x the transcendentals; XLA:CPU drops the barrier
        # before fusing, where _cos_sin's conditional holds them
        cos_BTk, sin_BTk = jax.lax.optimization_barrier((cos_BTk, sin_BTk))
        cos_BT1k, sin_BT1k = cos_BTk[:, :, None, :], sin_BTk[:, :, None, :]
        return _rotate(x_BTHK.astype(acc), cos_BT1k, sin_BT1k).astype(x_BTHK.dtype)

    def _dynamic_inv_freq(self, positions_BT: jax.Array, acc, real_BT: jax.Array | None = None) -> jax.Array:
        """[B, K/2] dynamic NTK frequencies: theta raised for each row's length L = its largest real
        position + 1, theta * (factor L / original - (factor - 1)) ** (K / (K - 2)), unscaled up to original.

        Why per call and per row, traced: transformers recomputes theta in each forward whose longest
        position passes the longest seen so far, and keeps the keys already cached as they were rotated.
        Here keys enter the fixed-size KV cache rotated too, so a call at positions [p, p + T) rotating
        with theta(p + T) is that rule without its state: a prefill of the whole prompt then one token a
        step gives transformers' greedy tokens (tests/hf/test_rope_scalings.py), a training forward its
        logits, and one compiled program serves every length (L is a traced value, not a shape). Per
        row, not the batch's maximum as transformers takes: a request's tokens do not depend on the
        others decoding beside it. What follows: a prompt prefilled in chunks rotates each chunk with
        its own theta (transformers fed those chunks does the same), and a right-padded prefill takes L
        from the row's real tokens (`real_BT`), so each prompt of a batch rotates as it would alone;
        the padding's keys, rotated with that L too, are never attended to and are overwritten."""
        K = self.head_dim
        if real_BT is not None:  # padding's positions run past the prompt: they must not set L
            positions_BT = jnp.where(real_BT, positions_BT, 0)
        length_B = jnp.max(positions_BT, axis=-1).astype(acc) + 1
        length_B = jnp.maximum(length_B, self.original_max_len)
        stretch_B = self.factor * length_B / self.original_max_len - (self.factor - 1)
        theta_B = self.theta * stretch_B ** (K / (K - 2))
        exponent_k = jnp.asarray(np.arange(0, K, 2) / K, acc)
        return 1.0 / theta_B[:, None] ** exponent_k[None, :]


def _cos_sin(angles_BTk, x_BTHK):
    """(cos, sin) of the angles [B, T, k], each computed once on XLA:CPU.

    Why: XLA:CPU removes optimization barriers before it fuses, takes cos and sin for cheap and fuses
    them into every consumer's loop, so each rotated element recomputed its cos and sin: 2H times
    the transcendentals (8x at 4 heads: rotating q [32, 72, 4, 64] took 2.5 ms against 0.8 ms so, the
    rotations 5% of the kernels' time of benchmarks/grpo_step.py's update). A conditional is a
    boundary fusion does not cross: both branches compute the same, so its predicate (read from the
    activations, never constant-folded) does not change the values (bit for bit). One position a
    row (a decoding step: no gain measured) and other platforms compute them directly."""

    def both(a_BTk):
        return jnp.cos(a_BTk), jnp.sin(a_BTk)

    def on_cpu(a_BTk, x):
        return jax.lax.cond(x.reshape(-1)[0] > 0, both, both, a_BTk)

    if angles_BTk.shape[1] == 1:
        return both(angles_BTk)
    return jax.lax.platform_dependent(angles_BTk, x_BTHK, cpu=on_cpu, default=lambda a, _: both(a))


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
    # of the positions: no gradient). YaRN's factor scales both, so it transposes to itself.
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


def yarn_attention_factor(factor: float, mscale: float = 1.0, mscale_all_dim: float = 0.0) -> float:
    """YaRN's default attention factor 0.1 ln(factor) + 1 (1 for factor <= 1); with DeepSeek's mscale and
    mscale_all_dim both set, the ratio of that formula scaled by each (transformers' get_mscale)."""

    def m(scale):
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    return m(mscale) / m(mscale_all_dim) if mscale and mscale_all_dim else m(1.0)


def _yarn_scaling(inv_freq: np.ndarray, r: RoPE) -> np.ndarray:
    """YaRN's frequencies: those turning more than beta_fast times over original_max_len kept
    (extrapolated), less than beta_slow times divided by factor (interpolated), a linear ramp over the
    frequency index between (as transformers' _compute_yarn_parameters)."""
    K = r.head_dim

    def index_turning(rotations):  # the (fractional) frequency index turning `rotations` times
        return K * math.log(r.original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(r.theta))

    low, high = index_turning(r.beta_fast), index_turning(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, K - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    # transformers builds the ramp in float32: the same rounding at its ends
    ramp = np.clip((np.arange(K // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    kept = 1.0 - ramp.astype(np.float64)  # 1: extrapolate (keep), 0: interpolate (divide by factor)
    return inv_freq / r.factor * (1 - kept) + inv_freq * kept
