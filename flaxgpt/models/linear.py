"""The GPT's linear layers and token table, each knowing how its weight is applied (vLLM's one
LinearMethod per representation), composed by the layer itself:

    y = Linear(N, name="c_attn", lora=spec)(x_MK)      # kernel [K, N] and bias [N], as nn.Dense's
    rows = Embedding(V, D, name="wte")(tokens_BT)        # embedding [V, D], as nn.Embed's

The base weight is what the "params" collection holds at the layer's path:
  float (float32, or a bfloat16 cast):  nn.Dense's own product (the same promotion and dot), or with
      `fp8` (GPTConfig.fp8) kernels.fp8's scaled float8 product, differentiable in x and the weight;
  quantized (quantize.QuantizedWeight: int8 or bfloat16 w [N, K] with per-row scales [N], or int4
      packed [N, K/2] with per-group scales [N, K/group]): `qdot`,
      kernels.qmatmul (the C++ kernel for decoding's few rows on CPU, XLA's dot for many), with a
      gradient for x so LoRA trains over it (QLoRA).
Adapters are what the "lora" collection holds at the same path (models/lora.py lays them out), added
to the base's output on their columns, whatever the base is:
  LoRA (`lora`, a models.lora.LoraSpec: columns, scale, dropout): {t}_a [K, r], {t}_b [r, N_t] for
      each target t this layer holds: y + dropout(x) A B * scale (`add_adapters`);
  adapter slots (models/multi_lora.py): {t}_a [S, K, R], {t}_b [S, R, N_t] stacked over S slots and
      `rows` [B], each batch row's slot; row b adds x A[rows[b]] B[rows[b]] (`add_slots`).
So an adapter over an int8 or bf16 base, and a batch of rows with different adapters over one, are
the base's own product plus the adapters' float32 terms (over a float8 base too: QLoRA-like, the
base in float8, the adapters not); the one refusal is float8 over an int8 or bf16-quantized base.
A mixture of experts' stacked weights compose the same way by type (models/moe.py: QuantizedWeight,
LoraExperts). Parameter names and paths are nn.Dense's and nn.Embed's, so checkpoints, Hugging Face
and PEFT key maps see no difference.

Two forms of the float product for the GPU step (docs/accelerators.md, "Fused MLP epilogues"):
`activation` (the plain MLP's GELU) applied with the bias in one pass that the backward pass runs
again, so only the product is kept; `splits`, the output wanted in pieces (c_attn's q | k | v for
cuDNN), one product a piece; on GPUs (`fused_epilogues`). Quantized or adapted layers compute the one
product, then split and activate it.

Shape letters: M rows (B*T), K input features, N output features, r an adapter's rank, S slots,
B batch rows, T positions, R the slots' rank, P = R times the targets one layer holds.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen.dtypes import promote_dtype

from flaxgpt.kernels import pallas_decode, target
from flaxgpt.kernels.fp8 import fp8_dot, fp8_note  # noqa: F401  (fp8_note: the trainer's door to it)
from flaxgpt.kernels.qmatmul import dequantize, qmatmul
from flaxgpt.models.quantize import QuantizedWeight

Dtype = Any

ROWS = "rows"  # the "lora" collection's per-row slot index beside stacked adapters (models/multi_lora.py)


@jax.custom_vjp
def qdot(x_MK, w_NK, scale_N):
    """x @ (w * scale)^T -> [M, N] float32 by kernels.qmatmul, differentiable in x (the weights are frozen:
    the CPU kernel has no gradient of its own, and a quantized weight is never trained)."""
    return qmatmul(x_MK, w_NK, scale_N)


def _qdot_fwd(x_MK, w_NK, scale_N):
    return qmatmul(x_MK, w_NK, scale_N), (x_MK, w_NK, scale_N)


def _qdot_bwd(res, dy_MN):
    x_MK, w_NK, scale_N = res
    if w_NK.dtype == jnp.uint8:  # int4: a scale per group, so the weight dequantized
        dx_MK = dy_MN @ dequantize(w_NK, scale_N)
    else:
        dx_MK = (dy_MN * scale_N) @ w_NK.astype(jnp.float32)  # dy (w * s), the weights read once more
    return dx_MK.astype(x_MK.dtype), None, None


qdot.defvjp(_qdot_fwd, _qdot_bwd)


class Linear(nn.Module):
    """y = x W (+ b) with W float or quantized, plus the "lora" collection's adapters at this path."""

    features: int
    use_bias: bool = True
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    kernel_init: Any = nn.initializers.lecun_normal()
    bias_init: Any = nn.initializers.zeros_init()
    lora: Any = None  # models.lora.LoraSpec (columns, scale, dropout); None: no adapters
    deterministic: bool = True  # False: LoRA dropout on (a "dropout" rng)
    fp8: bool = False  # a float base's product in float8 (kernels.fp8: GPTConfig.fp8); adapters stay float32
    # column boundaries: the output comes back as that many arrays (jnp.split's), see `_split_products`
    splits: tuple[int, ...] = ()
    # an elementwise function of the output (the MLP's GELU), see `_activated`; None: the output as is
    activation: Any = None

    @nn.compact
    def __call__(self, x, pre_norm: pallas_decode.Norm | None = None, residual=None):
        """`pre_norm` (decoding, models.layers.sublayer_input): x is the residual stream, which this
        layer normalizes first; `residual`: the output comes back with it added. Both go into one
        kernel with the product (`_decode_kernel`) where the kernel tiles the shape, else XLA's steps."""
        kernel = self.get_variable("params", "kernel") if self.has_variable("params", "kernel") else None
        if not isinstance(kernel, QuantizedWeight):
            kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features), self.param_dtype)
        bias = None
        if self.use_bias:
            bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype)
        if pre_norm is not None or residual is not None:
            y = self._decode_kernel(x, kernel, bias, pre_norm, residual)
            if y is not None:
                return y
            if pre_norm is not None:  # the norm as XLA's steps (flax's arithmetic), in the compute dtype
                x = pallas_decode.normalize(x, pre_norm).astype(self.dtype or x.dtype)
        y = self._product(x, kernel, bias)
        return y if residual is None else residual + y

    def _product(self, x, kernel, bias):
        """y = x W (+ b), split and activated as asked, plus the adapters."""
        if isinstance(kernel, QuantizedWeight):
            if self.fp8:
                raise ValueError(
                    f"model.fp8 multiplies float weights in float8, but {self.name}'s weight is quantized "
                    f"({kernel.w.dtype}): set model.fp8=False, or lora.base_dtype=float32 for a float base"
                )
            y = qdot(x.reshape(-1, x.shape[-1]), kernel.w, kernel.scale)
            y = y if bias is None else y + bias
            y = y.reshape(*x.shape[:-1], -1).astype(self.dtype or x.dtype)
        else:  # nn.Dense's product, step for step
            x_, kernel, bias = promote_dtype(x, kernel, bias, dtype=self.dtype)
            if self.splits and not self.fp8 and self.lora is None and fused_epilogues():
                return self._split_products(x_, kernel, bias)
            if self.fp8:  # e4m3 operands scaled per tensor, float32 accumulation, y in the compute dtype
                y = fp8_dot(x_, kernel)
            else:
                y = product(x_, kernel)
            if self.activation is not None and self.lora is None and fused_epilogues():
                return _activated(self.activation, y, bias)
            if bias is not None:
                y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
        return self._activate(self._split(self._adapted(x, y)))

    def _decode_kernel(self, x, kernel, bias, norm, residual):
        """norm + product + bias + activation + residual as one kernel (kernels.pallas_decode), for a
        float weight or a bf16-quantized one (rows [N, K], read as they lie: `--quantize bf16`),
        without adapters, float8 or an output in pieces, in shapes and dtypes it tiles (the step
        takes the kernels: the caller's `pre_norm` / `residual` say so); else None (the caller
        takes XLA's steps). int8 and int4 rows keep kernels.qmatmul's route."""
        x_MK = x.reshape(-1, x.shape[-1])
        quantized = isinstance(kernel, QuantizedWeight)
        rows = quantized and jnp.dtype(kernel.w.dtype) == jnp.bfloat16
        if (quantized and not rows) or self.fp8 or self.lora is not None:
            return None
        # bf16 rows' scales are ones (quantize's bf16 mode), so the rows are the weight; the quantized
        # path computes in the layer's dtype (else x's), as _product's qdot does
        w = kernel.w if rows else kernel
        (M, K), N = x_MK.shape, w.shape[0] if rows else w.shape[1]
        if rows:
            dtype = jnp.dtype(self.dtype or x.dtype)
        else:
            dtype = jnp.dtype(self.dtype or jnp.result_type(x, w, *(() if bias is None else (bias,))))
        out = dtype if residual is None else jnp.result_type(residual, dtype)
        if self.splits or not pallas_decode.takes(M, N, K, x.dtype, w.dtype, dtype, out):
            return None
        res_MN = None if residual is None else residual.reshape(M, N)
        y_MN = pallas_decode.gemv(
            x_MK, w, bias, norm=norm, activation=self.activation, residual_MN=res_MN, rows_w=rows,
            dtype=dtype, out_dtype=out, interpret=target.platform() != "gpu",
        )  # fmt: skip
        return y_MN.reshape(*x.shape[:-1], -1)

    def _adapted(self, x, y):
        """y plus the "lora" collection's adapters at this path (none: y)."""
        if self.lora is None:
            return y
        parts = sorted(
            (p for p in self.lora.columns if self.has_variable("lora", f"{p[0]}_a")), key=lambda p: p[1]
        )
        if not parts:
            return y
        get = lambda name: self.get_variable("lora", name)  # noqa: E731
        if self.has_variable("lora", ROWS):
            return add_slots(x, y, parts, get, get(ROWS))
        if self.lora.dropout and not self.deterministic:  # one mask per input, shared by its adapters (PEFT)
            keep = jax.random.bernoulli(self.make_rng("dropout"), 1.0 - self.lora.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.lora.dropout), 0.0).astype(x.dtype)
        return add_adapters(x, y, parts, get, self.lora.scale)

    def _activate(self, y):
        return y if self.activation is None else self.activation(y)

    def _split(self, y):
        return jnp.split(y, self.splits, axis=-1) if self.splits else y

    def _split_products(self, x, kernel, bias):
        """A float product whose output is wanted in pieces (c_attn's q | k | v for cuDNN) as one product
        a piece, each its own array: after one product split, the pieces' gradients (cuDNN's three) are
        concatenated back into one array for its backward products, a pass over all of them."""
        bounds = (0, *self.splits, kernel.shape[-1])
        ys = []
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            y = product(x, kernel[:, lo:hi])
            ys.append(y if bias is None else y + jnp.reshape(bias[lo:hi], (1,) * (y.ndim - 1) + (-1,)))
        return ys


