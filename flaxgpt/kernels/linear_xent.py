"""Fused linear + softmax statistics: what a cross-entropy needs of `x @ w`, without the [N, V] logits.

    s = token_stats(x_ND, Head(w_DV, "DV", V), targets_N)       # w [D, Vp]: an lm_head kernel
    s = token_stats(x_ND, Head(wte_VD, "VD", V, softcap), targets_N)  # a tied token table
    nll_N = s.lse - s.target;  logp_N = s.target - s.lse;  entropy_N = s.entropy
    mean log p over the vocabulary = s.total / V - s.lse           (label smoothing)

The logits z = scale * cap(x @ w) (cap: Gemma 2's soft-cap, cap * tanh(. / cap); scale: 1 / a sampling
temperature) of the first `vocab_size` columns, float32, are made `block` columns at a time (a lax.scan
over vocabulary blocks) and reduced at once with an online log-sum-exp, so only one [N, block] block
lives. Four statistics per row come back, float32 [N]:
  lse     log sum_v exp z_v
  target  z_{targets}
  total   sum_v z_v
  entropy -sum_v p_v log p_v, p = softmax(z) (accumulated as sum_v p_v (z_v - max z): no cancellation
          of lse against the mean logit, which costs float32 ~1e-6 at lse ~ 10)
Every loss in train/losses.py is a function of these, so one custom_vjp serves them all: the backward
takes their cotangents, recomputes each block's logits from x and w (nothing of [N, V] is kept for it
either: the residuals are x, w, the targets, lse and entropy), forms that block's d logits

  dz_v = g_lse p_v + g_target [v = t] + g_total - g_entropy p_v (log p_v + entropy)

and accumulates dx (float32 [N, D]) and writes d w's block. Products run in w's dtype (the model's
compute dtype: bf16 on accelerators) with float32 accumulation, as the unfused head's dot.

The vocabulary need not be a multiple of `block`: the last block starts at V - block and leaves out the
columns an earlier block took; padded columns (V..Vp, the model's pad_vocab_multiple) are never read
and get a zero gradient.

This is the XLA form, used on every platform: it writes each [N, block] block of logits to HBM (in
the compute dtype) and reads it back in the next fusion, since XLA does not fuse a product with the
reductions after it, and the backward recomputes the head's product. The Pallas kernels of
kernels/pallas_xent.py (Triton; FLAXGPT_XENT=pallas on one GPU, `pick_impl`) keep the blocks on the
chip but do not pay yet (their docstring; docs/accelerators.md has the compiled figures).

Shape letters: N tokens (B*T), D features, V vocabulary, Vp padded vocabulary, v a block of V.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp

from flaxgpt.kernels import target

BLOCK = 4096  # vocabulary columns per block: [N, 4096] float32 at a time (256 MiB at N = 16384)


class Stats(NamedTuple):
    lse: jax.Array
    target: jax.Array
    total: jax.Array
    entropy: jax.Array


class Head(NamedTuple):
    """An unembedding as the model applies it: w in its compute dtype, [D, Vp] ("DV": a Dense kernel)
    or [Vp, D] ("VD": a tied token table); the first vocab_size columns are the vocabulary; softcap
    as GPTConfig.logit_softcap (0 = off)."""

    w: jax.Array
    layout: str
    vocab_size: int
    softcap: float = 0.0


def token_stats(
    x_ND, head: Head, targets_N, *, scale: float = 1.0, block: int = 0, impl: str = "auto"
) -> Stats:
    """Stats of z = scale * cap(x @ w)[:, :vocab_size] (see the module docstring), float32 [N] each.
    block: vocabulary columns at a time of the XLA form (0 = BLOCK; at most the vocabulary).
    impl: "xla", "pallas" (kernels/pallas_xent.py; interpret mode off GPU) or "auto" (pick_impl)."""
    w, layout, vocab_size = head.w, head.layout, head.vocab_size
    if layout not in ("DV", "VD"):
        raise ValueError(f"layout {layout!r}: 'DV' for a [D, V] kernel, 'VD' for a [V, D] token table")
    n_cols = w.shape[1 if layout == "DV" else 0]
    if not 0 < vocab_size <= n_cols:
        raise ValueError(f"vocab_size {vocab_size} must be in 1..{n_cols} (the head's columns)")
    if x_ND.ndim != 2 or x_ND.shape[1] != w.shape[0 if layout == "DV" else 1]:
        raise ValueError(f"x {x_ND.shape} and w {w.shape} ({layout}) do not share the feature axis")
    if block < 0:
        raise ValueError(f"block {block} must be >= 0 (0 = {BLOCK})")
    size = min(int(block or BLOCK), vocab_size)
    impl = pick_impl(*x_ND.shape, vocab_size) if impl == "auto" else impl
    if impl not in ("xla", "pallas"):
        raise ValueError(f"impl {impl!r}: choose one of auto, xla, pallas")
    if impl == "pallas":
        from flaxgpt.kernels import pallas_xent

        if not pallas_xent.fits(*x_ND.shape, vocab_size):
            tiles = f"{pallas_xent.ROWS}, {pallas_xent.DEPTH}, {pallas_xent.COLS}"
            raise ValueError(
                f"the Pallas cross-entropy cannot tile {x_ND.shape[0]} tokens x {x_ND.shape[1]} features x "
                f"{vocab_size} words ({tiles}): use impl='xla'"
            )
    interpret = target.platform() != "gpu"  # the Triton kernels run on NVIDIA GPUs; elsewhere interpreted
    spec = _Spec(vocab_size, layout, float(head.softcap), float(scale), size, impl, interpret)
    return Stats(*_stats(spec, x_ND, w, targets_N.astype(jnp.int32)))


def pick_impl(n_tokens: int, n_features: int, vocab_size: int) -> str:
    """ "xla", unless FLAXGPT_XENT=pallas asks for the Triton kernels (pallas_xent: opt-in, its
    docstring says why) and the program is for one GPU (kernels.target) whose shapes the tiles cover."""
    mode = os.environ.get("FLAXGPT_XENT", "xla")
    if mode not in ("xla", "pallas"):
        raise ValueError(f"FLAXGPT_XENT={mode!r}: use xla (the default) or pallas (Triton kernels, one GPU)")
    if mode != "pallas" or target.platform() != "gpu":
        return "xla"
    # XLA cannot split a Pallas call over devices (it would gather every row onto each): one GPU only
    mesh = jax.sharding.get_abstract_mesh()
    if (jax.device_count() if mesh.empty else mesh.size) != 1:
        return "xla"
    from flaxgpt.kernels import pallas_xent  # (here: Pallas is imported only where it may run)

    return "pallas" if pallas_xent.fits(n_tokens, n_features, vocab_size) else "xla"


class _Spec(NamedTuple):  # the static part: hashable, a custom_vjp's nondiff argument
    vocab_size: int
    layout: str
    softcap: float
    scale: float
    block: int
    impl: str = "xla"
    interpret: bool = True

    @property
    def n_blocks(self) -> int:
        return self.n_blocks_of(self.block)

    def n_blocks_of(self, block: int) -> int:
        return -(-self.vocab_size // block)

    def start(self, i):
        """Block i's first column: the last block ends at vocab_size (overlapping the one before)."""
        return jnp.minimum(i * self.block, self.vocab_size - self.block)

    def raw(self, x_ND, w, start):
        """x @ w[:, start:start+block] -> [N, block] float32 (the product in w's dtype)."""
        axis = 1 if self.layout == "DV" else 0
        w_blk = jax.lax.dynamic_slice_in_dim(w, start, self.block, axis)
        dims = "dv" if self.layout == "DV" else "vd"
        # in the compute dtype, as the logits path's head: on bf16 this halves the [N, block] block
        # XLA writes between the product and the reductions (they cannot share a kernel)
        raw_Nv = jnp.einsum(f"nd,{dims}->nv", x_ND, w_blk, preferred_element_type=w_blk.dtype)
        return raw_Nv.astype(jnp.float32)

    def logits(self, raw_Nv):
        """(z, dz/draw) of a block's raw products."""
        if not self.softcap:
            return raw_Nv * self.scale, self.scale
        t_Nv = jnp.tanh(raw_Nv / self.softcap)
        return self.scale * self.softcap * t_Nv, self.scale * (1.0 - t_Nv * t_Nv)

    def fresh(self, i, start):
        """[block] bool: the block's columns no earlier block took."""
        return start + jnp.arange(self.block) >= i * self.block


