"""The decoder-only GPT (GPT-2 family), read bottom-up like nanoGPT's model.py.

    logits_BTV = GPT(config).apply({"params": params}, tokens_BT)
    logits_BTV, cache = GPT(config).apply({"params": params}, tokens_BT,
                                          positions=pos_BT, cache=cache)
    step = step_fn(config, params)    # the same, as flaxgpt.sampling's step_fn

Parameter names are GPT-2's (wte, wpe, h_0 ... h_{L-1}, ln_1, attn/c_attn, attn/c_proj,
ln_2, mlp/c_fc, mlp/c_proj, ln_f, lm_head), so importing OpenAI's weights is a
name-for-name copy. The same module is a Llama / Mistral / Qwen2 decoder with the options of
the second block of GPTConfig (RoPE, RMSNorm, SwiGLU, grouped-query attention, ...; presets
"smollm2-135m", "llama-3.2-1b", ...); their weights map onto these names in hf_llama.py.
With `scan_layers` the blocks live stacked under `h` with a leading [L] axis;
`stack_layers` / `unstack_layers` convert between the layouts.

Shape letters: B batch, T time, D n_embd, V vocab_size, L n_layer (see layers.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from flaxgpt import quantize
from flaxgpt.cache import KVCache
from flaxgpt.layers import (
    ACTIVATIONS,
    ATTENTION_IMPLS,
    MLP,
    NORMS,
    SINUSOID_LAYOUTS,
    SelfAttention,
    norm,
    normal_init,
    ones_init,
    sinusoidal_positions,
)
from flaxgpt.rope import ROPE_SCALINGS, RoPE

REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
# what Llama, Mistral and Qwen2 share (the presets below add their shapes)
LLAMA_STYLE = dict(pos_embedding="rope", norm="rmsnorm", activation="silu", glu=True, bias=False)
LLAMA_STYLE.update(qkv_bias=False)


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50257  # tokens the tokenizer can produce; logits have this many columns
    block_size: int = 1024  # longest sequence (context window)
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    pos_embedding: str = "learned"  # learned | sinusoidal | rope (rotary, in the attention)
    sinusoid_layout: str = "interleaved"  # interleaved (the paper's sin, cos, ...) | halves (older runs)
    activation: str = "gelu"  # gelu (tanh approx., GPT-2) | gelu_exact | relu | silu | relu2
    tie_embeddings: bool = True  # the LM head reuses wte
    bias: bool = True  # biases in Linear layers and LayerNorms
    qkv_bias: bool = True  # bias of the fused qkv projection (c_attn)
    dropout: float = 0.0  # the default rate of the three below (training only)
    embd_dropout: float = -1.0  # on token + position embeddings; -1 = dropout
    attn_dropout: float = -1.0  # on the attention weights; -1 = dropout
    resid_dropout: float = -1.0  # on each residual branch's output; -1 = dropout
    layer_norm_epsilon: float = 1e-5
    dtype: str = "float32"  # compute dtype (bfloat16 for speed)
    param_dtype: str = "float32"
    pad_vocab_multiple: int = 1  # round the embedding rows up to this (64 is fast); 1 = exact
    attention_impl: str = "xla"  # auto | xla | cudnn | pallas (see layers.attend)
    scan_layers: bool = False  # nn.scan over the blocks: compile time independent of depth
    remat: str = "none"  # none | full | dots | dots_no_batch (activation checkpointing)
    # modern decoders (Llama, Mistral, Qwen2); the defaults are GPT-2's
    norm: str = "layernorm"  # layernorm | rmsnorm (Llama); eps is layer_norm_epsilon
    glu: bool = False  # gated MLP act(x W_gate) * (x W_up): with activation=silu, SwiGLU
    mlp_hidden: int = 0  # the MLP's hidden size F; 0 = 4 * n_embd
    n_kv_head: int = 0  # key/value heads: 0 = n_head, 1 = multi-query, else grouped-query
    qk_norm: bool = False  # normalise each head's queries and keys (with `norm`) before attention
    rope_theta: float = 10000.0  # pos_embedding=rope: base of the rotary frequencies
    rope_scaling: str = "none"  # none | llama3 (Llama 3.1's long-context frequency scaling)
    rope_factor: float = 1.0  # llama3: context extension factor
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_original_max_len: int = 8192  # llama3: the pretraining context
    sliding_window: int = 0  # each query sees the last sliding_window keys (Mistral); 0 = all
    logit_softcap: float = 0.0  # logits = cap * tanh(logits / cap) (Gemma 2); 0 = off
    # the modded-nanogpt speedrun's architecture (activation="relu2" is its MLP)
    zero_init_proj: bool = False  # attention and MLP output projections (and an untied head) start at 0
    unet_skips: bool = False  # U-net: block L-1-i also gets block i's output, times a learned weight
    value_embeds: int = 0  # N extra token tables mixed into the values of the first N and last N blocks

    def __post_init__(self):
        # resolved here, so the stored rates are the real ones (what config.json records)
        for name in ("embd_dropout", "attn_dropout", "resid_dropout"):
            if getattr(self, name) < 0:
                object.__setattr__(self, name, self.dropout)
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")
        if (self.unet_skips or self.value_embeds) and self.scan_layers:
            raise ValueError(
                "unet_skips and value_embeds need scan_layers=False (each block takes its own inputs)"
            )
        if not 0 <= self.value_embeds <= self.n_layer // 2:
            raise ValueError(
                f"value_embeds {self.value_embeds} must be in [0, n_layer // 2 = {self.n_layer // 2}]"
            )
        if self.n_kv_head < 0 or self.n_head % (self.n_kv_head or self.n_head):
            raise ValueError(f"n_head {self.n_head} is not divisible by n_kv_head {self.n_kv_head}")
        choices = {
            "pos_embedding": ("learned", "sinusoidal", "rope"),
            "sinusoid_layout": SINUSOID_LAYOUTS,
            "activation": ACTIVATIONS,
            "attention_impl": ATTENTION_IMPLS,
            "remat": REMAT_POLICIES,
            "norm": NORMS,
            "rope_scaling": ROPE_SCALINGS,
        }
        for field, allowed in choices.items():
            if getattr(self, field) not in allowed:
                raise ValueError(f"{field}={getattr(self, field)!r} is not one of {allowed}")
        for field in ("vocab_size", "block_size", "n_layer", "n_head", "pad_vocab_multiple"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")

        for field in ("mlp_hidden", "sliding_window"):
            if getattr(self, field) < 0:
                raise ValueError(f"{field} must be >= 0 (0 = the default), got {getattr(self, field)}")
        if self.logit_softcap < 0:
            raise ValueError(f"logit_softcap must be >= 0 (0 = off), got {self.logit_softcap}")
        if self.pos_embedding == "rope":
            self.rope  # noqa: B018 -- RoPE checks its own arguments

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        """J, the key/value heads the attention projects and the KV cache stores."""
        return self.n_kv_head or self.n_head

    @property
    def rope(self) -> RoPE | None:
        if self.pos_embedding != "rope":
            return None
        return RoPE(
            self.head_dim,
            self.rope_theta,
            self.rope_scaling,
            self.rope_factor,
            self.rope_low_freq_factor,
            self.rope_high_freq_factor,
            self.rope_original_max_len,
        )

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    # fmt: off
    PRESETS = {
        "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
        "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
        "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),
        "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),
        # the published config.json shapes of Llama-family models (summaries, from-scratch runs)
        "smollm2-135m": dict(
            LLAMA_STYLE, vocab_size=49152, block_size=8192, n_layer=30, n_head=9, n_kv_head=3, n_embd=576,
            mlp_hidden=1536, rope_theta=100000.0,
        ),
        "llama-3.2-1b": dict(
            LLAMA_STYLE, vocab_size=128256, block_size=131072, n_layer=16, n_head=32, n_kv_head=8,
            n_embd=2048, mlp_hidden=8192, rope_theta=500000.0, rope_scaling="llama3", rope_factor=32.0,
            rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_len=8192,
        ),
        "qwen2.5-0.5b": dict(
            LLAMA_STYLE, qkv_bias=True, vocab_size=151936, block_size=32768, n_layer=24, n_head=14,
            n_kv_head=2, n_embd=896, mlp_hidden=4864, rope_theta=1000000.0, layer_norm_epsilon=1e-6,
        ),
        "mistral-7b-v0.1": dict(
            LLAMA_STYLE, vocab_size=32000, block_size=32768, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096,
            mlp_hidden=14336, sliding_window=4096, tie_embeddings=False,
        ),
    }
    # fmt: on

    @classmethod
    def preset(cls, name: str, **overrides) -> GPTConfig:
        """GPT-2 (or a Llama-family model's) shape by name; overrides replace any field (dtype=...)."""
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
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x)).

    `kv` is this layer's own (k, v) cache buffers (or None); the block returns them updated.
    """

    config: GPTConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x_BTD, positions_BT, kv=None, ve_BTD=None):
        c = self.config
        dtype, pdtype = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
        # GPT-2: residual projections start smaller so the residual stream's variance does not
        # grow with depth; the speedrun starts them at zero (each block starts as the identity)
        out_std = 0.0 if c.zero_init_proj else 0.02 / math.sqrt(2 * c.n_layer)
        ln = lambda name: norm(c.norm, c.bias, c.layer_norm_epsilon, dtype, pdtype, name)  # noqa: E731
        h_BTD, kv = SelfAttention(
            n_head=c.n_head,
            n_kv_head=c.kv_heads,
            rope=c.rope,
            qk_norm=c.norm if c.qk_norm else None,
            norm_eps=c.layer_norm_epsilon,
            window=c.sliding_window,
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
        )(ln("ln_1")(x_BTD), positions_BT, kv, ve_BTD=ve_BTD)
        x_BTD = x_BTD + h_BTD
        x_BTD = x_BTD + MLP(
            hidden=c.mlp_hidden or 4 * c.n_embd,
            activation=c.activation,
            glu=c.glu,
            use_bias=c.bias,
            dropout=c.resid_dropout,
            out_init_std=out_std,
            dtype=dtype,
            param_dtype=pdtype,
            deterministic=self.deterministic,
            name="mlp",
        )(ln("ln_2")(x_BTD))
        return x_BTD, kv


class ScannedBlock(nn.Module):
    """Block in nn.scan's (carry, xs) -> (carry, ys) form: xs and ys are the layer's (k, v)."""

    config: GPTConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, carry, kv):
        x_BTD, positions_BT = carry
        x_BTD, kv = Block(self.config, self.deterministic, name="block")(x_BTD, positions_BT, kv)
        return (x_BTD, positions_BT), kv


def _remat_policy(name: str):
    return {
        "full": None,
        "dots": jax.checkpoint_policies.checkpoint_dots,
        "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    }[name]


def wpe_prefix(wpe_SD: jax.Array, T: int) -> jax.Array:
    """Learned embeddings of positions 0..T-1 -> [1, T, D]."""
    # a slice, not a gather over broadcast positions (which FSDP rematerialises)
    return wpe_SD[None, :T]


def tied_head_few_rows(wte_VD: jax.Array, x_ND: jax.Array) -> jax.Array:
    """x @ wte^T -> [N, V] for the few rows of a decoding step."""
    # the [V, D] table as the left operand, rows as they lie in memory: XLA on CPU streams it
    # ~2x faster than x @ wte^T, which packs it first
    return jnp.dot(wte_VD, x_ND.T).T


class GPT(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(
        self,
        tokens_BT,
        positions=None,
        cache: KVCache | None = None,
        deterministic: bool = True,
        logits_at=None,
    ):
        """tokens [B, T] -> logits [B, T, V]; with a cache (and positions [B, T], default
        0..T-1) the keys/values are written at `positions` and (logits, cache) comes back.
        With `logits_at` [B] (time indices), the logits are those of one position per row: [B, 1, V]."""
        c = self.config
        check_tokens(tokens_BT, c, cache)
        dtype, pdtype = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
        B, T = tokens_BT.shape
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
        if c.pos_embedding != "rope":  # rope: positions rotate queries and keys inside each attention
            x_BTD = x_BTD + self._position_embeddings(positions, implicit_positions)
        x_BTD = nn.Dropout(c.embd_dropout)(x_BTD, deterministic=deterministic)
        kv_layers = None if cache is None else [cache.layer(i) for i in range(c.n_layer)]
        x_BTD, kv_layers = self._blocks(x_BTD, positions, kv_layers, deterministic, tokens_BT)
        if (
            logits_at is not None
        ):  # a prefill draws from one position: skip the head (1/3 of GPT-2's FLOPs) elsewhere
            x_BTD = jnp.take_along_axis(x_BTD, jnp.asarray(logits_at)[:, None, None], axis=1)
        x_BTD = norm(c.norm, c.bias, c.layer_norm_epsilon, dtype, pdtype, "ln_f")(x_BTD)
        logits_BTV = self._head(wte, x_BTD)
        # padded vocabulary rows exist for speed only: callers never see them
        logits_BTV = logits_BTV[..., : c.vocab_size]
        if c.logit_softcap:  # bounded logits (Gemma 2), in float32
            logits_BTV = c.logit_softcap * jnp.tanh(logits_BTV.astype(jnp.float32) / c.logit_softcap)
        if cache is None:
            return logits_BTV
        return logits_BTV, KVCache.from_layers(kv_layers, cache.n_head)

    def _position_embeddings(self, positions_BT, implicit: bool):
        c = self.config
        dtype = jnp.dtype(c.dtype)
        if c.pos_embedding == "sinusoidal":
            return sinusoidal_positions(positions_BT, c.n_embd, c.sinusoid_layout, dtype).astype(dtype)
        wpe = nn.Embed(
            c.block_size,
            c.n_embd,
            dtype=dtype,
            param_dtype=jnp.dtype(c.param_dtype),
            embedding_init=normal_init(0.02, (None, "embed")),
            name="wpe",
        )
        if implicit:
            return wpe_prefix(wpe.embedding, positions_BT.shape[1]).astype(dtype)
        return wpe(positions_BT)

    def _blocks(self, x_BTD, positions_BT, kv_layers, deterministic: bool, tokens_BT=None):
        """The n_layer blocks; kv_layers (or None) holds each layer's (k, v), handed to its block."""
        c = self.config
        if c.scan_layers:
            # the layers' buffers are the scan's xs and ys, stacked [L, ...] (a copy each way;
            # decoding unrolls the layers instead, see step_fn)
            stacked = (
                None if kv_layers is None else jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *kv_layers)
            )
            scan_cls = ScannedBlock
            if c.remat != "none":
                scan_cls = nn.remat(ScannedBlock, policy=_remat_policy(c.remat), prevent_cse=False)
            (x_BTD, _), stacked = nn.scan(
                scan_cls,
                variable_axes={"params": 0, "intermediates": 0},
                split_rngs={"params": True, "dropout": True},
                length=c.n_layer,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )(c, deterministic, name="h")((x_BTD, positions_BT), stacked)
            if stacked is not None:
                kv_layers = [(stacked[0][i], stacked[1][i]) for i in range(c.n_layer)]
            return x_BTD, kv_layers
        block_cls = Block
        if c.remat != "none":
            block_cls = nn.remat(Block, policy=_remat_policy(c.remat))
        L, n_enc = c.n_layer, c.n_layer // 2 if c.unet_skips else 0
        if c.unet_skips:  # decoder block n_enc + j adds skip_weights[j] x the output of block n_enc-1-j
            pdtype = jnp.dtype(c.param_dtype)
            skip_weights = self.param("skip_weights", ones_init((None,)), (L - n_enc,), pdtype)
        ve_layers = self._value_embeddings(tokens_BT)
        skips, out = [], []
        for i in range(L):
            if i >= n_enc and skips:
                x_BTD = x_BTD + skip_weights[i - n_enc].astype(x_BTD.dtype) * skips.pop()
            kv = None if kv_layers is None else kv_layers[i]
            x_BTD, kv = block_cls(c, deterministic, name=f"h_{i}")(x_BTD, positions_BT, kv, ve_layers[i])
            if i < n_enc:
                skips.append(x_BTD)
            out.append(kv)
        return x_BTD, None if kv_layers is None else out

    def _value_embeddings(self, tokens_BT) -> list:
        """Per block: table j of `value_embeds` N for block j and block L-N+j (a U-net pattern), else None."""
        c, N = self.config, self.config.value_embeds
        tables = [
            nn.Embed(
                c.padded_vocab_size,
                c.kv_heads * c.head_dim,  # the width of the values
                dtype=jnp.dtype(c.dtype),
                param_dtype=jnp.dtype(c.param_dtype),
                embedding_init=normal_init(0.02, ("vocab", "embed")),
                name=f"value_embed_{j}",
            )(tokens_BT)
            for j in range(N)
        ]
        return tables + [None] * (c.n_layer - 2 * N) + tables

    def _head(self, wte, x_BTD):
        c = self.config
        dtype = jnp.dtype(c.dtype)
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)  # 2-D operands: see layers.MLP
        if not c.tie_embeddings:
            lm_head = nn.Dense(
                c.padded_vocab_size,
                use_bias=False,
                dtype=dtype,
                param_dtype=jnp.dtype(c.param_dtype),
                kernel_init=normal_init(0.0 if c.zero_init_proj else 0.02, ("embed", "vocab")),
                name="lm_head",
            )
            return lm_head(x_ND).reshape(B, T, -1)
        if B * T <= 64:
            return tied_head_few_rows(wte.embedding.astype(dtype), x_ND.astype(dtype)).reshape(B, T, -1)
        return wte.attend(x_ND).reshape(B, T, -1)


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