# XLA's GPU compiler takes a product with a one-row operand and fewer than this many entries in
# the other as an elementwise multiply and a sum (its dot strength reduction's size threshold)
XLA_GPU_REDUCED_BELOW = 10_000_000


def product(x, kernel):
    """x W over x's last axis (nn.Dense's dot_general). One row (a batch-1 decoding step) on a GPU
    goes in as the same row twice, the second result dropped, where W has fewer than
    XLA_GPU_REDUCED_BELOW entries: XLA takes such a product as an elementwise multiply and a sum over
    K, and where the sum keeps few columns (GPT-2's c_proj products, N = 768) it writes the whole
    [K, N] product to HBM between two kernels (in bf16, rounded before the sum). Two rows are a GEMM
    to it (Triton's, autotuned on the device, float32 accumulation) that reads W once: GPT-2 124M's
    greedy bf16 token compiled for h100-1 moves 366 MB instead of 505, in the same 180 kernels
    (docs/accelerators.md). float32 asks for the GEMM at HIGHEST precision: the sum it replaces
    rounded nothing to TF32."""
    one_row = x.size == x.shape[-1]
    if one_row and kernel.size < XLA_GPU_REDUCED_BELOW and target.platform() == "gpu":
        exact = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
        x_2K = jnp.broadcast_to(x.reshape(1, -1), (2, x.shape[-1]))
        y_2N = jax.lax.dot_general(x_2K, kernel, (((1,), (0,)), ((), ())), precision=exact)
        return y_2N[:1].reshape(*x.shape[:-1], -1)
    return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))


