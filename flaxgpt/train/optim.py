"""Optimizers (AdamW, or Muon for the hidden matrices with AdamW for the rest) and schedules.

    tx, schedule = make_optimizer(config.optim, config.max_iters)

`optim.name`:
  adamw  AdamW on every parameter, weight decay on >= 2-D weights only (GPT-2 / nanoGPT);
  muon   the modded-nanogpt speedrun's split: Muon (optax.contrib.scale_by_muon: Nesterov momentum,
         then the update orthogonalised by a quintic Newton-Schulz iteration, scaled by
         sqrt(max(1, fan_out / fan_in))) on the 2-D kernels of the hidden layers; AdamW on the
         embeddings (`embed_learning_rate`), the head (`head_learning_rate`) and on every norm, bias
         and scalar (`learning_rate`). Groups come from parameter paths (`param_groups`).

Schedules take the optimizer step (0 for the first update) and return the learning rate:
  cosine   linear warmup lr*(s+1)/(warmup+1), then cosine from lr to min_lr at decay_steps,
           then min_lr (nanoGPT's get_lr);
  constant linear warmup, then lr;
  rsqrt    the Transformer paper's: lr * min(s'/warmup, sqrt(warmup/s')), s' = s + 1,
           i.e. linear warmup to lr at `warmup` then inverse square root decay;
  wsd      warmup, stable at lr, then a linear cooldown to min_lr over the last `cooldown_frac`
           of decay_steps (the speedrun's trapezoid).
Every group follows the same shape, scaled to its own peak (min_lr scales with it).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec
from optax.contrib import MuonDimensionNumbers, scale_by_muon

SCHEDULES = ("cosine", "constant", "rsqrt", "wsd")
OPTIMIZERS = ("adamw", "muon")
GROUPS = ("muon", "embed", "head", "adamw")  # optimizer groups of optim.name=muon
EMBEDDING_NAMES = ("wte", "wpe", "value_embed_")  # AdamW at embed_learning_rate (names or prefixes)
HEAD_NAMES = ("lm_head",)  # AdamW at head_learning_rate
STACKED_LAYERS = "block"  # scan_layers stacks blocks under h/block with a leading [L] axis


def make_schedule(
    name: str,
    learning_rate: float,
    warmup_steps: int,
    decay_steps: int = 0,
    min_lr: float = 0.0,
    cooldown_frac: float = 0.0,
):
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {SCHEDULES}")
    lr, warmup = float(learning_rate), int(warmup_steps)

    def warmup_lr(step):
        return lr * (step + 1) / (warmup + 1)

    if name == "constant":
        return lambda step: jnp.where(step < warmup, warmup_lr(step), lr)
    if name == "rsqrt":
        if warmup < 1:
            raise ValueError("the rsqrt schedule needs warmup_steps >= 1")

        def rsqrt(step):
            s = jnp.asarray(step, jnp.float32) + 1.0
            return lr * jnp.minimum(s / warmup, jnp.sqrt(warmup / s))

        return rsqrt
    if decay_steps <= warmup:
        raise ValueError(f"{name} decay_steps ({decay_steps}) must be larger than warmup_steps ({warmup})")
    if name == "wsd":
        if not 0 < cooldown_frac <= 1:
            raise ValueError(f"the wsd schedule needs 0 < cooldown_frac <= 1, got {cooldown_frac}")
        start = max(warmup, decay_steps - round(cooldown_frac * decay_steps))

        def wsd(step):
            step = jnp.asarray(step, jnp.float32)
            ratio = jnp.clip((step - start) / max(1, decay_steps - start), 0.0, 1.0)
            return jnp.where(step < warmup, warmup_lr(step), lr + ratio * (min_lr - lr))

        return wsd

    def cosine(step):
        step = jnp.asarray(step, jnp.float32)
        ratio = jnp.clip((step - warmup) / (decay_steps - warmup), 0.0, 1.0)
        decayed = min_lr + 0.5 * (1.0 + jnp.cos(math.pi * ratio)) * (lr - min_lr)
        return jnp.where(step < warmup, warmup_lr(step), decayed)

    return cosine


def decay_mask(params):
    """Weight decay on matrices and embeddings only, not on biases or LayerNorm scales."""
    return jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)


def _names(path) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "name", k))) for k in path]


def param_groups(params):
    """The optimizer group of every parameter, from its path: "embed" (wte, wpe), "head" (lm_head),
    "muon" (every other Dense kernel: the hidden matrices), "adamw" (norms, biases, scalars)."""

    def group(path, _):
        names = _names(path)
        if any(n.startswith(EMBEDDING_NAMES) for n in names):
            return "embed"
        if any(n in HEAD_NAMES for n in names):
            return "head"
        return "muon" if names[-1] == "kernel" else "adamw"

    return jax.tree_util.tree_map_with_path(group, params)


def _muon_dims(tree):
    """MuonDimensionNumbers for each Muon kernel: [in, out], or [L, in, out] stacked by scan_layers
    (orthogonalised layer by layer); the MaskedNodes of the other groups stay as they are. Anything
    else is an error naming the parameter: Newton-Schulz orthogonalises matrices only."""
    masked = optax.transforms.MaskedNode

    def dims(path, x):
        if isinstance(x, masked):
            return x
        names = _names(path)
        stacked = STACKED_LAYERS in names
        if x.ndim == 2 + stacked:
            return MuonDimensionNumbers(reduction_axis=x.ndim - 2, output_axis=x.ndim - 1)
        raise ValueError(
            f"Muon cannot orthogonalise {'/'.join(names)} of shape {tuple(x.shape)}: it takes "
            f"{'[layers, in, out]' if stacked else '[in, out]'} kernels; name the parameter something "
            "other than 'kernel' to give it to AdamW, or use optim.name=adamw"
        )

    return jax.tree_util.tree_map_with_path(dims, tree, is_leaf=lambda x: isinstance(x, masked))


def _width_scale(updates):
    """Keller Jordan's Muon scale sqrt(max(1, fan_out / fan_in)): the same RMS step for wide outputs."""
    masked = optax.transforms.MaskedNode

    def scale(u):
        if isinstance(u, masked):
            return u
        fan_in, fan_out = u.shape[-2], u.shape[-1]
        return u * math.sqrt(max(1.0, fan_out / fan_in))

    return jax.tree_util.tree_map(scale, updates, is_leaf=lambda x: isinstance(x, masked))


