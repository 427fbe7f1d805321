"""Attention over the mesh's "context" axis, which splits every sequence of a batch over its devices
(flaxgpt.sharding.make_mesh(context=N)): the load-balanced ring and the all-to-all over heads (Ulysses),
picked by GPTConfig.context_impl. SelfAttention calls `attend` when the mesh it is traced for has a
context axis of more than one device; the rest of the model is unchanged (the rules table splits its
activations' "length" axis over "context", so positions, RoPE and the MLP are split as data).

ring (Liu et al. 2023, load-balanced as MaxText and torchtitan do): each sequence, cut into 2N chunks,
lies on the devices in order (device d: chunks 2d and 2d+1); inside the attention every device trades
for chunks d and 2N-1-d (two ppermutes, undone on the way out), so under the causal mask each device
has the same work. The batch itself is not permuted: the model sees its sequence in order. Keys and
values then go round the ring (ppermute d -> d+1, N-1 times); each device merges the blocks' softmax
in float32 with a running max and sum (the online softmax). A visiting block from an earlier device
is seen whole by our queries through its first chunk only, one from a later device only by our second
chunk: each step computes a quarter of the [2C, 2C] block pair, as the causal mask leaves it.
Windows and packed documents (segment ids, travelling with the keys) are masks on the tokens' global
positions, so they hold across chunk boundaries. The backward is written out (a custom_vjp, as flash
attention's): the forward keeps only its own q, k, v, output and log-sum-exp; the keys and values go
round again, each block's softmax is recomputed, and its dK, dV travel with it back home, so no device
ever holds more than its own and one visiting block.

ulysses (Jacobs et al. 2023): an all-to-all turns the sequence split into a head split, each device
attends H/N heads over the whole sequence with the ordinary kernel (attention.attend, handed in as
`local_attend`: XLA, cuDNN or splash), and a second all-to-all turns it back. N must divide the heads.

Shape letters: as attention.py (B, T, H, J, G, K); N the context devices, C = T / 2N a chunk, L = 2C
the tokens a device holds, S the keys of a block.
On the CPU a block is also cut along its keys (CPU_TILES): the step's time then grows as its
attention FLOPs do, since a tile's logits stay in the caches whatever the sequence length
(docs/benchmarks.md, the long-context section).
May import: flaxgpt.kernels.target (the platform traced for picks the tiles); attention.py hands
Ulysses its within-device attention.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from flaxgpt.kernels import target

CONTEXT_AXIS = "context"  # the mesh axis that splits sequences (flaxgpt.sharding.make_mesh)
CONTEXT_IMPLS = ("ring", "ulysses")
# masked logits: finite, so a query row that sees no key of a block keeps a finite running max
_NEG = -1e30
Q_TILE = 512  # queries a ring block computes at once: [B, H, Q_TILE, S] float32 logits, not [B, H, L, S]
# On the CPU: (queries, keys) a tile, the keys' softmax merged online. A tile's [B, H, 256, 512] float32
# logits (2 MiB at 4 heads) stay in L2/L3 at any length, where [B, H, 512, S] outgrew them as S grew:
# 4.0 / 8.8 ns a logit forward / backward at 256 x 512 against 20.5 / 40.9 at 512 x 4,096 (4 heads of
# 16, benchmarks/ring_tiles.py, 2-core AVX-512 EPYC, loaded). 0 keys: the whole block. Accelerators
# keep (Q_TILE, 0).
CPU_TILES = (256, 512)


def axis_size() -> int:
    """Devices on the "context" axis of the mesh being traced for (1: none)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or CONTEXT_AXIS not in mesh.axis_names else mesh.shape[CONTEXT_AXIS]