def _forward(spec: _Spec, x_ND, w, targets_N):
    if spec.impl == "pallas":
        from flaxgpt.kernels import pallas_xent

        return pallas_xent.forward(spec, x_ND, w, targets_N, spec.interpret)
    N = x_ND.shape[0]

    def body(carry, i):
        m_N, s_N, e_N, total_N, tgt_N = carry
        start = spec.start(i)
        z_Nv, _ = spec.logits(spec.raw(x_ND, w, start))
        fresh_v = spec.fresh(i, start)
        z0_Nv = jnp.where(fresh_v, z_Nv, 0.0)
        m_new = jnp.maximum(m_N, jnp.max(jnp.where(fresh_v, z_Nv, -jnp.inf), axis=1))
        decay_N = jnp.exp(m_N - m_new)  # the running sums rescaled to the new maximum
        p_Nv = jnp.where(fresh_v, jnp.exp(z_Nv - m_new[:, None]), 0.0)
        # e = sum p (z - m): moved to the new maximum, sum p (z - m_new) = decay (e + (m - m_new) s)
        shift_N = jnp.where(s_N > 0, (m_N - m_new) * s_N, 0.0)  # (no -inf x 0 before the first block)
        e_N = decay_N * (e_N + shift_N) + (p_Nv * jnp.where(fresh_v, z_Nv - m_new[:, None], 0.0)).sum(1)
        s_N = s_N * decay_N + p_Nv.sum(1)
        hit_Nv = start + jnp.arange(spec.block) == targets_N[:, None]
        tgt_N = tgt_N + jnp.where(hit_Nv & fresh_v, z_Nv, 0.0).sum(1)
        return (m_new, s_N, e_N, total_N + z0_Nv.sum(1), tgt_N), None

    zero = jnp.zeros((N,), jnp.float32)
    init = (jnp.full((N,), -jnp.inf, jnp.float32), zero, zero, zero, zero)
    (m_N, s_N, e_N, total_N, tgt_N), _ = jax.lax.scan(body, init, jnp.arange(spec.n_blocks))
    return m_N + jnp.log(s_N), tgt_N, total_N, jnp.log(s_N) - e_N / s_N


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _stats(spec: _Spec, x_ND, w, targets_N):
    return _forward(spec, x_ND, w, targets_N)