def fused_epilogues() -> bool:
    """Whether `activation` and `splits` take their own forms (read when traced): on GPUs, where the
    compiled step shows what they save (docs/accelerators.md); elsewhere, or FLAXGPT_EPILOGUES=off,
    the activation applied after the layer as autodiff keeps it and one product split.
    FLAXGPT_EPILOGUES=on takes them anywhere (the tests; benchmarks/gpu_lease.py's `epilogues` part
    measures both forms of the step on one lease)."""
    mode = os.environ.get("FLAXGPT_EPILOGUES", "auto")
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"FLAXGPT_EPILOGUES={mode!r}: use auto (GPUs only), on or off")
    return mode == "on" or (mode == "auto" and target.platform() == "gpu")


@dataclasses.dataclass(frozen=True)
class DecodeKernels:
    """What a decoding step takes as Pallas kernels (`decode_kernels`, the GPT's one decision a step,
    handed to its blocks and head): `products`, each sublayer's norm + product (+ GELU) and product +
    residual, and ln_f + the head (kernels.pallas_decode, via models.layers.sublayer_input and
    Linear's pre_norm / residual); `attention`, each cache layer's writes + attention
    (kernels.pallas_decode_attention, via models/cache.py)."""

    products: bool = False
    attention: bool = False


NO_KERNELS = DecodeKernels()
# FLAXGPT_DECODE_KERNELS's values
MODES = {
    "auto": NO_KERNELS,
    "off": NO_KERNELS,
    "on": DecodeKernels(True, True),
    "attention": DecodeKernels(attention=True),
}


