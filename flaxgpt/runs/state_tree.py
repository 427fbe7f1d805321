"""A pytree as named leaves: the layout checkpoints store.

    named_leaves({"params": {"wte": {"embedding": x}}})   # [("params/wte/embedding", x)]
    nest({"params/wte/embedding": x})                      # {"params": {"wte": {"embedding": x}}}

Leaves are named by their key paths (dict keys, dataclass / flax struct fields, sequence indices), so
a checkpoint stored as a nested dict of these names restores into any pytree with the same names and
shapes, never needing the same Python classes (optax NamedTuples, flax structs...).
"""

from __future__ import annotations

import jax


def _key_name(k) -> str:
    for attr in ("key", "name", "idx"):  # DictKey / FlattenedIndexKey, GetAttrKey, SequenceKey
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def is_prng_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def named_leaves(tree) -> list[tuple[str, object]]:
    """[("params/h_0/attn/c_attn/kernel", leaf), ...] in tree order."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    out = [("/".join(_key_name(k) for k in path), leaf) for path, leaf in leaves]
    names = [n for n, _ in out]
    if "" in names or len(set(names)) != len(names):
        raise ValueError("the state must be a dict-like pytree whose leaves have distinct key paths")
    return out


def nest(flat: dict[str, object]) -> dict:
    """{"a/b/c": leaf} -> {"a": {"b": {"c": leaf}}}."""
    nested: dict = {}
    for name, leaf in flat.items():
        node = nested
        *parents, last = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = leaf
    return nested


def flatten_dict(tree, prefix="") -> dict[str, object]:
    """A nested dict (e.g. of orbax ArrayMetadata) -> {"a/b/c": leaf}; the inverse of `nest`."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out = {}
    for k, v in tree.items():
        out.update(flatten_dict(v, f"{prefix}/{k}" if prefix else str(k)))
    return out
