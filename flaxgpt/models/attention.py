"""Attention: masks, the one `attend` (XLA, cuDNN or Pallas), the cached form decoding uses, and the
self- and cross-attention layers the GPT and the encoder-decoder build on.

Shape letters used in names:
  B batch, T query length, S key length (the cache length when decoding),
  H heads (of queries), J key/value heads (J = H, or fewer: grouped-query attention, J = 1
  multi-query), G = H / J query heads per key/value head, K head dim, D model dim, N = B * J.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from flaxgpt.kernels import target
from flaxgpt.models import context_attention
from flaxgpt.models.layers import norm, normal_init, zeros_init
from flaxgpt.models.linear import NO_KERNELS, DecodeKernels, Linear
from flaxgpt.models.rope import RoPE

Dtype = Any

ATTENTION_IMPLS = ("auto", "xla", "cudnn", "pallas")


def accelerator() -> str:
    """The kind of device the program is traced for (kernels.target: the mesh context's devices, else
    the host's): "nvidia" (CUDA GPU, has cuDNN), "tpu", else the platform ("cpu", "gpu" on ROCm)."""
    where = target.platform()
    if where == "gpu" and "nvidia" in target.device_kind().lower():  # "NVIDIA H100 80GB HBM3"
        return "nvidia"
    return where


def resolve_attention_impl(impl: str, dtype: Dtype) -> str:
    """`auto` picks cuDNN flash attention on NVIDIA GPUs in 16-bit (cuDNN's fused kernel has no
    float32 path), the Pallas splash kernel on TPU, XLA elsewhere: for the devices the program is
    traced for (`accelerator`), called at trace time. Explicit choices pass through."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention_impl {impl!r}; choose one of {ATTENTION_IMPLS}")
    if impl != "auto":
        return impl
    where = accelerator()
    if where == "nvidia" and half(dtype):
        return "cudnn"
    if where == "tpu":
        return "pallas"
    return "xla"


def half(dtype: Dtype) -> bool:
    """bfloat16 or float16: what cuDNN's fused attention kernel runs in (it has no float32 path)."""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def check_context_kernel(context_impl: str, attention_impl: str, kernel: str) -> None:
    """One line when the context axis' attention cannot run the within-device `kernel` (attention_impl
    resolved for the target): Ulysses hands each device's heads to it inside its own shard_map, and
    the splash kernel's shard_map would nest there. The ring's blocks are its own (XLA), so it takes
    every kernel setting, windows and soft-caps included. The trainer and `flaxgpt aot` ask before
    tracing (`resolve_for_mesh`), the layer again when traced."""
    if context_impl == "ulysses" and kernel == "pallas":
        how = "auto on TPU" if attention_impl == "auto" else "attention_impl=pallas"
        raise ValueError(
            f"context_impl=ulysses cannot run the splash kernel ({how}): its own shard_map would nest "
            "inside Ulysses'; use model.context_impl=ring or model.attention_impl=xla"
        )


def resolve_for_mesh(impl: str, dtype: Dtype, mesh) -> str:
    """resolve_attention_impl for the devices of `mesh` (a jax Mesh), before anything is traced."""
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return resolve_attention_impl(impl, dtype)


def check_context_mesh(kind: str, mc, mesh) -> None:
    """Everything a "context" axis of `mesh` cannot split, and attention_impl=cudnn where cuDNN's kernel
    cannot run (off NVIDIA GPUs, or in float32: a traceback from inside jax), one line each, before
    anything is traced: the owner of the rule for the trainer and `flaxgpt aot` (the layer asks
    check_context_kernel again when traced). kind is the model's ("gpt" or "seq2seq"); mc its config."""
    if getattr(mc, "attention_impl", "auto") == "cudnn":
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            where = accelerator()
        if where != "nvidia" or not half(mc.dtype):
            raise ValueError(
                f"attention_impl=cudnn runs on NVIDIA GPUs in bfloat16 or float16, not on {where} in "
                f"{jnp.dtype(mc.dtype).name}: set model.attention_impl=auto (it picks cuDNN where it runs)"
            )
    n = mesh.shape.get(context_attention.CONTEXT_AXIS, 1)
    if n == 1:
        return
    if kind != "gpt":
        raise ValueError("mesh.context splits a GPT's sequences; a seq2seq run takes mesh.context=1")
    context_attention.check(mc.block_size, mc.n_head, n, mc.context_impl)
    if getattr(mc, "attn_dropout", 0) > 0:  # the layer's refusal (_over_context), before the run starts
        raise ValueError(
            f"attention dropout ({mc.attn_dropout}) needs the whole sequence on one device: "
            "set model.attn_dropout=0 or mesh.context=1"
        )
    kernel = resolve_for_mesh(mc.attention_impl, mc.dtype, mesh)
    check_context_kernel(mc.context_impl, mc.attention_impl, kernel)


def causal_mask(q_pos_BT: jax.Array, kv_len: int, window: int = 0) -> jax.Array:
    """[B, 1, T, S] True where key s may be seen by the query at position q_pos:
    s <= q_pos, and with a sliding `window` (Mistral) also s > q_pos - window."""
    s_11S = jnp.arange(kv_len)[None, None, :]
    q_BT1 = q_pos_BT[:, :, None]
    visible_BTS = s_11S <= q_BT1
    if window:
        visible_BTS &= s_11S > q_BT1 - window
    return visible_BTS[:, None]


def segment_mask(segment_ids_BT: jax.Array) -> jax.Array:
    """[B, 1, T, T] True where query t and key s are in the same segment (packed rows)."""
    return (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])[:, None]


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
    segment_ids_BT: jax.Array | None = None,
    scale: float = 0.0,
    softcap: float = 0.0,
    window: int = 0,
) -> jax.Array:
    """Scaled dot-product attention -> [B, T, H, K].

    `scale`: the logits' factor (0 = 1/sqrt(K)); `softcap`: logits = cap * tanh(logits / cap)
    before the mask (Gemma 2): XLA and the splash kernel do it, cuDNN has none. `window` with
    `is_causal`: the causal mask also limited to the last `window` keys (the mask holds it too):
    the splash kernel takes it as a local mask, cuDNN as the explicit mask.

    impl: "xla" (explicit logits and mask), "cudnn" (jax.nn.dot_product_attention's cuDNN
    flash attention, NVIDIA GPUs, 16-bit) or "pallas" (the splash kernel, TPU; interpret mode
    elsewhere). `is_causal` says the mask is exactly causal with queries and keys starting at
    position 0 together (training, prefill into an empty cache). The fused kernels take only
    that case (pallas) or causal / an explicit mask (cudnn), and neither does dropout or hands
    back the weights; everything else goes through the XLA path.
    Packed rows (`segment_ids_BT`, already folded into `mask_BHTS`): the splash kernel takes the
    segment ids itself; cuDNN gets the explicit causal-and-same-segment mask.
    """
    fused_ok = dropout_rate == 0.0 and sow is None
    if impl == "pallas" and fused_ok and is_causal:
        from flaxgpt.kernels import pallas_attention

        if pallas_attention.fits(q_BTHK.shape[1], k_BSHK.shape[1], q_BTHK.shape[0]):
            if scale:  # the kernel scales by 1/sqrt(K) itself
                q_BTHK = q_BTHK * jnp.asarray(scale * math.sqrt(q_BTHK.shape[-1]), q_BTHK.dtype)
            return pallas_attention.causal_attention(q_BTHK, k_BSHK, v_BSHK, segment_ids_BT, window, softcap)
    if impl == "cudnn" and fused_ok and not softcap:
        causal_only = is_causal and segment_ids_BT is None and not window
        if mask_BHTS is not None and not causal_only:
            # cuDNN takes the mask as a bias with every query's row: a padding mask [B, 1, 1, S]
            # (the encoder's, cross-attention's) is spread over the T queries
            T, S = q_BTHK.shape[1], k_BSHK.shape[1]
            mask_BHTS = jnp.broadcast_to(mask_BHTS, mask_BHTS.shape[:2] + (T, S))
        return jax.nn.dot_product_attention(
            q_BTHK,
            k_BSHK,
            v_BSHK,
            mask=None if causal_only else mask_BHTS,
            is_causal=causal_only,
            implementation="cudnn",
            **({"scale": scale} if scale else {}),
        )
    scale = scale or 1.0 / math.sqrt(q_BTHK.shape[-1])
    # logits and softmax in at least fp32 (bf16 loses the tail of the distribution), fp64 for fp64
    acc = jnp.promote_types(q_BTHK.dtype, jnp.float32)
    logits_BHTS = jnp.einsum("bthk,bshk->bhts", q_BTHK, k_BSHK, preferred_element_type=acc) * scale
    if softcap:
        logits_BHTS = softcap * jnp.tanh(logits_BHTS / softcap)
    if mask_BHTS is not None:
        logits_BHTS = jnp.where(mask_BHTS, logits_BHTS, jnp.finfo(acc).min)
    probs_BHTS = jax.nn.softmax(logits_BHTS, axis=-1)
    if sow is not None:
        sow(probs_BHTS)
    if dropout_rate > 0.0 and dropout_rng is not None:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, probs_BHTS.shape)
        probs_BHTS = jnp.where(keep, probs_BHTS / (1.0 - dropout_rate), 0.0)
    return jnp.einsum("bhts,bshk->bthk", probs_BHTS.astype(v_BSHK.dtype), v_BSHK)


