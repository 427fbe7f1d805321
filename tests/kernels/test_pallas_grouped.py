"""kernels/pallas_grouped.py run by Pallas' interpreter on the CPU: gmm equals the float64 grouped product
(unequal groups, empty ones first, between and last, rows past the groups, tiles straddling groups, no
dimension a multiple of its block; float32 and bfloat16), its gradients (dx through the transposed
tiles, dw through tgmm) equal jax.vjp of a float64 reference, shapes it cannot tile are one line naming
the tiled form, FLAXGPT_GROUPED=pallas gives a tiny Mixtral the default path's logits and gradients, the
float8 form (kernels.fp8.fp8_grouped through fp8_functions) is within float8's bound of float64 and equals
the tiled float8 form, and (with the CUDA plugin, not in CI) the products compile for an H100 as Triton
calls, the float8 ones on float8 operands. On a GPU the same
tests run the compiled kernels (a lease's check), float32 products there in TF32 as XLA's."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxgpt.kernels import pallas_grouped
from flaxgpt.kernels.fp8 import E4M3, E5M2, fp8_grouped
from flaxgpt.kernels.pallas_grouped import Tiles, gmm
from flaxgpt.models import gpt, moe
from tests.models.test_moe_fp8 import element_error, product_bound

INTERPRET = jax.default_backend() != "gpu"
F32_TOL = 1e-5 if INTERPRET else 5e-3  # GPUs multiply float32 tiles in TF32 (10-bit mantissas)
SMALL = Tiles(32, 16, 16)  # several tiles and blocks in every dimension at these sizes
# A = 100 rows, 95 in groups (5 past them); the empty groups first, between and last
GROUPS = np.array([0, 30, 0, 45, 1, 19, 0], np.int32)


def reference(x_AD, w_EDF, group_sizes_E):
    """float64: each group's rows times its matrix, rows past the groups 0 (jax, so it has a vjp)."""
    ends = np.cumsum(group_sizes_E)
    group_A = np.searchsorted(ends, np.arange(x_AD.shape[0]), side="right")  # E past the groups
    w_AEF = jnp.concatenate([w_EDF, jnp.zeros_like(w_EDF[:1])])[group_A]
    return jnp.einsum("ad,adf->af", x_AD, w_AEF)


def operands(dtype, A=100, D=48, F=40):
    rng = np.random.RandomState(0)
    x = rng.standard_normal((A, D)).astype(np.float32)
    w = rng.standard_normal((len(GROUPS), D, F)).astype(np.float32)
    x, w = (jnp.asarray(a, dtype).astype(jnp.float32) for a in (x, w))  # values the dtype holds
    return np.asarray(x, np.float64), np.asarray(w, np.float64)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, F32_TOL), (jnp.bfloat16, 1e-2)])
def test_gmm_equals_the_float64_grouped_product(dtype, tol):
    x, w = operands(dtype)
    y = gmm(
        jnp.asarray(x, dtype), jnp.asarray(w, dtype), jnp.asarray(GROUPS), tiles=SMALL, interpret=INTERPRET
    )
    with jax.enable_x64(True):
        want = np.asarray(reference(x, w, GROUPS))
    assert y.dtype == dtype and y.shape == want.shape
    # float32 accumulation; bf16: the output rounded once (2^-8 of the largest)
    assert np.abs(np.asarray(y, np.float64) - want).max() / np.abs(want).max() < tol
    assert np.all(np.asarray(y)[GROUPS.sum() :] == 0)  # rows past the groups give 0, as ragged_dot's