def decode_kernels(rows: int) -> DecodeKernels:
    """Which of a decoding step's kernels it takes (DecodeKernels), asked once a step when traced by
    models.gpt.GPT. FLAXGPT_DECODE_KERNELS=on takes them all for `rows` <= MAX_ROWS on one device
    (interpreted off GPUs: the tests), `attention` the attention kernel alone (the products XLA's: a
    Llama-3-8B token's 18 kernels a layer come to 13, compiled for h100-1); auto (the
    default) and off keep XLA's path. Why not on GPUs by default: measured on an H200 (2026-11-29,
    docs/accelerators.md) they were slower than XLA's path although they launch half the kernels
    (GPT-2 124M at batch 1, float: 1,340 tok/s against 1,606; the Llama-3-8B shape in bf16 183 tok/s,
    61% of HBM, where XLA's path read 72% on the 2026-11-27 lease): the GEMVs' tiles are untuned
    (benchmarks/kernel_sweep.py measures them on the next lease, and gpu_lease.py's decode parts the
    attention kernel alone). A prefill's many rows and several devices (XLA cannot split the
    kernel) keep XLA's path whatever the mode."""
    mode = os.environ.get("FLAXGPT_DECODE_KERNELS", "auto")
    if mode not in MODES:
        raise ValueError(f"FLAXGPT_DECODE_KERNELS={mode!r}: use auto (XLA's path), on, attention or off")
    if rows > pallas_decode.MAX_ROWS or not target.one_device():
        return NO_KERNELS
    return MODES[mode]


def _activated(activation, y, bias):
    """activation(y + bias), its inputs the only arrays kept for the backward pass: the pass that adds
    the bias and applies the activation runs again there (jax.checkpoint, its optimization barrier
    keeping XLA from sharing it with the forward's). Autodiff of the plain expression keeps the
    product and also what the derivative reuses (GELU's tanh, [tokens, F] each), written by the
    forward pass and read back; here the forward writes only the activation (the next product's
    input) and the backward reads the product and the incoming gradient: one [tokens, F] array less
    written and read (GPT-2's step: its GELU passes 2.53 -> 1.81 ms, docs/accelerators.md). The same
    operations, the same values."""

    def act(y, bias):
        return activation(y if bias is None else y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,)))

    return jax.checkpoint(act)(y, bias)


def add_adapters(x, y, parts, get, scale: float):
    """y + x A B * scale for each (target, start, stop) of `parts` (in column order) on its columns of y;
    get(name) reads an adapter tensor. The adapters of one layer (q, k, v of c_attn; gate, up of c_fc)
    share one x @ [A_q | A_k | A_v] (x read once), and the scale goes on those r columns rather than
    the N output columns."""
    names = [t for t, _, _ in parts]
    r = get(f"{names[0]}_a").shape[-1]
    a_KP = jnp.concatenate([get(f"{t}_a") for t in names], axis=-1)  # P = targets x r
    xa_MP = (x.astype(jnp.float32) @ a_KP) * scale
    deltas = [xa_MP[..., i * r : (i + 1) * r] @ get(f"{t}_b") for i, t in enumerate(names)]
    return join_deltas(y, parts, deltas)


