"""Learning-rate schedules and AdamW (decay on >= 2-D weights only) with global-norm clipping.

Schedules take the optimizer step (0 for the first update) and return the learning rate:
  cosine   linear warmup lr*(s+1)/(warmup+1), then cosine from lr to min_lr at decay_steps,
           then min_lr (nanoGPT's get_lr);
  constant linear warmup, then lr;
  rsqrt    the Transformer paper's: lr * min(s'/warmup, sqrt(warmup/s')), s' = s + 1,
           i.e. linear warmup to lr at `warmup` then inverse square root decay.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

SCHEDULES = ("cosine", "constant", "rsqrt")


def make_schedule(
    name: str, learning_rate: float, warmup_steps: int, decay_steps: int = 0, min_lr: float = 0.0
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
        raise ValueError(f"cosine decay_steps ({decay_steps}) must be larger than warmup_steps ({warmup})")

    def cosine(step):
        step = jnp.asarray(step, jnp.float32)
        ratio = jnp.clip((step - warmup) / (decay_steps - warmup), 0.0, 1.0)
        decayed = min_lr + 0.5 * (1.0 + jnp.cos(math.pi * ratio)) * (lr - min_lr)
        return jnp.where(step < warmup, warmup_lr(step), decayed)

    return cosine


def decay_mask(params):
    """Weight decay on matrices and embeddings only, not on biases or LayerNorm scales."""
    return jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)


def make_optimizer(optim_config, max_iters: int):
    """(optax transformation, schedule) from the config's `optim` section."""
    c = optim_config
    schedule = make_schedule(
        c.schedule, c.learning_rate, c.warmup_steps, c.decay_steps or max_iters, c.min_lr
    )
    parts = []
    if c.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(c.grad_clip))
    parts.append(
        optax.adamw(schedule, b1=c.beta1, b2=c.beta2, eps=c.eps, weight_decay=c.weight_decay, mask=decay_mask)
    )
    return optax.chain(*parts), schedule
