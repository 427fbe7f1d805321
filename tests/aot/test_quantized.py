"""int8 (and int4) weights ahead of time: gpt.quantize_params traced over abstract parameters gives
the concrete tree's layout (and placement: programs.abstract_quantized), and int8 sampling / serving
compile for a TPU without the CPU qmatmul kernel, the engine over 8 chips."""

import operator
import re

import jax
import jax.numpy as jnp
import pytest
from flax import linen as nn

from flaxgpt import sharding
from flaxgpt.aot import programs
from flaxgpt.models import gpt, quantize

CFG = gpt.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=40)


def _abstract(config, mesh):
    boxed = gpt.abstract_params(config)
    shardings = sharding.param_shardings(boxed, mesh)
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nn.unbox(boxed), shardings
    )


@pytest.mark.parametrize("mode", ["int8", "bf16"])
def test_abstract_quantized_tree_is_the_concrete_layout(mode):
    _, concrete = gpt.quantize_params(CFG, gpt.init_params(CFG, jax.random.key(0)), mode)
    mesh = sharding.make_mesh(1, 8)
    config = gpt.quantized_config(CFG)
    abstract = programs.abstract_quantized(CFG, _abstract(CFG, mesh), mesh, mode)
    assert not config.tie_embeddings and not config.scan_layers
    assert jax.tree.structure(abstract) == jax.tree.structure(concrete)
    for a, c in zip(jax.tree.leaves(abstract), jax.tree.leaves(concrete), strict=True):
        assert isinstance(a, jax.ShapeDtypeStruct) and (a.shape, a.dtype) == (c.shape, c.dtype)
    head, table = (jax.tree.leaves(abstract[k]) for k in ("lm_head", "wte"))
    assert all(map(operator.is_, head, table))  # tied: one table's arrays
    # placement follows the weight: c_fc kernel [embed, mlp] -> w [mlp, embed], its scales [mlp]
    fc = abstract["h_0"]["mlp"]["c_fc"]["kernel"]
    assert fc.w.sharding.spec == jax.P(None, "fsdp") and fc.scale.sharding.spec == jax.P(None)
    proj = abstract["h_0"]["mlp"]["c_proj"]["kernel"]  # [mlp, embed] -> w [embed, mlp]: rows split
    assert proj.w.sharding.spec == jax.P("fsdp", None) and proj.scale.sharding.spec == jax.P("fsdp")
    # per device: an eighth of each split weight, the shared table once
    nbytes = programs.per_device_bytes(abstract)
    assert nbytes < quantize.weight_bytes(concrete) and nbytes == programs.per_device_bytes(
        {k: v for k, v in abstract.items() if k != "lm_head"}
    )


def test_abstract_int4_tree_is_the_concrete_layout():
    """int4 (groups of 32) traced over 8 devices: the concrete tree's packed bytes and group scales, the
    packed rows split as the weight's (flaxgpt aot compiles int4 decoding from this layout)."""
    _, concrete = gpt.quantize_params(CFG, gpt.init_params(CFG, jax.random.key(0)), "int4_g32")
    mesh = sharding.make_mesh(1, 8)
    abstract = programs.abstract_quantized(CFG, _abstract(CFG, mesh), mesh, "int4_g32")
    assert jax.tree.structure(abstract) == jax.tree.structure(concrete)
    for a, c in zip(jax.tree.leaves(abstract), jax.tree.leaves(concrete), strict=True):
        assert (a.shape, a.dtype) == (c.shape, c.dtype)
    fc = abstract["h_0"]["mlp"]["c_fc"]["kernel"]  # [32, 128] -> w uint8 [128, 16], scales [128, 1]
    assert fc.w.dtype == jnp.uint8 and fc.w.shape == (128, 16) and fc.w.sharding.spec == jax.P(None, "fsdp")


def test_qmatmul_takes_the_cpu_kernel_only_for_cpu_devices():
    pytest.importorskip("libtpu", reason="needs libtpu's abstract TPU devices")
    from flaxgpt.aot import targets
    from flaxgpt.kernels import qmatmul

    if not qmatmul.kernel_available():
        pytest.skip("no C++ compiler: the CPU kernel is never used")
    args = (jnp.ones((1, 32)), jnp.ones((8, 32), jnp.int8), jnp.ones((8,)))
    assert "ffi_call" in str(jax.make_jaxpr(qmatmul.qmatmul)(*args))  # this host's CPU
    tpu = sharding.make_mesh(1, 8, targets.get("v5e-8").devices())
    with jax.sharding.use_abstract_mesh(tpu.abstract_mesh):
        assert "ffi_call" not in str(jax.make_jaxpr(qmatmul.qmatmul)(*args))


