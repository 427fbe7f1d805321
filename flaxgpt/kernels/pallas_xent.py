"""linear_xent's statistics and their backward as Pallas kernels for GPU (the Triton backend).

    lse, target, total, entropy = forward(spec, x_ND, w, targets_N, interpret)
    dx_ND, dw = backward(spec, x_ND, w, targets_N, lse_N, entropy_N, g, interpret)

The same math as kernels/linear_xent.py (its docstring has it), with the blocks of logits never leaving
the chip: the XLA form writes every [N, block] block of logits to HBM and reads it back in the next
fusion (forward and backward), these kernels keep a [ROWS, COLS] tile in registers between its product
and its reduction. Three kernels, as FlashAttention-2's backward: the forward (a program per ROWS
tokens, looping over the vocabulary with the online log-sum-exp), dx (the same grid, accumulating
d logits @ w^T) and dw (a program per COLS columns, looping over the tokens, accumulating x^T d logits),
each recomputing its tiles' logits. Products take DEPTH features at a time, so D need only be a
multiple of DEPTH (GPT-2's 768 = 6 x 128), not a power of two as a Triton tile must be.

Why Triton rather than Mosaic GPU: the kernels are tiles of products and elementwise math, which the
Triton backend compiles for every NVIDIA card JAX supports (Ampere's A100 too), and which Pallas runs
in interpret mode on the CPU (how tests/kernels checks them); Mosaic GPU targets Hopper's warpgroup
products only and is the place for a hand-scheduled GEMM, not yet for this.

`fits(N, D, V)` says when the tiles cover the shapes; linear_xent uses the XLA form otherwise.

Opt-in (FLAXGPT_XENT=pallas, linear_xent.pick_impl), not the default: compiled for an H100 it runs, but
every ROWS-token program streams the whole unembedding (GPT-2's 77 MB, more than the L2) once per
kernel, ~N / ROWS x D x V x 2 bytes a pass: HBM-bound well above the XLA form. Paying needs tiles of
both tokens and vocabulary on the grid with the log-sum-exp merged across vocabulary tiles (Apple's
Cut Cross-Entropy), which is what the next lease's measurement of this one is for.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# the largest tiles whose kernels fit an H100's 227 KiB of shared memory at D = 768 (flaxgpt aot
# --target h100-1: 64 x 128 asked for 288-480 KiB); dw's accumulators are D x COLS float32
ROWS = 32  # tokens per tile
COLS = 64  # vocabulary columns per tile
DEPTH = 128  # features per product step


def fits(n_tokens: int, n_features: int, vocab_size: int) -> bool:
    """Whether the tiles cover the shapes: N a multiple of ROWS, D of DEPTH, V at least COLS."""
    return n_tokens % ROWS == 0 and n_features % DEPTH == 0 and vocab_size >= COLS


def _start(spec, j):
    return jnp.minimum(j * COLS, spec.vocab_size - COLS)  # the last tile ends at V, as linear_xent's


def _raw(spec, x_ref, w_ref, rows, start):
    """x[rows] @ w[:, start:start+COLS] -> [ROWS, COLS] float32, DEPTH features at a time."""
    acc = jnp.zeros((ROWS, COLS), jnp.float32)
    for k in range(x_ref.shape[1] // DEPTH):
        feats = pl.ds(k * DEPTH, DEPTH)
        x_ = x_ref[rows, feats]
        if spec.layout == "DV":
            acc += plgpu.dot(x_, w_ref[feats, pl.ds(start, COLS)])
        else:
            acc += plgpu.dot(x_, w_ref[pl.ds(start, COLS), feats], trans_b=True)
    return acc


def _logits(spec, raw):
    if not spec.softcap:
        return raw * spec.scale, spec.scale
    t = jnp.tanh(raw / spec.softcap)
    return spec.scale * spec.softcap * t, spec.scale * (1.0 - t * t)


def _forward_kernel(spec, x_ref, w_ref, t_ref, lse_ref, tgt_ref, total_ref, entropy_ref):
    rows = pl.ds(pl.program_id(0) * ROWS, ROWS)
    t = t_ref[rows]

    def body(j, carry):
        m, s, e, total, tgt = carry  # e: sum p (z - m), as linear_xent's
        start = _start(spec, j)
        z, _ = _logits(spec, _raw(spec, x_ref, w_ref, rows, start))
        cols = start + jnp.arange(COLS)
        fresh = (cols >= j * COLS)[None, :]
        z0 = jnp.where(fresh, z, 0.0)
        m_new = jnp.maximum(m, jnp.max(jnp.where(fresh, z, -jnp.inf), axis=1))
        decay = jnp.exp(m - m_new)
        p = jnp.where(fresh, jnp.exp(z - m_new[:, None]), 0.0)
        hit = (cols[None, :] == t[:, None]) & fresh
        e = decay * (e + jnp.where(s > 0, (m - m_new) * s, 0.0)) + (
            p * jnp.where(fresh, z - m_new[:, None], 0.0)
        ).sum(1)
        return (m_new, s * decay + p.sum(1), e, total + z0.sum(1),
                tgt + jnp.where(hit, z, 0.0).sum(1))  # fmt: skip

    zero = jnp.zeros((ROWS,), jnp.float32)
    init = (jnp.full((ROWS,), -jnp.inf, jnp.float32), zero, zero, zero, zero)
    m, s, e, total, tgt = jax.lax.fori_loop(0, spec.n_blocks_of(COLS), body, init)
    lse_ref[rows] = m + jnp.log(s)
    tgt_ref[rows], total_ref[rows], entropy_ref[rows] = tgt, total, jnp.log(s) - e / s


def _dlogits(spec, x_ref, w_ref, rows, start, j, t, lse, entropy, g):
    """d loss / d raw logits of one tile [ROWS, COLS] in w's dtype (linear_xent's backward)."""
    g_lse, g_tgt, g_total, g_entropy = (gi[:, None] for gi in g)
    z, dz_draw = _logits(spec, _raw(spec, x_ref, w_ref, rows, start))
    cols = start + jnp.arange(COLS)
    logp = z - lse[:, None]
    p = jnp.exp(logp)
    dz = (g_lse - g_entropy * (logp + entropy[:, None])) * p + g_total
    dz = jnp.where(cols[None, :] == t[:, None], dz + g_tgt, dz)
    return (jnp.where((cols >= j * COLS)[None, :], dz, 0.0) * dz_draw).astype(w_ref.dtype)


def _dx_kernel(spec, x_ref, w_ref, t_ref, lse_ref, entropy_ref, *refs):
    *g_refs, dx_ref = refs
    rows = pl.ds(pl.program_id(0) * ROWS, ROWS)
    t, lse, entropy = t_ref[rows], lse_ref[rows], entropy_ref[rows]
    g = [r[rows] for r in g_refs]
    n_k = x_ref.shape[1] // DEPTH

    def body(j, accs):
        start = _start(spec, j)
        d = _dlogits(spec, x_ref, w_ref, rows, start, j, t, lse, entropy, g)
        out = []
        for k, acc in enumerate(accs):
            feats = pl.ds(k * DEPTH, DEPTH)
            if spec.layout == "DV":
                out.append(acc + plgpu.dot(d, w_ref[feats, pl.ds(start, COLS)], trans_b=True))
            else:
                out.append(acc + plgpu.dot(d, w_ref[pl.ds(start, COLS), feats]))
        return tuple(out)

    init = tuple(jnp.zeros((ROWS, DEPTH), jnp.float32) for _ in range(n_k))
    accs = jax.lax.fori_loop(0, spec.n_blocks_of(COLS), body, init)
    for k, acc in enumerate(accs):
        dx_ref[rows, pl.ds(k * DEPTH, DEPTH)] = acc.astype(dx_ref.dtype)


def _dw_kernel(spec, x_ref, w_ref, t_ref, lse_ref, entropy_ref, *refs):
    *g_refs, dw_ref = refs
    j = pl.program_id(0)
    start = _start(spec, j)
    n_k = x_ref.shape[1] // DEPTH

    def body(i, accs):
        rows = pl.ds(i * ROWS, ROWS)
        g = [r[rows] for r in g_refs]
        d = _dlogits(spec, x_ref, w_ref, rows, start, j, t_ref[rows], lse_ref[rows], entropy_ref[rows], g)
        out = []
        for k, acc in enumerate(accs):
            x_ = x_ref[rows, pl.ds(k * DEPTH, DEPTH)]
            out.append(
                acc
                + (plgpu.dot(x_, d, trans_a=True) if spec.layout == "DV" else plgpu.dot(d, x_, trans_a=True))
            )
        return tuple(out)

    shape = (DEPTH, COLS) if spec.layout == "DV" else (COLS, DEPTH)
    init = tuple(jnp.zeros(shape, jnp.float32) for _ in range(n_k))
    accs = jax.lax.fori_loop(0, x_ref.shape[0] // ROWS, body, init)
    fresh = start + jnp.arange(COLS) >= j * COLS  # the last tile leaves the columns before it alone
    for k, acc in enumerate(accs):
        feats = pl.ds(k * DEPTH, DEPTH)
        if spec.layout == "DV":
            plgpu.store(dw_ref.at[feats, pl.ds(start, COLS)], acc.astype(dw_ref.dtype), mask=fresh[None, :])
        else:
            plgpu.store(dw_ref.at[pl.ds(start, COLS), feats], acc.astype(dw_ref.dtype), mask=fresh[:, None])


def _call(kernel, grid, out_shape, interpret, name):
    return pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name=name,
    )


def forward(spec, x_ND, w, targets_N, interpret: bool):
    """(lse, target, total, entropy), float32 [N] each."""
    N = x_ND.shape[0]
    vec = jax.ShapeDtypeStruct((N,), jnp.float32)
    call = _call(functools.partial(_forward_kernel, spec), (N // ROWS,), [vec] * 4, interpret, "xent_forward")
    return tuple(call(x_ND, w, targets_N))


def backward(spec, x_ND, w, targets_N, lse_N, entropy_N, g, interpret: bool):
    """(dx [N, D] in x's dtype, dw in w's shape and dtype: zero past vocab_size)."""
    N = x_ND.shape[0]
    args = (x_ND, w, targets_N, lse_N, entropy_N, *g)
    dx_shape = jax.ShapeDtypeStruct(x_ND.shape, x_ND.dtype)
    dx = _call(functools.partial(_dx_kernel, spec), (N // ROWS,), dx_shape, interpret, "xent_dx")(*args)
    V, axis = spec.vocab_size, 1 if spec.layout == "DV" else 0
    shape = list(w.shape)
    shape[axis] = V
    dw_shape, grid = jax.ShapeDtypeStruct(tuple(shape), w.dtype), (spec.n_blocks_of(COLS),)
    dw = _call(functools.partial(_dw_kernel, spec), grid, dw_shape, interpret, "xent_dw")(*args)
    pad = [(0, 0), (0, 0)]
    pad[axis] = (0, w.shape[axis] - V)  # padded vocabulary columns: no gradient
    return dx, jnp.pad(dw, pad)