def attend_cached(q_BTHK, k_NSK, v_NSK, mask_BHTS, sow=None, scale=0.0, softcap=0.0) -> jax.Array:
    """Attention over a KVCache layer ([B*J, S, K] keys and values, as they lie) -> [B, T, H, K].

    With J < H key/value heads (grouped-query), the G = H / J query heads that share a key/value
    head are stacked as rows of one matrix (query head h reads key/value head h // G, as
    transformers' repeat_kv), so the cache is read once per key/value head and never repeated.
    """
    B, T, H, K = q_BTHK.shape
    N, S, _ = k_NSK.shape
    J = N // B
    G = H // J
    q_NMK = jnp.transpose(q_BTHK.reshape(B, T, J, G, K), (0, 2, 3, 1, 4)).reshape(N, G * T, K)  # M = G*T
    acc = jnp.promote_types(q_BTHK.dtype, jnp.float32)  # as in attend: fp32 at least, fp64 for fp64
    logits_NMS = jnp.einsum("nmk,nsk->nms", q_NMK, k_NSK.astype(q_NMK.dtype), preferred_element_type=acc)
    logits_BHTS = logits_NMS.reshape(B, H, T, S)
    logits_BHTS = logits_BHTS * scale if scale else logits_BHTS / math.sqrt(K)
    if softcap:  # as in attend
        logits_BHTS = softcap * jnp.tanh(logits_BHTS / softcap)
    logits_BHTS = jnp.where(mask_BHTS, logits_BHTS, jnp.finfo(acc).min)
    probs_BHTS = jax.nn.softmax(logits_BHTS, axis=-1)
    if sow is not None:
        sow(probs_BHTS)
    probs_NMS = probs_BHTS.reshape(N, G * T, S).astype(v_NSK.dtype)
    y_NMK = jnp.einsum("nms,nsk->nmk", probs_NMS, v_NSK)
    y_BHTK = y_NMK.reshape(B, H, T, K)
    return jnp.swapaxes(y_BHTK, 1, 2).astype(q_BTHK.dtype)


