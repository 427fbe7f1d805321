"""Per-device memory of a model's parameters and AdamW state for each data x fsdp mesh.

Nothing is allocated: the parameters and optimizer state are `jax.eval_shape` structures, and each
leaf's per-device size is the shard shape of its NamedSharding from flaxgpt.sharding (the same
rules table the trainer uses). Runs on 8 simulated CPU devices.

    python benchmarks/fsdp_memory.py                     # gpt2-xl, meshes 8x1 4x2 2x4 1x8
    python benchmarks/fsdp_memory.py --preset gpt2 --meshes 8x1,1x8 --scan_layers
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import linen as nn  # noqa: E402

from flaxgpt import sharding  # noqa: E402
from flaxgpt.models import gpt  # noqa: E402


def per_device_bytes(abstract_tree, shardings) -> int:
    """Bytes one device holds: the sum over leaves of its shard's size."""
    leaves = jax.tree_util.tree_leaves(abstract_tree)
    specs = jax.tree_util.tree_leaves(shardings)
    assert len(leaves) == len(specs), (len(leaves), len(specs))
    return sum(int(np.prod(s.shard_shape(x.shape))) * x.dtype.itemsize for x, s in zip(leaves, specs))


def adamw_state(abstract_params):
    """AdamW's state (mu, nu and counts) as the trainer builds it, abstract."""
    import optax

    return jax.eval_shape(optax.adamw(1e-4, b1=0.9, b2=0.95, weight_decay=0.1).init, abstract_params)


def measure(config: gpt.GPTConfig, data: int, fsdp: int) -> dict:
    mesh = sharding.make_mesh(data, fsdp, jax.devices()[: data * fsdp])
    boxed = gpt.abstract_params(config)
    params = nn.unbox(boxed)
    p_shardings = sharding.param_shardings(boxed, mesh)
    opt = adamw_state(params)
    o_shardings = sharding.state_shardings(opt, params, p_shardings, mesh)
    return {
        "mesh": f"{data}x{fsdp}",
        "params": per_device_bytes(params, p_shardings),
        "adam": per_device_bytes(opt, o_shardings),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt2-xl", choices=list(gpt.GPTConfig.PRESETS))
    ap.add_argument("--meshes", default="8x1,4x2,2x4,1x8", help="data x fsdp pairs")
    ap.add_argument("--scan_layers", action="store_true", help="stacked [L, ...] layout")
    args = ap.parse_args()
    config = gpt.GPTConfig.preset(args.preset, pad_vocab_multiple=64, scan_layers=args.scan_layers)
    n = gpt.count_params(gpt.abstract_params(config))
    print(
        f"{args.preset}: {n / 1e6:,.1f}M parameters (float32, vocab padded to {config.padded_vocab_size}), "
        f"{'scanned' if args.scan_layers else 'per-layer'} layout, AdamW state = mu + nu"
    )
    gib = 2.0**30
    rows = [measure(config, *map(int, m.split("x"))) for m in args.meshes.split(",")]
    base = rows[0]["params"] + rows[0]["adam"]
    print("| data x fsdp | params / device | AdamW state / device | total / device | shrink vs first row |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        total = r["params"] + r["adam"]
        sizes = [f"{b / gib:.2f} GiB" for b in (r["params"], r["adam"], total)]
        cells = [r["mesh"], *sizes]
        print("| " + " | ".join(cells) + f" | {base / total:.2f}x |")
    print("(gradients: one more params-sized, equally sharded buffer in the step; activations not counted)")


if __name__ == "__main__":
    main()
