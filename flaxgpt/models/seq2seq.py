"""The encoder-decoder Transformer of "Attention Is All You Need", built from layers.py.

    model = Transformer(config)                        # deterministic: eval and decoding
    logits_BTV = model.apply({"params": p}, src_BS, src_lengths_B, tgt_in_BT)
    memory_BSD = model.apply(v, src_BS, src_lengths_B, method=Transformer.encode)
    cache = model.apply(v, memory_BSD, max_len, method=Transformer.init_cache)
    logits_BTV, cache = model.apply(v, tgt_BT, None, src_lengths_B, cache=cache,
                                    positions=pos_BT, method=Transformer.decode)

Training uses `Transformer(config, deterministic=False)` with rngs={"dropout": key}.
The attention, MLP, position encoding and KV cache are the GPT's own (layers.py, cache.py).
Decoding: `start_decoding` + `step_fn` are this model's adapter for flaxgpt.decode.beam_search;
flaxgpt.decode.translate drives them (beam search, or greedy with one beam).

Shape letters: B batch, S source length, T target length, D n_embd, V vocab_size,
L decoder layers, H heads, K head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import linen as nn

from flaxgpt.kernels import linear_xent
from flaxgpt.models.attention import ATTENTION_IMPLS, CrossAttention, SelfAttention, padding_mask
from flaxgpt.models.cache import KVCache, Seq2SeqCache
from flaxgpt.models.layers import (
    ACTIVATIONS,
    MLP,
    SINUSOID_LAYOUTS,
    layer_norm,
    normal_init,
    sinusoidal_positions,
)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int = 37000  # shared source/target vocabulary, special tokens included
    block_size: int = 256  # longest source and longest target, in tokens (EOS / BOS included)
    n_enc_layer: int = 6  # encoder layers
    n_dec_layer: int = 6  # decoder layers
    n_embd: int = 512  # model width (the paper's d_model)
    d_ff: int = 2048  # MLP hidden width
    n_head: int = 8  # attention heads per layer
    dropout: float = 0.1  # the paper's P_drop: on embeddings + positions and each residual branch
    attn_dropout: float = 0.0  # on the attention weights
    pre_ln: bool = True  # LayerNorm before each sublayer (stable); False = the paper's post-LN
    tie_embeddings: bool = True  # one matrix for source, target and output (shared vocabulary)
    activation: str = "relu"  # relu (paper) | gelu | gelu_exact
    bias: bool = True  # biases in Linear layers and LayerNorms
    layer_norm_epsilon: float = 1e-6  # LayerNorm's epsilon
    dtype: str = "float32"  # compute dtype; bfloat16 on TPU/GPU (params stay param_dtype)
    param_dtype: str = "float32"  # parameter and optimizer-state dtype
    pad_vocab_multiple: int = 1  # round the embedding rows up to this (64 is fast); 1 = exact
    attention_impl: str = "auto"  # auto (cuDNN on NVIDIA GPUs in 16-bit, else XLA) | xla | cudnn
    sinusoid_layout: str = "interleaved"  # interleaved (the paper's sin, cos, ...) | halves (older runs)

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")
        choices = {
            "activation": ACTIVATIONS,
            "attention_impl": ATTENTION_IMPLS,
            "sinusoid_layout": SINUSOID_LAYOUTS,
        }
        for field, allowed in choices.items():
            if getattr(self, field) not in allowed:
                raise ValueError(f"{field}={getattr(self, field)!r} is not one of {allowed}")
        for field in (
            "vocab_size",
            "block_size",
            "n_enc_layer",
            "n_dec_layer",
            "n_embd",
            "d_ff",
            "n_head",
            "pad_vocab_multiple",
        ):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")

    @property
    def n_layer(self) -> int:  # the decoder's: what a KVCache holds
        return self.n_dec_layer

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    PRESETS = {
        # the paper's Table 3 sizes
        "base": dict(n_enc_layer=6, n_dec_layer=6, n_embd=512, d_ff=2048, n_head=8, dropout=0.1),
        "big": dict(n_enc_layer=6, n_dec_layer=6, n_embd=1024, d_ff=4096, n_head=16, dropout=0.3),
        # small enough to train on a CPU in seconds (tests, synthetic tasks)
        "tiny": dict(n_enc_layer=2, n_dec_layer=2, n_embd=64, d_ff=256, n_head=4, dropout=0.0),
    }

    @classmethod
    def preset(cls, name: str, **overrides) -> TransformerConfig:
        """The paper's sizes by name ("base", "big") or "tiny"; overrides replace any field."""
        if name not in cls.PRESETS:
            raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **overrides})

    @classmethod
    def base(cls, **kw):
        return cls.preset("base", **kw)

    @classmethod
    def big(cls, **kw):
        return cls.preset("big", **kw)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TransformerConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown TransformerConfig fields {sorted(unknown)}")
        return cls(**d)


