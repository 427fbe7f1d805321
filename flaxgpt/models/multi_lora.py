"""Many LoRA adapters in one batch, never merged: row b of a batch gets the adapter in slot idx_B[b].

    multi = MultiLora(config, params, slots=4, rank=16)     # slot 0 is "no adapter" (zeros)
    stack = multi.empty_stack()                              # the resident adapters, on the device
    weights = multi.slot_weights(spec, adapters)            # an adapter in a slot's layout, on the host
    stack = multi.write(stack, 2, weights)                   # a device write: no recompile
    cache = AdapterCache.wrap(KVCache.for_config(config, B, W), adapter=2)   # each row's slot
    logits_BTV, cache = multi.step_fn(stack)(tokens_BT, positions_BT, cache)

Each adapted linear layer computes y = x W + (x A[idx_b]) B[idx_b] per row b: A [S, K, R] and B
[S, R, N] stacked over S resident slots, the "lora" collection GPT(config, lora=spec) reads with
each row's slot beside them (`with_rows`; linear.add_slots does the arithmetic: a prefill gathers
each row's adapter, a decoding step reads the stack once for the whole batch). Every slot holds
every target the model has at one rank R: an adapter of rank r < R fills its first r columns of A
and rows of B (the rest zeros add nothing), a target it does not adapt stays zeros, and its scale
alpha / r (or / sqrt(r)) is folded into its B, so adapters of any rank, alpha and targets share one
compiled program. A mixture of experts' slots hold its expert stacks' adapters too: A [S, E, K, R]
and B [S, E, R, N], each token through its own row's slot of its expert's pair (moe.LoraExperts with
`slots`: every slot's rank-R columns side by side, each row keeping its own), E times a Linear's
adapter in memory. The stack is a jit argument of the step_fn (a Partial), so loading an adapter is a
write into the stack, not a recompile; the slot index travels with each row in its cache
(models.cache.AdapterCache), so decoders and the serving engine see only step_fn(tokens_BT,
positions_BT, cache) as for a plain GPT.

The merged model (models.lora.merge) gives the same logits up to float rounding: x (W + s A B) against
x W + (x A)(s B). The base may be quantized (int8 or bf16: loader.compact's `quantize`, or
lora.quantize_base's): x W is then what the quantized model alone computes (linear.Linear and
linear.Embedding over quantize.QuantizedWeight: kernels.qmatmul), and the adapters' float32 term is
added to it, so a slot-0 row decodes as the quantized model and an adapter's row as
QLoRA's forward (models.lora over the same quantized weights), which no merge could hold in int8.

Shape letters: S slots, B batch rows, K a layer's input features, N its output features, R the
stack's rank, E experts.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from flaxgpt.models import lora
from flaxgpt.models.cache import AdapterCache
from flaxgpt.models.gpt import GPT, GPTConfig, unstack_layers
from flaxgpt.models.linear import ROWS


@functools.partial(jax.jit, donate_argnums=0)
def _write(stack, slot, weights):
    return jax.tree_util.tree_map(lambda s_SX, w_X: s_SX.at[slot].set(w_X.astype(s_SX.dtype)), stack, weights)


def with_rows(stack, rows_B):
    """The stack as the "lora" collection: beside each layer's stacked adapters, `rows` [B] (each batch
    row's slot), which tells linear.Linear to add a slot per row."""
    if any(name.endswith("_a") for name in stack):
        return {**stack, ROWS: rows_B}
    return {name: with_rows(sub, rows_B) for name, sub in stack.items()}


class MultiLora:
    """A base model and the layout of its adapter slots; see the module docstring."""

    def __init__(self, config: GPTConfig, params, *, slots: int, rank: int):
        if slots < 2 or rank < 1:
            raise ValueError(
                f"adapter slots must be >= 2 (slot 0 is the base) and rank >= 1: {slots}, {rank}"
            )
        if config.scan_layers:  # decode unrolled, as gpt.step_fn: each layer reads its own cache buffer
            params = unstack_layers(params, config.n_layer)
        self.config = dataclasses.replace(config, scan_layers=False, remat="none")
        self.params, self.slots, self.rank = params, slots, rank
        # every target the model has (expert stacks too), at the stack's rank: one layout for any adapter
        self.spec = lora.LoraSpec.make(self.config, rank, rank, targets=lora.model_targets(self.config))
        self.shapes = lora.adapter_shapes(self.config, self.spec)
        model = GPT(self.config, lora=self.spec)

        def apply(params, stack, tokens_BT, positions_BT, cache: AdapterCache, logits_at=None):
            logits, inner = model.apply(
                {"params": params, "lora": with_rows(stack, cache.adapter_B)},
                tokens_BT,
                positions=positions_BT,
                cache=cache.inner,
                logits_at=logits_at,
            )
            return logits, cache.replace(inner=inner)

        self._apply = apply  # one function object: every step_fn(stack) is the same jit signature

    def empty_stack(self):
        """Zeros for every slot: each is "no adapter" until written."""
        return lora._nest(
            {
                path: {n: jnp.zeros((self.slots, *s), jnp.float32) for n, s in leaves.items()}
                for path, leaves in self.shapes.items()
            }
        )

    def slot_weights(self, spec: lora.LoraSpec, adapters, what: str = "adapter"):
        """An adapter (h_0.. layout, models.lora's tree) as one slot of the stack: host float32 arrays,
        rank padded to R, scale folded into B, absent targets zeros. A one-line ValueError when it does
        not fit this base (shapes, targets) or its rank is over R."""
        if spec.rank > self.rank:
            raise ValueError(
                f"{what} has rank {spec.rank}; this server's adapter slots hold rank <= {self.rank}"
            )
        spec = lora.LoraSpec.make(self.config, spec.rank, spec.alpha, spec.dropout, spec.targets, spec.rslora)
        lora.check_adapters(self.config, spec, adapters, what=what)
        adapters = jax.device_get(adapters)
        flat = {}
        for path, leaves in self.shapes.items():
            node = {n: np.zeros(s, np.float32) for n, s in leaves.items()}
            src = adapters
            for name in path:
                src = src.get(name, {})
            for t in spec.targets:
                if f"{t}_a" in src:  # A [(E,) K, r] and B [(E,) r, N]: an expert stack's lead with E
                    node[f"{t}_a"][..., : spec.rank] = np.asarray(src[f"{t}_a"], np.float32)
                    node[f"{t}_b"][..., : spec.rank, :] = np.asarray(src[f"{t}_b"], np.float32) * spec.scale
            flat[path] = node
        return lora._nest(flat)

    def write(self, stack, slot: int, weights):
        """The stack with `weights` (slot_weights' tree) in slot `slot`; the old stack is donated."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is not in [0, {self.slots})")
        return _write(stack, np.int32(slot), weights)

    def step_fn(self, stack) -> jax.tree_util.Partial:
        """The decoders' step_fn(tokens_BT, positions_BT, cache: AdapterCache) over these slots."""
        return jax.tree_util.Partial(self._apply, self.params, stack)