def _stats_fwd(spec: _Spec, x_ND, w, targets_N):
    lse_N, tgt_N, total_N, entropy_N = _forward(spec, x_ND, w, targets_N)
    return (lse_N, tgt_N, total_N, entropy_N), (x_ND, w, targets_N, lse_N, entropy_N)


def _stats_bwd(spec: _Spec, res, g):
    x_ND, w, targets_N, lse_N, entropy_N = res
    if spec.impl == "pallas":
        from flaxgpt.kernels import pallas_xent

        g = tuple(gi.astype(jnp.float32) for gi in g)
        dx_ND, dw = pallas_xent.backward(spec, x_ND, w, targets_N, lse_N, entropy_N, g, spec.interpret)
        return dx_ND, dw, None
    g_lse, g_tgt, g_total, g_entropy = (gi.astype(jnp.float32)[:, None] for gi in g)
    axis = 1 if spec.layout == "DV" else 0

    def body(carry, i):
        dx_ND, dw = carry
        start = spec.start(i)
        z_Nv, dz_draw = spec.logits(spec.raw(x_ND, w, start))
        logp_Nv = z_Nv - lse_N[:, None]
        p_Nv = jnp.exp(logp_Nv)
        hit_Nv = start + jnp.arange(spec.block) == targets_N[:, None]
        dz_Nv = (g_lse - g_entropy * (logp_Nv + entropy_N[:, None])) * p_Nv + g_total
        dz_Nv = jnp.where(hit_Nv, dz_Nv + g_tgt, dz_Nv)
        # columns an earlier block took count once: here they add nothing
        draw_Nv = (jnp.where(spec.fresh(i, start), dz_Nv, 0.0) * dz_draw).astype(w.dtype)
        w_blk = jax.lax.dynamic_slice_in_dim(w, start, spec.block, axis)
        if spec.layout == "DV":
            dx_ND += jnp.einsum("nv,dv->nd", draw_Nv, w_blk, preferred_element_type=jnp.float32)
            dw_blk = jnp.einsum("nd,nv->dv", x_ND, draw_Nv, preferred_element_type=jnp.float32)
        else:
            dx_ND += jnp.einsum("nv,vd->nd", draw_Nv, w_blk, preferred_element_type=jnp.float32)
            dw_blk = jnp.einsum("nv,nd->vd", draw_Nv, x_ND, preferred_element_type=jnp.float32)
        # the overlapped columns' block is zero here, so adding to what is there is exact
        old = jax.lax.dynamic_slice_in_dim(dw, start, spec.block, axis)
        dw = jax.lax.dynamic_update_slice_in_dim(dw, old + dw_blk.astype(dw.dtype), start, axis)
        return (dx_ND, dw), None

    init = (jnp.zeros(x_ND.shape, jnp.float32), jnp.zeros(w.shape, w.dtype))
    (dx_ND, dw), _ = jax.lax.scan(body, init, jnp.arange(spec.n_blocks))
    return dx_ND.astype(x_ND.dtype), dw, None  # integer targets: no cotangent


_stats.defvjp(_stats_fwd, _stats_bwd)