def test_default_tiles_one_group_and_all_rows_past_the_groups():
    """The default tiling (blocks larger than the dimensions shrink to them); one group holding every
    row; no rows in any group."""
    x, w = operands(jnp.float32, A=64, D=16, F=24)
    for sizes in ([0, 64, 0, 0, 0, 0, 0], [0] * 7):
        sizes = np.array(sizes, np.int32)
        y = np.asarray(gmm(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), jnp.asarray(sizes),
                           interpret=INTERPRET))  # fmt: skip
        with jax.enable_x64(True):
            np.testing.assert_allclose(
                y, np.asarray(reference(x, w, sizes)), atol=1e-4 if INTERPRET else 1e-2
            )


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, F32_TOL), (jnp.bfloat16, 2e-2)])
def test_gradients_equal_the_float64_references_vjp(dtype, tol):
    x, w = operands(dtype)
    g = np.random.RandomState(1).standard_normal((x.shape[0], w.shape[2]))
    g = np.asarray(jnp.asarray(g, dtype).astype(jnp.float32), np.float64)
    f = lambda x, w: gmm(x, w, jnp.asarray(GROUPS), tiles=SMALL, interpret=INTERPRET)  # noqa: E731
    _, vjp = jax.vjp(f, jnp.asarray(x, dtype), jnp.asarray(w, dtype))
    dx, dw = vjp(jnp.asarray(g, dtype))
    with jax.enable_x64(True):
        _, vjp_ref = jax.vjp(lambda x, w: reference(x, w, GROUPS), x, w)
        want_dx, want_dw = (np.asarray(a) for a in vjp_ref(g))
    for got, want in ((dx, want_dx), (dw, want_dw)):
        assert got.dtype == dtype
        assert np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max() < tol
    assert not np.asarray(dw)[[0, 2, 6]].any()  # the empty groups' matrices get no gradient


def test_many_blocks_take_the_swizzled_order_with_a_remainder():
    """19 row tiles (two GROUP_M groups of 8 and a remainder of 3) and tgmm's 10 blocks of D: every
    output tile is visited once, forward and gradients equal the float64 reference."""
    rng = np.random.RandomState(2)
    sizes = np.array([70, 0, 113, 9, 99], np.int32)  # 291 of 300 rows
    x, w, g = (
        rng.standard_normal((300, 160)),
        rng.standard_normal((5, 160, 48)),
        rng.standard_normal((300, 48)),
    )
    f = lambda x, w: gmm(x, w, jnp.asarray(sizes), tiles=Tiles(16, 16, 16), interpret=INTERPRET)  # noqa: E731
    y, vjp = jax.vjp(f, *(jnp.asarray(a, jnp.float32) for a in (x, w)))
    got = (y, *vjp(jnp.asarray(g, jnp.float32)))
    with jax.enable_x64(True):
        want_y, vjp_ref = jax.vjp(lambda x, w: reference(x, w, sizes), x, w)
        want = (want_y, *vjp_ref(g))
    for a, b in zip(got, want):
        b = np.asarray(b)
        assert np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max() < F32_TOL


def test_shapes_it_cannot_tile_are_one_line_naming_the_tiled_form():
    x, w = jnp.ones((64, 8)), jnp.ones((4, 8, 32))
    with pytest.raises(ValueError, match=r"D=8 and F=32 must each be >= 16 .*use models.moe's tiled form"):
        gmm(x, w, jnp.full(4, 16), interpret=INTERPRET)
    with pytest.raises(ValueError, match=r"block_k=24 is not a power of two >= 16; use"):
        gmm(jnp.ones((64, 32)), jnp.ones((4, 32, 32)), jnp.full(4, 16), tiles=Tiles(block_k=24))
    assert pallas_grouped.why_not(16384, 4096, 28672) == ""


MIXTRAL = dict(
    gpt.GPTConfig.PRESETS["mixtral-8x7b"], vocab_size=32, block_size=16, n_layer=2, n_head=2, n_kv_head=1,
    n_embd=32, mlp_hidden=48, num_experts=4, experts_per_token=2, expert_hidden=16,
)  # fmt: skip


