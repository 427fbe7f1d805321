"""kernels/pallas_qgemv.py run by Pallas' interpreter on a CPU (compiled on a GPU): decoding rows times
int8 and int4 weights equal the dequantized weights' float64 product (int4's groups of 64 and 128, K
not a multiple of the kernel's step, N not a multiple of its block, 1 to MAX_ROWS rows), with its
default tiling and others (benchmarks/kernel_sweep.py's), split-K among them (K's steps in 2-4 ranges,
partials summed by XLA); shapes it cannot tile are one line naming XLA's form, tilings that do not fit
one line saying why; FLAXGPT_QMATMUL=pallas routes qmatmul through it."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxgpt.kernels import int4, pallas_qgemv, qmatmul
from flaxgpt.kernels.pallas_decode import Tiles
from flaxgpt.models.quantize import quantize_rows

# Pallas' interpreter on a CPU; on a GPU (a lease's `tests` part) the compiled Triton kernels
INTERPRET = jax.default_backend() != "gpu"

TOL = 2e-6  # relative to the largest output: float32 sums in another order than float64's


def reference(x_MK, q):
    """float64 x @ w^T with w unpacked here in numpy (low nibble first, stored + 8, a scale per group)."""
    w, scale = np.asarray(q.w), np.asarray(q.scale, np.float64)
    if w.dtype == np.uint8:
        v = np.stack([w & 0xF, w >> 4], axis=-1).reshape(w.shape[0], -1).astype(np.float64) - 8
        w_NK = (v.reshape(*scale.shape, -1) * scale[..., None]).reshape(v.shape)
    else:
        w_NK = w.astype(np.float64) * scale[:, None]
    return np.asarray(x_MK, np.float64) @ w_NK.T


@pytest.mark.parametrize(
    "mode,M,N,K",
    [
        ("int8", 1, 64, 512),  # whole blocks
        ("int8", 3, 40, 300),  # K = 256 + 44, N = 32 + 8: both last blocks overlap the one before
        ("int4", 1, 64, 384),  # groups of 128: 3 groups, two a step (the second step overlaps)
        ("int4_g64", 8, 33, 320),  # groups of 64: 5 groups, four a step
        ("int4_g64", 2, 32, 64),  # one group: fewer than a step's
    ],
)
def test_interpreted_kernel_equals_the_dequantized_product(mode, M, N, K):
    rng = np.random.RandomState(M * N + K)
    q = quantize_rows(rng.standard_normal((N, K)).astype(np.float32), mode)
    x_MK = rng.standard_normal((M, K)).astype(np.float32)
    got = np.asarray(pallas_qgemv.gemv(jnp.asarray(x_MK), q.w, q.scale, interpret=INTERPRET))
    want = reference(x_MK, q)
    assert got.shape == (M, N)
    assert np.abs(got - want).max() / np.abs(want).max() < TOL
    # XLA's forms (qmatmul, int4.matmul) give the same product
    xla = np.asarray(qmatmul.qmatmul(jnp.asarray(x_MK), q.w, q.scale))
    assert np.abs(xla - want).max() / np.abs(want).max() < TOL


def test_shapes_it_cannot_tile_are_one_line_naming_xla():
    x = jnp.ones((1, 512), jnp.float32)
    q = quantize_rows(np.ones((16, 512), np.float32), "int8")  # 16 channels < BLOCK_N
    with pytest.raises(ValueError, match=r"qgemv cannot tile .* N=16 output channels < BLOCK_N 32; use XLA"):
        pallas_qgemv.gemv(x, q.w, q.scale, interpret=INTERPRET)
    q = quantize_rows(np.ones((32, 128), np.float32), "int8")
    with pytest.raises(ValueError, match=r"K=128 < BLOCK_K 256; use XLA's form"):
        pallas_qgemv.gemv(jnp.ones((1, 128)), q.w, q.scale, interpret=INTERPRET)
    q = quantize_rows(np.ones((32, 512), np.float32), "int4")
    with pytest.raises(ValueError, match=r"16 rows > MAX_ROWS 8 \(prefill"):
        pallas_qgemv.gemv(jnp.ones((16, 512)), q.w, q.scale, interpret=INTERPRET)
    assert pallas_qgemv.why_not(1, 4096, 4096, 128) == "" and pallas_qgemv.why_not(1, 4096, 4096) == ""
    with pytest.raises(ValueError, match=r"group size 128 does not divide K=192 .*use --quantize int4_g64"):
        int4.quantize(np.ones((32, 192), np.float32), 128)


def test_opt_in_routes_qmatmul_through_the_kernel(monkeypatch):
    """FLAXGPT_QMATMUL=pallas: qmatmul calls the kernel (interpreted off a GPU) where it tiles, XLA's form
    where not; either way the dequantized product."""
    calls = []
    real = pallas_qgemv.gemv
    monkeypatch.setattr(pallas_qgemv, "gemv", lambda *a, **k: calls.append(k) or real(*a, **k))
    monkeypatch.setenv("FLAXGPT_QMATMUL", "pallas")
    rng = np.random.RandomState(0)
    q = quantize_rows(rng.standard_normal((64, 256)).astype(np.float32), "int4_g64")
    for M in (2, 16):  # decoding rows: the kernel; a prefill's: XLA's
        x = rng.standard_normal((M, 256)).astype(np.float32)
        got = np.asarray(qmatmul.qmatmul(jnp.asarray(x), q.w, q.scale))
        assert np.abs(got - reference(x, q)).max() / np.abs(reference(x, q)).max() < TOL
    assert calls == [{"interpret": True}]
    # a program traced over several devices keeps XLA's form (XLA cannot split a custom call)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    with jax.set_mesh(mesh):
        assert qmatmul.route(2, 64, 256, jnp.uint8, 64) == "int4"
    assert qmatmul.route(2, 64, 256, jnp.uint8, 64) == "pallas"
    # a misspelt mode: one line, not the default route silently
    monkeypatch.setenv("FLAXGPT_QMATMUL", "palas")
    with pytest.raises(ValueError, match=r"^FLAXGPT_QMATMUL='palas': use pallas, reduce or xla, or leave"):
        qmatmul.qmatmul(jnp.asarray(x), q.w, q.scale)


@pytest.mark.parametrize(
    "mode,tiles",
    [("int8", None), ("int4", None), ("int8", Tiles(32, 512, 4, 3, 2)), ("int4", Tiles(16, 256, 4, 3, 8))],
)
def test_kernel_compiles_for_h100_as_one_triton_call(mode, tiles):
    """The Triton lowering itself (interpret mode checks values only): the Llama-3-8B q-projection's shape
    at batch 1 compiled for an H100 on this CPU holds the kernel as one Triton custom call, split-K's
    too (its program's loop over a range of K has bounds from program_id(1))."""
    pytest.importorskip("jax_cuda12_plugin", reason="the GPU targets need the CUDA plugin (not in CI)")
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from flaxgpt.aot import targets

    mesh = Mesh(np.array(targets.get("h100-1").devices()[:1]), ("x",))
    one = NamedSharding(mesh, PartitionSpec())
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=one)  # noqa: E731
    shapes = {"int8": ((4096, 4096), jnp.int8, (4096,)), "int4": ((4096, 2048), jnp.uint8, (4096, 32))}
    shape, dtype, scale = shapes[mode]
    args = spec((1, 4096), jnp.bfloat16), spec(shape, dtype), spec(scale, jnp.float32)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        hlo = jax.jit(functools.partial(pallas_qgemv.gemv, tiles=tiles)).lower(*args).compile().as_text()
    assert len(re.findall(r'custom_call_target="__gpu\$xla\.gpu\.triton"', hlo)) == 1, hlo[-2000:]


