"""Building blocks shared by the GPT and the encoder-decoder Transformer.

One implementation of each: parameter initializers, activations, norms, the MLP and sinusoidal
positions (attention is in attention.py; the linear layers, float, quantized or adapted, in linear.py).

Shape letters used in names:
  B batch, T query length, S key length (the cache length when decoding),
  L layers, H heads (of queries), J key/value heads (J = H, or fewer: grouped-query
  attention, J = 1 multi-query), G = H / J query heads per key/value head,
  K head dim, D model dim, F MLP hidden dim.

Parameters carry logical axis names ("embed", "heads", "mlp", "vocab",
"layers"); `flaxgpt.sharding` maps them onto a device mesh.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from flaxgpt.kernels.pallas_decode import Norm
from flaxgpt.models.linear import DecodeKernels, Linear

Dtype = Any

ACTIVATIONS = ("gelu", "gelu_exact", "relu", "silu", "relu2")
NORMS = ("layernorm", "rmsnorm", "rmsnorm_1p")


def normal_init(std: float, axes: tuple[str | None, ...]):
    return nn.with_logical_partitioning(nn.initializers.normal(std), axes)


def zeros_init(axes: tuple[str | None, ...]):
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), axes)


def ones_init(axes: tuple[str | None, ...]):
    return nn.with_logical_partitioning(nn.initializers.ones_init(), axes)


def activation_fn(name: str):
    if name == "gelu":  # GPT-2's tanh approximation
        return lambda x: jax.nn.gelu(x, approximate=True)
    if name == "gelu_exact":
        return lambda x: jax.nn.gelu(x, approximate=False)
    if name == "relu":
        return jax.nn.relu
    if name == "relu2":  # relu(x)^2 (So et al. 2021, Primer), the speedrun's MLP activation
        return lambda x: jnp.square(jax.nn.relu(x))
    if name == "silu":  # x * sigmoid(x): Llama's activation (SwiGLU with a gated MLP)
        return jax.nn.silu
    raise ValueError(f"unknown activation {name!r}; choose one of {ACTIVATIONS}")


@jax.custom_vjp
def swiglu(gate_up):
    """[..., 2F] (columns gate | up) -> silu(gate) * up [..., F] (Llama's gated MLP), with a
    hand-written backward pass.

    Autodiff of the plain expression keeps sigmoid(gate), silu(gate) and their products as separate
    arrays, each its own pass over [tokens, F], and joins the two halves' gradients in one more;
    here the forward is one pass and the backward one, which recomputes the sigmoid from gate.
    """
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return jax.nn.silu(gate) * up


def _swiglu_fwd(gate_up):
    return swiglu(gate_up), gate_up


def _swiglu_bwd(gate_up, dh):
    # the barrier keeps XLA from sharing this sigmoid with the forward's (CSE), which would store
    # sigmoid(gate) as an array and split both passes
    gate, up = jnp.split(jax.lax.optimization_barrier(gate_up), 2, axis=-1)
    sig = jax.nn.sigmoid(gate)
    silu = gate * sig
    dgate = dh * up * (sig + silu * (1 - sig))  # d silu / dg = sig (1 + g (1 - sig))
    return (jnp.concatenate([dgate, dh * silu], axis=-1),)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


SINUSOID_LAYOUTS = ("interleaved", "halves")


def sinusoidal_positions(
    positions: jax.Array, dim: int, layout: str = "interleaved", dtype: Dtype = jnp.float32
) -> jax.Array:
    """The original Transformer's encoding: [...] int positions -> [..., dim] in `dtype` (at least float32).

    "interleaved" is the paper's: column 2i is sin(pos / 10000^(2i/dim)), column 2i+1 the cosine.
    "halves" (flaxgpt until this field existed) put all the sines first, then all the cosines; runs saved
    then record no layout and keep it (models.config_from(..., saved=True)).
    """
    if layout not in SINUSOID_LAYOUTS:
        raise ValueError(f"unknown sinusoid_layout {layout!r}; choose one of {SINUSOID_LAYOUTS}")
    dtype = jnp.promote_types(dtype, jnp.float32)
    if layout == "halves":
        half = dim // 2
        inv_freq = np.exp(-math.log(10000.0) * np.arange(half) / half).astype(np.float32)
        angles = positions[..., None].astype(jnp.float32) * inv_freq  # [..., dim/2]
        enc = jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)
        if dim % 2:
            enc = jnp.pad(enc, [(0, 0)] * (enc.ndim - 1) + [(0, 1)])
        return enc.astype(dtype)
    two_i = np.arange(0, dim, 2)  # 2i for the sin columns; the cos columns share them
    inv_freq = jnp.asarray(np.exp(-math.log(10000.0) * two_i / dim), dtype)  # [ceil(dim/2)]
    angles = positions[..., None].astype(dtype) * inv_freq  # [..., ceil(dim/2)]
    enc = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)  # [..., ceil(dim/2), 2]
    return enc.reshape(*angles.shape[:-1], -1)[..., :dim]  # sin, cos, sin, cos, ...


class MLP(nn.Module):
    """Position-wise feed-forward: D -> F -> D (GPT-2's c_fc, c_proj).

    `glu`: the gated form of Shazeer 2020, act(x W_gate) * (x W_up), then c_proj; with silu it
    is Llama's SwiGLU. Gate and up share the fused c_fc kernel [D, 2F] (columns gate | up).
    """

    hidden: int
    activation: str = "gelu"
    glu: bool = False
    use_bias: bool = True
    dropout: float = 0.0
    out_init_std: float = 0.02
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    deterministic: bool = True
    lora: Any = None  # models.lora.LoraSpec: c_fc's and c_proj's adapters (models/linear.py)
    fp8: bool = False  # c_fc's and c_proj's base products in float8 (GPTConfig.fp8)

    @nn.compact
    def __call__(self, x_BTD, pre_norm: Norm | None = None, residual=None):
        """`pre_norm`: x is normalized by c_fc first; `residual`: added by c_proj (models.linear)."""
        D = x_BTD.shape[-1]
        adapted = dict(lora=self.lora, deterministic=self.deterministic, fp8=self.fp8)
        # Tokens flattened to one axis: with [B, T, D] operands the weight gradients contract
        # two axes, and XLA on CPU then transposes the [B*T, F] activations (fused with the GELU
        # derivative) before each weight-gradient matmul, a third of the step's time.
        x_ND = x_BTD.reshape(-1, D)
        # the plain MLP's activation goes to c_fc: on GPUs its float product without adapters applies it
        # with the bias in one pass, recomputed in the backward (Linear's `activation`), so GELU's tanh
        # and the pre-activation with its bias are never kept. SwiGLU's is one pass each way already.
        h_NE = Linear(
            2 * self.hidden if self.glu else self.hidden,
            use_bias=self.use_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=normal_init(0.02, ("embed", "mlp")),
            bias_init=zeros_init(("mlp",)),
            name="c_fc",
            activation=None if self.glu else activation_fn(self.activation),
            **adapted,
        )(x_ND, pre_norm=pre_norm)
        if not self.glu:
            h_NF = h_NE
        elif self.activation == "silu":
            h_NF = swiglu(h_NE)
        else:
            gate_NF, up_NF = jnp.split(h_NE, 2, axis=-1)
            h_NF = activation_fn(self.activation)(gate_NF) * up_NF
        y_ND = Linear(
            D,
            use_bias=self.use_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=normal_init(self.out_init_std, ("mlp", "embed")),
            bias_init=zeros_init(("embed",)),
            name="c_proj",
            **adapted,
        )(h_NF, residual=None if residual is None else residual.reshape(-1, D))
        y_BTD = y_ND.reshape(x_BTD.shape)
        return nn.Dropout(self.dropout)(y_BTD, deterministic=self.deterministic)


def norm(kind: str, use_bias: bool, eps: float, dtype: Dtype, param_dtype: Dtype, name, axes=("embed",)):
    """LayerNorm (GPT-2), RMSNorm (Zhang & Sennrich 2019; Llama: no mean, no bias) or Gemma's RMSNorm
    scaled by (1 + w) ("rmsnorm_1p"), param `scale` in each."""
    if kind == "rmsnorm_1p":
        return RMSNormPlusOne(epsilon=eps, dtype=dtype, param_dtype=param_dtype, axes=axes, name=name)
    if kind == "rmsnorm":
        return nn.RMSNorm(
            epsilon=eps, dtype=dtype, param_dtype=param_dtype, scale_init=ones_init(axes), name=name
        )
    if kind != "layernorm":
        raise ValueError(f"unknown norm {kind!r}; choose one of {NORMS}")
    return layer_norm(use_bias, eps, dtype, param_dtype, name, axes)


def layer_norm(use_bias: bool, eps: float, dtype: Dtype, param_dtype: Dtype, name: str, axes=("embed",)):
    return nn.LayerNorm(
        epsilon=eps,
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=param_dtype,
        scale_init=ones_init(axes),
        bias_init=zeros_init(axes),
        name=name,
    )


class NormParams(nn.Module):
    """A LayerNorm's or RMSNorm's parameters under its name, as flax's (scale, and LayerNorm's bias),
    not applied here: decoding hands them to the product after the norm (`sublayer_input`)."""

    kind: str
    use_bias: bool
    eps: float
    param_dtype: Dtype = jnp.float32
    axes: tuple = ("embed",)

    @nn.compact
    def __call__(self, D: int) -> Norm:
        scale = self.param("scale", ones_init(self.axes), (D,), self.param_dtype)
        with_bias = self.kind == "layernorm" and self.use_bias
        bias = self.param("bias", zeros_init(self.axes), (D,), self.param_dtype) if with_bias else None
        return Norm(self.kind, scale, bias, self.eps)


def sublayer_input(c, layer: int, kernels: DecodeKernels, lora, deterministic: bool, name: str, x_BTD):
    """Block `layer`'s input to its attention or MLP and the extra call arguments (c: the GPT's config,
    the rest the block's): norm(x) and {}, or where `fuse_decode` takes the kernels x itself and
    {pre_norm, residual: x}, the sublayer's first product normalizing x and its last adding x back,
    each in its kernel (models.linear)."""
    dtype, pdtype = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
    if not fuse_decode(c, layer, kernels, lora, deterministic):
        return norm(c.norm, c.bias, c.layer_norm_epsilon, dtype, pdtype, name)(x_BTD), {}
    params = NormParams(c.norm, c.bias, c.layer_norm_epsilon, pdtype, name=name)(x_BTD.shape[-1])
    return x_BTD, {"pre_norm": params, "residual": x_BTD}


def fuse_decode(c, layer: int, kernels: DecodeKernels, lora, deterministic: bool) -> bool:
    """Whether block `layer` of the GPT config `c` takes `sublayer_input`'s fused form: a decoding step
    taking the decode kernels' products (`kernels`, the GPT's models.linear.DecodeKernels), a norm
    the kernel has, and sublayers with nothing between the norm, the products and the residual add
    (no post-norms, mixture of experts, adapters, float8 or dropout)."""
    plain = not (c.post_norms or c.layer_is_sparse(layer) or lora or c.fp8)
    plain = plain and (deterministic or not c.resid_dropout) and c.norm in ("layernorm", "rmsnorm")
    return kernels.products and plain


class RMSNormPlusOne(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + scale), scale starting at 0; in float32 (float64 for float64)
    until the product, as transformers' Gemma2RMSNorm / Gemma3RMSNorm (not Llama's cast-then-scale)."""

    epsilon: float = 1e-6
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    axes: tuple = ("embed",)

    @nn.compact
    def __call__(self, x_BTD):
        w_D = self.param("scale", zeros_init(self.axes), (x_BTD.shape[-1],), self.param_dtype)
        acc = jnp.promote_types(x_BTD.dtype, jnp.float32)
        x = x_BTD.astype(acc)
        y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.epsilon)
        return (y * (1.0 + w_D.astype(acc))).astype(self.dtype)