def check(T: int, H: int, n: int, impl: str) -> None:
    """One-line errors for a sequence of T tokens and H query heads over n context devices. Lengths
    that do not divide are refused, never padded: padding would change what the loss counts."""
    if impl not in CONTEXT_IMPLS:
        raise ValueError(f"unknown context_impl {impl!r}; choose one of {CONTEXT_IMPLS}")
    if impl == "ring" and T % (2 * n):
        raise ValueError(
            f"sequence length {T} is not divisible by 2 x mesh.context = {2 * n} (ring attention's load "
            f"balancing cuts each sequence into {2 * n} chunks); use a length that is a multiple of {2 * n}"
        )
    bad = [f"{what} {size}" for what, size in (("n_head", H), ("sequence length", T)) if size % n]
    if impl == "ulysses" and bad:
        raise ValueError(
            f"context_impl=ulysses splits the heads and the tokens over mesh.context = {n}, which does not "
            f"divide {' or '.join(bad)}; use context_impl=ring or another mesh.context"
        )


def attend(
    q_BTHK,
    k_BTJK,
    v_BTJK,
    segment_ids_BT=None,
    *,
    impl="ring",
    window=0,
    scale=0.0,
    softcap=0.0,
    local_attend=None,
):
    """Causal self-attention of sequences split over the mesh's context axis -> [B, T, H, K].

    `segment_ids_BT` (packed rows) keeps each query inside its document; `window` limits it to its
    last `window` keys; `scale` 0 = 1/sqrt(K); `softcap` as attention.attend. `local_attend(q, k, v,
    segment_ids)` is the within-device attention Ulysses runs on the whole sequence (H / N heads)."""
    mesh = jax.sharding.get_abstract_mesh()
    n = mesh.shape[CONTEXT_AXIS]
    B, T, H, K = q_BTHK.shape
    check(T, H, n, impl)
    packed = segment_ids_BT is not None
    seg_BT = segment_ids_BT if packed else jnp.zeros((B, T), jnp.int32)
    rows = tuple(a for a in mesh.axis_names if a != CONTEXT_AXIS) or None
    tokens, heads = P(rows, CONTEXT_AXIS), P(rows, CONTEXT_AXIS, None, None)
    if impl == "ring":
        scale = scale or 1.0 / math.sqrt(K)
        fn = functools.partial(_ring, n=n, window=window, scale=scale, softcap=softcap, packed=packed)
    else:
        fn = functools.partial(_ulysses, n=n, local_attend=local_attend, packed=packed)
    return jax.shard_map(fn, mesh=mesh, in_specs=(heads, heads, heads, tokens), out_specs=heads)(
        q_BTHK, k_BTJK, v_BTJK, seg_BT
    )


# ----------------------------------------------------------------------------- the load-balanced layout


def _home(c: int, n: int) -> int:
    """The device that holds chunk c (of 2n) in the balanced layout: chunks d and 2n-1-d on device d."""
    return c if c < n else 2 * n - 1 - c


def _permutations(n: int):
    """(even, odd): where each device's first (chunk 2d) and second (chunk 2d+1) chunk go. Each is a
    permutation of the devices: even chunks land on the even devices below n (as chunk d) and on the
    odd ones (as chunk 2n-1-d), odd chunks the other way round."""
    return [(d, _home(2 * d, n)) for d in range(n)], [(d, _home(2 * d + 1, n)) for d in range(n)]


def _to_balanced(x_BL, d, n: int):
    """[B, L, ...] holding chunks 2d, 2d+1 -> chunks d, 2n-1-d."""
    even, odd = _permutations(n)
    first, second = jnp.split(x_BL, 2, axis=1)
    a = jax.lax.ppermute(first, CONTEXT_AXIS, even)
    b = jax.lax.ppermute(second, CONTEXT_AXIS, odd)
    # an even device's chunk d is even, so it came by the first permutation; an odd device's by the second
    return jnp.where(d % 2 == 0, jnp.concatenate([a, b], 1), jnp.concatenate([b, a], 1))


