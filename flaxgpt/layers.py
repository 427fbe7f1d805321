"""Building blocks shared by the GPT and the encoder-decoder Transformer.

One implementation of each: attention (self or cross, causal or padded, with an
optional fixed-size KV cache), the MLP, and position encodings.

Shape letters used in names:
  B batch, T query length, S key length (the cache length when decoding),
  L layers, H heads, K head dim, D model dim, F MLP hidden dim.

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

Dtype = Any

ATTENTION_IMPLS = ("auto", "xla", "cudnn", "pallas")
ACTIVATIONS = ("gelu", "gelu_exact", "relu")


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
    raise ValueError(f"unknown activation {name!r}; choose one of {ACTIVATIONS}")


def accelerator() -> str:
    """The kind of device: "nvidia" (CUDA GPU, has cuDNN), "tpu", else the backend ("cpu", "gpu" on ROCm)."""
    backend = jax.default_backend()
    if backend == "gpu" and "nvidia" in jax.devices()[0].device_kind.lower():
        return "nvidia"
    return backend


def resolve_attention_impl(impl: str, dtype: Dtype) -> str:
    """`auto` picks cuDNN flash attention on NVIDIA GPUs in 16-bit (cuDNN's fused kernel has no
    float32 path), the Pallas splash kernel on TPU, XLA elsewhere. Explicit choices pass through."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention_impl {impl!r}; choose one of {ATTENTION_IMPLS}")
    if impl != "auto":
        return impl
    where = accelerator()
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if where == "nvidia" and half:
        return "cudnn"
    if where == "tpu":
        return "pallas"
    return "xla"


def sinusoidal_positions(positions: jax.Array, dim: int) -> jax.Array:
    """The original Transformer's encoding: [...] int positions -> [..., dim] float32."""
    half = dim // 2
    inv_freq = np.exp(-math.log(10000.0) * np.arange(half) / half).astype(np.float32)
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [..., dim/2]
    enc = jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)
    if dim % 2:
        enc = jnp.pad(enc, [(0, 0)] * (enc.ndim - 1) + [(0, 1)])
    return enc


def causal_mask(q_pos_BT: jax.Array, kv_len: int) -> jax.Array:
    """[B, 1, T, S] True where key s may be seen by the query at position q_pos."""
    return (jnp.arange(kv_len)[None, None, :] <= q_pos_BT[:, :, None])[:, None]


def padding_mask(kv_lengths_B: jax.Array, kv_len: int) -> jax.Array:
    """[B, 1, 1, S] True on the first kv_lengths[b] keys of each row."""
    return (jnp.arange(kv_len)[None, :] < kv_lengths_B[:, None])[:, None, None, :]


def attend(
    q_BTHK: jax.Array,
    k_BSHK: jax.Array,
    v_BSHK: jax.Array,
    mask_BHTS: jax.Array | None,
    *,
    impl: str,
    is_causal: bool = False,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    sow=None,
) -> jax.Array:
    """Scaled dot-product attention -> [B, T, H, K].

    impl: "xla" (explicit logits and mask), "cudnn" (jax.nn.dot_product_attention's cuDNN
    flash attention, NVIDIA GPUs, 16-bit) or "pallas" (the splash kernel, TPU; interpret mode
    elsewhere). `is_causal` says the mask is exactly causal with queries and keys starting at
    position 0 together (training, prefill into an empty cache). The fused kernels take only
    that case (pallas) or causal / an explicit mask (cudnn), and neither does dropout or hands
    back the weights; everything else goes through the XLA path.
    """
    fused_ok = dropout_rate == 0.0 and sow is None
    if impl == "pallas" and fused_ok and is_causal:
        from flaxgpt import pallas_attention

        if pallas_attention.fits(q_BTHK.shape[1], k_BSHK.shape[1], q_BTHK.shape[0]):
            return pallas_attention.causal_attention(q_BTHK, k_BSHK, v_BSHK)
    if impl == "cudnn" and fused_ok:
        return jax.nn.dot_product_attention(
            q_BTHK,
            k_BSHK,
            v_BSHK,
            mask=None if is_causal else mask_BHTS,
            is_causal=is_causal,
            implementation="cudnn",
        )
    scale = 1.0 / math.sqrt(q_BTHK.shape[-1])
    # fp32 logits and softmax: bf16 loses the tail of the distribution
    logits_BHTS = jnp.einsum("bthk,bshk->bhts", q_BTHK, k_BSHK, preferred_element_type=jnp.float32) * scale
    if mask_BHTS is not None:
        logits_BHTS = jnp.where(mask_BHTS, logits_BHTS, jnp.finfo(jnp.float32).min)
    probs_BHTS = jax.nn.softmax(logits_BHTS, axis=-1)
    if sow is not None:
        sow(probs_BHTS)
    if dropout_rate > 0.0 and dropout_rng is not None:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, probs_BHTS.shape)
        probs_BHTS = jnp.where(keep, probs_BHTS / (1.0 - dropout_rate), 0.0)
    return jnp.einsum("bhts,bshk->bthk", probs_BHTS.astype(v_BSHK.dtype), v_BSHK)