def test_tiny_mixtral_with_the_kernels_equals_the_default_path(monkeypatch):
    """FLAXGPT_GROUPED=pallas: the experts' grouped products (64 tokens: the sorted path) go through gmm,
    interpreted on the CPU (compiled on a GPU); the loss and the weights' gradients equal the tiled form's."""
    config = gpt.GPTConfig(**MIXTRAL)
    params = gpt.init_params(config, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, 32, (4, 16)).astype(np.int32)

    def run():
        loss = lambda p: jnp.mean(gpt.GPT(config).apply({"params": p}, tokens) ** 2)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss))(params)

    calls = []
    real = pallas_grouped.gmm
    monkeypatch.setattr(pallas_grouped, "gmm", lambda *a, **k: calls.append(k) or real(*a, **k))
    want = run()
    assert not calls  # the default: the tiled form
    monkeypatch.setenv("FLAXGPT_GROUPED", "pallas")
    got = run()
    # each layer's two expert products through this platform's branch (a CPU's interpreted; the other
    # platforms' branches are traced too)
    assert sum(k.get("interpret", False) == INTERPRET for k in calls) >= 2 * config.n_layer
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-4 if INTERPRET else 2e-2, atol=1e-6 if INTERPRET else 1e-4)
    monkeypatch.setenv("FLAXGPT_GROUPED", "triton")
    with pytest.raises(ValueError, match=r"FLAXGPT_GROUPED='triton': 'pallas' .* or unset"):
        moe.grouped_matmul(jnp.ones((64, 32)), jnp.ones((4, 32, 32)), jnp.full(4, 16))


def h100_grouped_args():
    """(one h100-1 device's mesh, abstract x [1024, 256] bf16, w [8, 256, 512] bf16, group sizes [8]):
    what the compile tests lower (skipped without the CUDA plugin)."""
    pytest.importorskip("jax_cuda12_plugin", reason="the GPU targets need the CUDA plugin (not in CI)")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from flaxgpt.aot import targets

    mesh = Mesh(np.array(targets.get("h100-1").devices()[:1]), ("x",))
    one = NamedSharding(mesh, PartitionSpec())
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=one)  # noqa: E731
    A, D, F, E = 1024, 256, 512, 8
    return mesh, (spec((A, D), jnp.bfloat16), spec((E, D, F), jnp.bfloat16), spec((E,), jnp.int32))


def test_products_and_gradients_compile_for_h100_as_triton_calls():
    """The Triton lowering itself (interpret mode checks values only): forward and backward of a
    grouped product compiled for an H100 on this CPU hold gmm, its transposed form and tgmm."""
    mesh, args = h100_grouped_args()
    loss = lambda x, w, sizes: jnp.sum(gmm(x, w, sizes).astype(jnp.float32) ** 2)  # noqa: E731
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile().as_text()
    assert len(re.findall(r'custom_call_target="__gpu\$xla\.gpu\.triton"', hlo)) == 3, hlo[-2000:]


def fp8_sides(x, w, g, tiles=SMALL):
    """kernels.fp8.fp8_grouped's output and (dx, dw) through the tiled form and through these kernels."""
    tiled = (moe.tiled_grouped_matmul, moe.tiled_weight_grad)

    def run(fns):
        y, vjp = jax.vjp(lambda x, w: fp8_grouped(x, w, jnp.asarray(GROUPS), *fns), x, w)
        return (y, *vjp(g))

    kernels = pallas_grouped.fp8_functions(*tiled, tiles=tiles)
    return jax.jit(run, static_argnums=0)(tiled), jax.jit(run, static_argnums=0)(kernels)