def _sublayer(x_BTD, branch, ln, pre_ln: bool):
    """Residual around `branch`: pre-LN x + f(ln(x)), or the paper's post-LN ln(x + f(x))."""
    if pre_ln:
        return x_BTD + branch(ln(x_BTD))
    return ln(x_BTD + branch(x_BTD))


class _LayerBase(nn.Module):
    config: TransformerConfig
    deterministic: bool = True

    def kw(self):
        c = self.config
        return dict(
            dtype=jnp.dtype(c.dtype), param_dtype=jnp.dtype(c.param_dtype), deterministic=self.deterministic
        )

    def ln(self):  # named after the attribute it is assigned to in setup
        c = self.config
        return layer_norm(c.bias, c.layer_norm_epsilon, jnp.dtype(c.dtype), jnp.dtype(c.param_dtype), None)

    def make_self_attention(self, causal: bool):
        c = self.config
        return SelfAttention(
            n_head=c.n_head,
            causal=causal,
            use_bias=c.bias,
            qkv_bias=c.bias,
            attn_dropout=c.attn_dropout,
            resid_dropout=c.dropout,
            impl=c.attention_impl,
            **self.kw(),
        )

    def make_mlp(self):
        c = self.config
        return MLP(hidden=c.d_ff, activation=c.activation, use_bias=c.bias, dropout=c.dropout, **self.kw())


class EncoderLayer(_LayerBase):
    """Bidirectional self-attention over the unpadded source, then the MLP."""

    def setup(self):
        self.attn = self.make_self_attention(causal=False)
        self.ln_1, self.ln_2, self.mlp = self.ln(), self.ln(), self.make_mlp()

    def __call__(self, x_BSD, mask_B11S):
        pre = self.config.pre_ln
        x_BSD = _sublayer(x_BSD, lambda h: self.attn(h, mask_BHTS=mask_B11S)[0], self.ln_1, pre)
        return _sublayer(x_BSD, self.mlp, self.ln_2, pre)


class DecoderLayer(_LayerBase):
    """Causal self-attention (optionally over a KV cache), cross-attention, then the MLP."""

    def setup(self):
        c = self.config
        self.attn = self.make_self_attention(causal=True)
        self.cross = CrossAttention(
            d_model=c.n_embd,
            n_head=c.n_head,
            use_bias=c.bias,
            attn_dropout=c.attn_dropout,
            resid_dropout=c.dropout,
            impl=c.attention_impl,
            **self.kw(),
        )
        self.ln_1, self.ln_2, self.ln_3 = self.ln(), self.ln(), self.ln()
        self.mlp = self.make_mlp()

    def project_kv(self, memory_BSD):
        return self.cross.project_kv(memory_BSD)

    def __call__(self, x_BTD, positions_BT, kv, memory, src_lengths_B):
        """kv: this layer's self-attention cache.KVLayer or None (returned updated);
        memory: the encoder output [B, S, D], or this layer's projected (k, v) from the cache."""
        pre = self.config.pre_ln
        new_kv = kv

        def self_attn(h_BTD):
            nonlocal new_kv
            y_BTD, new_kv = self.attn(h_BTD, positions_BT, kv)
            return y_BTD

        x_BTD = _sublayer(x_BTD, self_attn, self.ln_1, pre)
        x_BTD = _sublayer(x_BTD, lambda h: self.cross(h, memory, src_lengths_B), self.ln_2, pre)
        return _sublayer(x_BTD, self.mlp, self.ln_3, pre), new_kv


