"""The pure, jitted steps of a run: TrainState, the train step (gradient accumulation inside) and the
eval step, with the optimizer and shardings they are compiled with.

    steps = make_steps(config, task, mesh)
    state, metrics = steps.train_step(state, batch)   # batch leaves [grad_accum, micro_B, ...]

The trainer (flaxgpt.train.trainer) runs them; flaxgpt.aot compiles them for a target ahead of time.
`frozen` is train.policy.Frozen(base, reference): LoRA's base and DPO / GRPO's reference, the weights
that are not trained (FSDP-sharded, never checkpointed); with LoRA `params` are the adapters.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import struct

from flaxgpt import sharding
from flaxgpt.train.optim import make_optimizer
from flaxgpt.train.policy import NONE, Frozen


@struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer updates done so far (also the data position)
    params: Any
    opt_state: Any
    rng: jax.Array  # base key; dropout at step s uses fold_in(rng, s)
    frozen: Frozen = NONE  # the weights not trained: never differentiated, never checkpointed


def _with_sums(aux):
    """A task loss's aux: the weight alone, or (weight, {name: sum}) of metrics to log (DPO's rewards)."""
    return aux if isinstance(aux, tuple) else (aux, {})


def make_train_step(task, tx, schedule, grad_accum: int):
    """train_step(state, batch) with batch leaves [grad_accum, micro_B, ...]."""
    grad_fn = jax.value_and_grad(lambda p, b, r, f: task.loss(p, b, r, True, f), has_aux=True)

    def train_step(state: TrainState, batch):
        rng = jax.random.fold_in(state.rng, state.step)

        def micro(i, micro_batch):
            r = jax.random.fold_in(rng, i)
            (loss_sum, aux), grads = grad_fn(state.params, micro_batch, r, state.frozen)
            weight, sums = _with_sums(aux)
            return grads, loss_sum, weight, sums

        if grad_accum == 1:
            grads, loss_sum, weight, sums = micro(0, jax.tree_util.tree_map(lambda x: x[0], batch))
        else:  # sum gradients of summed losses, divide once: k micro-batches == one big batch

            def body(carry, xs):
                out = micro(*xs)
                return jax.tree_util.tree_map(jnp.add, carry, out), None

            first = jax.tree_util.tree_map(lambda x: x[0], batch)
            sums = jax.tree_util.tree_map(jnp.zeros_like, jax.eval_shape(micro, 0, first)[3])  # {}: LM
            zeros = (
                jax.tree_util.tree_map(jnp.zeros_like, state.params),
                jnp.float32(0),
                jnp.float32(0),
                sums,
            )
            (grads, loss_sum, weight, sums), _ = jax.lax.scan(body, zeros, (jnp.arange(grad_accum), batch))
        # the mean gradient in each parameter's own dtype: a float32 weight made bf16 gradients (param_dtype
        # bfloat16) float32, then the optimizer moments, and step 2 refused the changed state
        grads = jax.tree_util.tree_map(lambda g: (g / weight).astype(g.dtype), grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss_sum / weight, "grad_norm": optax.tree.norm(grads), "lr": schedule(state.step)}
        metrics.update({name: s / weight for name, s in sums.items()})
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


class Steps(NamedTuple):
    """A run's jitted programs and what they are built from: what Trainer runs and flaxgpt.aot compiles."""

    tx: Any
    schedule: Any
    init_state: Any  # init_state(rng, params=None) -> TrainState (fresh parameters, or the given ones)
    param_shardings: Any
    abstract_state: Any
    state_shardings: Any  # of what checkpoints hold (frozen: None)
    frozen: Frozen  # the frozen weights placed on the mesh (LoRA's base, a reference)
    train_batch_sharding: Any  # ndim -> sharding of leaves [grad_accum, micro_B, ...] (to_global's)
    eval_batch_sharding: Any  # ndim -> sharding of leaves [B, ...]
    train_step: Any  # jitted, state donated
    eval_step: Any  # jitted: (params, batch, frozen) -> (loss_sum, weight)


def make_steps(config, task, mesh) -> Steps:
    """The optimizer, shardings and jitted train / eval steps of `config` for `task` on `mesh`."""
    tx, schedule = make_optimizer(config.optim, config.max_iters, mesh)
    param_shardings = sharding.param_shardings(task.abstract_params(), mesh)

    def init_state(rng, params=None):
        params_rng, train_rng = jax.random.split(rng)
        params = task.init_params(params_rng) if params is None else params
        return TrainState(step=jnp.int32(0), params=params, opt_state=tx.init(params), rng=train_rng)

    abstract_state = jax.eval_shape(init_state, jax.random.key(0))
    state_shardings = sharding.state_shardings(abstract_state, abstract_state.params, param_shardings, mesh)
    frozen, frozen_shardings = task.place_frozen(mesh)  # sharded as FSDP shards the parameters
    step_shardings = state_shardings.replace(frozen=frozen_shardings)  # checkpoints hold no frozen base
    # ndim -> a leaf's sharding: a context axis splits [B, T] leaves' T, never [B] ones (advantages)
    train_batch_sharding = sharding.batch_shardings(mesh, leading_axes=1)
    eval_batch_sharding = sharding.batch_shardings(mesh)
    rep = sharding.replicated(mesh)
    # traced under the mesh: "auto" attention and the Pallas kernel see the devices compiled for
    train_step = jax.jit(
        sharding.under_mesh(make_train_step(task, tx, schedule, config.grad_accum), mesh),
        in_shardings=(step_shardings, None),  # None: the batch as placed (train_batch_sharding)
        out_shardings=(step_shardings, rep),
        donate_argnums=0,
    )

    def eval_sums(params, batch, frozen):  # (loss_sum, weight): what evaluations average
        loss_sum, aux = task.loss(params, batch, None, False, frozen)
        return loss_sum, _with_sums(aux)[0]

    eval_step = jax.jit(
        sharding.under_mesh(eval_sums, mesh),
        in_shardings=(param_shardings, None, frozen_shardings),  # the batch by eval_batch_sharding
        out_shardings=rep,
    )
    return Steps(
        tx, schedule, init_state, param_shardings, abstract_state, state_shardings, frozen,
        train_batch_sharding, eval_batch_sharding, train_step, eval_step,
    )  # fmt: skip