def write_cache(bufs, layer, new_BTHK: jax.Array, pos_BT: jax.Array):
    """Scatter new keys or values into a layer's fixed-size buffer at per-row positions.

    `bufs` is the KVCache's tuple of per-layer [B*H, S, K] buffers (`layer` an int), or
    one stacked [L, B*H, S, K] array (under nn.scan, where `layer` is traced). Either
    way a donated buffer is updated in place.
    """
    B, T, H, K = new_BTHK.shape
    rows_B1H = (jnp.arange(B)[:, None] * H + jnp.arange(H))[:, None, :]  # buffer row of (b, h)
    pos_BT1 = pos_BT[:, :, None]
    if isinstance(bufs, (tuple, list)):
        out = list(bufs)
        out[layer] = bufs[layer].at[rows_B1H, pos_BT1].set(new_BTHK.astype(bufs[layer].dtype))
        return tuple(out)
    return bufs.at[layer, rows_B1H, pos_BT1].set(new_BTHK.astype(bufs.dtype))


def attend_cached(q_BTHK, k_NSK, v_NSK, mask_BHTS, sow=None) -> jax.Array:
    """Attention over a KVCache layer ([B*H, S, K] keys and values, as they lie) -> [B, T, H, K]."""
    B, T, H, K = q_BTHK.shape
    S = k_NSK.shape[1]
    q_NTK = jnp.swapaxes(q_BTHK, 1, 2).reshape(B * H, T, K)
    logits_NTS = jnp.einsum(
        "ntk,nsk->nts", q_NTK, k_NSK.astype(q_NTK.dtype), preferred_element_type=jnp.float32
    )
    logits_BHTS = logits_NTS.reshape(B, H, T, S) / math.sqrt(K)
    logits_BHTS = jnp.where(mask_BHTS, logits_BHTS, jnp.finfo(jnp.float32).min)
    probs_BHTS = jax.nn.softmax(logits_BHTS, axis=-1)
    if sow is not None:
        sow(probs_BHTS)
    probs_NTS = probs_BHTS.reshape(B * H, T, S).astype(v_NSK.dtype)
    y_NTK = jnp.einsum("nts,nsk->ntk", probs_NTS, v_NSK)
    return jnp.swapaxes(y_NTK.reshape(B, H, T, K), 1, 2).astype(q_BTHK.dtype)


class SelfAttention(nn.Module):
    """Multi-head self-attention with one fused qkv projection (GPT-2's c_attn).

    Without a cache it attends over `x` itself (causal, or bidirectional with a
    padding mask). With a cache (k, v: per-layer [B*H, S, K] buffers, and this block's
    `layer` index) it writes its new keys and values at `positions` and attends
    over the buffer, masked to positions <= each query's own.
    """

    n_head: int
    causal: bool = True
    use_bias: bool = True
    qkv_bias: bool = True
    attn_dropout: float = 0.0
    resid_dropout: float = 0.0
    out_init_std: float = 0.02
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    impl: str = "xla"
    deterministic: bool = True

    @nn.compact
    def __call__(self, x_BTD, positions_BT=None, cache=None, layer=0, mask_BHTS=None):
        B, T, D = x_BTD.shape
        H = self.n_head
        K = D // H
        qkv_BTE = nn.Dense(
            3 * D,
            use_bias=self.qkv_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=normal_init(0.02, ("embed", "heads")),
            bias_init=zeros_init(("heads",)),
            name="c_attn",
        )(x_BTD.reshape(B * T, D))  # 2-D operands: see MLP
        q_BTHK, k_BTHK, v_BTHK = jnp.split(qkv_BTE.reshape(B, T, 3 * H, K), 3, axis=2)

        sow = None
        if self.is_mutable_collection("intermediates"):
            sow = lambda p: self.sow("intermediates", "attn_weights", p)  # noqa: E731
        if cache is not None:  # decoding: per-row query positions, the XLA path with an explicit mask
            k_buf = write_cache(cache[0], layer, k_BTHK, positions_BT)
            v_buf = write_cache(cache[1], layer, v_BTHK, positions_BT)
            cache = (k_buf, v_buf)
            k_NSK, v_NSK = k_buf[layer], v_buf[layer]
            mask_BHTS = causal_mask(positions_BT, k_NSK.shape[1])
            y_BTHK = attend_cached(q_BTHK, k_NSK, v_NSK, mask_BHTS, sow)
        else:
            is_causal = False
            if self.causal:
                is_causal = mask_BHTS is None  # an extra mask must reach the kernel explicitly
                tril = jnp.tril(jnp.ones((T, T), dtype=bool))[None, None]
                mask_BHTS = tril if mask_BHTS is None else mask_BHTS & tril
            dropout = 0.0 if self.deterministic else self.attn_dropout
            y_BTHK = attend(
                q_BTHK,
                k_BTHK,
                v_BTHK,
                mask_BHTS,
                impl=resolve_attention_impl(self.impl, self.dtype),
                is_causal=is_causal,
                dropout_rate=dropout,
                dropout_rng=self.make_rng("dropout") if dropout > 0 else None,
                sow=sow,
            )
        y_BTD = nn.Dense(
            D,
            use_bias=self.use_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=normal_init(self.out_init_std, ("heads", "embed")),
            bias_init=zeros_init(("embed",)),
            name="c_proj",
        )(y_BTHK.reshape(B * T, D)).reshape(B, T, D)
        y_BTD = nn.Dropout(self.resid_dropout)(y_BTD, deterministic=self.deterministic)
        return y_BTD, cache