@pytest.mark.parametrize(
    "mode,M,N,K,tiles",
    [
        (
            "int8",
            2,
            40,
            300,
            Tiles(16, 128, 8, 2),
        ),  # N = 2 * 16 + 8, K = 2 * 128 + 44: both last blocks overlap
        ("int8", 1, 48, 512, Tiles(32, 512)),  # K in one step
        ("int4", 3, 40, 640, Tiles(16, 256, 2, 1)),  # 5 groups of 128, 2 a step: the last step overlaps
        ("int4_g64", 1, 64, 384, Tiles(64, 64)),  # a group a step, one block of channels
        ("int8", 1, 20, 256, Tiles(4, 128, 1, 1)),  # 4 channels a program: 5 programs
        ("int4", 2, 12, 256, Tiles(2, 128)),  # 2 channels a program, a group a step
    ],
)
def test_every_tiling_gives_the_dequantized_product(mode, M, N, K, tiles):
    """kernel_sweep.py's tilings compute the same function: the float64 reference for each."""
    rng = np.random.RandomState(N + K)
    q = quantize_rows(rng.standard_normal((N, K)).astype(np.float32), mode)
    x_MK = rng.standard_normal((M, K)).astype(np.float32)
    got = np.asarray(pallas_qgemv.gemv(jnp.asarray(x_MK), q.w, q.scale, tiles=tiles, interpret=INTERPRET))
    want = reference(x_MK, q)
    assert got.shape == (M, N) and np.abs(got - want).max() / np.abs(want).max() < TOL