def _check_muon_shapes():
    """Stateless; its init raises the one-line error of `_muon_dims` when the state is built."""

    def init(params):
        _muon_dims(params)
        return optax.EmptyState()

    return optax.GradientTransformation(init, lambda updates, state, params=None: (updates, state))


def _stacked_dims(tree):
    """Every stacked group [N, a, b] is N matrices, orthogonalised one by one (optax vmaps them)."""
    return {k: MuonDimensionNumbers(reduction_axis=1, output_axis=2) for k in tree}


def _distributed(inner, mesh):
    """`inner` (Muon) on the Muon kernels stacked by shape: each group of same-shaped matrices
    ([in, out] and [out, in] together, the latter transposed: Newton-Schulz commutes with the
    transpose) becomes one [N, a, b] array, split over every device of the mesh, so each device
    orthogonalises N / devices of them (the speedrun's distributed Muon) in a few large batched
    matmuls instead of many small ones; the results are gathered back. The momentum is stored per
    parameter, like the weights, and stacked inside the update with the gradients: a checkpoint
    holds no trace of the device count, so a run resumes on any mesh (under FSDP the per-parameter
    form runs instead, its momentum sharded as the weights)."""
    masked = optax.transforms.MaskedNode
    is_masked = lambda x: isinstance(x, masked)  # noqa: E731
    n = 1 if mesh is None else mesh.devices.size
    split = None if n == 1 else NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))
    whole = None if n == 1 else NamedSharding(mesh, PartitionSpec())

    def layout(tree):
        leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_masked)
        groups: dict[str, list[int]] = {}
        for i, x in enumerate(leaves):
            if not is_masked(x):
                a, b = sorted(x.shape[-2:])
                groups.setdefault(f"{a}x{b}", []).append(i)
        return leaves, treedef, groups

    def stack(tree):
        leaves, _, groups = layout(tree)
        out = {}
        for key, members in groups.items():
            mats = []
            for i in members:
                x = leaves[i].reshape(-1, *leaves[i].shape[-2:])  # [L, in, out] (scanned) or [1, in, out]
                mats.append(jnp.swapaxes(x, 1, 2) if x.shape[1] > x.shape[2] else x)
            x = jnp.concatenate(mats)
            pad = -len(x) % n  # zero matrices stay zero: Newton-Schulz divides by (norm + eps)
            x = jnp.concatenate([x, jnp.zeros((pad, *x.shape[1:]), x.dtype)]) if pad else x
            out[key] = x if split is None else jax.lax.with_sharding_constraint(x, split)
        return out

    def unstack(stacked, like):
        leaves, treedef, groups = layout(like)
        for key, members in groups.items():
            x = stacked[key] if whole is None else jax.lax.with_sharding_constraint(stacked[key], whole)
            offset = 0
            for i in members:
                shape = leaves[i].shape
                count = math.prod(shape[:-2])
                part = x[offset : offset + count]
                offset += count
                leaves[i] = (jnp.swapaxes(part, 1, 2) if shape[-2] > shape[-1] else part).reshape(shape)
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def with_mu(state, fn):  # scale_by_muon's state, or inject_hyperparams' around it (momentum warmup)
        if hasattr(state, "inner_state"):
            return state._replace(inner_state=with_mu(state.inner_state, fn))
        return state._replace(mu=fn(state.mu))

    def update(updates, state, params=None):
        out, state = inner.update(stack(updates), with_mu(state, stack))
        return unstack(out, updates), with_mu(state, lambda mu: unstack(mu, updates))

    return optax.GradientTransformation(inner.init, update)


