"""kernels.pallas_decode (Pallas' interpreter on a CPU, compiled on a GPU): norm + GEMV + bias +
activation + residual against a float64 reference, over shapes whose last channel and input blocks
overlap the ones before, in float32 and bfloat16, with the default tiling and others
(benchmarks/kernel_sweep.py's); shapes it cannot take and tilings that do not fit are refused in one
line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxgpt.kernels.pallas_decode import MAX_ROWS, Norm, Tiles, gemv, normalize, why_not

# Pallas' interpreter on a CPU; on a GPU (a lease's `tests` part) the compiled Triton kernels
INTERPRET = jax.default_backend() != "gpu"


def gelu64(y):
    return 0.5 * y * (1 + np.tanh(np.sqrt(2 / np.pi) * (y + 0.044715 * y**3)))


def reference(x, w, b, norm, act, res):
    """float64: residual + act(norm(x) @ w + b)."""
    x = np.asarray(x, np.float64)
    if norm is not None:
        g = np.asarray(norm.scale_K, np.float64)
        if norm.kind == "rmsnorm":
            x = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + norm.eps) * g
        else:
            x = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + norm.eps) * g
            x = x if norm.bias_K is None else x + np.asarray(norm.bias_K, np.float64)
    y = x @ np.asarray(w, np.float64) + (0 if b is None else np.asarray(b, np.float64))
    y = y if act is None else gelu64(y)
    return y if res is None else np.asarray(res, np.float64) + y


CASES = [  # M, K, N, norm, activation, residual
    (
        1,
        96,
        80,
        "layernorm",
        True,
        False,
    ),  # K: one 64-block then one overlapping it; N: 3 of 32, the last overlapping
    (3, 200, 48, "layernorm_nobias", False, True),  # K over BLOCK_K 128, overlapping
    (2, 64, 32, "rmsnorm", False, False),
    (MAX_ROWS, 160, 40, None, False, True),  # c_proj + bias + residual
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("M,K,N,kind,act,res", CASES)
def test_equals_float64_reference(M, K, N, kind, act, res, dtype):
    k = jax.random.split(jax.random.key(M * K + N), 6)
    x = (jax.random.normal(k[0], (M, K)) * 2 + 0.5).astype(dtype)
    w = (jax.random.normal(k[1], (K, N)) / np.sqrt(K)).astype(dtype)
    b = jax.random.normal(k[2], (N,)).astype(dtype)
    norm = None
    if kind:
        beta = None if kind != "layernorm" else 0.1 * jax.random.normal(k[4], (K,))
        norm = Norm(kind.split("_")[0], 1 + 0.1 * jax.random.normal(k[3], (K,)), beta, 1e-5)
    r = jax.random.normal(k[5], (M, N)).astype(dtype) if res else None
    activation = (lambda y: jax.nn.gelu(y, approximate=True)) if act else None
    got = gemv(x, w, b, norm=norm, activation=activation, residual_MN=r, interpret=INTERPRET)
    assert got.shape == (M, N) and got.dtype == jnp.dtype(dtype)
    want = reference(x, w, b, norm, activation, r)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == "float32" else dict(atol=0.05, rtol=0.02)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, **tol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("M,K,N,kind", [(1, 96, 80, "layernorm"), (3, 200, 48, "rmsnorm")])
def test_a_weight_given_as_rows_is_its_transpose(M, K, N, kind, dtype):
    """rows_w (ln_f + a tied head: the token table [N, K] as it lies): the float64 reference of x @ w^T,
    and the [K, N] form's values (float32 2e-5; bfloat16 within its rounding)."""
    k = jax.random.split(jax.random.key(K + N), 4)
    x = (jax.random.normal(k[0], (M, K)) * 2 + 0.5).astype(dtype)
    table = (jax.random.normal(k[1], (N, K)) / np.sqrt(K)).astype(dtype)
    beta = 0.1 * jax.random.normal(k[3], (K,)) if kind == "layernorm" else None
    norm = Norm(kind, 1 + 0.1 * jax.random.normal(k[2], (K,)), beta, 1e-5)
    got = gemv(x, table, norm=norm, rows_w=True, interpret=INTERPRET)
    assert got.shape == (M, N) and got.dtype == jnp.dtype(dtype)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == "float32" else dict(atol=0.05, rtol=0.02)
    np.testing.assert_allclose(
        np.asarray(got, np.float64), reference(x, table.T, None, norm, None, None), **tol
    )
    same = gemv(x, table.T, norm=norm, interpret=INTERPRET)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(same, np.float32), **tol)
    with pytest.raises(ValueError, match=r"disagree on K"):
        gemv(x, table.T, rows_w=True, interpret=INTERPRET)