class Transformer(nn.Module):
    config: TransformerConfig
    deterministic: bool = True

    def setup(self):
        c = self.config
        pdtype = jnp.dtype(c.param_dtype)
        # std d^-1/2: after the sqrt(d) scale the embeddings have unit variance, and the
        # tied output layer starts with logits of unit scale
        embed = lambda: nn.Embed(
            c.padded_vocab_size,
            c.n_embd,
            dtype=jnp.dtype(c.dtype),
            param_dtype=pdtype,
            embedding_init=normal_init(c.n_embd**-0.5, ("vocab", "embed")),
        )
        if c.tie_embeddings:
            self.embed = embed()
        else:
            self.src_embed, self.tgt_embed = embed(), embed()
            self.lm_head = nn.Dense(
                c.padded_vocab_size,
                use_bias=False,
                dtype=jnp.dtype(c.dtype),
                param_dtype=pdtype,
                kernel_init=normal_init(c.n_embd**-0.5, ("embed", "vocab")),
            )
        self.enc = [EncoderLayer(c, self.deterministic) for _ in range(c.n_enc_layer)]
        self.dec = [DecoderLayer(c, self.deterministic) for _ in range(c.n_dec_layer)]
        if c.pre_ln:  # pre-LN leaves the residual stream unnormalized: one LayerNorm at each end
            ln = lambda: layer_norm(c.bias, c.layer_norm_epsilon, jnp.dtype(c.dtype), pdtype, None)
            self.enc_ln, self.dec_ln = ln(), ln()
        self.drop = nn.Dropout(c.dropout)

    def _embed(self, table, tokens_BT, positions_BT):
        c = self.config
        x_BTD = table(tokens_BT) * math.sqrt(c.n_embd)
        pe_BTD = sinusoidal_positions(positions_BT, c.n_embd, c.sinusoid_layout, x_BTD.dtype)
        x_BTD = x_BTD + pe_BTD.astype(x_BTD.dtype)
        return self.drop(x_BTD, deterministic=self.deterministic)

    def encode(self, src_BS, src_lengths_B):
        """Source tokens [B, S] (valid on the first src_lengths[b]) -> memory [B, S, D]."""
        c = self.config
        B, S = src_BS.shape
        _check_length("source", S, c.block_size)
        table = self.embed if c.tie_embeddings else self.src_embed
        x_BSD = self._embed(table, src_BS, jnp.broadcast_to(jnp.arange(S), (B, S)))
        mask_B11S = padding_mask(src_lengths_B, S)
        for layer in self.enc:
            x_BSD = layer(x_BSD, mask_B11S)
        return self.enc_ln(x_BSD) if c.pre_ln else x_BSD

    def init_cache(self, memory_BSD, max_len: int) -> Seq2SeqCache:
        """A decoding cache: empty self-attention buffers of `max_len` target positions and
        every decoder layer's cross-attention keys and values of `memory`."""
        c = self.config
        cross = [layer.project_kv(memory_BSD) for layer in self.dec]
        self_kv = KVCache.init(
            c.n_dec_layer, memory_BSD.shape[0], max_len, c.n_head, c.head_dim, jnp.dtype(c.dtype)
        )
        return Seq2SeqCache(
            self_kv=self_kv,
            cross_k=tuple(k for k, _ in cross),
            cross_v=tuple(v for _, v in cross),
            source_R=jnp.arange(memory_BSD.shape[0], dtype=jnp.int32),
        )

    def decode(
        self,
        tgt_BT,
        memory_BSD,
        src_lengths_B,
        cache: Seq2SeqCache | None = None,
        positions=None,
        hidden=False,
    ):
        """Target tokens [B, T] -> logits [B, T, V] (float32); with `hidden` (teacher forcing, no
        cache) the decoder's final states [B, T, D] instead, for the fused loss (`unembedding`).

        Without a cache the decoder attends causally over `tgt` and projects `memory`.
        With one, `tgt` sits at `positions` [B, T], its keys and values are written into
        the cache, `memory` is unused (the cache holds its projection), and the updated
        cache comes back with the logits.
        """
        c = self.config
        B, T = tgt_BT.shape
        _check_length("target", T, c.block_size if cache is None else cache.self_kv.max_len)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T), (B, T))
        table = self.embed if c.tie_embeddings else self.tgt_embed
        x_BTD = self._embed(table, tgt_BT, positions)
        kv_layers = []
        for i, layer in enumerate(self.dec):
            kv = None if cache is None else cache.self_kv.layer(i)
            memory = memory_BSD if cache is None else (cache.cross_k[i], cache.cross_v[i])
            x_BTD, kv = layer(x_BTD, positions, kv, memory, src_lengths_B)
            kv_layers.append(kv)
        if c.pre_ln:
            x_BTD = self.dec_ln(x_BTD)
        if hidden and cache is None:
            return x_BTD
        logits_BTV = table.attend(x_BTD) if c.tie_embeddings else self.lm_head(x_BTD)
        # padded vocabulary rows exist for speed only: callers never see them
        logits_BTV = logits_BTV[..., : c.vocab_size].astype(jnp.float32)
        if cache is None:
            return logits_BTV
        return logits_BTV, cache.replace(self_kv=cache.self_kv.with_layers(kv_layers))

    def __call__(self, src_BS, src_lengths_B, tgt_in_BT, hidden=False):
        """Teacher forcing: logits [B, T, V] for the next target token at each position (or with
        `hidden` the decoder's final states [B, T, D])."""
        return self.decode(tgt_in_BT, self.encode(src_BS, src_lengths_B), src_lengths_B, hidden=hidden)