def test_qmatmul_for_accelerators_widens_int8_to_the_activations_dtype(monkeypatch):
    """Traced for a TPU / GPU: bfloat16 activations meet the int8 weights in bfloat16 (exact), summed in
    float32: the product the CPU path gives in float32."""
    import numpy as np

    from flaxgpt.kernels import qmatmul, target

    rs = np.random.RandomState(0)
    x = jnp.asarray(rs.randn(3, 40), jnp.bfloat16)
    w = jnp.asarray(rs.randint(-127, 128, (24, 40)), jnp.int8)
    scale = jnp.asarray(rs.rand(24), jnp.float32)
    want = np.asarray(x, np.float32) @ (np.asarray(w, np.float32) * np.asarray(scale)[:, None]).T
    monkeypatch.setattr(target, "platform", lambda: "tpu")
    text = str(jax.make_jaxpr(qmatmul.qmatmul)(x, w, scale))
    assert "ffi_call" not in text and "preferred_element_type=float32" in text
    got = np.asarray(jax.jit(qmatmul.qmatmul)(x, w, scale))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_qmatmul_reduce_experiment_is_the_same_product(monkeypatch):
    """FLAXGPT_QMATMUL=reduce (benchmarks/gpu_lease.py decode_llama8b_reduce): for a GPU's decoding rows
    the product as a multiply and a reduction over K (no dot in the program), the same values; more
    rows than REDUCE_ROWS keep the dot."""
    import numpy as np

    from flaxgpt.kernels import qmatmul, target

    rs = np.random.RandomState(1)
    w = jnp.asarray(rs.randint(-127, 128, (24, 40)), jnp.int8)
    scale = jnp.asarray(rs.rand(24), jnp.float32)
    monkeypatch.setattr(target, "platform", lambda: "gpu")
    monkeypatch.setenv("FLAXGPT_QMATMUL", "reduce")
    for rows, reduced in ((1, True), (qmatmul.REDUCE_ROWS + 1, False)):
        x = jnp.asarray(rs.randn(rows, 40), jnp.bfloat16)
        want = np.asarray(x, np.float32) @ (np.asarray(w, np.float32) * np.asarray(scale)[:, None]).T
        text = str(jax.make_jaxpr(qmatmul.qmatmul)(x, w, scale))
        assert ("dot_general" not in text) == reduced and ("reduce_sum" in text) == reduced
        np.testing.assert_allclose(
            np.asarray(jax.jit(qmatmul.qmatmul)(x, w, scale)), want, rtol=1e-5, atol=1e-4
        )


def test_int4_decoding_rows_take_the_gemv_on_one_gpu(monkeypatch):
    """kernels.qmatmul.route, the one rule: on one GPU, int4 decoding rows take pallas_qgemv by default
    (3.2x XLA's unpack-then-dot on the 8B shape, measured on an H200), int8 keeps XLA's fusion
    (faster there); FLAXGPT_QMATMUL=xla, a mesh of several devices, a prefill's rows, a CPU or a
    shape the kernel cannot tile keep XLA's forms; =pallas takes the kernel for int8 too."""
    from flaxgpt.kernels import pallas_qgemv, qmatmul, target

    u8, i8 = jnp.uint8, jnp.int8
    monkeypatch.delenv("FLAXGPT_QMATMUL", raising=False)
    assert qmatmul.route(1, 4096, 4096, u8, 128) == "int4"  # this host: a CPU
    monkeypatch.setattr(target, "platform", lambda: "gpu")
    assert qmatmul.route(1, 4096, 4096, u8, 128) == "pallas"
    assert qmatmul.route(pallas_qgemv.MAX_ROWS + 1, 4096, 4096, u8, 128) == "int4"  # prefill
    assert qmatmul.route(1, 8, 4096, u8, 128) == "int4"  # N < the kernel's block: one line in why_not
    assert qmatmul.route(1, 4096, 4096, i8) == "dense"
    monkeypatch.setattr(target, "one_device", lambda: False)
    assert qmatmul.route(1, 4096, 4096, u8, 128) == "int4"
    monkeypatch.setattr(target, "one_device", lambda: True)
    monkeypatch.setenv("FLAXGPT_QMATMUL", "xla")
    assert qmatmul.route(1, 4096, 4096, u8, 128) == "int4"
    monkeypatch.setenv("FLAXGPT_QMATMUL", "pallas")
    assert qmatmul.route(1, 4096, 4096, i8) == "pallas"