def test_float8_products_and_gradients_within_float8s_bound_and_equal_the_tiled_form(monkeypatch):
    """fp8_grouped through gmm (e4m3 x e4m3), gmm reading w transposed (dX: e5m2 x e4m3) and tgmm
    (dW: e4m3 x e5m2), each scaled in its epilogue: within float8's rounding bound of the float64
    products (test_moe_fp8's bound) and equal to the tiled float8 form's values up to float32 sums."""
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((100, 48)) * 2, rng.standard_normal((len(GROUPS), 48, 40)) * 0.05
    g = rng.standard_normal((100, 40)) * 1e-3
    g[GROUPS.sum() :] = 0  # the caller drops those rows' outputs: no gradient comes back for them
    calls = []
    for name in ("gmm", "tgmm"):
        real = getattr(pallas_grouped, name)
        monkeypatch.setattr(
            pallas_grouped, name, lambda *a, f=real, n=name, **k: calls.append((n, k)) or f(*a, **k)
        )
    tiled, got = fp8_sides(*(jnp.asarray(a, jnp.float32) for a in (x, w, g)))
    # this platform's branch runs the kernels, scaled: forward, dX (w transposed in place) and dW
    mine = [
        (n, k.get("transpose_w", False))
        for n, k in calls
        if k["interpret"] == INTERPRET and k["scale"] is not None
    ]
    assert {("gmm", False), ("gmm", True), ("tgmm", False)} <= set(mine), calls
    x, w, g = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (x, w, g))
    ex, ew = element_error(x, E4M3, np.abs(x).max()), element_error(w, E4M3, np.abs(w).max())
    eg = element_error(g, E5M2, np.abs(g).max())
    ends, (y, dx, dw) = np.cumsum(GROUPS), (np.asarray(a, np.float64) for a in got)
    for e, rows in enumerate(slice(end - n, end) for n, end in zip(GROUPS, ends)):
        assert np.all(np.abs(y[rows] - x[rows] @ w[e]) <= product_bound(x[rows], ex[rows], w[e], ew[e]))
        assert np.all(
            np.abs(dx[rows] - g[rows] @ w[e].T) <= product_bound(g[rows], eg[rows], w[e].T, ew[e].T)
        )
        assert np.all(
            np.abs(dw[e] - x[rows].T @ g[rows]) <= product_bound(x[rows].T, ex[rows].T, g[rows], eg[rows])
        )
    assert not y[ends[-1] :].any() and not dw[[0, 2, 6]].any()  # rows past the groups; empty groups
    for a, b in zip(got, tiled):  # the same float8 operands and scales: only the float32 sums' order differs
        assert a.dtype == b.dtype == jnp.float32
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * float(jnp.abs(b).max()))


def test_float8_products_compile_for_h100_as_triton_calls_on_float8_operands():
    """Compiled for an H100: forward, dX and dW are three Triton calls whose operands are the float8
    copies (e4m3 x e4m3, e5m2 x the e4m3 stack as it is, e4m3 x e5m2: no transposed copy), with the
    scale a float32 scalar."""
    mesh, args = h100_grouped_args()
    (A, D), (E, _, F) = args[0].shape, args[1].shape
    fns = pallas_grouped.fp8_functions(moe.tiled_grouped_matmul, moe.tiled_weight_grad)
    loss = lambda x, w, sizes: jnp.sum(fp8_grouped(x, w, sizes, *fns).astype(jnp.float32) ** 2)  # noqa: E731
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile().as_text()
    calls = [line for line in hlo.splitlines() if 'custom_call_target="__gpu$xla.gpu.triton"' in line]
    operands = sorted(
        re.search(r"operand_layout_constraints=\{(.*)\}, api_version", c).group(1) for c in calls
    )
    kinds = [re.findall(r"(f8e\w+|bf16|f32)\[([\d,]*)\]", o) for o in operands]
    f8 = [tuple(k for k in kind if k[0].startswith("f8")) for kind in kinds]
    assert sorted(f8) == sorted([
        (("f8e4m3fn", f"{A},{D}"), ("f8e4m3fn", f"{E},{D},{F}")),  # y = x8 w8
        (("f8e5m2", f"{A},{F}"), ("f8e4m3fn", f"{E},{D},{F}")),  # dX = g8 w8^T, w8 read in place
        (("f8e4m3fn", f"{A},{D}"), ("f8e5m2", f"{A},{F}")),  # dW = x8^T g8
    ]), operands  # fmt: skip
    assert all(("f32", "1") in kind for kind in kinds)  # the scale, applied in the epilogue
    # y and dX in the compute dtype, dW in float32 (a float32 parameter's gradient: cast after, if at all)
    assert sorted(re.search(r"= (\w+)\[", c).group(1) for c in calls) == ["bf16", "bf16", "f32"]