@pytest.mark.parametrize(
    "mode,M,N,K,tiles",
    [
        ("int8", 1, 48, 512, Tiles(16, 128, 4, 3, 2)),  # 4 steps, 2 a range
        (
            "int8",
            3,
            40,
            700,
            Tiles(16, 128, 4, 3, 4),
        ),  # K = 5 * 128 + 60: 6 steps as 1, 2, 1, 2; the last overlaps
        ("int8", 2, 33, 300, Tiles(16, 256, 8, 3, 2)),  # 2 steps of 256 (the second overlaps): one a range
        ("int4", 1, 40, 640, Tiles(16, 128, 4, 3, 4)),  # 5 groups of 128, one a step: ranges of 1, 1, 1, 2
        ("int4", 2, 32, 1152, Tiles(32, 256, 4, 3, 2)),  # 9 groups, 2 a step: 5 steps, the last overlaps
        ("int4_g64", 4, 48, 832, Tiles(16, 128, 2, 3, 4)),  # 13 groups of 64, 2 a step: 7 steps in 4
        ("int4_g32", 8, 40, 224, Tiles(16, 64, 4, 3, 2)),  # 7 groups of 32, 2 a step: 4 steps, overlap
        ("int4_g32", 1, 16, 96, Tiles(16, 32, 4, 3, 3)),  # a group a step, a step a range
    ],
)
def test_split_k_gives_the_dequantized_product(mode, M, N, K, tiles):
    """Split-K's partials over S ranges of K's steps, summed (int8: then scaled) by XLA: the float64
    reference, K not a multiple of S * block_k, int4's groups of 32, 64 and 128."""
    rng = np.random.RandomState(M + N + K)
    q = quantize_rows(rng.standard_normal((N, K)).astype(np.float32), mode)
    x_MK = rng.standard_normal((M, K)).astype(np.float32)
    got = np.asarray(pallas_qgemv.gemv(jnp.asarray(x_MK), q.w, q.scale, tiles=tiles, interpret=INTERPRET))
    want = reference(x_MK, q)
    assert got.shape == (M, N) and np.abs(got - want).max() / np.abs(want).max() < TOL
    one = np.asarray(
        pallas_qgemv.gemv(jnp.asarray(x_MK), q.w, q.scale, tiles._replace(split_k=1), interpret=INTERPRET)
    )
    assert np.abs(got - one).max() / np.abs(want).max() < TOL  # the unsplit tiling's sums, in another order


@pytest.mark.parametrize(
    "tiles,mode,message",
    [
        (Tiles(24, 128), "int8", r"block_n=24 is not a power of two >= 1"),
        (Tiles(8, 96), "int8", r"block_k=96 is not a power of two >= 16"),
        (Tiles(64, 128), "int8", r"block_n=64 > N=48"),
        (Tiles(16, 1024), "int8", r"block_k=1024 > K=512"),
        (Tiles(16, 128, 3), "int8", r"num_warps=3 is not a power of two <= 32"),
        (Tiles(16, 64), "int4", r"block_k=64 is not whole int4 groups of 128"),
        (Tiles(16, 128, 4, 3, 5), "int8", r"K=512 has 4 steps of block_k=128: split_k=5 would leave a range"),
        (Tiles(16, 256, 4, 3, 3), "int4", r"K=512 has 2 steps of block_k=256: .* use split_k <= 2$"),
        (Tiles(16, 128, 4, 3, 0), "int8", r"split_k=0 < 1$"),
    ],
)
def test_a_tiling_that_does_not_fit_is_one_line(tiles, mode, message):
    q = quantize_rows(np.ones((48, 512), np.float32), mode)
    with pytest.raises(
        ValueError, match=r"^qgemv: tiles \(.*\) do not fit x \(1, 512\) @ w \[48, 512\]: " + message
    ):
        pallas_qgemv.gemv(jnp.ones((1, 512)), q.w, q.scale, tiles=tiles, interpret=INTERPRET)