def _from_balanced(x_BL, d, n: int):
    """The inverse of _to_balanced: [B, L, ...] holding chunks d, 2n-1-d -> chunks 2d, 2d+1."""
    even, odd = _permutations(n)
    first, second = jnp.split(x_BL, 2, axis=1)
    even_chunk = jnp.where(d % 2 == 0, first, second)
    odd_chunk = jnp.where(d % 2 == 0, second, first)
    a = jax.lax.ppermute(even_chunk, CONTEXT_AXIS, [(dst, src) for src, dst in even])
    b = jax.lax.ppermute(odd_chunk, CONTEXT_AXIS, [(dst, src) for src, dst in odd])
    return jnp.concatenate([a, b], 1)


def _positions(d, n: int, C: int):
    """[L] the sequence positions of the tokens device d holds in the balanced layout."""
    return jnp.concatenate([d * C + jnp.arange(C), (2 * n - 1 - d) * C + jnp.arange(C)])


# ----------------------------------------------------------------------------- ring


def _ring(q_BLHK, k_BLJK, v_BLJK, seg_BL, *, n, window, scale, softcap, packed):
    """One device's part of the ring (inside shard_map over the context axis)."""
    d = jax.lax.axis_index(CONTEXT_AXIS)
    q_BLHK, k_BLJK, v_BLJK = (_to_balanced(x, d, n) for x in (q_BLHK, k_BLJK, v_BLJK))
    seg_BL = _to_balanced(seg_BL, d, n) if packed else seg_BL  # unread unless packed
    B, L, H, K = q_BLHK.shape
    q_BLJGK = q_BLHK.reshape(B, L, k_BLJK.shape[2], -1, K)  # query head h reads key/value head h // G
    y_BJGLK = _ring_core(q_BLJGK, k_BLJK, v_BLJK, seg_BL, (n, window, scale, softcap, packed))
    y_BLHK = jnp.transpose(y_BJGLK, (0, 3, 1, 2, 4)).reshape(B, L, H, K).astype(q_BLHK.dtype)
    return _from_balanced(y_BLHK, d, n)


def _ring_setup(q_BLJGK, cfg):
    """(d, C, positions [L] of this device's tokens, the block statistics function, the ring's pairs)."""
    n, window, scale, softcap, packed = cfg
    d, C = jax.lax.axis_index(CONTEXT_AXIS), q_BLJGK.shape[1] // 2
    blocks = functools.partial(_block, scale=scale, softcap=softcap, window=window, packed=packed)
    return d, C, _positions(d, n, C), blocks, [(i, (i + 1) % n) for i in range(n)]


def _ring_forward(q_BLJGK, k_BLJK, v_BLJK, seg_BL, cfg):
    return _ring_fwd(q_BLJGK, k_BLJK, v_BLJK, seg_BL, cfg)[0]


def _ring_fwd(q_BLJGK, k_BLJK, v_BLJK, seg_BL, cfg):
    """Softmax attention over every device's keys -> (output [B, J, G, L, K] in float32, residuals)."""
    n, packed = cfg[0], cfg[4]
    d, C, pos_L, blocks, ring = _ring_setup(q_BLJGK, cfg)
    # the device's own keys first (causal inside), then the others' as they come round the ring
    state = blocks(q_BLJGK, k_BLJK, v_BLJK, pos_L, pos_L, seg_BL, seg_BL)

    def step(carry):  # a loop, not unrolled: one block program whatever N
        i, state, kv = carry
        kv = tuple(jax.lax.ppermute(x, CONTEXT_AXIS, ring) for x in kv)
        src = (d - i) % n  # the device these keys started on
        kv_seg_BL = kv[2] if packed else seg_BL
        src_pos_L = _positions(src, n, C)
        stats = _visit(q_BLJGK, kv[0], kv[1], kv_seg_BL, pos_L, src_pos_L, seg_BL, src < d, blocks=blocks)
        return i + 1, _merge(state, stats), kv

    kv = (k_BLJK, v_BLJK, seg_BL) if packed else (k_BLJK, v_BLJK)  # segment ids travel with their keys
    # a while loop, not a scan: in a scanned model (scan_layers) JAX 0.10 partially evaluates this
    # forward's scan as if it were differentiated and keeps every step's masks and logits (and every
    # query tile's) as residuals, [N-1, tiles, ...]: 109 GB a GPU for one Llama-3-8B layer at 128k
    # tokens over 8. A while loop is one unit to it (and could not be differentiated by mistake).
    start = jnp.asarray(1, jnp.int32)
    _, (m_BJGL, l_BJGL, o_BJGLK), _ = jax.lax.while_loop(lambda c: c[0] < n, step, (start, state, kv))
    y_BJGLK = o_BJGLK / l_BJGL[..., None]  # every query sees at least its own key: l > 0
    lse_BJGL = m_BJGL + jnp.log(l_BJGL)
    return y_BJGLK, (q_BLJGK, k_BLJK, v_BLJK, seg_BL, y_BJGLK, lse_BJGL)


