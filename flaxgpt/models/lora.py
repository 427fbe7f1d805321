"""LoRA adapters on the GPT's linear layers (Hu et al. 2021), over a float32, bf16 or int8 base.

    spec = LoraSpec.make(config, rank=8, alpha=16, dropout=0.05, targets="all-linear")
    adapters = init_adapters(config, spec, rng)                 # the only trained tree
    logits_BTV = apply(config, spec, base, adapters, tokens_BT)  # base frozen: not differentiated
    params = merge(config, spec, base, adapters)                 # W + (alpha / r) A B, a plain GPT

Each targeted linear layer computes y = x W + dropout(x) A B * alpha / r with A [K, r] (random) and
B [r, N] (zeros: training starts at the base model). `apply` runs GPT(config, lora=spec), whose
linear layers (models/linear.py) add the adapters they find at their own paths and MoE layers give
their stacks theirs (moe.LoraExperts). Adapters live in their own variable collection
"lora", at the same paths as the Dense they adapt (h_0/attn/c_attn/q_a ...; stacked [L, ...]
under h/block with scan_layers), so the trainer differentiates and checkpoints only them and
the base is a frozen argument (sharded as for full fine-tuning).

Targets name the projections as Hugging Face PEFT does, one adapter each. flaxgpt fuses
q | k | v into c_attn and gate | up into c_fc, so a Llama-family q, k or v adapter writes its
own column block of the fused output; GPT-2 itself fuses c_attn, so its adapter spans all of it:
  Llama / Mistral / Qwen2:  q k v (attn/c_attn), o (attn/c_proj), gate up (mlp/c_fc), down (mlp/c_proj)
  GPT-2 (no gated MLP):     qkv (attn/c_attn), o (attn/c_proj), up (mlp/c_fc), down (mlp/c_proj)
  a mixture of experts:     the attention's, and experts_gate_up (mlp/experts_fc), experts_down
                            (mlp/experts_proj): PEFT's target_parameters on the stacked expert
                            tensors, an A [E, K, r] / B [E, r, N] pair per stack (moe.LoraExperts)
"all-linear" is every Linear of them, never the LM head or the expert stacks (PEFT 0.21's "all-linear"
on a mixture of experts also takes the stacks and the router, which flaxgpt does not adapt).

An int8 or bf16 base (`quantize_base`: QLoRA-style, adapters stay float32) is applied as the
quantized model alone applies it (linear.qdot: kernels.qmatmul, with a gradient for the activations),
the adapters' float32 terms added to its output.

Why not qwix's LoraProvider (qwix 0.1.8): it gives each weight one A/B pair, so it cannot hold
PEFT's separate q/k/v (gate/up) adapters on flaxgpt's fused kernels; it quantizes the base in its
own QArray format instead of flaxgpt's QuantizedWeight; its adapters share the "params"
collection with the base (the trainer would have to split them back out); and its linen dropout
is never deterministic, so evaluation would be noisy.

Shape letters: K a Dense's input features, N its output features, r the rank, L layers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from flaxgpt.models.gpt import GPT, GPTConfig, unstack_layers
from flaxgpt.models.moe import EXPERT_PARAMS  # expert target -> the stacked weight it adapts
from flaxgpt.models.quantize import QuantizedWeight, quantize_rows

# target -> (the Dense it adapts inside a block, the Dense's name); columns come from `_columns`
SITES = {
    "q": ("attn", "c_attn"),
    "k": ("attn", "c_attn"),
    "v": ("attn", "c_attn"),
    "qkv": ("attn", "c_attn"),
    "o": ("attn", "c_proj"),
    "gate": ("mlp", "c_fc"),
    "up": ("mlp", "c_fc"),
    "down": ("mlp", "c_proj"),
    "experts_gate_up": ("mlp",),  # a mixture of experts' stacks: the adapters sit beside them in "mlp"
    "experts_up": ("mlp",),
    "experts_down": ("mlp",),
}
LLAMA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
GPT2_TARGETS = ("qkv", "o", "up", "down")
MLP_TARGETS = ("gate", "up", "down")
BASE_DTYPES = ("float32", "bfloat16", "int8")


def model_targets(config: GPTConfig) -> tuple[str, ...]:
    """The targets a model has: PEFT's modules of its Hugging Face family; of a mixture of experts the
    attention's and the expert stacks' (its sparse layers have no dense MLP)."""
    have = LLAMA_TARGETS if config.glu else GPT2_TARGETS
    if not config.num_experts:
        return have
    experts = ("experts_gate_up" if config.glu else "experts_up", "experts_down")
    return tuple(t for t in have if t not in MLP_TARGETS) + experts


def linear_targets(config: GPTConfig) -> tuple[str, ...]:
    """ "all-linear": the model's targets that are Linear modules in PEFT (never the expert stacks,
    named on their own)."""
    return tuple(t for t in model_targets(config) if t not in EXPERT_PARAMS)


def _columns(config: GPTConfig, target: str) -> tuple[int, int]:
    """The output columns [start, stop) of the fused Dense that `target` writes."""
    HK, JK = config.n_head * config.head_dim, config.kv_heads * config.head_dim
    F = config.mlp_hidden or 4 * config.n_embd
    D = config.n_embd
    if target in EXPERT_PARAMS:  # the whole stack: gate | up columns together, as PEFT's gate_up_proj
        F_e = config.expert_mlp_hidden
        return (0, D) if target == "experts_down" else (0, 2 * F_e if config.glu else F_e)
    return {
        "q": (0, HK),
        "k": (HK, HK + JK),
        "v": (HK + JK, HK + 2 * JK),
        "qkv": (0, HK + 2 * JK),
        "o": (0, D),
        "gate": (0, F),
        "up": (F, 2 * F) if config.glu else (0, F),
        "down": (0, D),
    }[target]


def _in_features(config: GPTConfig, target: str) -> int:
    if target == "experts_down":
        return config.expert_mlp_hidden
    if target == "o":
        return config.n_head * config.head_dim
    if target == "down":
        return config.mlp_hidden or 4 * config.n_embd
    return config.n_embd


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    columns: tuple[tuple[str, int, int], ...]  # (target, start, stop): static, for linear.Linear
    rslora: bool = False  # scale alpha / sqrt(r) (PEFT's use_rslora) instead of alpha / r

    @property
    def scale(self) -> float:
        return self.alpha / (np.sqrt(self.rank) if self.rslora else self.rank)

    @staticmethod
    def make(
        config: GPTConfig, rank: int, alpha: float, dropout: float = 0.0, targets="all-linear", rslora=False
    ):
        """Checked: rank > 0, dropout in [0, 1), targets the model has ("all-linear" or a list / "q,v")."""
        if rank <= 0:
            raise ValueError(f"lora rank {rank} must be > 0 (rank 0 means LoRA off)")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"lora dropout {dropout} must be in [0, 1)")
        names = resolve_targets(config, targets)
        experts = [t for t in names if t in EXPERT_PARAMS]
        if dropout and experts:  # x A B per expert row after the routing: PEFT refuses it too
            raise ValueError(
                f"lora dropout {dropout} cannot apply to expert weights ({', '.join(experts)}); "
                "set lora.dropout=0 or leave the experts out of lora.targets"
            )
        columns = tuple((t, *_columns(config, t)) for t in names)
        return LoraSpec(int(rank), float(alpha), float(dropout), names, columns, bool(rslora))


def resolve_targets(config: GPTConfig, targets) -> tuple[str, ...]:
    have = model_targets(config)
    if isinstance(targets, str):
        targets = (
            linear_targets(config)
            if targets == "all-linear"
            else [t.strip() for t in targets.split(",") if t.strip()]
        )
    unknown = [t for t in targets if t not in have]
    if unknown or not targets:
        family = (
            "mixture-of-experts" if config.num_experts else "Llama-family" if config.glu else "GPT-2-style"
        )
        raise ValueError(
            f"lora targets {list(targets)}: this {family} model has no {', '.join(unknown) or 'targets'}; "
            f"choose from {', '.join(have)} or all-linear"
        )
    return tuple(t for t in have if t in targets)  # the model's order: one layout per spec


def _layer_prefixes(config: GPTConfig) -> list[tuple[str, ...]]:
    return [("h", "block")] if config.scan_layers else [(f"h_{i}",) for i in range(config.n_layer)]


def adapter_shapes(config: GPTConfig, spec: LoraSpec) -> dict:
    """{path to a Dense: {target_a: shape [K, r], target_b: shape [r, N]}} (with [L] first under scan);
    an expert target's pair sits in its sparse layers' "mlp", [E, K, r] and [E, r, N]."""
    lead = (config.n_layer,) if config.scan_layers else ()
    out = {}
    for i, prefix in enumerate(_layer_prefixes(config)):
        for t, start, stop in spec.columns:
            experts = ()
            if t in EXPERT_PARAMS:
                # a dense layer (Qwen3-MoE's mlp_only_layers) has no stacks; scanned layers are all sparse
                if not config.layer_is_sparse(i):
                    continue
                experts = (config.num_experts,)
            node = out.setdefault(prefix + SITES[t], {})
            node[f"{t}_a"] = lead + experts + (_in_features(config, t), spec.rank)
            node[f"{t}_b"] = lead + experts + (spec.rank, stop - start)
    return out


def _nest(flat: dict) -> dict:
    tree: dict = {}
    for path, leaves in flat.items():
        node = tree
        for name in path:
            node = node.setdefault(name, {})
        node.update(leaves)
    return tree


def init_adapters(config: GPTConfig, spec: LoraSpec, rng: jax.Array) -> dict:
    """A like PEFT's default (Kaiming-uniform, bound 1/sqrt(K)), B zeros: the model starts as the base."""
    flat = adapter_shapes(config, spec)
    keys = jax.random.split(rng, max(1, len(flat)))
    out = {}
    for key, (path, shapes) in zip(keys, flat.items()):
        node = {}
        for i, (name, shape) in enumerate(sorted(shapes.items())):
            if name.endswith("_a"):
                bound = 1.0 / np.sqrt(shape[-2])
                node[name] = jax.random.uniform(jax.random.fold_in(key, i), shape, jnp.float32, -bound, bound)
            else:
                node[name] = jnp.zeros(shape, jnp.float32)
        out[path] = node
    return _nest(out)


