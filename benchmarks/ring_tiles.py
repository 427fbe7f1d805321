"""The ring attention's work unit on the CPU: nanoseconds a logit of one tile's forward and backward
(context_attention._block_tile, _block_grads_tile) against the tile's shape (issue #53).

    python benchmarks/ring_tiles.py                       # 512 x 4096 ... 128 x 128 tiles, 4 heads of 16
    python benchmarks/ring_tiles.py --heads 32 --head_dim 128 --tiles 512x512,256x512

Before CPU_TILES a block's tile was [heads, 512 queries, S keys] with S = the tokens a device holds,
so it grew with the sequence and left the caches; the time a logit of such tiles against fixed small
ones is why the training step grew faster than its attention FLOPs (docs/benchmarks.md). Each tile's
two programs are timed in rounds (the best of --rounds, each the mean of enough calls to cover 2^23
logits), unmasked: every key is before every query.
"""

from __future__ import annotations

import argparse
import time

import harness  # noqa: F401  (first: the benchmarks' one sys.path rule, see harness.py)


def programs(L: int, S: int, heads: int, head_dim: int):
    """The jitted forward and backward of an [heads, L, S] tile and their arguments."""
    import jax
    import jax.numpy as jnp

    from flaxgpt.models import context_attention as ca

    kw = dict(scale=head_dim**-0.5, softcap=0.0, window=0, packed=False)
    r = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(r[0], (1, L, heads, 1, head_dim))
    k, v = (jax.random.normal(x, (1, S, heads, head_dim)) for x in r[1:3])
    q_pos, kv_pos = jnp.arange(L) + S, jnp.arange(S)
    q_seg, kv_seg = jnp.zeros((1, L), jnp.int32), jnp.zeros((1, S), jnp.int32)
    dy = jax.random.normal(r[3], (1, heads, 1, L, head_dim))
    lse, D = jnp.full((1, heads, 1, L), 5.0), jnp.zeros((1, heads, 1, L))
    fwd = jax.jit(lambda q, k, v: ca._block_tile(q, k, v, q_pos, kv_pos, q_seg, kv_seg, **kw))
    bwd = jax.jit(lambda *a: ca._block_grads_tile(*a[:3], q_pos, kv_pos, q_seg, kv_seg, *a[3:], **kw))
    return (fwd, (q, k, v)), (bwd, (q, k, v, dy, lse, D))


def main():
    import jax

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", default="512x4096,512x2048,512x1024,512x512,256x512,256x256,128x512,128x128",
                    help="queries x keys a tile, comma-separated")  # fmt: skip
    ap.add_argument("--heads", type=int, default=4, help="heads (the benchmark model's 4)")
    ap.add_argument("--head_dim", type=int, default=16, help="head width (the benchmark model's 16)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over every tile; the best is kept")
    args = ap.parse_args()
    tiles = [tuple(int(x) for x in t.split("x")) for t in args.tiles.split(",")]
    progs = {t: programs(*t, args.heads, args.head_dim) for t in tiles}
    best = {t: [float("inf")] * 2 for t in tiles}
    for _ in range(args.rounds):  # rounds over every tile: a busy spell of the machine hits all of them
        for t in tiles:
            logits = t[0] * t[1] * args.heads
            for i, (fn, fn_args) in enumerate(progs[t]):
                jax.block_until_ready(fn(*fn_args))
                calls = max(2, 2**23 // logits)
                t0 = time.perf_counter()
                for _ in range(calls):
                    jax.block_until_ready(fn(*fn_args))
                best[t][i] = min(best[t][i], (time.perf_counter() - t0) / calls / logits * 1e9)
    print("| tile (queries x keys) | float32 logits | forward ns a logit | backward ns a logit |")
    print("| --- | ---: | ---: | ---: |")
    for t in tiles:
        mib = t[0] * t[1] * args.heads * 4 / 2**20
        print(f"| {t[0]} x {t[1]} | {mib:g} MiB | {best[t][0]:.1f} | {best[t][1]:.1f} |")


if __name__ == "__main__":
    main()