class SelfAttention(nn.Module):
    """Multi-head self-attention with one fused qkv projection (GPT-2's c_attn).

    Without a cache it attends over `x` itself (causal, or bidirectional with a
    padding mask). With `kv` (this layer's cache.KVLayer: contiguous, ring or paged) the layer
    writes the new keys and values at `positions` and attends, masked to positions <= each
    query's own (and within the window), and the updated layer comes back (`real_BT`: False on a
    prefill's padding, which a ring never takes in).

    Options of modern decoders: `n_kv_head` J < H key/value heads (grouped-query attention,
    Ainslie et al. 2023; J = 1 is multi-query), which also shrinks the cache H / J times;
    `qk_norm` normalises each head's queries and keys (Dehghani et al. 2023); `rope` rotates
    them by their positions (RoPE); `window` limits each query to the last `window` keys.
    """

    n_head: int
    n_kv_head: int = 0  # J; 0 = n_head
    rope: RoPE | None = None
    qk_norm: str | None = None  # None, or the norm ("layernorm" | "rmsnorm") over each head's K features
    norm_eps: float = 1e-5
    window: int = 0  # sliding-window attention (Mistral); 0 = every earlier key
    head_dim: int = 0  # K; 0 = D // H (Gemma and Qwen3 set their own)
    scale: float = 0.0  # the logits' factor; 0 = 1/sqrt(K) (Gemma: 1/sqrt(query_pre_attn_scalar))
    softcap: float = 0.0  # attention-logit soft-cap (Gemma 2); 0 = off
    causal: bool = True
    use_bias: bool = True
    qkv_bias: bool = True
    attn_dropout: float = 0.0
    resid_dropout: float = 0.0
    out_init_std: float = 0.02
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    impl: str = "xla"
    context_impl: str = "ring"  # a mesh context axis (models/context_attention.py): ring | ulysses
    deterministic: bool = True
    lora: Any = None  # models.lora.LoraSpec: c_attn's and c_proj's adapters (models/linear.py)
    fp8: bool = False  # c_attn's and c_proj's base products in float8 (GPTConfig.fp8)
    kernels: DecodeKernels = NO_KERNELS  # the decoding step's (models.linear): `attention`, kv.attend's

    @nn.compact
    def __call__(
        self,
        x_BTD,
        positions_BT=None,
        kv=None,
        mask_BHTS=None,
        ve_BTD=None,
        segment_ids_BT=None,
        real_BT=None,
        pre_norm=None,
        residual=None,
    ):
        """`pre_norm` (kernels.pallas_decode.Norm): x is normalized by c_attn first; `residual`: added by
        c_proj (decoding's fused kernels, models.linear)."""
        B, T, D = x_BTD.shape
        H = self.n_head
        J = self.n_kv_head or H
        K = self.head_dim or D // H
        adapted = dict(lora=self.lora, deterministic=self.deterministic, fp8=self.fp8)
        # cuDNN's attention takes q, k and v as arrays of their own and hands back their gradients so:
        # out of one [B*T, (H+2J)*K] product they are split by a copy, and the gradients concatenated
        # back by another. With a product each (Linear's `splits`, a piece of the kernel each) the
        # backward's concatenation is gone (compiled for h100-1: docs/accelerators.md). Decoding keeps
        # the one product, which the decode attention kernel takes as it lies (models/cache.py).
        apart = kv is None and context_attention.axis_size() <= 1
        apart = apart and resolve_attention_impl(self.impl, self.dtype) == "cudnn"
        qkv = Linear(
            (H + 2 * J) * K,  # columns q | k | v, heads inside each (3D for GPT-2)
            use_bias=self.qkv_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=normal_init(0.02, ("embed", "heads")),
            bias_init=zeros_init(("heads",)),
            name="c_attn",
            splits=(H * K, (H + J) * K) if apart else (),
            **adapted,
        )(x_BTD.reshape(B * T, D), pre_norm=pre_norm)  # 2-D operands: see MLP
        if apart:
            q_BTHK, k_BTJK, v_BTJK = (y.reshape(B, T, -1, K) for y in qkv)
        else:
            q_BTHK, k_BTJK, v_BTJK = jnp.split(qkv.reshape(B, T, H + 2 * J, K), [H, H + J], axis=2)
        if ve_BTD is not None:  # value embeddings (the speedrun's): v = l0 * v + l1 * ve, l learned
            lambdas = self.param("ve_lambdas", nn.initializers.constant(0.5), (2,), self.param_dtype)
            lambdas = lambdas.astype(v_BTJK.dtype)
            v_BTJK = lambdas[0] * v_BTJK + lambdas[1] * ve_BTD.reshape(B, T, J, K).astype(v_BTJK.dtype)
        if self.qk_norm:
            norm_args = (self.qk_norm, self.use_bias, self.norm_eps, self.dtype, self.param_dtype)
            q_BTHK = norm(*norm_args, "q_norm", axes=(None,))(q_BTHK)
            k_BTJK = norm(*norm_args, "k_norm", axes=(None,))(k_BTJK)
        if self.rope is not None:  # keys enter the cache rotated
            q_BTHK = self.rope.apply(q_BTHK, positions_BT, real_BT)  # real_BT: dynamic's lengths
            k_BTJK = self.rope.apply(k_BTJK, positions_BT, real_BT)

        sow = None
        if self.is_mutable_collection("intermediates"):
            sow = lambda p: self.sow("intermediates", "attn_weights", p)  # noqa: E731
        if kv is not None:  # a cache layer (models/cache.py: contiguous, ring or paged) writes and attends
            y_BTHK, kv = kv.attend(
                q_BTHK, k_BTJK, v_BTJK, positions_BT, window=self.window, real_BT=real_BT,
                kernels=self.kernels.attention, sow=sow, scale=self.scale, softcap=self.softcap,
            )  # fmt: skip
        elif context_attention.axis_size() > 1:  # sequences split over the mesh's context axis
            y_BTHK = self._over_context(q_BTHK, k_BTJK, v_BTJK, mask_BHTS, segment_ids_BT, sow)
        else:
            is_causal = False
            if self.causal:
                # an extra mask must reach the kernel explicitly (a window goes as `window`)
                is_causal = mask_BHTS is None
                tril = causal_mask(jnp.arange(T)[None], T, self.window)
                mask_BHTS = tril if mask_BHTS is None else mask_BHTS & tril
            if segment_ids_BT is not None:  # packed rows: no query sees another example's keys
                mask_BHTS = mask_BHTS & segment_mask(segment_ids_BT)
            dropout = 0.0 if self.deterministic else self.attn_dropout
            if J < H:  # grouped-query: each key/value head serves G query heads (h reads h // G)
                k_BTJK, v_BTJK = jnp.repeat(k_BTJK, H // J, axis=2), jnp.repeat(v_BTJK, H // J, axis=2)
            y_BTHK = attend(
                q_BTHK,
                k_BTJK,
                v_BTJK,
                mask_BHTS,
                impl=resolve_attention_impl(self.impl, self.dtype),
                is_causal=is_causal,
                dropout_rate=dropout,
                dropout_rng=self.make_rng("dropout") if dropout > 0 else None,
                sow=sow,
                segment_ids_BT=segment_ids_BT,
                scale=self.scale,
                softcap=self.softcap,
                window=self.window,
            )
        y_BTD = Linear(
            D,
            use_bias=self.use_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=normal_init(self.out_init_std, ("heads", "embed")),
            bias_init=zeros_init(("embed",)),
            name="c_proj",
            **adapted,
        )(y_BTHK.reshape(B * T, H * K), residual=None if residual is None else residual.reshape(B * T, D))
        y_BTD = y_BTD.reshape(B, T, D)
        y_BTD = nn.Dropout(self.resid_dropout)(y_BTD, deterministic=self.deterministic)
        return y_BTD, kv

    def _over_context(self, q_BTHK, k_BTJK, v_BTJK, mask_BHTS, segment_ids_BT, sow):
        """Causal attention of sequences split over the mesh's context axis (context_attention)."""
        if not self.causal or mask_BHTS is not None:
            raise ValueError("a mesh context axis takes causal self-attention only: set mesh.context=1")
        if sow is not None or (self.attn_dropout > 0 and not self.deterministic):
            raise ValueError(
                "attention dropout and sown attention weights need the whole sequence on one device: "
                "set model.attn_dropout=0 or mesh.context=1"
            )
        impl = resolve_attention_impl(self.impl, self.dtype)
        check_context_kernel(self.context_impl, self.impl, impl)
        kw = dict(scale=self.scale, softcap=self.softcap, window=self.window)

        def local_attend(q_BTHK, k_BTJK, v_BTJK, seg_BT):  # Ulysses: a device's heads, whole sequence
            T, H, J = q_BTHK.shape[1], q_BTHK.shape[2], k_BTJK.shape[2]
            mask_BHTS = causal_mask(jnp.arange(T)[None], T, self.window)
            if seg_BT is not None:
                mask_BHTS = mask_BHTS & segment_mask(seg_BT)
            if J < H:
                k_BTJK, v_BTJK = jnp.repeat(k_BTJK, H // J, axis=2), jnp.repeat(v_BTJK, H // J, axis=2)
            return attend(
                q_BTHK, k_BTJK, v_BTJK, mask_BHTS, impl=impl, is_causal=True, segment_ids_BT=seg_BT, **kw
            )

        return context_attention.attend(
            q_BTHK, k_BTJK, v_BTJK, segment_ids_BT, impl=self.context_impl, local_attend=local_attend, **kw
        )


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