@functools.cache
def _apply_with_cache(config: GPTConfig):
    model = GPT(config)

    def apply(params, tokens_BT, positions_BT, cache, logits_at=None):
        return model.apply(
            {"params": params}, tokens_BT, positions=positions_BT, cache=cache, logits_at=logits_at
        )

    return apply


def step_fn(config: GPTConfig, params) -> jax.tree_util.Partial:
    """The GPT as a decoder's step_fn(tokens_BT, positions_BT, cache: KVCache) -> (logits_BTV, cache);
    step_fn(..., logits_at=idx_B) gives the logits at one time index per row, [B, 1, V] (prefills).

    A Partial carries params as a jit argument, not baked-in constants:

        cache = KVCache.for_config(config, batch=B, max_len=W)
        tokens_BN, lengths_B = sampling.generate(step_fn(config, params), cache, prompt_BP, ...)

    Params from `quantize_params` decode through the quantized matmuls.
    """
    if config.scan_layers:  # decode unrolled: each layer reads its own cache buffer in place
        params = unstack_layers(params, config.n_layer)
        config = dataclasses.replace(config, scan_layers=False)
    config = dataclasses.replace(config, remat="none")  # no gradients here
    apply = _apply_with_cache(config)
    if quantize.is_quantized(params):
        apply = quantize.intercepted(apply)
    return jax.tree_util.Partial(apply, params)


def quantize_params(config: GPTConfig, params, mode: str):
    """Weight-only int8 (per-output-channel scales) or bf16 weights for decoding -> (config, params).

    Dense kernels and the token embedding are quantized (see flaxgpt/quantize.py); wpe, LayerNorms
    and biases stay float32. A tied head becomes an untied lm_head sharing the quantized table (its
    rows are the head's output channels), so the decode-time head is one quantized matmul.
    """
    quantize.check_mode(mode)
    if config.scan_layers:
        params = unstack_layers(params, config.n_layer)
    params = dict(params)
    table = quantize.quantize_rows(params.pop("wte")["embedding"], mode)
    qparams = quantize.quantize_tree(params, mode)
    qparams["wte"] = {"embedding": table}
    if config.tie_embeddings:
        qparams["lm_head"] = {"kernel": table}  # the same arrays: one copy in memory
    config = dataclasses.replace(config, tie_embeddings=False, scan_layers=False, remat="none")
    return config, qparams