def _ring_bwd(cfg, res, dy_BJGLK):
    """The ring's backward, flash-style: keys and values go round again, each block's softmax is
    recomputed from the saved log-sum-exp, and the block's dK, dV travel with it back to its device
    (N hops in all), so no device keeps the other devices' keys."""
    n, scale, softcap, packed = cfg[0], cfg[2], cfg[3], cfg[4]
    q_BLJGK, k_BLJK, v_BLJK, seg_BL, y_BJGLK, lse_BJGL = res
    d, C, pos_L, _, ring = _ring_setup(q_BLJGK, cfg)
    grads = functools.partial(_block_grads, scale=scale, softcap=softcap, window=cfg[1], packed=packed)
    D_BJGL = jnp.sum(dy_BJGLK * y_BJGLK, axis=-1)  # softmax backward's row term: sum_k dy y
    q_side = (dy_BJGLK, lse_BJGL, D_BJGL)
    dq_BLJGK, dk_BLJK, dv_BLJK = grads(q_BLJGK, k_BLJK, v_BLJK, pos_L, pos_L, seg_BL, seg_BL, *q_side)

    def step(carry, i):
        dq_BLJGK, kv, dkv = carry
        kv, dkv = (tuple(jax.lax.ppermute(x, CONTEXT_AXIS, ring) for x in xs) for xs in (kv, dkv))
        src = (d - i) % n
        kv_seg_BL = kv[2] if packed else seg_BL
        args = (q_BLJGK, kv[0], kv[1], kv_seg_BL, pos_L, _positions(src, n, C), seg_BL, q_side)
        dq, dk, dv = _visit_grads(*args, src < d, grads=grads)
        return (dq_BLJGK + dq, kv, (dkv[0] + dk, dkv[1] + dv)), None

    kv = (k_BLJK, v_BLJK, seg_BL) if packed else (k_BLJK, v_BLJK)
    (dq_BLJGK, _, dkv), _ = jax.lax.scan(step, (dq_BLJGK, kv, (dk_BLJK, dv_BLJK)), jnp.arange(1, n))
    # the block held last came from device d + 1: one more hop brings its dK, dV home
    dk_BLJK, dv_BLJK = (jax.lax.ppermute(x, CONTEXT_AXIS, ring) for x in dkv)
    cast = lambda g, x: g.astype(x.dtype)  # noqa: E731
    return cast(dq_BLJGK, q_BLJGK), cast(dk_BLJK, k_BLJK), cast(dv_BLJK, v_BLJK), None


_ring_core = jax.custom_vjp(_ring_forward, nondiff_argnums=(4,))
_ring_core.defvjp(_ring_fwd, _ring_bwd)