def unembedding(config: TransformerConfig, params) -> linear_xent.Head:
    """The output layer as decode applies it (in config.dtype), for the fused loss (train/losses.py)."""
    dtype = jnp.dtype(config.dtype)
    if config.tie_embeddings:
        return linear_xent.Head(params["embed"]["embedding"].astype(dtype), "VD", config.vocab_size)
    return linear_xent.Head(params["lm_head"]["kernel"].astype(dtype), "DV", config.vocab_size)


def _check_length(what: str, n: int, limit: int):
    if n > limit:
        raise ValueError(
            f"{what} length {n} is longer than the model's block_size {limit}; "
            "raise block_size or truncate the data (prepare with --truncate)"
        )


def _dummy(config: TransformerConfig):
    n = min(8, config.block_size)
    return jnp.zeros((1, n), jnp.int32), jnp.full((1,), n, jnp.int32), jnp.zeros((1, n), jnp.int32)


@functools.partial(jax.jit, static_argnums=0)  # one program: init run eagerly compiles op by op
def init_params(config: TransformerConfig, rng: jax.Array):
    """Plain (unboxed) float parameters."""
    return nn.unbox(Transformer(config).init(rng, *_dummy(config))["params"])


def abstract_params(config: TransformerConfig):
    """ShapeDtypeStructs of the parameters, still boxed with their logical axes."""
    return jax.eval_shape(lambda r: Transformer(config).init(r, *_dummy(config)), jax.random.key(0))["params"]


# ---- decoding: the model seen by beam_search through a step function ----


def start_decoding(config: TransformerConfig, params, src_BS, src_lengths_B, *, beams: int, max_len: int):
    """Encode the sources once -> (Seq2SeqCache of B * beams rows, src_lengths_R): row b * beams + w
    is beam w of source b; the cache has room for max_len target positions."""
    model, v = Transformer(config), {"params": params}
    memory_BSD = model.apply(v, src_BS, src_lengths_B, method=Transformer.encode)
    cache = model.apply(v, memory_BSD, max_len, method=Transformer.init_cache)
    rows_R = jnp.repeat(jnp.arange(src_BS.shape[0]), beams)  # project each source once, then copy
    return cache.take_rows(rows_R), src_lengths_B[rows_R]


@functools.cache
def _decode_with_cache(config: TransformerConfig):
    model = Transformer(config)

    def apply(params, src_lengths_R, tokens_RT, positions_RT, cache, logits_at=None):
        v = {"params": params}
        logits_RTV, cache = model.apply(
            v, tokens_RT, None, src_lengths_R, cache=cache, positions=positions_RT, method=Transformer.decode
        )
        if logits_at is not None:  # the step_fn protocol's one-position form (see gpt.step_fn)
            logits_RTV = jnp.take_along_axis(logits_RTV, jnp.asarray(logits_at)[:, None, None], axis=1)
        return logits_RTV, cache

    return apply


def step_fn(config: TransformerConfig, params, src_lengths_R) -> jax.tree_util.Partial:
    """The decoder as a step_fn(tokens_RT, positions_RT, cache: Seq2SeqCache) -> (logits_RTV, cache)
    for flaxgpt.decode.beam_search, with the cache and source lengths from `start_decoding`."""
    return jax.tree_util.Partial(_decode_with_cache(config), params, src_lengths_R)
