"""Weight-only quantization for decoding: int8 with per-output-channel scales, or bfloat16.

    qconfig, qparams = gpt.quantize_params(config, params, "int8")   # or "bf16"
    step = gpt.step_fn(qconfig, qparams)      # decodes through qmatmul (sampling.generate etc.)
    logits = gpt.GPT(qconfig).apply({"params": qparams}, tokens)   # any other use: the same model

Every Dense kernel [K, N] becomes a `QuantizedWeight` holding w [N, K] (rows are output
channels) and scale [N]: int8 w = round(kernel / scale) with scale = max|kernel[:, n]| / 127,
so each output channel keeps its own range; bf16 w is the kernel rounded to bfloat16 (scale 1).
A stack of kernels [E, K, N] (a mixture of experts' expert weights) keeps its layout, w [E, K, N],
with scale [E, N]: each expert's output channels their own range (`quantize_stacked`).
The token embedding table [V, D] is quantized by rows, which are both its lookup rows and the
LM head's output channels: a tied head becomes an untied `lm_head` that shares the quantized
table (no copy). Position embeddings, LayerNorms and biases stay float32 (under 1% of GPT-2's
bytes, and each step reads one row of wpe); activations, attention, the KV cache, softmax and
the logits stay float32.

This module only makes and lays out the weights; the layers apply them: a linear layer or the
token table holding a `QuantizedWeight` (models/linear.py: Linear, Embedding) goes through
kernels.qmatmul (a CPU kernel that reads the compact weights directly), a quantized stack of expert
weights through the MoE layer's matmuls (models/moe.py), whatever adapters sit over them. Nothing
here knows the GPT: `gpt.quantize_params` picks what to quantize.
Decoding then reads 1 (int8) or 2 (bf16) bytes per weight instead of 4.

A weight on one device is quantized there (one jitted program, the host path's values); host
arrays and weights split over a mesh are quantized on the host, a weight at a time.

Given jax.ShapeDtypeStructs (gpt.abstract_params, with or without shardings) the same functions
build the quantized tree's layout without computing anything: `gpt.quantize_params(config,
abstract, "int8")` is what flaxgpt.aot compiles the 8B model's int8 decoding with. A weight's
placement follows it: w [N, K] is the kernel's transpose, placed transposed; the scales as its rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec

MODES = ("int8", "bf16")
_DTYPES = {"int8": jnp.int8, "bf16": jnp.bfloat16}


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown quantization mode {mode!r}; choose one of {', '.join(MODES)}")
    return mode


@struct.dataclass
class QuantizedWeight:
    w: jax.Array  # [N, K] int8 or bfloat16: one row per output channel (first leaf: linear.Embedding)
    scale: jax.Array  # [N] float32 (ones for bf16)
    # (a stack of kernels, quantize_stacked: w [E, K, N] as the float stack lay, scale [E, N])

    @property
    def nbytes(self) -> int:
        return self.w.nbytes + self.scale.nbytes


def quantize_rows(w_NK, mode: str, sharding=None) -> QuantizedWeight:
    """One scale per row (output channel): symmetric int8, or bfloat16 with scale 1. A
    jax.ShapeDtypeStruct gives the layout alone (`abstract_rows`). Weights split over a mesh (a
    NamedSharding: w_NK's own, or `sharding` for a host array) come back split the same way, the
    scales as their rows: quantized on the host a weight at a time, each device receiving its slices."""
    if isinstance(w_NK, jax.ShapeDtypeStruct):
        return abstract_rows(w_NK, mode)
    sharding = sharding or getattr(w_NK, "sharding", None)
    if _on_one_device(w_NK, sharding):
        return QuantizedWeight(*_symmetric_on_device(w_NK, mode, axis=1))
    q_NK, scale_N = _symmetric(np.asarray(w_NK, np.float32), mode, axis=1)
    if not isinstance(sharding, NamedSharding):
        return QuantizedWeight(jnp.asarray(q_NK), jnp.asarray(scale_N))
    layout = abstract_rows(jax.ShapeDtypeStruct(q_NK.shape, np.float32, sharding=sharding), mode)
    return _placed(QuantizedWeight(q_NK, scale_N), layout)


def quantize_stacked(w_EKN, mode: str) -> QuantizedWeight:
    """A stack of E kernels [E, K, N] (a mixture of experts' weights) with one scale per kernel and
    output channel, scale [E, N]; w keeps the stack's [E, K, N] layout, the grouped matmul's (its
    caller multiplies each row's output by its kernel's scales: models/moe.py). A stack split over a
    mesh comes back split the same way (the scales as the stack and its columns)."""
    sharding = getattr(w_EKN, "sharding", None)
    if isinstance(w_EKN, jax.ShapeDtypeStruct):
        rows = None
        if isinstance(sharding, NamedSharding):
            spec = tuple(sharding.spec) + (None,) * (3 - len(sharding.spec))
            rows = NamedSharding(sharding.mesh, PartitionSpec(spec[0], spec[2]))
        E, _, N = w_EKN.shape
        w = jax.ShapeDtypeStruct(w_EKN.shape, _DTYPES[check_mode(mode)], sharding=sharding)
        return QuantizedWeight(w, jax.ShapeDtypeStruct((E, N), jnp.float32, sharding=rows))
    if _on_one_device(w_EKN, sharding):
        return QuantizedWeight(*_symmetric_on_device(w_EKN, mode, axis=1))
    w, scale = _symmetric(np.asarray(w_EKN, np.float32), mode, axis=1)
    if not isinstance(sharding, NamedSharding):
        return QuantizedWeight(jnp.asarray(w), jnp.asarray(scale))
    return _placed(
        QuantizedWeight(w, scale),
        quantize_stacked(jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=sharding), mode),
    )


def _placed(host: QuantizedWeight, layout: QuantizedWeight) -> QuantizedWeight:
    """Host arrays onto the layout's shardings, each device receiving only its slices."""
    return jax.tree.map(
        lambda x, a: jax.make_array_from_callback(x.shape, a.sharding, lambda index: x[index]), host, layout
    )


def _symmetric(w, mode: str, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """(w as int8 or bfloat16, float32 scales with `axis` dropped), on the host: symmetric int8 whose
    scale is the largest |w| along `axis` (the input dimension) / 127, or bfloat16 with scale 1."""
    scale_shape = w.shape[:axis] + w.shape[axis + 1 :]
    if check_mode(mode) == "bf16":
        return w.astype(jnp.bfloat16), np.ones(scale_shape, np.float32)
    absmax = np.abs(w).max(axis=axis)
    scale = np.where(absmax > 0, absmax / 127.0, 1.0).astype(np.float32)  # all-zero channels: any scale
    q = np.clip(np.rint(w / np.expand_dims(scale, axis)), -127, 127).astype(np.int8)
    return q, scale


def _on_one_device(w, sharding) -> bool:
    """A concrete array on one device, not placed over a mesh: quantized where it lives."""
    return (
        isinstance(w, jax.Array)
        and not isinstance(w, jax.core.Tracer)
        and not isinstance(sharding, NamedSharding)
        and len(w.sharding.device_set) == 1
    )


@functools.partial(jax.jit, static_argnames=("mode", "axis"))
def _symmetric_on_device(w, mode: str, axis: int):
    """_symmetric on the weight's own device, the same values: a GPU quantizes an 8B model's weights
    in seconds, where copying each to the host and back took minutes on an H100."""
    w = w.astype(jnp.float32)
    scale_shape = w.shape[:axis] + w.shape[axis + 1 :]
    if mode == "bf16":
        return w.astype(jnp.bfloat16), jnp.ones(scale_shape, jnp.float32)
    absmax = jnp.abs(w).max(axis=axis)
    scale = jnp.where(absmax > 0, _divide(absmax, jnp.full(absmax.shape, 127.0, jnp.float32)), 1.0)
    q = _divide(w, jnp.broadcast_to(jnp.expand_dims(scale, axis), w.shape))
    return jnp.clip(jnp.rint(q), -127, 127).astype(jnp.int8), scale


def _divide(a, b):
    """a / b rounded as numpy rounds it: XLA turns a division by a broadcast (or a constant) into a
    multiplication by its reciprocal, an ulp off; a materialized divisor keeps the division."""
    return a / jax.lax.optimization_barrier(b)


def abstract_rows(w_NK: jax.ShapeDtypeStruct, mode: str) -> QuantizedWeight:
    """quantize_rows' result as ShapeDtypeStructs, nothing computed: flaxgpt.aot compiles decoding
    with it. w keeps w_NK's placement; the scales [N] are placed as its rows."""
    sharding, rows = w_NK.sharding, None
    if isinstance(sharding, NamedSharding):
        rows = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[:1]))
    w = jax.ShapeDtypeStruct(w_NK.shape, _DTYPES[check_mode(mode)], sharding=sharding)
    return QuantizedWeight(w, jax.ShapeDtypeStruct(w_NK.shape[:1], jnp.float32, sharding=rows))


def _transposed(x):
    """x.T: a host array, a ShapeDtypeStruct, or a host array and its (transposed) NamedSharding."""
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding):  # the spec padded to the rank, then reversed
        spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
        sharding = NamedSharding(sharding.mesh, PartitionSpec(*spec[::-1]))
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape[::-1], x.dtype, sharding=sharding), None
    if _on_one_device(x, sharding):  # stays there: quantize_rows quantizes it on its device
        return x.T, None
    return np.asarray(x).T, sharding if isinstance(sharding, NamedSharding) else None


def quantize_tree(params, mode: str, stacked: tuple = (), keep: tuple = ()):
    """Every 2-D Dense `kernel` [K, N] -> QuantizedWeight of its transpose, every 3-D leaf named in
    `stacked` -> quantize_stacked's; subtrees named in `keep` and the rest unchanged."""
    check_mode(mode)

    def visit(tree):
        out = {}
        for name, value in tree.items():
            if name in keep:
                out[name] = value
            elif isinstance(value, dict):
                out[name] = visit(value)
            elif name == "kernel" and np.ndim(value) == 2:
                w_NK, sharding = _transposed(value)
                out[name] = quantize_rows(w_NK, mode, sharding)
            elif name in stacked and np.ndim(value) == 3:
                out[name] = quantize_stacked(value, mode)
            else:
                out[name] = value
        return out

    return visit(dict(params))


def weight_bytes(params) -> int:
    """Bytes of distinct parameter arrays (a table shared by embedding and head counts once)."""
    seen = {id(x): x.nbytes for x in jax.tree_util.tree_leaves(params)}
    return sum(seen.values())


def is_quantized(params) -> bool:
    leaves = jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    return any(isinstance(x, QuantizedWeight) for x in leaves)
