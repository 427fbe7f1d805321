"""The scaled float8 matmul of FP8 training (`model.fp8`), and which devices multiply in float8.

    y_MN = fp8_dot(x_MK, w_KN)       # y in x's dtype; differentiable in x and w (a custom_vjp)
    y_AN = fp8_grouped(x_AK, w_EKN, group_sizes_E, matmul, weight_grad)  # a mixture's experts (models/moe.py)
    fp8_note()                       # None on Hopper-class GPUs, else one line naming the fallback

Forward operands are float8 e4m3 (3 mantissa bits, max 448), the backward's incoming gradient float8
e5m2 (2 mantissa bits, max 57344: gradients span more octaves than they need digits); dX = dY W^T
and dW = X^T dY reuse the forward's e4m3 X and W. Each tensor is scaled per tensor by *current*
scaling, torchtitan's default: scale = fp8_max / amax(tensor), from the tensor itself, every call.
Delayed scaling (amax history from earlier steps) would put a history per matmul into the train
state, make a resume exact only if that history is checkpointed too, and lag a tensor whose range
jumps (the step overflows); current scaling costs one amax reduction per operand and keeps the step a
pure function of (params, batch). Products accumulate in float32 (preferred_element_type).

The product is a dot of float8 operands (quantize: scale, clip, convert) whose float32 result is
multiplied by 1 / (scale_x scale_w). XLA for Hopper compiles it as one float8 GEMM with the
scales and the output cast in its epilogue (a Triton GEMM fusion over f8e4m3fn operands when
compiled ahead of time, jax 0.10; the autotuner on the card may pick cuBLASLt's float8 GEMM);
a dequantize-then-dot form (convert back, times 1/scale, dot) compiled for h100-1 as a float32
GEMM instead, the casts fused into its operands. Elsewhere the same program widens the float8
operands exactly and runs a float32 dot: values round as on Hopper (an emulation), not fast.

Shape letters: M rows, K input features, N output features; a grouped product's A rows sorted by
group and E groups (experts), group e's rows times its own matrix w_EKN[e].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from flaxgpt.kernels import target

E4M3 = jnp.float8_e4m3fn  # forward operands: weights and activations
E5M2 = jnp.float8_e5m2  # gradients of the outputs
# per-element rounding bounds (unit roundoffs) and the smallest subnormal steps, for the tests' and
# the docs' error analysis: a normal value rounds within u relative, a subnormal within half a step
UNIT_ROUNDOFF = {E4M3: 2.0**-4, E5M2: 2.0**-3}
SUBNORMAL_STEP = {E4M3: 2.0**-9, E5M2: 2.0**-16}


def current_scale(x, f8) -> jax.Array:
    """fp8_max / amax(x) as float32 (1 where x is all zeros): x * scale fills f8's range."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    amax = jax.lax.stop_gradient(amax)
    return jnp.where(amax > 0, float(jnp.finfo(f8).max) / jnp.where(amax > 0, amax, 1.0), 1.0)


def quantize(x, f8):
    """(x * scale clipped to f8's range, in f8; 1 / scale): the clip keeps a value that rounds up
    past fp8_max finite (e4m3fn has no infinity: it would be NaN)."""
    scale = current_scale(x, f8)
    big = float(jnp.finfo(f8).max)
    return jnp.clip(x.astype(jnp.float32) * scale, -big, big).astype(f8), 1.0 / scale


def _scaled_dot(a8, a_inv, b8, b_inv, dims, out_dtype):
    """dot(a8, b8) / (scale_a scale_b): float8 operands, float32 accumulation, the scales applied to
    the product (a scalar each), cast to out_dtype. XLA for Hopper compiles it as one float8 GEMM
    with the scales and the cast in its epilogue; on CPU the dot widens the float8 operands (exactly)."""
    y = jax.lax.dot_general(a8, b8, (dims, ((), ())), preferred_element_type=jnp.float32)
    return (y * (a_inv * b_inv)).astype(out_dtype)


@jax.custom_vjp
def fp8_dot(x_MK, w_KN):
    """x @ w with e4m3 operands under current scaling; [..., K] x [K, N] -> [..., N] in x's dtype."""
    return _forward(x_MK, w_KN)[0]


def _forward(x_MK, w_KN):
    lead, K = x_MK.shape[:-1], x_MK.shape[-1]
    x8_MK, x_inv = quantize(x_MK.reshape(-1, K), E4M3)
    w8_KN, w_inv = quantize(w_KN, E4M3)
    y_MN = _scaled_dot(x8_MK, x_inv, w8_KN, w_inv, ((1,), (0,)), x_MK.dtype)
    # the residuals are the float8 copies (a byte an element) and their scales, plus each input's
    # dtype as an empty array (the gradients come back in the dtypes that came in)
    dtypes = (jnp.zeros((0,), x_MK.dtype), jnp.zeros((0,), w_KN.dtype))
    return y_MN.reshape(*lead, -1), (x8_MK, x_inv, w8_KN, w_inv, lead, dtypes)


def _fwd(x_MK, w_KN):
    y, (x8_MK, x_inv, w8_KN, w_inv, lead, dtypes) = _forward(x_MK, w_KN)
    return y, (x8_MK, x_inv, w8_KN, w_inv, dtypes)