def _visit(q_BLJGK, k_BLJK, v_BLJK, kv_seg_BL, q_pos_L, kv_pos_L, q_seg_BL, earlier, *, blocks):
    """The softmax statistics of our queries against another device's block, computing only the
    quarter the causal mask leaves: from an earlier device (`earlier`), every query of ours sees its
    first chunk and none its second (later than all of ours); from a later one, only our second chunk
    sees it, both of its chunks."""
    C = q_BLJGK.shape[1] // 2

    def from_earlier():
        k, v, pos, seg = k_BLJK[:, :C], v_BLJK[:, :C], kv_pos_L[:C], kv_seg_BL[:, :C]
        return blocks(q_BLJGK, k, v, q_pos_L, pos, q_seg_BL, seg)

    def from_later():
        stats = blocks(q_BLJGK[:, C:], k_BLJK, v_BLJK, q_pos_L[C:], kv_pos_L, q_seg_BL[:, C:], kv_seg_BL)
        m, total, o = stats
        none = (jnp.full_like(m, _NEG), jnp.zeros_like(total), jnp.zeros_like(o))  # our first chunk: nothing
        return tuple(jnp.concatenate([e, x], axis=3) for e, x in zip(none, stats))

    return jax.lax.cond(earlier, from_earlier, from_later)


def _visit_grads(q_BLJGK, k_BLJK, v_BLJK, kv_seg_BL, q_pos_L, kv_pos_L, q_seg_BL, q_side, earlier, *, grads):
    """_visit's backward: (dq [B, L, J, G, K], dk, dv [B, L, J, K]) of the same quarter."""
    C = q_BLJGK.shape[1] // 2

    def from_earlier():  # every query, the block's first chunk: its second chunk's dk, dv are 0
        k, v, pos, seg = k_BLJK[:, :C], v_BLJK[:, :C], kv_pos_L[:C], kv_seg_BL[:, :C]
        dq, dk, dv = grads(q_BLJGK, k, v, q_pos_L, pos, q_seg_BL, seg, *q_side)
        return dq, jnp.concatenate([dk, jnp.zeros_like(dk)], 1), jnp.concatenate([dv, jnp.zeros_like(dv)], 1)

    def from_later():  # our second chunk's queries, the whole block: our first chunk's dq is 0
        later = tuple(x[:, :, :, C:] for x in q_side)  # [B, J, G, L, ...] rows of the second chunk
        dq, dk, dv = grads(
            q_BLJGK[:, C:], k_BLJK, v_BLJK, q_pos_L[C:], kv_pos_L, q_seg_BL[:, C:], kv_seg_BL, *later
        )
        return jnp.concatenate([jnp.zeros_like(dq), dq], 1), dk, dv

    return jax.lax.cond(earlier, from_earlier, from_later)


def _visible(q_pos_L, kv_pos_S, q_seg_BL, kv_seg_BS, window, packed):
    """[B, 1, 1, L, S] True where a query may see a key: causal by their sequence positions, within the
    window, in the same document."""
    visible_LS = kv_pos_S[None, :] <= q_pos_L[:, None]
    if window:
        visible_LS &= kv_pos_S[None, :] > q_pos_L[:, None] - window
    visible_BLS = visible_LS[None]
    if packed:  # no query sees another document's keys
        visible_BLS = visible_BLS & (q_seg_BL[:, :, None] == kv_seg_BS[:, None, :])
    return visible_BLS[:, None, None]


def _tiles(L: int, S: int) -> tuple[int, int]:
    """(query tiles, key tiles) a block of L queries and S keys is taken in: [Q_TILE, S] logits at a
    time on accelerators (at 128k tokens over 8 devices a device's whole block would be 34 GB of float32
    logits a head group), CPU_TILES on the CPU; 1 where the block is no longer than a tile or a tile
    does not divide it."""
    q_tile, kv_tile = CPU_TILES if target.platform() == "cpu" else (Q_TILE, 0)
    count = lambda n, tile: n // tile if tile and n > tile and n % tile == 0 else 1  # noqa: E731
    return count(L, q_tile), count(S, kv_tile)


