"""The trained policy of a task: how its parameters and the weights that are not trained are applied and
placed. One kind of policy a way to train (full fine-tuning, LoRA); the objectives (lm_task, dpo_task,
grpo_task, seq2seq_task) call the model only through it.

    policy = make_policy(config, model_config)        # FullPolicy, or LoraPolicy when lora.rank > 0
    frozen = Frozen(base=policy.base(start), reference=None)
    out = policy.apply(params, frozen, tokens_BT, rng=rng, train=True)           # the policy
    ref = policy.apply(policy.reference_params(frozen), frozen, tokens_BT)      # its reference
    placed = REAL.place(frozen, frozen_shardings(model_config, frozen, mesh))   # ABSTRACT: shapes

`Frozen(base, reference)` is every weight a run holds and does not train, one pytree: `base` is LoRA's
frozen base (lora.quantize_base of the start, in lora.base_dtype), `reference` the reference of DPO or
GRPO under full fine-tuning (a copy of the start, or dpo.reference's weights); None where there is
none. A LoRA policy's reference is its base with the adapters off, so it never needs `reference`. The
train state carries it (TrainState.frozen), the loss reads it, checkpoints never hold it.

A `Mode` says once how a task holds its weights: REAL (arrays, placed by jax.device_put) or ABSTRACT
(jax.ShapeDtypeStructs with shardings, for flaxgpt aot: the same functions, run by jax.eval_shape).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import struct

from flaxgpt import sharding
from flaxgpt.models import gpt, lora
from flaxgpt.models import registry as models
from flaxgpt.train import sections


@struct.dataclass
class Frozen:
    """The weights a run holds and does not train (never differentiated, never checkpointed)."""

    base: Any = None  # LoRA: the frozen base the adapters are added to; else None
    reference: Any = None  # DPO / GRPO with full fine-tuning: the reference's parameters; else None


NONE = Frozen()  # a run with no frozen weights (seq2seq, full fine-tuning's LM)


def _host_copy(tree):
    """A host copy: the policy's start is donated and updated in place, its reference must not be."""
    return jax.tree.map(lambda x: np.array(x, copy=True), tree)


@dataclasses.dataclass(frozen=True)
class Mode:
    """How a task holds weights: chosen once, when the task is built."""

    name: str
    place: Callable  # (tree, shardings) -> the tree on them
    copy: Callable  # tree -> a copy that no donated buffer aliases
    run: Callable  # (fn, *trees) -> fn(*trees): its arrays, or (ABSTRACT) their shapes


REAL = Mode("real", jax.device_put, _host_copy, lambda fn, *trees: fn(*trees))
# flaxgpt aot: shapes, nothing allocated
ABSTRACT = Mode("abstract", sharding.shapes_on, lambda tree: tree, jax.eval_shape)


def frozen_shardings(model_config, frozen: Frozen, mesh) -> Frozen:
    """Shardings of `frozen` on `mesh`: the base and the reference as full fine-tuning shards the
    parameters (FSDP; an int8 base's transposed kernels and scales follow: lora.base_shardings)."""
    if frozen.base is None and frozen.reference is None:
        return Frozen()
    params = sharding.param_shardings(gpt.abstract_params(model_config), mesh)
    return Frozen(
        base=None if frozen.base is None else lora.base_shardings(params, frozen.base),
        reference=None if frozen.reference is None else params,
    )


class FullPolicy:
    """Full fine-tuning: the trained parameters are the model's."""

    lora = None

    def __init__(self, model_config):
        self.model_config = model_config
        self.model = gpt.GPT(model_config) if models.kind_of(model_config) == "gpt" else None

    def abstract_params(self):
        """The trained parameters, boxed with their logical axes."""
        return models.abstract_params(self.model_config)

    def init_params(self, rng):
        return models.init_params(self.model_config, rng)

    def base(self, start):
        """Frozen.base of the start's weights: none, the model trains them all."""
        return None

    def apply(self, params, frozen: Frozen, tokens_BT, *, rng=None, train=False, mutable=False, **kw):
        """The GPT with `params` (the policy's, or reference_params') on tokens_BT."""
        rngs = {"dropout": rng} if train else None
        return self.model.apply(
            {"params": params}, tokens_BT, rngs=rngs, mutable=mutable, deterministic=not train, **kw
        )

    def reference_params(self, frozen: Frozen):
        """What `apply` takes for the reference: the frozen copy."""
        return frozen.reference

    def head_params(self, params, frozen: Frozen):
        """The weights the output head reads (gpt.head_logits): the parameters applied."""
        return params

    def weights(self, params, frozen: Frozen):
        """The policy's weights as a decoder takes them (gpt.step_fn): the parameters."""
        return params


class LoraPolicy:
    """LoRA: the trained parameters are the adapters, added to the frozen base (Frozen.base)."""

    def __init__(self, model_config, spec: lora.LoraSpec, base_dtype: str):
        self.model_config, self.lora, self.base_dtype = model_config, spec, base_dtype

    def abstract_params(self):
        """The adapters (replicated: no logical axes)."""
        return jax.eval_shape(self.init_params, jax.random.key(0))

    def init_params(self, rng):
        return lora.init_adapters(self.model_config, self.lora, rng)

    def base(self, start):
        """Frozen.base of the start's weights: them in lora.base_dtype."""
        return lora.quantize_base(start, self.base_dtype)

    def apply(self, params, frozen: Frozen, tokens_BT, *, rng=None, train=False, mutable=False, **kw):
        """The base with the adapters `params` added ({}: the base alone); the base is not differentiated."""
        return lora.apply(
            self.model_config, self.lora, frozen.base, params, tokens_BT,
            rng=rng, mutable=mutable, deterministic=not train, **kw,
        )  # fmt: skip

    def reference_params(self, frozen: Frozen):
        """The reference: the base with the adapters off."""
        return {}

    def head_params(self, params, frozen: Frozen):
        return frozen.base  # the head is the base's: no adapter on it

    def weights(self, params, frozen: Frozen):
        """The base with the adapters merged (float bases: lora.merge)."""
        return _merge(self.model_config, self.lora, frozen.base, params)

    def merges(self) -> bool:
        """Whether `weights` is the policy to rounding: a float32 base (W + s A B in float32, ~1e-7
        apart from the base and the adapters' products added); a bfloat16 base would round the
        adapters' small product into bfloat16's 8 bits (vanishing early in training), an int8 one
        cannot hold it."""
        return self.base_dtype == "float32" and self.model_config.param_dtype == "float32"


def make_policy(config, model_config) -> FullPolicy | LoraPolicy:
    """LoraPolicy when the recipe's lora.rank > 0 (a GPT), else FullPolicy."""
    c = sections.of(config).lora
    if not c.rank or models.kind_of(model_config) != "gpt":
        return FullPolicy(model_config)
    spec = lora.LoraSpec.make(model_config, c.rank, c.alpha, c.dropout, c.targets)
    return LoraPolicy(model_config, spec, c.base_dtype)


def _merge(model_config, spec, base, adapters):
    return _merge_jit(model_config, spec, base, adapters)


_merge_jit = jax.jit(lora.merge, static_argnums=(0, 1))