def _bwd(res, dy_MN):
    x8_MK, x_inv, w8_KN, w_inv, (x_dtype, w_dtype) = res
    g8_MN, g_inv = quantize(dy_MN.reshape(-1, dy_MN.shape[-1]), E5M2)
    dx_MK = _scaled_dot(g8_MN, g_inv, w8_KN, w_inv, ((1,), (1,)), x_dtype.dtype)  # dY W^T
    dw_KN = _scaled_dot(x8_MK, x_inv, g8_MN, g_inv, ((0,), (0,)), w_dtype.dtype)  # X^T dY
    return dx_MK.reshape(*dy_MN.shape[:-1], -1), dw_KN


fp8_dot.defvjp(_fwd, _bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))  # the functions are static
def fp8_grouped(x_AK, w_EKN, group_sizes_E, matmul, weight_grad, matmul_t=None):
    """A grouped matmul (a mixture's experts) with e4m3 operands under current scaling: [A, K] rows
    sorted by group, [E, K, N] a matrix a group -> [A, N] in x's dtype; differentiable in x and w.

    `matmul(a_AK, b_EKN, group_sizes_E, scale, dtype)` is the grouped product to run (models/moe.py's
    tiled form) and `weight_grad(a_AK, g_AN, group_sizes_E, scale, dtype)` its transpose in the stack,
    [E, K, N] = each group's a^T g: both take float8 operands, accumulate in float32 and apply the
    scalar `scale` (1 / the operands' scales) and the cast to `dtype` to each partial product (a
    float8 GEMM's epilogue), before partial products of one row or one expert are summed. dX =
    matmul(dY8, W8^T) and dW = weight_grad(X8, dY8) are the grouped product's VJP written out,
    because jax.vjp of it over the float8 copies cannot keep float8 operands: its pullback takes a
    cotangent of the output's dtype (float32, not e5m2) and casts each gradient to its primal's
    dtype (e4m3).

    The stack's scale is one per tensor, not one per expert: the experts start from one init and
    train with one optimizer, so their ranges stay alike, and a scalar scale is what a float8 GEMM's
    epilogue applies (a scale per expert would be a per-row multiply after each visit); an expert
    far below the stack's amax keeps fewer digits (the subnormal steps).

    `matmul_t(a_AN, b_EKN, group_sizes_E, scale, dtype)` -> [A, K], a times each group's matrix
    transposed, is dX's product where a kernel reads the stack transposed in place
    (kernels.pallas_grouped); None: matmul over the stack's transposed copy."""
    return _grouped_forward(x_AK, w_EKN, group_sizes_E, matmul)[0]


def transposed(matmul):
    """matmul_t from a grouped `matmul` (fp8_grouped's contract): a times each group's matrix
    transposed, over the stack's transposed copy."""
    return lambda a, b, *rest: matmul(a, jnp.swapaxes(b, 1, 2), *rest)


def _grouped_forward(x_AK, w_EKN, group_sizes_E, matmul):
    x8_AK, x_inv = quantize(x_AK, E4M3)
    w8_EKN, w_inv = quantize(w_EKN, E4M3)
    y_AN = matmul(x8_AK, w8_EKN, group_sizes_E, x_inv * w_inv, x_AK.dtype)
    dtypes = (jnp.zeros((0,), x_AK.dtype), jnp.zeros((0,), w_EKN.dtype))
    return y_AN, (x8_AK, x_inv, w8_EKN, w_inv, group_sizes_E, dtypes)


def _grouped_fwd(x_AK, w_EKN, group_sizes_E, matmul, weight_grad, matmul_t):
    return _grouped_forward(x_AK, w_EKN, group_sizes_E, matmul)


def _grouped_bwd(matmul, weight_grad, matmul_t, res, dy_AN):
    x8_AK, x_inv, w8_EKN, w_inv, group_sizes_E, (x_dtype, w_dtype) = res
    g8_AN, g_inv = quantize(dy_AN, E5M2)
    matmul_t = matmul_t or transposed(matmul)
    dx_AK = matmul_t(g8_AN, w8_EKN, group_sizes_E, g_inv * w_inv, x_dtype.dtype)  # dY W^T
    dw_EKN = weight_grad(x8_AK, g8_AN, group_sizes_E, x_inv * g_inv, w_dtype.dtype)  # X^T dY a group
    return dx_AK, dw_EKN, None


fp8_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def has_fp8_matmul() -> bool:
    """Whether the devices traced for (kernels.target) multiply float8 natively: NVIDIA compute
    capability >= 8.9 (Ada, Hopper, Blackwell). TPU v5e / v5p have no float8 MXU, CPUs none."""
    if target.platform() != "gpu":
        return False
    device = target.device()
    cc = getattr(device, "compute_capability", None)
    if cc:
        return tuple(int(p) for p in str(cc).split(".")[:2]) >= (8, 9)
    kind = device.device_kind.upper()  # an abstract device (flaxgpt aot) has only its name
    return any(name in kind for name in ("H100", "H200", "H800", "H20", "GH200", "B200", "B100", "L4", "L40"))


def fp8_note() -> str | None:
    """One line when model.fp8 runs on devices without float8 matmuls (the fallback it gets), else None."""
    if has_fp8_matmul():
        return None
    kind, platform = target.device_kind(), target.platform()
    where = kind if kind.lower() == platform else f"{kind} ({platform})"
    return (
        f"note: model.fp8 on {where}, which has no float8 matmuls: the float8 "
        "casts and scales run around wider matmuls (Hopper's values, not its speed); "
        "--config.model.fp8=False trains faster here"
    )