def _seen(q_pos_L, kv_pos_S, window):
    """Whether any query of a tile may see any key of it (causal, window): else the tile is skipped."""
    seen = jnp.min(kv_pos_S) <= jnp.max(q_pos_L)
    return seen & (jnp.max(kv_pos_S) > jnp.min(q_pos_L) - window) if window else seen


def _key_tiles(nk: int, k_BSJK, v_BSJK, kv_pos_S, kv_seg_BS):
    """The keys' side of a block in nk tiles, the tiles first."""
    return (
        _split_tiles(k_BSJK, 1, nk),
        _split_tiles(v_BSJK, 1, nk),
        kv_pos_S.reshape(nk, -1),
        _split_tiles(kv_seg_BS, 1, nk),
    )


def _block(q_BLJGK, k_BSJK, v_BSJK, q_pos_L, kv_pos_S, q_seg_BL, kv_seg_BS, **kw):
    """_block_tile over query tiles in sequence (lax.map), each over the key tiles in sequence (a while
    loop merging their softmax statistics online; tiles no query sees skipped): each query's statistics
    are its own."""
    nq, nk = _tiles(q_BLJGK.shape[1], k_BSJK.shape[1])
    keys = _key_tiles(nk, k_BSJK, v_BSJK, kv_pos_S, kv_seg_BS)

    def row(q_BLJGK, q_pos_L, q_seg_BL):  # one query tile against every key tile
        if nk == 1:
            return _block_tile(q_BLJGK, k_BSJK, v_BSJK, q_pos_L, kv_pos_S, q_seg_BL, kv_seg_BS, **kw)
        acc = jnp.promote_types(q_BLJGK.dtype, jnp.float32)
        o_BJGLK = jnp.zeros_like(jnp.moveaxis(q_BLJGK, 1, 3), acc)  # _like: varying over the mesh as q
        none = (o_BJGLK[..., 0] + _NEG, o_BJGLK[..., 0], o_BJGLK)  # no key seen yet

        def step(carry):
            i, state = carry
            k, v, pos, seg = (x[i] for x in keys)
            seen = _seen(q_pos_L, pos, kw["window"])
            stats = jax.lax.cond(seen, lambda: _block_tile(q_BLJGK, k, v, q_pos_L, pos, q_seg_BL, seg, **kw),
                                 lambda: none)  # fmt: skip
            return i + 1, _merge(state, stats)

        # a while loop, not a scan, as _ring_fwd's: in a scanned model a scan here kept every key tile's
        # logits as residuals of the forward
        return jax.lax.while_loop(lambda c: c[0] < nk, step, (jnp.asarray(0, jnp.int32), none))[1]

    if nq == 1:
        return row(q_BLJGK, q_pos_L, q_seg_BL)
    tiles = (_split_tiles(q_BLJGK, 1, nq), q_pos_L.reshape(nq, -1), _split_tiles(q_seg_BL, 1, nq))
    stats = jax.lax.map(lambda t: row(*t), tiles)  # [nq, B, J, G, tile, ...]
    return tuple(_join_tiles(x, 3) for x in stats)


