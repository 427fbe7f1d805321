"""A decoding step's attention over a contiguous KV cache, XLA's path against the Pallas kernel, per call.

    python benchmarks/decode_attention.py --json $OUT/decode_attention.json   # one GPU, ~40 s
    python benchmarks/decode_attention.py --dry_run                            # CPU, tiny, interpreted
    python benchmarks/decode_attention.py --compile_for h100-1   # CPU: kernels a layer, compiled

What `FLAXGPT_DECODE_KERNELS=attention` changes in a decoding token, alone: models/cache.py's
ContiguousLayer.attend for one row, its new key and value written into the cache and attended over with
the positions before it, either as XLA's path (the k and v scatters, q . k over the whole cache
masked past the position, softmax, p . v: 5-7 kernels a layer) or as kernels/pallas_decode_attention.py
(one kernel reading only the positions up to the row's). For the Llama-3-8B shape (8 key/value heads
of 4 query heads, K 128) and GPT-2 124M's (12 heads, K 64), caches of S positions with the row at
`pos`: the lease's decode parts run S = 192 / 320 at positions up to 143 / 271; serving and long
prompts run longer caches, where XLA's path reads all S positions a call and the kernel reads those up
to pos, a program a key/value head and range of SPAN (1,024) positions, the ranges merged after.

Method: one jitted program of LAYERS calls, each on its own layer's cache buffers (a token's layers:
no two calls share a buffer, so none is in cache for another), the buffers donated and carried from
run to run as decoding carries them (a buffer not donated would be copied whole before its in-place
write); after a compile and a warm run, 7 repeats of 3 back-to-back runs, the median over LAYERS:
us a call, and GB/s of the cache bytes a call must read (2 x (pos + 1) x J x K x 2 bytes). The kernel's
output is checked against XLA's (`err`, relative, bf16). Rows on stdout; every row as JSON (--json).

--compile_for h100-1 compiles each case's two programs for a `flaxgpt aot` target on this machine and
prints the kernels a layer (flaxgpt.aot.hlo_cost) and the cache buffers copied (none: the donated
buffers are written in place); on 2026-11-30 (jax 0.10.2): XLA's path 5 kernels a layer at S 192, 6 at
8192 (p . v split over K, then summed), GPT-2's 3.2; the kernel 2 (its call, and q | k | v written as
one array, which in the model is rope's fusion; at 8192 its ranges' merge fused with the outputs' stack).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import harness  # noqa: F401  (first: the benchmarks' one sys.path rule, see harness.py)
import jax
import jax.numpy as jnp

from flaxgpt.models.cache import ContiguousLayer

# name: (key/value heads J, query heads a key/value head G, head dim K), [(cache length S, position)]
SHAPES = {
    "Llama-3-8B": ((8, 4, 128), [(192, 143), (1024, 1023), (8192, 143), (8192, 8191)]),
    "GPT-2 124M": ((12, 1, 64), [(320, 271), (1024, 1023)]),
}
DRY = {"tiny": ((2, 2, 16), [(64, 10), (128, 127)])}
LAYERS = 32  # calls a program: a token's layers (the Llama-3-8B shape's 32)
TOL = 2e-2  # relative error of the kernel's output against XLA's path (bf16)


def program(layers: int, kernels: bool):
    """f(q [L, 1, 1, H, K], k|v new [L, 1, 1, J, K], pos [1, 1], caches [L, J, S, K] x 2) -> (y, caches):
    each layer's attend, the caches donated (updated in place, carried to the next run)."""

    def f(q, kn, vn, pos, ks, vs):
        ys, k_out, v_out = [], [], []
        for i in range(layers):
            y, layer = ContiguousLayer(ks[i], vs[i]).attend(q[i], kn[i], vn[i], pos, kernels=kernels)
            ys.append(y)
            k_out.append(layer.k)
            v_out.append(layer.v)
        return jnp.stack(ys), k_out, v_out

    return jax.jit(f, donate_argnums=(4, 5))


