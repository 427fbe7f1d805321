"""Checksums and finiteness of saved arrays: what a checkpoint records at save and verifies at restore.

    finite, sums = inspect({"params/wte": w, ...})   # ({name: all finite}, {name: "8 hex digits"})
    all_finite(state.params)                           # no NaN / inf in any float leaf

One jitted pass on the devices that hold the arrays; exact integer arithmetic, so any sharding or
device count gives the same checksum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


@jax.jit
def _all_finite_leaves(leaves):
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def all_finite(tree) -> bool:
    """True when every float leaf of `tree` is finite (no NaN / inf); one jitted reduction."""
    leaves = [
        x
        for x in jax.tree_util.tree_leaves(tree)
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    return not leaves or bool(_all_finite_leaves(leaves))


def _words(x):
    """x's bits as uint32 words: 1- and 2-byte values (and bools) widened, 8-byte ones split in two."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    narrow = {1: jnp.uint8, 2: jnp.uint16}.get(x.dtype.itemsize)
    if narrow is not None:
        return lax.bitcast_convert_type(x, narrow).astype(jnp.uint32)
    return lax.bitcast_convert_type(x, jnp.uint32)  # 8-byte values get a trailing [2]


def _checksum(x):
    """sum_i word_i * (2 i + 1) mod 2**32: the weights are odd, so flipping any one bit changes it;
    exact integer arithmetic, so any sharding or device count gives the same number."""
    w = _words(x)
    index, stride = jnp.zeros(w.shape, jnp.uint32), 1
    for d in reversed(range(w.ndim)):  # the flat index without a reshape (shards stay where they are)
        index = index + lax.broadcasted_iota(jnp.uint32, w.shape, d) * jnp.uint32(stride % 2**32)
        stride *= w.shape[d]
    return jnp.sum(w * (2 * index + 1), dtype=jnp.uint32)


@jax.jit
def _inspect_leaves(leaves):
    finite = [
        jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True) for x in leaves
    ]
    return jnp.stack(finite), jnp.stack([_checksum(x) for x in leaves])


def inspect(flat: dict) -> tuple[dict[str, bool], dict[str, str]]:
    """({name: all finite}, {name: checksum as 8 hex digits}) of named arrays, in one jitted pass
    on the devices that hold them (a save already reads every array once; this is as cheap)."""
    names = [k for k, x in flat.items() if hasattr(x, "dtype")]
    if not names:
        return {}, {}
    finite, sums = jax.device_get(_inspect_leaves([flat[k] for k in names]))
    return (
        {k: bool(f) for k, f in zip(names, finite)},
        {k: f"{int(s):08x}" for k, s in zip(names, sums)},
    )