def test_normalize_is_flax_layernorm_and_rmsnorm():
    from flax import linen as nn

    x = jax.random.normal(jax.random.key(0), (3, 24)) * 3 + 1
    g, b = 1 + 0.1 * jax.random.normal(jax.random.key(1), (24,)), jax.random.normal(jax.random.key(2), (24,))
    ln = nn.LayerNorm(epsilon=1e-5).apply({"params": {"scale": g, "bias": b}}, x)
    rms = nn.RMSNorm(epsilon=1e-6).apply({"params": {"scale": g}}, x)
    np.testing.assert_allclose(normalize(x, Norm("layernorm", g, b, 1e-5)), ln, atol=1e-6)
    np.testing.assert_allclose(normalize(x, Norm("rmsnorm", g, None, 1e-6)), rms, atol=1e-6)


def test_shapes_it_cannot_take_are_one_line():
    assert why_not(MAX_ROWS, 32, 32) == "" and "prefill" in why_not(MAX_ROWS + 1, 32, 32)
    x, w = jnp.ones((MAX_ROWS + 1, 32)), jnp.ones((32, 32))
    with pytest.raises(ValueError, match=r"9 rows > MAX_ROWS 8 .*FLAXGPT_DECODE_KERNELS=off"):
        gemv(x, w, interpret=INTERPRET)
    with pytest.raises(ValueError, match=r"side < 16"):
        gemv(jnp.ones((1, 32)), jnp.ones((32, 8)), interpret=INTERPRET)
    with pytest.raises(ValueError, match=r"dtype int8"):
        gemv(jnp.ones((1, 32), jnp.int8), jnp.ones((32, 32)), interpret=INTERPRET)


@pytest.mark.parametrize(
    "M,K,N,tiles",
    [
        (3, 200, 40, Tiles(32, 128, 8, 2)),  # neither divides: both last blocks overlap the one before
        (1, 96, 80, Tiles(16, 32, 2, 1)),  # 5 blocks of channels, 3 steps
        (2, 64, 64, Tiles(64, 64)),  # one program, one step
        (1, 96, 44, Tiles(4, 32, 1, 1)),  # 4 channels a program: 11 programs, 3 steps
        (2, 64, 24, Tiles(1, 64)),  # a channel a program
        (1, 160, 40, Tiles(8, 32, 1, 4)),  # 5 steps, 3 queued ahead (the last ones clipped), whole-tile sums
    ],
)
@pytest.mark.parametrize("rows_w", [False, True])
def test_every_tiling_gives_the_reference(M, K, N, tiles, rows_w):
    """kernel_sweep.py's tilings compute the same function: layernorm + product + bias + residual in
    float32 against float64, and the bfloat16 form as the default tiling's; the weight as flax's kernel
    [K, N] or as its rows [N, K] (rows_w)."""
    k = jax.random.split(jax.random.key(K + N), 6)
    x, w = jax.random.normal(k[0], (M, K)) * 2 + 0.5, jax.random.normal(k[1], (K, N)) / np.sqrt(K)
    b, r = jax.random.normal(k[2], (N,)), jax.random.normal(k[5], (M, N))
    norm = Norm(
        "layernorm", 1 + 0.1 * jax.random.normal(k[3], (K,)), 0.1 * jax.random.normal(k[4], (K,)), 1e-5
    )
    given = w.T if rows_w else w
    got = gemv(x, given, b, norm=norm, residual_MN=r, rows_w=rows_w, tiles=tiles, interpret=INTERPRET)
    want = reference(x, w, b, norm, None, r)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-5, rtol=2e-5)
    x16, w16 = x.astype(jnp.bfloat16), given.astype(jnp.bfloat16)
    got16 = gemv(x16, w16, rows_w=rows_w, tiles=tiles, interpret=INTERPRET).astype(jnp.float32)
    np.testing.assert_allclose(
        got16, gemv(x16, w16, rows_w=rows_w, interpret=INTERPRET).astype(jnp.float32), atol=0.02, rtol=0.02
    )


@pytest.mark.parametrize(
    "tiles,message",
    [
        (Tiles(48, 32), r"block_n=48 is not a power of two >= 1"),
        (Tiles(32, 8), r"block_k=8 is not a power of two >= 16"),
        (Tiles(128, 32), r"block_n=128 > N=64"),
        (Tiles(16, 64), r"block_k=64 > K=32"),
        (Tiles(16, 32, 4, 0), r"num_stages=0 < 1"),
        (Tiles(16, 32, split_k=2), r"split_k=2: this kernel's epilogue .* kernels.pallas_qgemv only"),
    ],
)
def test_a_tiling_that_does_not_fit_is_one_line(tiles, message):
    with pytest.raises(
        ValueError, match=r"^decode gemv: tiles \(.*\) do not fit w \[32, 64\]: " + message + "$"
    ):
        gemv(jnp.ones((1, 32)), jnp.ones((32, 64)), tiles=tiles, interpret=INTERPRET)