def _muon(c, schedule, mesh=None):
    per_parameter = mesh is not None and mesh.shape.get("fsdp", 1) > 1  # FSDP: momentum sharded as weights
    dims = _muon_dims if per_parameter else _stacked_dims
    kw = dict(ns_steps=c.muon_ns_steps, nesterov=c.muon_nesterov, weight_dimension_numbers=dims)
    warmup = c.get("muon_momentum_warmup", 0)
    if warmup:  # the speedrun's: momentum ramps linearly from muon_momentum_start over `warmup` steps
        start, end = c.muon_momentum_start, c.muon_momentum
        beta = lambda count: start + (end - start) * jnp.minimum(count / warmup, 1.0)  # noqa: E731
        muon = optax.inject_hyperparams(scale_by_muon, static_args=tuple(kw))(beta=beta, **kw)
    else:
        muon = scale_by_muon(beta=c.muon_momentum, **kw)
    return optax.chain(
        _check_muon_shapes(),
        muon if per_parameter else _distributed(muon, mesh),
        optax.stateless(lambda updates, params=None: _width_scale(updates)),
        optax.add_decayed_weights(c.muon_weight_decay),
        optax.scale_by_learning_rate(schedule),
    )


def make_optimizer(optim_config, max_iters: int, mesh=None):
    """(optax transformation, schedule) from the config's `optim` section; the schedule returned is
    the AdamW `learning_rate` one (what the trainer logs as lr). `mesh`: the training mesh, over
    which Muon spreads its orthogonalisations (data parallel) or shards its momentum (FSDP)."""
    c = optim_config
    name = c.get("name", "adamw")
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optim.name {name!r}; choose one of {OPTIMIZERS}")

    def schedule_for(peak):  # every group: the same shape, scaled to its own peak
        scale = peak / c.learning_rate if c.learning_rate else 0.0
        return make_schedule(
            c.schedule,
            peak,
            c.warmup_steps,
            c.decay_steps or max_iters,
            c.min_lr * scale,
            c.get("cooldown_frac", 0.0),
        )

    schedule = schedule_for(c.learning_rate)

    def adamw(sched):
        return optax.adamw(
            sched, b1=c.beta1, b2=c.beta2, eps=c.eps, weight_decay=c.weight_decay, mask=decay_mask
        )

    parts = []
    if c.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(c.grad_clip))
    if name == "adamw":
        parts.append(adamw(schedule))
    else:
        groups = {
            "muon": _muon(c, schedule_for(c.muon_learning_rate), mesh),
            "embed": adamw(schedule_for(c.embed_learning_rate or c.learning_rate)),
            "head": adamw(schedule_for(c.head_learning_rate or c.learning_rate)),
            "adamw": adamw(schedule),
        }
        parts.append(optax.partition(groups, param_groups))
    return optax.chain(*parts), schedule