def time_form(shape, S: int, pos: int, kernels: bool, layers: int, repeats: int) -> tuple[dict, jax.Array]:
    (J, G, K), H = shape, shape[0] * shape[1]
    keys = jax.random.split(jax.random.key(S + pos), 5)
    bf16 = jnp.bfloat16
    q = jax.random.normal(keys[0], (layers, 1, 1, H, K), bf16)
    kn, vn = (jax.random.normal(k, (layers, 1, 1, J, K), bf16) for k in keys[1:3])
    ks, vs = (
        [jax.random.normal(jax.random.fold_in(k, i), (J, S, K), bf16) for i in range(layers)]
        for k in keys[3:]
    )
    pos_11 = jnp.full((1, 1), pos, jnp.int32)
    f = program(layers, kernels)
    took = "decode_attention" in str(jax.make_jaxpr(f)(q, kn, vn, pos_11, ks, vs))
    if took != kernels:  # the kernel must not decline the shape (models/cache.py's _kernel_takes) unseen
        raise SystemExit(
            f"kernels={kernels} but the program {'has' if took else 'lacks'} the attention kernel"
        )
    t0 = time.perf_counter()
    y, ks, vs = jax.block_until_ready(f(q, kn, vn, pos_11, ks, vs))  # compile and the first run
    compile_s = time.perf_counter() - t0
    _, ks, vs = jax.block_until_ready(f(q, kn, vn, pos_11, ks, vs))  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(3):  # back to back: dispatch overlaps the device
            _, ks, vs = f(q, kn, vn, pos_11, ks, vs)
        jax.block_until_ready((ks, vs))
        times.append((time.perf_counter() - t0) / 3)
    per_call = statistics.median(times) / layers
    read = 2 * (pos + 1) * J * K * 2  # the keys and values up to pos, bf16
    row = dict(form="kernel" if kernels else "xla", J=J, G=G, K=K, S=S, pos=pos, calls=layers)
    row.update(
        compile_s=round(compile_s, 2), us=round(1e6 * per_call, 2), gbps=float(f"{read / per_call / 1e9:.4g}")
    )
    return row, y


def compile_for(name: str, shapes) -> int:
    """Each case's two programs compiled for the aot target `name`: kernels a layer, cache copies."""
    import re

    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from flaxgpt.aot import hlo_cost, targets

    mesh = Mesh(np.array(targets.get(name).devices()[:1]), ("x",))
    one = NamedSharding(mesh, PartitionSpec())
    for shape_name, ((J, G, K), cases) in shapes.items():
        for S, pos in cases:
            bf16 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=one)  # noqa: E731
            new = bf16((LAYERS, 1, 1, J, K))
            args = (
                bf16((LAYERS, 1, 1, J * G, K)),
                new,
                new,
                jax.ShapeDtypeStruct((1, 1), jnp.int32, sharding=one),
            )
            args += ([bf16((J, S, K))] * LAYERS,) * 2
            for kernels in (False, True):
                with jax.set_mesh(mesh):  # the kernels' target is the mesh's (flaxgpt.kernels.target)
                    text = program(LAYERS, kernels).lower(*args).compile().as_text()
                cost = hlo_cost.estimate(text, 989e12, 3.35e12)
                copies = len(re.findall(rf"= bf16\[{J},{S},{K}\]\{{[^}}]*\}} copy\(", text))
                row = dict(shape=shape_name, S=S, pos=pos, form="kernel" if kernels else "xla")
                print(
                    json.dumps(dict(row, kernels_a_layer=cost.kernels / LAYERS, cache_copies=copies)),
                    flush=True,
                )
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="every row as JSON")
    ap.add_argument("--dry_run", action="store_true", help="tiny shapes on the CPU, the kernel interpreted")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument(
        "--compile_for", metavar="TARGET", help="compile for a flaxgpt aot target (h100-1), run nothing"
    )
    a = ap.parse_args(argv)
    if a.compile_for:
        return compile_for(a.compile_for, SHAPES)
    shapes, layers = (DRY, 2) if a.dry_run else (SHAPES, LAYERS)
    rows = []
    head = f"{'shape':<12} {'S':>5} {'pos':>5} {'XLA us':>8} {'kernel us':>9} {'speedup':>7}"
    print(head, f"{'kernel GB/s':>11} err")
    for name, (shape, cases) in shapes.items():
        for S, pos in cases:
            xla, y_xla = time_form(shape, S, pos, False, layers, a.repeats)
            kernel, y_kernel = time_form(shape, S, pos, True, layers, a.repeats)
            err = float(
                jnp.linalg.norm((y_kernel - y_xla).astype(jnp.float32))
                / jnp.linalg.norm(y_xla.astype(jnp.float32))
            )
            kernel.update(err=float(f"{err:.2e}"), ok=err < TOL, speedup=round(xla["us"] / kernel["us"], 3))
            rows += [dict(xla, shape=name), dict(kernel, shape=name)]
            print(f"{name:<12} {S:>5} {pos:>5} {xla['us']:>8} {kernel['us']:>9} {kernel['speedup']:>7} "
                  f"{kernel['gbps']:>11} {kernel['err']}", flush=True)  # fmt: skip
            if a.json:
                a.json.parent.mkdir(parents=True, exist_ok=True)
                a.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r.get("ok", True) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