def test_int8_sampling_and_serving_compile_for_v5e_8(tmp_path):
    pytest.importorskip("libtpu", reason="the TPU targets need libtpu: pip install 'jax[tpu]==<jax version>'")
    from flaxgpt.aot import compile as aot
    from flaxgpt.aot import targets
    from tests.aot.test_compile import tiny

    target = targets.get("v5e-8")
    rows, mc = aot.run(
        tiny(), target, ("sample", "serve"), quantize="int8", serve_devices=8, dump=tmp_path,
        print_fn=lambda *_: None,
    )  # fmt: skip
    by = {r.program: r for r in rows}
    assert list(by) == ["sample.prefill", "sample.decode", "serve.prefill", "serve.generate"]
    assert by["sample.decode"].devices == 1 and by["serve.generate"].devices == 8
    assert all(r.fits(0.1) for r in rows)
    for path in tmp_path.iterdir():  # XLA's dequantize-and-dot, not the CPU kernel's custom call
        assert "flaxgpt_" not in path.read_text(), path.name
    # int8 weights: about a byte per weight; serving splits the MLP and vocabulary over the 8 chips
    n = sum(x.size for x in jax.tree.leaves(nn.unbox(gpt.abstract_params(mc))))
    assert by["sample.decode"].parameters < 2 * n
    assert by["serve.generate"].parameters < 0.6 * by["sample.decode"].parameters
    assert by["serve.generate"].collectives  # the activations move between the chips


def test_int8_sampling_and_serving_compile_for_h100_1(tmp_path):
    pytest.importorskip("jax_cuda12_plugin", reason="the GPU targets need the CUDA plugin (not in CI)")
    from flaxgpt.aot import compile as aot
    from flaxgpt.aot import targets
    from tests.aot.test_compile import tiny

    rows, _ = aot.run(
        tiny(), targets.get("h100-1"), ("sample", "serve"), quantize="int8", dump=tmp_path,
        print_fn=lambda *_: None,
    )  # fmt: skip
    assert [r.program for r in rows] == [
        "sample.prefill", "sample.decode", "serve.prefill", "serve.generate",
    ]  # fmt: skip
    assert all(r.fits(0.1) for r in rows)
    for path in tmp_path.iterdir():
        assert "flaxgpt_" not in path.read_text(), path.name
    # the decoding kernels read the int8 matrices themselves (a fused computation takes s8[N, K]):
    # no kernel widens a weight matrix to 16 bits in HBM first
    hlo = (tmp_path / "sample.decode.h100-1.hlo.txt").read_text()
    assert re.search(r"^%\S+ \([^)]*s8\[\d+,\d+\]", hlo, re.M)


def test_serving_over_several_tpu_devices_takes_the_partitionable_path(tmp_path):
    """head_dim 128 (Llama's): one chip's engine decodes with the Pallas paged kernel; an engine over 2
    chips with the xla path, which XLA partitions (the Mosaic kernel is a custom call it cannot split:
    'Mosaic kernels cannot be automatically partitioned')."""
    pytest.importorskip("libtpu", reason="the TPU targets need libtpu: pip install 'jax[tpu]==<jax version>'")
    from flaxgpt.aot import compile as aot
    from flaxgpt.aot import targets
    from flaxgpt.models.paged import paged_impl
    from tests.aot.test_compile import tiny

    assert paged_impl("tpu", 128) == "pallas_tpu" and paged_impl("tpu", 128, devices=2) == "xla"
    assert paged_impl("gpu", 64) == "pallas_gpu" and paged_impl("gpu", 64, devices=8) == "xla"
    kernels = {}
    for n in (1, 2):
        rows, _ = aot.run(
            tiny(model__n_embd=256, model__n_head=2), targets.get("v5e-8"), ("serve",), serve_devices=n,
            print_fn=lambda *_: None,
        )  # fmt: skip
        by = {r.program: r for r in rows}
        assert by["serve.generate"].devices == n
        kernels[n] = by["serve.generate"].kernel
    assert kernels[1] == "pallas paged (mosaic)" and kernels[2] != kernels[1], kernels