def check_adapters(config: GPTConfig, spec: LoraSpec, adapters, what: str = "adapter") -> None:
    """One-line error naming the first tensor whose shape does not fit this model and spec."""
    expected = {
        path + (n,): s for path, leaves in adapter_shapes(config, spec).items() for n, s in leaves.items()
    }
    got = {
        tuple(k.key for k in path): tuple(x.shape)
        for path, x in jax.tree_util.tree_flatten_with_path(adapters)[0]
    }
    for name in sorted(set(expected) | set(got)):
        if expected.get(name) != got.get(name):
            raise ValueError(
                f"{what} tensor {'/'.join(name)} has shape {got.get(name)}, this model needs "
                f"{expected.get(name)}; was it made for another model or rank?"
            )


# ---------------------------------------------------------------- the forward pass


@functools.cache
def _model(config: GPTConfig, spec: LoraSpec):
    return GPT(config, lora=spec)


def apply(
    config: GPTConfig, spec: LoraSpec, base, adapters, tokens_BT, *, deterministic=True, rng=None, **kw
):
    """GPT(config)(tokens) with the adapters added; `rng` (dropout) when not deterministic."""
    return _model(config, spec).apply(
        {"params": base, "lora": adapters},
        tokens_BT,
        deterministic=deterministic,
        rngs=None if rng is None else {"dropout": rng},
        **kw,
    )


