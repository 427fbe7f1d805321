"""Compile a recipe's real train step for an accelerator this machine does not have; print its memory.

    python benchmarks/fit_check.py --config configs/gpt2_124m.py --target v5e-8 [model.remat=dots ...]
    CUDA_VISIBLE_DEVICES=-1 JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 PYTHONPATH=. /work/venv-cuda/bin/python \
        benchmarks/fit_check.py --config configs/gpt2_124m_1gpu.py --target h100-1

The step is flaxgpt's own (Trainer: task, optimizer, shardings, micro-batches, donation), traced with
abstract inputs over the devices of `jax.experimental.topologies` (libtpu for TPU, the CUDA plugin for
H100). A throwaway dataset (meta.json and a few tokens) stands in for the recipe's data directory.
Per device: arguments (parameters, optimizer state, batch), temporaries, outputs and the total against
the target's memory; the attention kernel and the collectives found in the compiled program.
The `flaxgpt aot` tool reports the same and more; this is the small check the fit work measured with.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import tempfile
from pathlib import Path

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold libtpu

import jax  # noqa: E402
import numpy as np  # noqa: E402

from flaxgpt.train.config_check import load_recipe  # noqa: E402

GiB = 2**30
H100_SPEC = "/work/shared/aot/h100.txtpb"
# name: (platform, topology arguments, memory per device in GiB: what the TPU compiler says is
# available (v5e: 16 GiB of HBM less its reserve; v5p: 95 GB), an H100's 81,559 MiB)
TARGETS = {
    "v5e-8": (
        "tpu",
        dict(topology_name="v5e:2x4", chip_config_name="default", chips_per_host_bounds=(2, 4, 1)),
        15.75,
    ),
    "v4-8": (
        "tpu",
        dict(topology_name="v4:2x2x1", chip_config_name="megacore", chips_per_host_bounds=(2, 2, 1)),
        30.75,
    ),
    "v5p-8": (
        "tpu",
        dict(topology_name="v5p:2x2x1", chip_config_name="megacore", chips_per_host_bounds=(2, 2, 1)),
        95.74,
    ),
    "v5p-64": (
        "tpu",
        dict(topology_name="v5p:2x4x4", chip_config_name="megacore", chips_per_host_bounds=(2, 2, 1)),
        95.74,
    ),
    "h100-1": ("cuda", dict(topology="1x1x1"), 79.6),
    "h100-8": ("cuda", dict(topology="1x1x8"), 79.6),
}


def target_devices(name: str):
    from jax.experimental import topologies

    platform, kw, mem_gib = TARGETS[name]
    if platform == "tpu":
        topo = topologies.get_topology_desc(platform="tpu", num_slices=1, **kw)
    else:
        topo = topologies.get_topology_desc(platform="cuda", target_config=Path(H100_SPEC).read_text(), **kw)
    return list(topo.devices), mem_gib * GiB


def fake_data(vocab_size: int, block_size: int) -> str:
    d = Path(tempfile.mkdtemp(prefix="fit_data_"))
    dtype = "uint16" if vocab_size <= 65536 else "uint32"
    n = 2 * block_size + 2
    for split in ("train", "val"):
        np.zeros(n, dtype).tofile(d / f"{split}.bin")
    meta = {"vocab_size": vocab_size, "dtype": dtype, "train_tokens": n, "val_tokens": n}
    (d / "meta.json").write_text(json.dumps(meta))
    return str(d)


def apply_override(config, item: str) -> None:
    key, value = item.split("=", 1)
    *path, leaf = key.split(".")
    node = config
    for p in path:
        node = node[p]
    old = node[leaf]
    node[leaf] = type(old)(value) if not isinstance(old, bool) else value.lower() in ("1", "true")


def collectives(hlo: str) -> dict:
    found = re.findall(
        r"= [^ ]+ (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)[-a-z]*\(", hlo
    )
    return dict(collections.Counter(found))


def attention_kernels(hlo: str) -> list:
    kinds = []
    if "tpu_custom_call" in hlo:
        kinds.append("pallas (Mosaic)")
    if "__cudnn$fmha" in hlo:
        kinds.append("cudnn fmha")
    return kinds or ["xla"]


def decode_check(config, devices, capacity, slots: int, quantize: str) -> None:
    """One decode step of the GPT for `slots` rows over a KV cache of block_size positions (what the
    serving engine runs per token), parameters and cache split over the devices."""
    import dataclasses

    from flax import linen as nn

    from flaxgpt import sharding
    from flaxgpt.models import gpt
    from flaxgpt.models import registry as models
    from flaxgpt.models.cache import KVCache

    cfg = dataclasses.replace(models.config_from(config.model), scan_layers=False, remat="none")
    mesh = sharding.make_mesh(1, len(devices), devices)
    boxed = gpt.abstract_params(cfg)
    p_shard = sharding.param_shardings(boxed, mesh)
    params = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, jnp_dtype(cfg), sharding=s), nn.unbox(boxed), p_shard
    )
    if quantize != "none":
        cfg, params = gpt.quantize_params(cfg, params, quantize)  # the layout, placed as the weights
    rows = jax.sharding.NamedSharding(mesh, jax.P(("data", "fsdp")))
    cache = jax.eval_shape(lambda: KVCache.for_config(cfg, slots, cfg.block_size, dtype=jnp_dtype(cfg)))
    cache = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rows), cache)
    tokens = jax.ShapeDtypeStruct((slots, 1), np.int32)

    def step(params, tokens_B1, pos_B1, cache):
        return gpt.step_fn(cfg, params)(tokens_B1, pos_B1, cache)

    with jax.set_mesh(mesh):
        compiled = jax.jit(step, donate_argnums=3).trace(params, tokens, tokens, cache).lower().compile()
    report(compiled, capacity)


def jnp_dtype(cfg):
    return np.dtype("bfloat16") if cfg.dtype == "bfloat16" else np.dtype(cfg.dtype)


def report(compiled, capacity) -> None:
    m = compiled.memory_analysis()
    hlo = compiled.as_text()
    total = m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    print(
        f"  per device: arguments {m.argument_size_in_bytes / GiB:.2f} GiB, temporaries "
        f"{m.temp_size_in_bytes / GiB:.2f} GiB, outputs {m.output_size_in_bytes / GiB:.2f} GiB "
        f"(aliased {m.alias_size_in_bytes / GiB:.2f}), total {total / GiB:.2f} of {capacity / GiB:.2f} GiB: "
        f"{'fits' if total <= 0.9 * capacity else 'DOES NOT FIT with 10% headroom'}"
    )
    print(f"  attention: {', '.join(attention_kernels(hlo))}; collectives: {collectives(hlo)}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--target", required=True, choices=sorted(TARGETS))
    p.add_argument(
        "--vocab", type=int, default=50257, help="the dataset's vocabulary (when model.vocab_size=0)"
    )
    p.add_argument("--hlo", help="write the optimized HLO here")
    p.add_argument("--no_mesh_context", action="store_true", help="compile outside jax.set_mesh")
    p.add_argument("--decode_slots", type=int, default=0, help="compile one decode step for this many slots")
    p.add_argument("--quantize", default="none", help="decode: none | int8 | bf16 weights")
    p.add_argument("overrides", nargs="*", help="key=value, e.g. grad_accum=16 model.remat=dots")
    args = p.parse_args()

    from flaxgpt.train.trainer import Trainer

    config = load_recipe(args.config)
    for item in args.overrides:
        apply_override(config, item)
    vocab = config.model.vocab_size or args.vocab
    config.data.dir = fake_data(vocab, config.model.block_size)
    config.out_dir = tempfile.mkdtemp(prefix="fit_out_")
    config.init_from = "scratch"
    devices, capacity = target_devices(args.target)
    if args.decode_slots:
        print(
            f"{args.config} decode on {args.target}: {args.decode_slots} slots x "
            f"{config.model.block_size}, weights {args.quantize}"
        )
        return decode_check(config, devices, capacity, args.decode_slots, args.quantize)
    trainer = Trainer(config, devices=devices, print_fn=lambda *_: None)
    T = trainer.task.tokens_per_row
    shape = (config.grad_accum, trainer.micro_rows, T)
    tokens = jax.ShapeDtypeStruct(shape, np.int32, sharding=trainer.train_batch_sharding)
    batch = {"inputs": tokens, "targets": tokens}
    head = (
        f"{args.config} on {args.target} ({len(devices)} devices, mesh {dict(trainer.mesh.shape)}, "
        f"micro-batch {trainer.micro_rows} x {config.grad_accum}, attention {config.model.attention_impl}, "
        f"remat {config.model.remat}, loss_chunk {config.optim.get('loss_chunk', 0)})"
    )
    print(head)
    try:
        with jax.set_mesh(trainer.mesh) if not args.no_mesh_context else contextlib.nullcontext():
            compiled = trainer.train_step.trace(trainer.restore_target, batch).lower().compile()
    except jax.errors.JaxRuntimeError as e:  # the TPU compiler refuses a program that does not fit
        print(f"  DOES NOT FIT: {str(e).splitlines()[0]}")
        return
    if args.hlo:
        Path(args.hlo).write_text(compiled.as_text())
    report(compiled, capacity)


if __name__ == "__main__":
    main()
