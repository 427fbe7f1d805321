"""Weight-only quantization for decoding: int8 with per-output-channel scales, bfloat16, or int4 with
per-group scales.

    qconfig, qparams = gpt.quantize_params(config, params, "int8")   # or "bf16", "int4" (groups of 128),
                                                                     # "int4_g64", "int4_g32"
    step = gpt.step_fn(qconfig, qparams)      # decodes through qmatmul (sampling.generate etc.)
    logits = gpt.GPT(qconfig).apply({"params": qparams}, tokens)   # any other use: the same model

Every Dense kernel [K, N] becomes a `QuantizedWeight` holding w [N, K] (rows are output
channels) and scale [N]: int8 w = round(kernel / scale) with scale = max|kernel[:, n]| / 127,
so each output channel keeps its own range; bf16 w is the kernel rounded to bfloat16 (scale 1).
int4 w is uint8 [N, K/2], two symmetric 4-bit values a byte, with scale [N, K / group], one per
output channel and group of inputs (kernels/int4.py owns the layout: compressed-tensors' bytes).
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
Decoding then reads 1 (int8), 2 (bf16) or 0.5 + 4 / group (int4) bytes per weight instead of 4.
A mixture of experts' stacks take int8 or bf16 (int4 is refused there in one line).

A weight on one device is quantized there (one jitted program, the host path's values); host
arrays and weights split over a mesh are quantized on the host, a weight at a time, and placed as
they were: w [N, K] is the kernel's transpose, placed transposed; the scales as the rows they scale.
A traced weight takes the jitted path, so `jax.eval_shape(gpt.quantize_params, ...)` gives the
quantized tree's layout without computing anything (flaxgpt.aot compiles int8 decoding with it and
places it itself).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec

from flaxgpt.kernels import int4, qmatmul

MODES = ("int8", "bf16", "int4", "int4_g64", "int4_g32")  # int4: groups of 128 inputs


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown quantization mode {mode!r}; choose one of {', '.join(MODES)}")
    return mode


def int4_group(mode: str) -> int:
    """The group size of an int4 mode ("int4": 128, "int4_g64": 64); 0 for int8 and bf16."""
    if not check_mode(mode).startswith("int4"):
        return 0
    return int(mode.split("_g")[1]) if "_g" in mode else 128


@struct.dataclass
class QuantizedWeight:
    w: jax.Array  # [N, K] int8 or bfloat16: one row per output channel (first leaf: linear.Embedding)
    scale: jax.Array  # [N] float32 (ones for bf16)
    # (int4: w uint8 [N, K/2], scale [N, K / group]: kernels.int4; the dtype tells them apart)
    # (a stack of kernels, quantize_stacked: w [E, K, N] as the float stack lay, scale [E, N])

    @property
    def nbytes(self) -> int:
        return self.w.nbytes + self.scale.nbytes


def dequantize_rows(q: QuantizedWeight) -> jax.Array:
    """The float32 weight [N, K] a row-quantized weight stands for (int8, bf16, or int4's groups)."""
    return qmatmul.dequantize(q.w, q.scale)


def quantize_rows(w_NK, mode: str, sharding=None, name: str = "a weight") -> QuantizedWeight:
    """One scale per row (output channel): symmetric int8, or bfloat16 with scale 1; int4: one per row
    and group of inputs. Weights split over a mesh (a NamedSharding: w_NK's own, or `sharding` for a
    host array) come back split the same way, the scales as their rows: quantized on the host a
    weight at a time, each device receiving its slices. `name` names the weight in errors."""
    sharding = sharding or getattr(w_NK, "sharding", None)
    group = int4_group(mode)
    if group and _in_place(w_NK, sharding):
        return QuantizedWeight(*_int4_on_device(w_NK, group, name))
    if _in_place(w_NK, sharding):
        return QuantizedWeight(*_symmetric_on_device(w_NK, check_mode(mode), axis=1))
    if group:
        q_NK, scale_N = (np.asarray(a) for a in int4.quantize(np.asarray(w_NK, np.float32), group, name))
    else:
        q_NK, scale_N = _symmetric(np.asarray(w_NK, np.float32), mode, axis=1)
    if not isinstance(sharding, NamedSharding):
        return QuantizedWeight(jnp.asarray(q_NK), jnp.asarray(scale_N))
    return _placed(QuantizedWeight(q_NK, scale_N), _scales_follow(sharding, rank=2))


def quantize_stacked(w_EKN, mode: str) -> QuantizedWeight:
    """A stack of E kernels [E, K, N] (a mixture of experts' weights) with one scale per kernel and
    output channel, scale [E, N]; w keeps the stack's [E, K, N] layout, the grouped matmul's (its
    caller multiplies each row's output by its kernel's scales: models/moe.py). A stack split over a
    mesh comes back split the same way (the scales as the stack and its columns)."""
    if int4_group(mode):
        raise ValueError(
            f"int4 quantizes 2-D weights, not a mixture of experts' stacked experts {tuple(w_EKN.shape)}: "
            "use --quantize int8 or bf16 for MoE models"
        )
    sharding = getattr(w_EKN, "sharding", None)
    if _in_place(w_EKN, sharding):
        return QuantizedWeight(*_symmetric_on_device(w_EKN, check_mode(mode), axis=1))
    w, scale = _symmetric(np.asarray(w_EKN, np.float32), mode, axis=1)
    if not isinstance(sharding, NamedSharding):
        return QuantizedWeight(jnp.asarray(w), jnp.asarray(scale))
    return _placed(QuantizedWeight(w, scale), _scales_follow(sharding, rank=3))


def _scales_follow(sharding: NamedSharding, rank: int) -> QuantizedWeight:
    """The shardings of a weight quantized over its axis 1 (the input dimension): w keeps the
    weight's, the scales take it without that axis: rows [N] (w [N, K]: its first axis), or [E, N]
    (a stack [E, K, N]: its first and last)."""
    spec = tuple(sharding.spec) + (None,) * (rank - len(sharding.spec))
    scales = sharding.spec[:1] if rank == 2 else (spec[0], spec[2])
    return QuantizedWeight(sharding, NamedSharding(sharding.mesh, PartitionSpec(*scales)))


def _placed(host: QuantizedWeight, shardings: QuantizedWeight) -> QuantizedWeight:
    """Host arrays onto their shardings, each device receiving only its slices."""
    return jax.tree.map(
        lambda x, s: jax.make_array_from_callback(x.shape, s, lambda index: x[index]), host, shardings
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


def _in_place(w, sharding) -> bool:
    """Quantized by jax where the weight is: an array on one device, or a traced one (under jit, or
    jax.eval_shape: the layout alone). Host arrays and weights placed over a mesh (`sharding`) are
    quantized on the host."""
    if not isinstance(w, jax.Array) or isinstance(sharding, NamedSharding):
        return False
    placed = getattr(w, "sharding", None)  # a traced array has none to read
    return placed is None or len(placed.device_set) == 1


@functools.partial(jax.jit, static_argnames=("mode", "axis"))
def _symmetric_on_device(w, mode: str, axis: int):
    """_symmetric on the weight's own device, the same values: a GPU quantizes an 8B model's weights
    in seconds, where copying each to the host and back took minutes on an H100."""
    w = w.astype(jnp.float32)
    absmax = jnp.abs(w).max(axis=axis)
    if mode == "bf16":  # scales of 1 shaped (and, traced over a mesh, placed) as w's rows; XLA drops the max
        return w.astype(jnp.bfloat16), jnp.ones_like(absmax)
    scale = jnp.where(absmax > 0, _divide(absmax, jnp.full(absmax.shape, 127.0, jnp.float32)), 1.0)
    q = _divide(w, jnp.broadcast_to(jnp.expand_dims(scale, axis), w.shape))
    return jnp.clip(jnp.rint(q), -127, 127).astype(jnp.int8), scale


def _int4_on_device(w_NK, group: int, name: str):
    int4.check_group(w_NK.shape[1], group, name)  # before tracing: one line, not a reshape error
    return _int4_jit(w_NK, group)


@functools.partial(jax.jit, static_argnames=("group",))
def _int4_jit(w_NK, group: int):
    return int4.quantize(w_NK, group)


def _divide(a, b):
    """a / b rounded as numpy rounds it: XLA turns a division by a broadcast (or a constant) into a
    multiplication by its reciprocal, an ulp off; a materialized divisor keeps the division."""
    return a / jax.lax.optimization_barrier(b)


def _transposed(x):
    """x.T: where it is (quantize_rows quantizes it there), or a host array and its (transposed)
    NamedSharding."""
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding):  # the spec padded to the rank, then reversed
        spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
        sharding = NamedSharding(sharding.mesh, PartitionSpec(*spec[::-1]))
    if _in_place(x, sharding):
        return x.T, None
    return np.asarray(x).T, sharding if isinstance(sharding, NamedSharding) else None


def quantize_tree(params, mode: str, stacked: tuple = (), keep: tuple = ()):
    """Every 2-D Dense `kernel` [K, N] -> QuantizedWeight of its transpose, every 3-D leaf named in
    `stacked` -> quantize_stacked's; subtrees named in `keep` and the rest unchanged."""
    check_mode(mode)
    _check_groups(params, int4_group(mode), keep)

    def visit(tree, path=()):
        out = {}
        for name, value in tree.items():
            if name in keep:
                out[name] = value
            elif isinstance(value, dict):
                out[name] = visit(value, (*path, name))
            elif name == "kernel" and np.ndim(value) == 2:
                w_NK, sharding = _transposed(value)
                out[name] = quantize_rows(w_NK, mode, sharding, name=".".join(path))
            elif name in stacked and np.ndim(value) == 3:
                out[name] = quantize_stacked(value, mode)
            else:
                out[name] = value
        return out

    return visit(dict(params))


def _check_groups(params, group: int, keep: tuple) -> None:
    """int4's group must divide every kernel's K: one line naming the first that it does not, and the
    group that fits them all (one weight's own check would suggest a group the next weight refuses)."""
    if not group:
        return
    Ks = {}

    def visit(tree, path=()):
        for name, value in tree.items():
            if isinstance(value, dict) and name not in keep:
                visit(value, (*path, name))
            elif name == "kernel" and np.ndim(value) == 2:
                Ks.setdefault(int(np.shape(value)[0]), ".".join(path))

    visit(dict(params))
    bad = [K for K in sorted(Ks) if K % group]
    if bad:
        fits = [g for g in int4.GROUPS if all(K % g == 0 for K in Ks)]
        fix = f"--quantize int4_g{fits[-1]}" if fits else "--quantize int8 (per-row scales)"
        raise ValueError(
            f"int4 group size {group} does not divide K={bad[0]} ({Ks[bad[0]]}'s inputs): use {fix}"
        )


def weight_bytes(params) -> int:
    """Bytes of distinct parameter arrays (a table shared by embedding and head counts once)."""
    seen = {id(x): x.nbytes for x in jax.tree_util.tree_leaves(params)}
    return sum(seen.values())


def modes(params) -> set[str]:
    """The modes of a tree's QuantizedWeights, read from their arrays: "int8", "bf16", int4's by its
    group ("int4" for 128, "int4_g64", ...); empty for float weights."""
    out = set()
    for x in jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, QuantizedWeight)):
        if isinstance(x, QuantizedWeight):
            if x.w.dtype != np.uint8:
                out.add("int8" if x.w.dtype == np.int8 else "bf16")
            else:
                group = x.w.shape[-1] * 2 // x.scale.shape[-1]
                out.add("int4" if group == 128 else f"int4_g{group}")
    return out


def is_quantized(params) -> bool:
    leaves = jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    return any(isinstance(x, QuantizedWeight) for x in leaves)