@functools.cache
def _apply_with_cache(config: GPTConfig, spec: LoraSpec):
    model = GPT(config, lora=spec)

    def apply(base, adapters, tokens_BT, positions_BT, cache, logits_at=None):
        return model.apply(
            {"params": base, "lora": adapters},
            tokens_BT,
            positions=positions_BT,
            cache=cache,
            logits_at=logits_at,
        )

    return apply


def step_fn(config: GPTConfig, spec: LoraSpec, base, adapters) -> jax.tree_util.Partial:
    """The GPT with its adapters added, unmerged, as a decoder's step_fn (gpt.step_fn's contract):
    any base quantize_base gives (int8 too, which `merge` cannot hold). Base and adapters are the
    Partial's jit arguments: new weights each call, one compiled program (GRPO's rollouts)."""
    if config.scan_layers:  # decode unrolled: each layer reads its own cache buffer in place
        base, adapters = unstack_layers(base, config.n_layer), unstack_layers(adapters, config.n_layer)
        config = dataclasses.replace(config, scan_layers=False)
    config = dataclasses.replace(config, remat="none")  # no gradients here
    return jax.tree_util.Partial(_apply_with_cache(config, spec), base, adapters)


# ---------------------------------------------------------------- base and merge


def quantize_base(base, dtype: str):
    """The frozen base in `dtype`: float32 as is, bfloat16 by a cast, int8 with per-output-channel
    scales on every Dense kernel of the blocks (quantize.quantize_rows; embeddings, head and norms stay
    float32). jax.eval_shape of it gives the abstract base (ahead-of-time compiles: train.policy's
    ABSTRACT mode), placed by the caller (base_shardings)."""
    if dtype not in BASE_DTYPES:
        raise ValueError(f"lora base_dtype {dtype!r}: choose one of {', '.join(BASE_DTYPES)}")
    if dtype == "float32":
        return base
    if dtype == "bfloat16":
        return jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.bfloat16) if x.ndim >= 2 else x, base)

    def rows(kernel):  # [.., K, N] -> QuantizedWeight(w [.., N, K] int8, scale [.., N])
        if kernel.ndim == 2:
            return quantize_rows(kernel.T, "int8")
        layers = [quantize_rows(k.T, "int8") for k in kernel]  # scan_layers: per layer
        return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *layers)

    def visit(tree, in_block):
        out = {}
        for name, value in tree.items():
            if isinstance(value, dict):
                out[name] = visit(value, in_block or name.startswith("h"))
            else:
                out[name] = rows(value) if in_block and name == "kernel" else value
        return out

    return visit(dict(base), False)


