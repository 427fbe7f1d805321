"""A mixture of experts compiled for a TPU v5e-8 (libtpu's abstract devices, no TPU): the grouped matmul
is TPU's ragged-dot kernel (the CPU's tiled path is not taken there), and the train step compiles over
an fsdp 2 x expert 4 mesh."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from flaxgpt.aot import compile as aot
from flaxgpt.aot import targets
from flaxgpt.models.moe import grouped_matmul, mix_experts
from tests.aot.test_compile import tiny

pytest.importorskip("libtpu", reason="the TPU targets need libtpu: pip install 'jax[tpu]==<jax version>'")

MOE = dict(
    model__pos_embedding="rope", model__norm="rmsnorm", model__activation="silu", model__glu=True,
    model__bias=False, model__num_experts=8, model__experts_per_token=2, model__expert_hidden=64,
)  # fmt: skip


def test_the_grouped_matmul_is_tpus_ragged_dot():
    on = SingleDeviceSharding(targets.get("v5e-1").devices()[0])
    shapes = [((256, 128), jnp.bfloat16), ((8, 128, 256), jnp.bfloat16), ((8,), jnp.int32)]
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=on) for shape, dtype in shapes]
    hlo = jax.jit(grouped_matmul).trace(*args).lower(lowering_platforms=("tpu",)).compile().as_text()
    assert "ragged-dot" in hlo


def test_gpus_take_the_tiled_grouped_matmul_not_ragged_dot():
    """XLA on NVIDIA GPUs expands ragged_dot to every row through every expert (docs/aot.md: 449 GB of
    temporaries a device for Qwen3-30B-A3B LoRA training on h100-8, 14.9 GB tiled): lowered for cuda
    (no plugin needed), the grouped matmul is the CPU's tiled pass; for tpu it stays ragged_dot."""
    shapes = [((256, 128), jnp.bfloat16), ((8, 128, 256), jnp.bfloat16), ((8,), jnp.int32)]
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
    text = {
        p: jax.jit(grouped_matmul).trace(*args).lower(lowering_platforms=(p,)).as_text()
        for p in ("cuda", "tpu")
    }
    assert "ragged_dot" not in text["cuda"] and "dot_general" in text["cuda"]
    assert "ragged_dot" in text["tpu"]
    # a prefill chunk's or a decoding batch's tokens that hit about every expert go through every
    # expert once on GPUs (no sort), as on the CPU; TPUs sort them into ragged_dot
    mix = lambda x, w, e, fc, proj: mix_experts(x, w, e, fc, proj, jax.nn.silu)  # noqa: E731
    shapes = [((16, 128), jnp.float32), ((16, 2), jnp.float32), ((16, 2), jnp.int32)]
    shapes += [((8, 128, 64), jnp.float32), ((8, 64, 128), jnp.float32)]
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
    text = {p: jax.jit(mix).trace(*args).lower(lowering_platforms=(p,)).as_text() for p in ("cuda", "tpu")}
    assert "sort" not in text["cuda"] and "sort" in text["tpu"]


def test_expert_parallel_train_step_compiles_for_v5e_8():
    config = tiny(mesh__fsdp=2, mesh__expert=4, **MOE)
    (train,) = aot.run(config, targets.get("v5e-8"), ("train",), print_fn=lambda *_: None)[0]
    assert train.devices == 8 and train.total > 0
    assert {"all-gather", "reduce-scatter"} <= set(train.collectives)
