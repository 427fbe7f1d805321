"""kernels.tuned: the tilings benchmarks/kernel_sweep.py measured on a card (FLAXGPT_GEMV_TILES), taken by
the decoding GEMV kernels where the file holds their shape (the entry at the most rows not above theirs),
their defaults elsewhere, the same values either way; a file that cannot be read, or a tiling that does
not fit, is one line naming the file."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxgpt.kernels import pallas_decode, pallas_qgemv, tuned
from flaxgpt.kernels.pallas_decode import Tiles
from flaxgpt.models.quantize import quantize_rows

INTERPRET = jax.default_backend() != "gpu"
ROOT = Path(__file__).resolve().parents[2]


def taken(fn, *args):
    """(programs, warps) of the one Pallas call fn traces: which tiling the kernel took (a fresh function
    each time: jax caches a function's trace, and the file is read when it is traced)."""
    eqns = [e for e in jax.make_jaxpr(lambda *a: fn(*a))(*args).eqns if e.primitive.name == "pallas_call"]
    assert len(eqns) == 1
    return tuple(eqns[0].params["grid_mapping"].grid), eqns[0].params["compiler_params"].num_warps


def tiles_file(path, entries):
    tuned.write(path, entries, "test card", jax.__version__)
    return str(path)


def test_kernel_names():
    assert (
        tuned.kernel_name(jnp.bfloat16) == "bf16"
        and tuned.kernel_name(jnp.float32, rows_w=True) == "f32_rows"
    )
    assert tuned.kernel_name(jnp.int8) == "int8" and tuned.kernel_name(jnp.uint8, group=64) == "int4_g64"


def test_the_float_gemv_takes_the_file_tiling_for_its_shape_and_rows(tmp_path, monkeypatch):
    K, N = 256, 96
    k = jax.random.split(jax.random.key(0), 3)
    w = (jax.random.normal(k[0], (K, N)) / 16).astype(jnp.bfloat16)
    entries = [
        dict(kernel="bf16", N=N, K=K, M=1, tiles=Tiles(16, 64, 2, 2), gbps=1.0),
        dict(kernel="bf16", N=N, K=K, M=4, tiles=Tiles(8, 128, 1, 3), gbps=1.0),
        dict(kernel="bf16_rows", N=N, K=K, M=1, tiles=Tiles(4, 256, 2, 3), gbps=1.0),
    ]
    gemv = lambda x, w, rows_w=False: pallas_decode.gemv(x, w, rows_w=rows_w, interpret=INTERPRET)  # noqa: E731
    plain = {}
    for M in (1, 3, 4, 8):
        x = jax.random.normal(k[1], (M, K)).astype(jnp.bfloat16)
        plain[M] = (taken(gemv, x, w), np.asarray(gemv(x, w), np.float32))
    assert plain[1][0] == ((3,), 4)  # the default: 32 channels a program, 4 warps
    monkeypatch.setenv(tuned.ENV, tiles_file(tmp_path / "tiles.json", entries))
    # M 1 and 3 take the 1-row entry, 4 and 8 the 4-row one; the values are the default tiling's
    for M, want in ((1, ((6,), 2)), (3, ((6,), 2)), (4, ((12,), 1)), (8, ((12,), 1))):
        x = jax.random.normal(k[1], (M, K)).astype(jnp.bfloat16)
        assert taken(gemv, x, w) == want, M
        np.testing.assert_allclose(np.asarray(gemv(x, w), np.float32), plain[M][1], rtol=2e-2, atol=2e-2)
    x = jax.random.normal(k[1], (1, K)).astype(jnp.bfloat16)
    assert taken(lambda x, w: gemv(x, w, True), x, w.T) == ((24,), 2)  # rows [N, K]: their own entry
    # float32 weights, another shape, an explicit tiling: not the file's
    assert taken(gemv, x.astype(jnp.float32), w.astype(jnp.float32)) == plain[1][0]
    assert taken(gemv, x[:, :128], w[:128]) == plain[1][0]
    explicit = lambda x, w: pallas_decode.gemv(x, w, tiles=Tiles(32, 64), interpret=INTERPRET)  # noqa: E731
    assert taken(explicit, x, w) == ((3,), 4)


@pytest.mark.parametrize("mode,kernel,tiles", [("int8", "int8", Tiles(16, 128, 2, 2, 2)),
                                               ("int4", "int4_g128", Tiles(16, 128, 4, 3, 3))])  # fmt: skip
def test_the_quantized_gemv_takes_the_file_tiling(tmp_path, monkeypatch, mode, kernel, tiles):
    N, K = 64, 384
    rng = np.random.RandomState(0)
    q = quantize_rows(rng.standard_normal((N, K)).astype(np.float32), mode)
    x = jnp.asarray(rng.standard_normal((1, K)).astype(np.float32))
    gemv = lambda x: pallas_qgemv.gemv(x, q.w, q.scale, interpret=INTERPRET)  # noqa: E731
    before, want = taken(gemv, x), np.asarray(gemv(x))
    assert before == ((2,), 4)  # 32 channels a program, K unsplit
    monkeypatch.setenv(
        tuned.ENV, tiles_file(tmp_path / "tiles.json", [dict(kernel=kernel, N=N, K=K, M=1, tiles=tiles)])
    )
    assert taken(gemv, x) == ((4, tiles.split_k), tiles.num_warps)  # 16 channels a program, K in ranges
    np.testing.assert_allclose(np.asarray(gemv(x)), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_a_rewritten_file_is_read_again(tmp_path, monkeypatch):
    x, w = jnp.ones((1, 64)), jnp.ones((64, 64))
    gemv = lambda x, w: pallas_decode.gemv(x, w, interpret=INTERPRET)  # noqa: E731
    path = tmp_path / "tiles.json"
    monkeypatch.setenv(tuned.ENV, tiles_file(path, [dict(kernel="f32", N=64, K=64, M=1, tiles=[16, 64])]))
    assert taken(gemv, x, w) == ((4,), 4)
    tiles_file(path, [dict(kernel="f32", N=64, K=64, M=1, tiles=[8, 64, 1])])
    os.utime(path, ns=(0, path.stat().st_mtime_ns + 10**9))  # a later modification time, whatever the clock
    assert taken(gemv, x, w) == ((8,), 1)


@pytest.mark.parametrize(
    "content,message",
    [
        (None, "cannot read it"),
        ("{not json", "not a tiles file"),
        ('{"device": "x"}', "not a tiles file"),
        (
            '{"tiles": [{"kernel": "f32", "N": 64, "K": 64, "M": 1}]}',
            "entry 0 is not {kernel, N, K, M, tiles}",
        ),
        ('{"tiles": [{"kernel": "f32", "N": 64, "K": 64, "M": 1, "tiles": [16]}]}', "1 numbers where"),
        (
            '{"tiles": [{"kernel": "f32", "N": 64, "K": 64, "M": 1, "tiles": [128, 64]}]}',
            "block_n=128 > N=64",
        ),
        ('{"tiles": [{"kernel": "f32", "N": 64, "K": 64, "M": 1, "tiles": [16, 64, 4, 3, 2]}]}', "split_k=2"),
    ],
)
def test_a_bad_file_is_one_line_naming_it(tmp_path, monkeypatch, content, message):
    path = tmp_path / "tiles.json"
    if content is not None:
        path.write_text(content)
    monkeypatch.setenv(tuned.ENV, str(path))
    with pytest.raises(ValueError, match=message) as e:
        pallas_decode.gemv(jnp.ones((1, 64)), jnp.ones((64, 64)), interpret=INTERPRET)
    assert f"{tuned.ENV}={path}" in str(e.value) and "\n" not in str(e.value)


def test_the_sweep_writes_what_the_kernels_read(tmp_path, monkeypatch):
    """kernel_sweep's summary rows -> the file: int4's group in its kernel's name, bf16's rows apart,
    a shape whose every tiling failed left out."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("kernel_sweep", ROOT / "benchmarks/kernel_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    best = dict(best_gbps=2.0, default_gbps=1.0, xla_gbps=1.5)
    rows = [
        dict(weights="bf16", N=768, K=3072, M=1, best=[16, 512, 4, 3, 1], **best),
        dict(weights="bf16_rows", N=768, K=3072, M=1, best=[4, 512, 4, 3, 1], **best),
        dict(weights="int4", N=4096, K=4096, M=4, best=[32, 256, 4, 3, 4], **best),
        dict(weights="int8", N=4096, K=4096, M=1, best=None, **best),
    ]
    sweep.write_tiles(tmp_path / "t.json", rows, "test card")
    got = json.loads((tmp_path / "t.json").read_text())
    assert got["device"] == "test card" and [e["kernel"] for e in got["tiles"]] == [
        "bf16",
        "bf16_rows",
        "int4_g128",
    ]
    monkeypatch.setenv(tuned.ENV, str(tmp_path / "t.json"))
    assert tuned.lookup("int4_g128", 4096, 4096, 8) == (32, 256, 4, 3, 4)
    assert tuned.lookup("int4_g128", 4096, 4096, 1) is None and tuned.lookup("int8", 4096, 4096, 1) is None


def test_int8_rows_take_the_kernel_on_a_gpu_where_the_sweep_measured_it_faster(tmp_path, monkeypatch):
    """qmatmul.route, FLAXGPT_QMATMUL unset, traced for one GPU: int8 keeps XLA's dot unless the file's
    entry for the shape and rows says the kernel beat it (best_gbps > xla_gbps); int4 takes the kernel
    either way; other platforms and an explicit mode are not the file's to change."""
    from flaxgpt.kernels import qmatmul, target

    monkeypatch.delenv("FLAXGPT_QMATMUL", raising=False)
    monkeypatch.setattr(target, "platform", lambda: "gpu")
    faster = dict(kernel="int8", N=64, K=512, M=1, tiles=[32, 256, 4, 3, 1], best_gbps=900.0, xla_gbps=600.0)
    slower = dict(faster, N=128, best_gbps=500.0)
    unmeasured = {k: v for k, v in faster.items() if k != "xla_gbps"} | {"N": 256}
    monkeypatch.setenv(tuned.ENV, tiles_file(tmp_path / "t.json", [faster, slower, unmeasured]))
    routes = {N: qmatmul.route(1, N, 512, jnp.int8) for N in (64, 128, 256, 512)}
    assert routes == {64: "pallas", 128: "dense", 256: "dense", 512: "dense"}  # 512: not in the file
    assert qmatmul.route(1, 128, 512, jnp.uint8, 128) == "pallas"  # int4: the kernel without the file
    monkeypatch.setenv("FLAXGPT_QMATMUL", "xla")
    assert qmatmul.route(1, 64, 512, jnp.int8) == "dense"
    monkeypatch.delenv("FLAXGPT_QMATMUL")
    monkeypatch.setattr(target, "platform", lambda: "cpu")
    assert qmatmul.route(1, 64, 512, jnp.int8) == "dense"
    monkeypatch.delenv(tuned.ENV)
    monkeypatch.setattr(target, "platform", lambda: "gpu")
    assert qmatmul.route(1, 64, 512, jnp.int8) == "dense"