def add_slots(x, y, parts, get, rows_B):
    """y + (x A[s]) B[s] for each batch row's slot s = rows_B[b] (scales folded into B). The layers are
    called on [B * T, K] rows, row b's positions together. A decoding step (one position a row) runs x
    through every slot's A, keeps each row's own slot, and contracts over (slot, rank) with the B stack:
    the stack read once a step, not an adapter copied per row. A prefill gathers each row's adapter once
    and uses it over all its positions."""
    B, R = rows_B.shape[0], get(f"{parts[0][0]}_a").shape[-1]
    x_BTK = x.reshape(B, -1, x.shape[-1]).astype(jnp.float32)
    a_SKP = jnp.concatenate([get(f"{t}_a") for t, _, _ in parts], axis=-1)  # P = targets x R
    if x_BTK.shape[1] == 1:  # S x more multiply-adds, on a rank-R sliver of the layer
        mask_BS = jax.nn.one_hot(rows_B, a_SKP.shape[0], dtype=jnp.float32)
        xa_BTSP = jnp.einsum("btk,skp->btsp", x_BTK, a_SKP) * mask_BS[:, None, :, None]
        deltas = [
            jnp.einsum("btsr,srn->btn", xa_BTSP[..., i * R : (i + 1) * R], get(f"{t}_b"))
            for i, (t, _, _) in enumerate(parts)
        ]
    else:
        take = lambda w_SXY: jnp.take(w_SXY, rows_B, axis=0)  # noqa: E731
        xa_BTP = jnp.einsum("btk,bkp->btp", x_BTK, take(a_SKP))
        deltas = [
            jnp.einsum("btr,brn->btn", xa_BTP[..., i * R : (i + 1) * R], take(get(f"{t}_b")))
            for i, (t, _, _) in enumerate(parts)
        ]
    return join_deltas(y, parts, [d_BTN.reshape(*y.shape[:-1], -1) for d_BTN in deltas])


def join_deltas(y, parts, deltas):
    """y with each delta added on its (target, start, stop) columns of `parts` (in column order): the
    deltas join y in one concatenation, one pass over y where an `.at[].add` per adapter took one each."""
    out, at = [], 0
    for (_, start, stop), delta in zip(parts, deltas, strict=True):
        if start > at:  # columns no adapter writes (e.g. k when only q and v are targets)
            out.append(y[..., at:start])
        out.append(y[..., start:stop] + delta.astype(y.dtype))
        at = stop
    if at < y.shape[-1]:
        out.append(y[..., at:])
    return out[0] if len(out) == 1 else jnp.concatenate(out, axis=-1)


class Embedding(nn.Embed):
    """nn.Embed whose table may be quantized (quantize.QuantizedWeight: rows w [V, D], scale [V], or int4's
    packed rows and group scales): a
    lookup dequantizes the rows it reads, `attend` (a tied head) is one quantized matmul."""

    def setup(self):
        table = self.get_variable("params", "embedding") if self.has_variable("params", "embedding") else None
        if isinstance(table, QuantizedWeight):  # int4's rows are [V, D/2]: nn.Embed's [V, D] check skipped
            self.embedding = table
        else:
            super().setup()

    def __call__(self, inputs):
        table = self.embedding
        if not isinstance(table, QuantizedWeight):
            return super().__call__(inputs)
        flat = inputs.reshape(-1)
        rows = dequantize(jnp.take(table.w, flat, axis=0), jnp.take(table.scale, flat, axis=0))
        return rows.reshape(*inputs.shape, -1).astype(self.dtype or jnp.float32)

    def attend(self, query):
        table = self.embedding
        if not isinstance(table, QuantizedWeight):
            return super().attend(query)
        return qdot(query.reshape(-1, query.shape[-1]), table.w, table.scale).reshape(*query.shape[:-1], -1)
