"""Many LoRA adapters in one batch, never merged: row b of a batch gets the adapter in slot idx_B[b].

    multi = MultiLora(config, params, slots=4, rank=16)     # slot 0 is "no adapter" (zeros)
    stack = multi.empty_stack()                              # the resident adapters, on the device
    weights = multi.slot_weights(spec, adapters)            # an adapter in a slot's layout, on the host
    stack = multi.write(stack, 2, weights)                   # a device write: no recompile
    cache = AdapterCache.wrap(KVCache.for_config(config, B, W), adapter=2)   # each row's slot
    logits_BTV, cache = multi.step_fn(stack)(tokens_BT, positions_BT, cache)

Each adapted Dense computes y = x W + (x A[idx_b]) B[idx_b] per row b: A [S, K, R] and B [S, R, N]
stacked over S resident slots. A prefill gathers each row's adapter (jnp.take) and applies it as a
batched low-rank matmul (einsum over the row axis); a decoding step (one position a row) runs x
through every slot's A, keeps each row's own slot, and contracts over (slot, rank) with the B stack:
the stack read once per step, not an adapter copied per row. Every slot holds every target the model
has at one rank R: an adapter of rank r < R fills its first r columns of A and rows of B (the rest
zeros add nothing), a target it does not adapt stays zeros, and its scale alpha / r (or / sqrt(r))
is folded into its B, so adapters of any rank, alpha and targets share one compiled program. The
stack is a jit argument of the step_fn (a Partial), so loading an adapter is a write into the stack,
not a recompile; the slot index travels with each row in its cache (models.cache.AdapterCache), so
decoders and the serving engine see only step_fn(tokens_BT, positions_BT, cache) as for a plain GPT.

The merged model (models.lora.merge) gives the same logits up to float rounding: x (W + s A B) against
x W + (x A)(s B). The base may be quantized (int8 or bf16: loader.compact's `quantize`, or
lora.quantize_base's): x W is then what the quantized model alone computes, each Dense by quantize's
qmatmul (lora._dense with grad=False) and the embedding by quantize's interceptor, and the adapters'
float32 term is added to it, so a slot-0 row decodes as the quantized model and an adapter's row as
QLoRA's forward (models.lora over the same quantized weights), which no merge could hold in int8.

Shape letters: S slots, B batch rows, T positions, K a Dense's input features, N its output
features, R the stack's rank, P the rank times the targets one Dense holds (q, k, v in one kernel).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from flaxgpt.models import lora, quantize
from flaxgpt.models.cache import AdapterCache
from flaxgpt.models.gpt import GPT, GPTConfig, unstack_layers


@functools.partial(jax.jit, donate_argnums=0)
def _write(stack, slot, weights):
    return jax.tree_util.tree_map(lambda s_SX, w_X: s_SX.at[slot].set(w_X.astype(s_SX.dtype)), stack, weights)


def _interceptor(by_site: dict, idx_B, rank: int):
    def intercept(next_fun, args, kwargs, context):
        module = context.module
        if context.method_name != "__call__" or not isinstance(module, nn.Dense):
            return next_fun(*args, **kwargs)
        (x,) = args
        # the base as the model alone computes it: a quantized kernel through quantize's qmatmul
        kernel = module.get_variable("params", "kernel")
        y = lora._dense(module, x, kernel, next_fun, args, kwargs, grad=False)
        parts = [p for p in by_site.get(module.name, ()) if module.has_variable("lora", f"{p[0]}_a")]
        if not parts:
            return y
        parts = sorted(parts, key=lambda p: p[1])
        stack = lambda name: module.get_variable("lora", name)  # noqa: E731
        # the blocks call their Dense layers on [B * T, K] rows, row b's positions together
        B = idx_B.shape[0]
        x_BTK = x.reshape(B, -1, x.shape[-1]).astype(jnp.float32)
        a_SKP = jnp.concatenate([stack(f"{t}_a") for t, _, _ in parts], axis=-1)  # P = parts x rank
        if x_BTK.shape[1] == 1:
            # decoding, one position a row: every slot's A and B read once for the whole batch
            # (x through all S slots, then each row keeps its own slot's columns) instead of a
            # copy of an adapter per row; S x more multiply-adds, on a rank-R sliver of the layer
            mask_BS = jax.nn.one_hot(idx_B, a_SKP.shape[0], dtype=jnp.float32)
            xa_BTSP = jnp.einsum("btk,skp->btsp", x_BTK, a_SKP) * mask_BS[:, None, :, None]
            deltas = [
                jnp.einsum("btsr,srn->btn", xa_BTSP[..., i * rank : (i + 1) * rank], stack(f"{t}_b"))
                for i, (t, _, _) in enumerate(parts)
            ]
        else:
            # a prefill: each row's adapter gathered once and used over all its positions
            take = lambda w_SXY: jnp.take(w_SXY, idx_B, axis=0)  # noqa: E731
            xa_BTP = jnp.einsum("btk,bkp->btp", x_BTK, take(a_SKP))
            deltas = [
                jnp.einsum("btr,brn->btn", xa_BTP[..., i * rank : (i + 1) * rank], take(stack(f"{t}_b")))
                for i, (t, _, _) in enumerate(parts)
            ]
        return lora.join_deltas(y, parts, [d_BTN.reshape(*y.shape[:-1], -1) for d_BTN in deltas])

    return intercept


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
        # every target the model has, at the stack's rank: one layout for any adapter
        self.spec = lora.LoraSpec.make(self.config, rank, rank, targets="all-linear")
        self.shapes = lora.adapter_shapes(self.config, self.spec)
        by_site: dict = {}
        for t, start, stop in self.spec.columns:
            by_site.setdefault(lora.SITES[t][1], []).append((t, start, stop))
        model_apply = GPT(self.config).apply
        if quantize.is_quantized(params):
            # a quantized token embedding is read by quantize's interceptor, entered inside this one:
            # flax runs the outermost first, so every Dense reaches this one (quantize's would return
            # its matmul without calling on, and the adapters would be skipped)
            model_apply = quantize.intercepted(model_apply)

        def apply(params, stack, tokens_BT, positions_BT, cache: AdapterCache, logits_at=None):
            with nn.intercept_methods(_interceptor(by_site, cache.adapter_B, rank)):
                logits, inner = model_apply(
                    {"params": params, "lora": stack},
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
        experts = [t for t in spec.targets if t in lora.EXPERT_PARAMS]
        if experts:  # the slots hold Linear adapters; a per-row expert stack would be E times their size
            raise ValueError(
                f"{what} adapts expert weights ({', '.join(experts)}), which served adapter slots do not "
                "hold: merge it into the base (flaxgpt peft merge) and serve the merged model"
            )
        lora.check_adapters(self.config, spec, adapters, what=what)
        adapters = jax.device_get(adapters)
        flat = {}
        for path, leaves in self.shapes.items():
            node = {n: np.zeros(s, np.float32) for n, s in leaves.items()}
            src = adapters
            for name in path:
                src = src.get(name, {})
            for t in spec.targets:
                if f"{t}_a" in src:
                    node[f"{t}_a"][:, : spec.rank] = np.asarray(src[f"{t}_a"], np.float32)
                    node[f"{t}_b"][: spec.rank] = np.asarray(src[f"{t}_b"], np.float32) * spec.scale
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