def _split_tiles(x, axis: int, nt: int):
    """x with its `axis` cut into nt tiles, the tiles first: [nt, ..., L / nt, ...]."""
    shape = (*x.shape[:axis], nt, x.shape[axis] // nt, *x.shape[axis + 1 :])
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _join_tiles(x, axis: int):
    """_split_tiles undone: [nt, ..., tile (at `axis`), ...] -> [..., nt * tile, ...]."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2 :])


def _block_tile(
    q_BLJGK, k_BSJK, v_BSJK, q_pos_L, kv_pos_S, q_seg_BL, kv_seg_BS, *, scale, softcap, window, packed
):
    """Queries against one block of keys -> (max [B, J, G, L], sum [B, J, G, L], unnormalised output
    [B, J, G, L, K]) of the masked softmax, in float32 (float64 for float64).

    The seam for a fused kernel: on TPU or GPU a splash or cuDNN call that returns the block's output
    and its log-sum-exp would replace this (m = lse, l = 1, o = output); not wired, not measured."""
    acc = jnp.promote_types(q_BLJGK.dtype, jnp.float32)
    logits_BJGLS = jnp.einsum("bljgk,bsjk->bjgls", q_BLJGK, k_BSJK, preferred_element_type=acc) * scale
    if softcap:
        logits_BJGLS = softcap * jnp.tanh(logits_BJGLS / softcap)
    visible_B11LS = _visible(q_pos_L, kv_pos_S, q_seg_BL, kv_seg_BS, window, packed)
    logits_BJGLS = jnp.where(visible_B11LS, logits_BJGLS, _NEG)
    m_BJGL = jnp.max(logits_BJGLS, axis=-1)
    p_BJGLS = jnp.where(visible_B11LS, jnp.exp(logits_BJGLS - m_BJGL[..., None]), 0.0)
    o_BJGLK = jnp.einsum(
        "bjgls,bsjk->bjglk", p_BJGLS.astype(v_BSJK.dtype), v_BSJK, preferred_element_type=acc
    )
    return m_BJGL, jnp.sum(p_BJGLS, axis=-1), o_BJGLK


def _block_grads(q_BLJGK, k_BSJK, v_BSJK, q_pos_L, kv_pos_S, q_seg_BL, kv_seg_BS, dy_BJGLK, lse_BJGL, D_BJGL,
                 **kw):  # fmt: skip
    """_block_grads_tile over query tiles in sequence (a scan), each over the key tiles in sequence (a
    scan, tiles no query sees skipped): dq summed over the key tiles, dk and dv over the query tiles."""
    nq, nk = _tiles(q_BLJGK.shape[1], k_BSJK.shape[1])
    keys = _key_tiles(nk, k_BSJK, v_BSJK, kv_pos_S, kv_seg_BS)
    acc = jnp.promote_types(q_BLJGK.dtype, jnp.float32)

    def row(q, pos, seg, dy, lse, D):  # one query tile against every key tile -> dq, dk [B, S, J, K], dv
        if nk == 1:
            return _block_grads_tile(q, k_BSJK, v_BSJK, pos, kv_pos_S, seg, kv_seg_BS, dy, lse, D, **kw)

        def step(dq, key):
            k, v, kv_pos, kv_seg = key
            grads = lambda: _block_grads_tile(q, k, v, pos, kv_pos, seg, kv_seg, dy, lse, D, **kw)  # noqa: E731
            zeros = lambda: (jnp.zeros_like(q, acc), jnp.zeros_like(k, acc), jnp.zeros_like(v, acc))  # noqa: E731
            dq_t, dk, dv = jax.lax.cond(_seen(pos, kv_pos, kw["window"]), grads, zeros)
            return dq + dq_t, (dk, dv)

        dq, (dk, dv) = jax.lax.scan(step, jnp.zeros_like(q, acc), keys)
        return dq, _join_tiles(dk, 1), _join_tiles(dv, 1)

    if nq == 1:
        return row(q_BLJGK, q_pos_L, q_seg_BL, dy_BJGLK, lse_BJGL, D_BJGL)
    tiles = (
        _split_tiles(q_BLJGK, 1, nq), q_pos_L.reshape(nq, -1), _split_tiles(q_seg_BL, 1, nq),
        _split_tiles(dy_BJGLK, 3, nq), _split_tiles(lse_BJGL, 3, nq), _split_tiles(D_BJGL, 3, nq),
    )  # fmt: skip

    def step(dkv, t):
        dq, dk, dv = row(*t)
        return (dkv[0] + dk, dkv[1] + dv), dq

    zeros = jnp.zeros_like(k_BSJK, acc), jnp.zeros_like(v_BSJK, acc)  # _like: varying over the mesh as k
    (dk_BSJK, dv_BSJK), dq_tiles = jax.lax.scan(step, zeros, tiles)
    return _join_tiles(dq_tiles, 1), dk_BSJK, dv_BSJK


def _block_grads_tile(q_BLJGK, k_BSJK, v_BSJK, q_pos_L, kv_pos_S, q_seg_BL, kv_seg_BS, dy_BJGLK, lse_BJGL,
                      D_BJGL, *, scale, softcap, window, packed):  # fmt: skip
    """The gradients of one block's share of the attention -> (dq [B, L, J, G, K], dk, dv [B, S, J, K]),
    its softmax recomputed from the whole row's log-sum-exp (`lse_BJGL`); `D_BJGL` = sum(dy * y)."""
    acc = jnp.promote_types(q_BLJGK.dtype, jnp.float32)
    q, k, v = (x.astype(acc) for x in (q_BLJGK, k_BSJK, v_BSJK))
    logits_BJGLS = jnp.einsum("bljgk,bsjk->bjgls", q, k) * scale
    if softcap:
        logits_BJGLS = softcap * jnp.tanh(logits_BJGLS / softcap)
    visible_B11LS = _visible(q_pos_L, kv_pos_S, q_seg_BL, kv_seg_BS, window, packed)
    p_BJGLS = jnp.where(visible_B11LS, jnp.exp(logits_BJGLS - lse_BJGL[..., None]), 0.0)
    dv_BSJK = jnp.einsum("bjgls,bjglk->bsjk", p_BJGLS, dy_BJGLK)
    dp_BJGLS = jnp.einsum("bjglk,bsjk->bjgls", dy_BJGLK, v)
    ds_BJGLS = p_BJGLS * (dp_BJGLS - D_BJGL[..., None])
    if softcap:  # d(cap tanh(x / cap)) / dx = 1 - tanh^2
        ds_BJGLS = ds_BJGLS * (1.0 - jnp.square(logits_BJGLS / softcap))
    ds_BJGLS = ds_BJGLS * scale
    dq_BLJGK = jnp.einsum("bjgls,bsjk->bljgk", ds_BJGLS, k)
    dk_BSJK = jnp.einsum("bjgls,bljgk->bsjk", ds_BJGLS, q)
    return dq_BLJGK, dk_BSJK, dv_BSJK


def _merge(a, b):
    """Two blocks' softmax statistics of the same queries -> those of both (the online softmax)."""
    (m_a, l_a, o_a), (m_b, l_b, o_b) = a, b
    m = jnp.maximum(m_a, m_b)
    w_a, w_b = jnp.exp(m_a - m), jnp.exp(m_b - m)
    return m, l_a * w_a + l_b * w_b, o_a * w_a[..., None] + o_b * w_b[..., None]


# ----------------------------------------------------------------------------- Ulysses


def _ulysses(q_BLHK, k_BLJK, v_BLJK, seg_BL, *, n, local_attend, packed):
    """One device's part of Ulysses: its H / N heads over the whole sequence, in order."""
    H, J = q_BLHK.shape[2], k_BLJK.shape[2]
    if J % n:  # fewer key/value heads than devices (grouped-query): each device takes its query heads' own
        k_BLJK, v_BLJK = jnp.repeat(k_BLJK, H // J, axis=2), jnp.repeat(v_BLJK, H // J, axis=2)

    def to_heads(x_BLHK):  # [B, T/N, h, K] -> [B, T, h/N, K]: device i sends head group j to device j
        return jax.lax.all_to_all(x_BLHK, CONTEXT_AXIS, split_axis=2, concat_axis=1, tiled=True)

    seg_BT = jax.lax.all_gather(seg_BL, CONTEXT_AXIS, axis=1, tiled=True) if packed else None
    # head groups are contiguous, so the key/value heads a device holds are its query heads' (h // G)
    y_BTHK = local_attend(to_heads(q_BLHK), to_heads(k_BLJK), to_heads(v_BLJK), seg_BT)
    return jax.lax.all_to_all(y_BTHK, CONTEXT_AXIS, split_axis=1, concat_axis=2, tiled=True)
