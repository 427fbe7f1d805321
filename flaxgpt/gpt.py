"""The decoder-only GPT (GPT-2 family), read bottom-up like nanoGPT's model.py.

    logits_BTV = GPT(config).apply({"params": params}, tokens_BT)
    logits_BTV, cache = GPT(config).apply({"params": params}, tokens_BT,
                                          positions=pos_BT, cache=cache)

Parameter names are GPT-2's (wte, wpe, h_0 ... h_{L-1}, ln_1, attn/c_attn, attn/c_proj,
ln_2, mlp/c_fc, mlp/c_proj, ln_f, lm_head), so importing OpenAI's weights is a
name-for-name copy. With `scan_layers` the blocks live stacked under `h` with a
leading [L] axis; `stack_layers` / `unstack_layers` convert between the layouts.

Shape letters: B batch, T time, D n_embd, V vocab_size, L n_layer (see layers.py).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from flaxgpt.cache import KVCache
from flaxgpt.layers import (
    ACTIVATIONS,
    ATTENTION_IMPLS,
    MLP,
    SelfAttention,
    layer_norm,
    normal_init,
    sinusoidal_positions,
)

REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50257  # tokens the tokenizer can produce; logits have this many columns
    block_size: int = 1024  # longest sequence (context window)
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    pos_embedding: str = "learned"  # learned | sinusoidal
    activation: str = "gelu"  # gelu (tanh approx., GPT-2) | gelu_exact | relu
    tie_embeddings: bool = True  # the LM head reuses wte
    bias: bool = True  # biases in Linear layers and LayerNorms
    qkv_bias: bool = True  # bias of the fused qkv projection (c_attn)
    embd_dropout: float = 0.0
    attn_dropout: float = 0.0  # on the attention weights
    resid_dropout: float = 0.0  # on each residual branch's output
    layer_norm_epsilon: float = 1e-5
    dtype: str = "float32"  # compute dtype (bfloat16 for speed)
    param_dtype: str = "float32"
    pad_vocab_multiple: int = 1  # round the embedding rows up to this (64 is fast); 1 = exact
    attention_impl: str = "xla"  # auto | xla | cudnn | pallas (see layers.attend)
    scan_layers: bool = False  # nn.scan over the blocks: compile time independent of depth
    remat: str = "none"  # none | full | dots | dots_no_batch (activation checkpointing)

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")
        choices = {
            "pos_embedding": ("learned", "sinusoidal"),
            "activation": ACTIVATIONS,
            "attention_impl": ATTENTION_IMPLS,
            "remat": REMAT_POLICIES,
        }
        for field, allowed in choices.items():
            if getattr(self, field) not in allowed:
                raise ValueError(f"{field}={getattr(self, field)!r} is not one of {allowed}")
        for field in ("vocab_size", "block_size", "n_layer", "n_head", "pad_vocab_multiple"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    PRESETS = {
        "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
        "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
        "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),
        "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),
    }

    @classmethod
    def preset(cls, name: str, **overrides) -> GPTConfig:
        """GPT-2 sizes by name; overrides replace any field (e.g. dtype="bfloat16")."""
        if name not in cls.PRESETS:
            raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **overrides})

    @classmethod
    def gpt2(cls, **kw):
        return cls.preset("gpt2", **kw)

    @classmethod
    def gpt2_medium(cls, **kw):
        return cls.preset("gpt2-medium", **kw)

    @classmethod
    def gpt2_large(cls, **kw):
        return cls.preset("gpt2-large", **kw)

    @classmethod
    def gpt2_xl(cls, **kw):
        return cls.preset("gpt2-xl", **kw)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> GPTConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown GPTConfig fields {sorted(unknown)}")
        return cls(**d)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    config: GPTConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x_BTD, positions_BT, cache, layer):
        c = self.config
        dtype, pdtype = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
        # GPT-2: residual projections start smaller so the residual stream's
        # variance does not grow with depth
        out_std = 0.02 / math.sqrt(2 * c.n_layer)
        h_BTD, cache = SelfAttention(
            n_head=c.n_head,
            causal=True,
            use_bias=c.bias,
            qkv_bias=c.qkv_bias,
            attn_dropout=c.attn_dropout,
            resid_dropout=c.resid_dropout,
            out_init_std=out_std,
            dtype=dtype,
            param_dtype=pdtype,
            impl=c.attention_impl,
            deterministic=self.deterministic,
            name="attn",
        )(layer_norm(c.bias, c.layer_norm_epsilon, dtype, pdtype, "ln_1")(x_BTD), positions_BT, cache, layer)
        x_BTD = x_BTD + h_BTD
        x_BTD = x_BTD + MLP(
            hidden=4 * c.n_embd,
            activation=c.activation,
            use_bias=c.bias,
            dropout=c.resid_dropout,
            out_init_std=out_std,
            dtype=dtype,
            param_dtype=pdtype,
            deterministic=self.deterministic,
            name="mlp",
        )(layer_norm(c.bias, c.layer_norm_epsilon, dtype, pdtype, "ln_2")(x_BTD))
        return x_BTD, cache


class ScannedBlock(nn.Module):
    """Block in the (carry, xs) -> (carry, ys) form nn.scan wants; xs is the layer index."""

    config: GPTConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, carry, layer):
        x_BTD, positions_BT, cache = carry
        x_BTD, cache = Block(self.config, self.deterministic, name="block")(x_BTD, positions_BT, cache, layer)
        return (x_BTD, positions_BT, cache), None


def _remat_policy(name: str):
    return {
        "full": None,
        "dots": jax.checkpoint_policies.checkpoint_dots,
        "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    }[name]


class GPT(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, tokens_BT, positions=None, cache: KVCache | None = None, deterministic: bool = True):
        c = self.config
        B, T = tokens_BT.shape
        check_tokens(tokens_BT, c, cache)
        dtype, pdtype = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
        implicit_positions = positions is None
        if implicit_positions:
            positions = jnp.broadcast_to(jnp.arange(T), (B, T))
        wte = nn.Embed(
            c.padded_vocab_size,
            c.n_embd,
            dtype=dtype,
            param_dtype=pdtype,
            embedding_init=normal_init(0.02, ("vocab", "embed")),
            name="wte",
        )
        x_BTD = wte(tokens_BT)
        if c.pos_embedding == "learned":
            wpe = nn.Embed(
                c.block_size,
                c.n_embd,
                dtype=dtype,
                param_dtype=pdtype,
                embedding_init=normal_init(0.02, (None, "embed")),
                name="wpe",
            )
            # positions 0..T-1: a slice, not a gather over broadcast positions (which FSDP rematerialises)
            pos_BTD = wpe.embedding[None, :T].astype(dtype) if implicit_positions else wpe(positions)
            x_BTD = x_BTD + pos_BTD
        else:
            x_BTD = x_BTD + sinusoidal_positions(positions, c.n_embd).astype(dtype)
        x_BTD = nn.Dropout(c.embd_dropout)(x_BTD, deterministic=deterministic)

        kv = None if cache is None else (cache.k, cache.v)
        block_cls = Block
        if c.remat != "none":
            block_cls = nn.remat(Block, policy=_remat_policy(c.remat), prevent_cse=not c.scan_layers)
        if c.scan_layers:
            # nn.scan's layer index is traced: the per-layer buffers go in stacked (a copy; decoding
            # is fast unrolled, see sampling.gpt_step_fn) and come back as the tuple
            kv = None if kv is None else tuple(jnp.stack(bufs) for bufs in kv)
            scan_cls = ScannedBlock
            if c.remat != "none":
                scan_cls = nn.remat(ScannedBlock, policy=_remat_policy(c.remat), prevent_cse=False)
            (x_BTD, _, kv), _ = nn.scan(
                scan_cls,
                variable_axes={"params": 0, "intermediates": 0},
                split_rngs={"params": True, "dropout": True},
                length=c.n_layer,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )(c, deterministic, name="h")((x_BTD, positions, kv), jnp.arange(c.n_layer))
            kv = None if kv is None else tuple(tuple(stacked) for stacked in kv)
        else:
            for i in range(c.n_layer):
                x_BTD, kv = block_cls(c, deterministic, name=f"h_{i}")(x_BTD, positions, kv, i)

        x_BTD = layer_norm(c.bias, c.layer_norm_epsilon, dtype, pdtype, "ln_f")(x_BTD)
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)  # 2-D operands: see layers.MLP
        if c.tie_embeddings and B * T <= 64:
            # few rows (decoding): the [V, D] table as the left operand, rows as they lie in
            # memory; XLA on CPU streams it ~2x faster than x @ wte^T, which packs it first
            wte_VD = wte.embedding.astype(dtype)
            logits_BTV = jnp.dot(wte_VD, x_ND.astype(dtype).T).T.reshape(B, T, -1)
        elif c.tie_embeddings:
            logits_BTV = wte.attend(x_ND).reshape(B, T, -1)
        else:
            logits_BTV = nn.Dense(
                c.padded_vocab_size,
                use_bias=False,
                dtype=dtype,
                param_dtype=pdtype,
                kernel_init=normal_init(0.02, ("embed", "vocab")),
                name="lm_head",
            )(x_ND).reshape(B, T, -1)
        # padded vocabulary rows exist for speed only: callers never see them
        logits_BTV = logits_BTV[..., : c.vocab_size]
        if cache is None:
            return logits_BTV
        return logits_BTV, cache.replace(k=kv[0], v=kv[1])


def check_tokens(tokens_BT, config: GPTConfig, cache=None):
    """Errors for the bad input that can be seen before tracing: length and id range."""
    if tokens_BT.ndim != 2:
        raise ValueError(f"tokens must be [batch, time], got shape {tokens_BT.shape}")
    T = tokens_BT.shape[1]
    limit = config.block_size if cache is None else cache.max_len
    if T > limit:
        raise ValueError(
            f"sequence length {T} is longer than block_size {limit}; "
            "crop the input to the last block_size tokens"
        )
    if not isinstance(tokens_BT, jax.core.Tracer):
        arr = np.asarray(tokens_BT)
        if arr.size and (arr.min() < 0 or arr.max() >= config.vocab_size):
            raise ValueError(
                f"token ids must be in [0, {config.vocab_size}), got min {arr.min()} max {arr.max()}"
            )


def init_params(config: GPTConfig, rng: jax.Array):
    """Plain (unboxed) float parameters: {'wte': ..., 'h_0': ..., ...}."""
    dummy = jnp.zeros((1, min(8, config.block_size)), jnp.int32)
    variables = GPT(config).init(rng, dummy)
    return nn.unbox(variables["params"])


def abstract_params(config: GPTConfig):
    """ShapeDtypeStructs of the parameters, still boxed with their logical axes."""
    dummy = jnp.zeros((1, min(8, config.block_size)), jnp.int32)
    return jax.eval_shape(lambda r: GPT(config).init(r, dummy), jax.random.key(0))["params"]


def count_params(params, exclude_embeddings: bool = False) -> int:
    """Number of parameters; `exclude_embeddings` drops wpe (nanoGPT's convention)."""
    params = nn.unbox(params)
    n = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
    if exclude_embeddings and "wpe" in params:
        n -= int(np.prod(params["wpe"]["embedding"].shape))
    return n


def stack_layers(params, n_layer: int):
    """h_0 ... h_{L-1} -> h/block with a leading [L] axis (the scan_layers layout)."""
    params = dict(params)
    layers = [params.pop(f"h_{i}") for i in range(n_layer)]
    params["h"] = {"block": jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *layers)}
    return params


def unstack_layers(params, n_layer: int):
    """h/block [L, ...] -> h_0 ... h_{L-1} (the GPT-2 layout)."""
    params = dict(params)
    stacked = params.pop("h")["block"]
    for i in range(n_layer):
        params[f"h_{i}"] = jax.tree_util.tree_map(lambda x, i=i: x[i], stacked)
    return params