def base_shardings(float_shardings, base):
    """Shardings of the frozen base from those of its float parameters (full fine-tuning's FSDP):
    a QuantizedWeight's w [.., N, K] is its kernel [.., K, N] transposed, its scale [.., N] follows N."""

    def one(s, leaf):
        if not isinstance(leaf, QuantizedWeight):
            return s
        *lead, k, n = tuple(s.spec) + (None,) * (leaf.w.ndim - len(s.spec))
        named = lambda *axes: jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*axes))  # noqa: E731
        return QuantizedWeight(named(*lead, n, k), named(*lead, n))

    return jax.tree_util.tree_map(
        one, float_shardings, base, is_leaf=lambda x: isinstance(x, QuantizedWeight)
    )


def merge(config: GPTConfig, spec: LoraSpec, base, adapters):
    """Plain GPT params with W + (alpha / r) A B in each adapted kernel's columns (float32 base)."""
    check_adapters(config, spec, adapters)
    out = jax.tree_util.tree_map(lambda x: x, dict(base))  # a new tree: the base is not changed
    for prefix in _layer_prefixes(config):
        for t, start, stop in spec.columns:
            node = adapters
            for name in prefix + SITES[t]:
                node = node.get(name, {})
            if f"{t}_a" not in node:  # an expert target in a dense layer
                continue
            owner = out
            for name in prefix + SITES[t]:
                owner[name] = dict(owner[name])
                owner = owner[name]
            delta = jnp.einsum("...kr,...rn->...kn", node[f"{t}_a"], node[f"{t}_b"]) * spec.scale
            field = EXPERT_PARAMS.get(t, "kernel")  # an expert stack [.., E, K, N], or a Dense's kernel
            kernel = jnp.asarray(owner[field])
            owner[field] = kernel.at[..., start:stop].add(delta.astype(kernel.dtype))
    return out