class CrossAttention(nn.Module):
    """Queries from the decoder, keys and values from the encoder output.

    `memory` is either the encoder output [B, S, D], projected here, or the
    pair (k, v) [B, S, H, K] from `project_kv`, so decoding projects a source once.
    Keys past `kv_lengths[b]` (source padding) are never attended to.
    """

    d_model: int
    n_head: int
    use_bias: bool = True
    attn_dropout: float = 0.0
    resid_dropout: float = 0.0
    out_init_std: float = 0.02
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    impl: str = "xla"
    deterministic: bool = True

    def setup(self):
        dense = dict(use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype)
        self.c_q = nn.Dense(
            self.d_model,
            kernel_init=normal_init(0.02, ("embed", "heads")),
            bias_init=zeros_init(("heads",)),
            **dense,
        )
        self.c_kv = nn.Dense(
            2 * self.d_model,
            kernel_init=normal_init(0.02, ("embed", "heads")),
            bias_init=zeros_init(("heads",)),
            **dense,
        )
        self.c_proj = nn.Dense(
            self.d_model,
            kernel_init=normal_init(self.out_init_std, ("heads", "embed")),
            bias_init=zeros_init(("embed",)),
            **dense,
        )
        self.drop = nn.Dropout(self.resid_dropout)

    def project_kv(self, memory_BSD):
        B, S, D = memory_BSD.shape
        kv_BSE = self.c_kv(memory_BSD)
        k_BSHK, v_BSHK = jnp.split(kv_BSE.reshape(B, S, 2 * self.n_head, D // self.n_head), 2, axis=2)
        return k_BSHK, v_BSHK

    def __call__(self, x_BTD, memory, kv_lengths_B):
        B, T, D = x_BTD.shape
        k_BSHK, v_BSHK = memory if isinstance(memory, tuple) else self.project_kv(memory)
        q_BTHK = self.c_q(x_BTD).reshape(B, T, self.n_head, D // self.n_head)
        mask_BHTS = padding_mask(kv_lengths_B, k_BSHK.shape[1])
        sow = None
        if self.is_mutable_collection("intermediates"):
            sow = lambda p: self.sow("intermediates", "attn_weights", p)  # noqa: E731
        dropout = 0.0 if self.deterministic else self.attn_dropout
        y_BTHK = attend(
            q_BTHK,
            k_BSHK.astype(q_BTHK.dtype),
            v_BSHK.astype(q_BTHK.dtype),
            mask_BHTS,
            impl=resolve_attention_impl(self.impl, self.dtype),
            dropout_rate=dropout,
            dropout_rng=self.make_rng("dropout") if dropout > 0 else None,
            sow=sow,
        )
        y_BTD = self.c_proj(y_BTHK.reshape(B, T, D))
        return self.drop(y_BTD, deterministic=self.deterministic)


class MLP(nn.Module):
    """Position-wise feed-forward: D -> F -> D (GPT-2's c_fc, c_proj)."""

    hidden: int
    activation: str = "gelu"
    use_bias: bool = True
    dropout: float = 0.0
    out_init_std: float = 0.02
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    deterministic: bool = True

    @nn.compact
    def __call__(self, x_BTD):
        D = x_BTD.shape[-1]
        # Tokens flattened to one axis: with [B, T, D] operands the weight gradients contract
        # two axes, and XLA on CPU then transposes the [B*T, F] activations (fused with the GELU
        # derivative) before each weight-gradient matmul, a third of the step's time.
        x_ND = x_BTD.reshape(-1, D)
        h_NF = nn.Dense(
            self.hidden,
            use_bias=self.use_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=normal_init(0.02, ("embed", "mlp")),
            bias_init=zeros_init(("mlp",)),
            name="c_fc",
        )(x_ND)
        h_NF = activation_fn(self.activation)(h_NF)
        y_ND = nn.Dense(
            D,
            use_bias=self.use_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=normal_init(self.out_init_std, ("mlp", "embed")),
            bias_init=zeros_init(("embed",)),
            name="c_proj",
        )(h_NF)
        y_BTD = y_ND.reshape(x_BTD.shape)
        return nn.Dropout(self.dropout)(y_BTD, deterministic=self.deterministic)


def layer_norm(use_bias: bool, eps: float, dtype: Dtype, param_dtype: Dtype, name: str):
    return nn.LayerNorm(
        epsilon=eps,
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=param_dtype,
        scale_init=ones_init(("embed",)),
        bias_init=zeros_init(("embed",)),
        name=name,
    )
