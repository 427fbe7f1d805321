"""Kernels chosen for the devices a program is compiled for, not the host's: a TPU v5e-8 compiled
ahead of time on this CPU (libtpu's abstract topology) gets the Pallas splash kernel from
attention_impl="auto", split per device (no all-gather on a data-only mesh); the CPU keeps XLA."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from flaxgpt import sharding
from flaxgpt.kernels import target
from flaxgpt.models.attention import resolve_attention_impl
from flaxgpt.models.gpt import GPT, GPTConfig, abstract_params
from flaxgpt.train.losses import cross_entropy

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other test processes may hold libtpu


@pytest.fixture(scope="module")
def v5e_8():
    pytest.importorskip("libtpu", reason="ahead-of-time TPU compiles need libtpu (pip install 'jax[tpu]')")
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(
        platform="tpu",
        topology_name="v5e:2x4",
        chip_config_name="default",
        chips_per_host_bounds=(2, 4, 1),
        num_slices=1,
    )
    return list(topo.devices)


def test_auto_follows_the_mesh_context(v5e_8):
    assert target.platform() == "cpu" and resolve_attention_impl("auto", jnp.bfloat16) == "xla"
    with jax.set_mesh(sharding.make_mesh(8, 1, v5e_8)):
        assert target.platform() == "tpu" and target.device_kind().startswith("TPU v5")
        assert resolve_attention_impl("auto", jnp.bfloat16) == "pallas"
    assert resolve_attention_impl("auto", jnp.bfloat16) == "xla"


def test_tpu_compile_has_the_pallas_kernel_per_device(v5e_8):
    config = GPTConfig(
        vocab_size=256,
        block_size=128,
        n_layer=2,
        n_head=2,
        n_embd=64,
        dtype="bfloat16",
        scan_layers=True,
        attention_impl="auto",
    )
    mesh = sharding.make_mesh(8, 1, v5e_8)  # data-parallel only: parameters replicated

    def loss(params, tokens_BT):
        logits_BTV = GPT(config).apply({"params": params}, tokens_BT)
        return cross_entropy(logits_BTV, tokens_BT)[0]

    boxed = abstract_params(config)
    p_shard = sharding.param_shardings(boxed, mesh)
    params = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nn.unbox(boxed), p_shard
    )
    tokens = jax.ShapeDtypeStruct((16, 128), np.int32, sharding=sharding.batch_sharding(mesh))
    step = jax.jit(sharding.under_mesh(jax.grad(loss), mesh), out_shardings=p_shard)
    hlo = step.trace(params, tokens).lower().compile().as_text()
    assert "tpu_custom_call" in hlo  # the Mosaic kernel, not interpret mode's XLA loops
    assert " all-gather" not in hlo  # each device attends over its own rows
