"""The decoder-only GPT (GPT-2 family), read bottom-up like nanoGPT's model.py.

    logits_BTV = GPT(config).apply({"params": params}, tokens_BT)
    logits_BTV, cache = GPT(config).apply({"params": params}, tokens_BT, positions=pos_BT, cache=cache)
    step = step_fn(config, params)    # the same, as flaxgpt.decode.sampling's step_fn

Parameter names are GPT-2's (wte, wpe, h_0 ... h_{L-1}, ln_1, attn/c_attn, attn/c_proj,
ln_2, mlp/c_fc, mlp/c_proj, ln_f, lm_head), so importing OpenAI's weights is a
name-for-name copy. The same module is a Llama / Mistral / Qwen2 decoder with the options of
the second block of GPTConfig (RoPE, RMSNorm, SwiGLU, grouped-query attention, ...; presets
"smollm2-135m", "llama-3.2-1b", ...); their weights map onto these names by flaxgpt.hf.families.
With `num_experts` a block's MLP is a mixture of experts (models/moe.py: Mixtral, Qwen3-MoE).
Its linear layers and token table (models/linear.py) apply float or quantized weights, and with
`lora` (a models.lora.LoraSpec) the "lora" collection's adapters over them.
With `scan_layers` the blocks live stacked under `h`, [L] first (`stack_layers` / `unstack_layers`).

Shape letters: B batch, T time, D n_embd, V vocab_size, L n_layer (see layers.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from flaxgpt.kernels import linear_xent, pallas_decode, target
from flaxgpt.models import layers, quantize
from flaxgpt.models.attention import SelfAttention
from flaxgpt.models.cache import KVCache
from flaxgpt.models.gpt_config import LLAMA_STYLE, REMAT_POLICIES, GPTConfig, check_tokens  # noqa: F401  (gpt.GPTConfig)
from flaxgpt.models.layers import MLP, norm, normal_init, ones_init, sinusoidal_positions
from flaxgpt.models.linear import NO_KERNELS, DecodeKernels, Embedding, Linear, decode_kernels
from flaxgpt.models.moe import ROUTER, MoE


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x)).

    `kv` is this layer's cache.KVLayer (or None); the block returns it updated.
    """

    config: GPTConfig
    deterministic: bool = True
    layer: int = 0  # the block's index: window and rotary base may differ per layer (Gemma)
    lora: Any = None  # models.lora.LoraSpec: how the "lora" collection's adapters apply (models/linear.py)
    kernels: DecodeKernels = NO_KERNELS  # what this decoding step takes as kernels (the GPT's one decision)

    @nn.compact
    def __call__(self, x_BTD, positions_BT, kv=None, ve_BTD=None, segment_ids_BT=None, real_BT=None):
        c = self.config
        dtype, pdtype = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
        # activations keep their rows split over the devices and their tokens over a context axis (a
        # no-op without axis rules: see sharding.under_mesh); else with FSDP's "embed"-sharded weights
        # XLA may keep every device's activations whole for the batch and split the features instead
        x_BTD = nn.with_logical_constraint(x_BTD, ("batch", "length", None))
        # GPT-2: residual projections start smaller so the residual stream's variance does not
        # grow with depth; the speedrun starts them at zero (each block starts as the identity)
        out_std = 0.0 if c.zero_init_proj else 0.02 / math.sqrt(2 * c.n_layer)
        ln = lambda name: norm(c.norm, c.bias, c.layer_norm_epsilon, dtype, pdtype, name)  # noqa: E731
        pre = functools.partial(
            layers.sublayer_input, c, self.layer, self.kernels, self.lora, self.deterministic
        )
        a_BTD, extra = pre("ln_1", x_BTD)
        h_BTD, kv = SelfAttention(
            n_head=c.n_head,
            n_kv_head=c.kv_heads,
            rope=c.layer_rope(self.layer),
            qk_norm=c.norm if c.qk_norm else None,
            norm_eps=c.layer_norm_epsilon,
            window=c.layer_window(self.layer),
            head_dim=c.head_dim,
            scale=c.query_pre_attn_scalar**-0.5 if c.query_pre_attn_scalar else 0.0,
            softcap=c.attn_softcap,
            causal=True,
            use_bias=c.bias,
            qkv_bias=c.qkv_bias,
            attn_dropout=c.attn_dropout,
            resid_dropout=c.resid_dropout,
            out_init_std=out_std,
            dtype=dtype,
            param_dtype=pdtype,
            impl=c.attention_impl,
            context_impl=c.context_impl,
            deterministic=self.deterministic,
            lora=self.lora,
            fp8=c.fp8,
            kernels=self.kernels,
            name="attn",
        )(a_BTD, positions_BT, kv, ve_BTD=ve_BTD, segment_ids_BT=segment_ids_BT, real_BT=real_BT, **extra)
        if c.post_norms:  # Gemma: normalise the branch's output too (its post_attention_layernorm)
            h_BTD = ln("post_attn_ln")(h_BTD)
        x_BTD = h_BTD if extra else x_BTD + h_BTD  # extra: decoding's kernels add x (sublayer_input)
        shared = dict(
            activation=c.activation,
            glu=c.glu,
            dropout=c.resid_dropout,
            out_init_std=out_std,
            dtype=dtype,
            param_dtype=pdtype,
            deterministic=self.deterministic,
            lora=self.lora,
            name="mlp",
        )
        if c.layer_is_sparse(self.layer):  # a mixture of experts (Mixtral, Qwen2/3-MoE): models/moe.py
            mlp = MoE(
                c.num_experts,
                c.experts_per_token,
                c.expert_mlp_hidden,
                norm_topk_prob=c.norm_topk_prob,
                shared_hidden=c.shared_expert_hidden,
                shared_gate=c.shared_expert_gate,
                fp8=c.fp8,
                fp8_experts=c.fp8 and c.fp8_experts,
                **shared,
            )
        else:
            mlp = MLP(hidden=c.mlp_hidden or 4 * c.n_embd, use_bias=c.bias, fp8=c.fp8, **shared)
        a_BTD, extra = pre("ln_2", x_BTD)
        h_BTD = mlp(a_BTD, **extra)
        if c.post_norms:  # Gemma's post_feedforward_layernorm
            h_BTD = ln("post_mlp_ln")(h_BTD)
        return (h_BTD if extra else x_BTD + h_BTD), kv


class ScannedBlock(nn.Module):
    """Block in nn.scan's (carry, xs) -> (carry, ys) form: xs and ys are the layer's KVLayer;
    the carry holds the segment ids (or None) beside the positions."""

    config: GPTConfig
    deterministic: bool = True
    lora: Any = None
    kernels: DecodeKernels = NO_KERNELS

    @nn.compact
    def __call__(self, carry, kv):
        x_BTD, positions_BT, seg_BT, real_BT = carry
        block = Block(self.config, self.deterministic, lora=self.lora, kernels=self.kernels, name="block")
        x_BTD, kv = block(x_BTD, positions_BT, kv, segment_ids_BT=seg_BT, real_BT=real_BT)
        return (x_BTD, positions_BT, seg_BT, real_BT), kv


def _remat_policy(name: str):
    """What a rematerialized block keeps for its backward pass (GPTConfig.remat): full = only its
    input (recompute everything); dots = every matmul output (JAX's dots_saveable); dots_no_batch =
    the weight matmuls' outputs, not attention's batched q k^T and p v; offload_dots_no_batch = those
    same outputs moved to host memory during the forward and back for the backward (TPU/GPU: device
    memory for PCIe/ICI time)."""
    policies = jax.checkpoint_policies
    return {
        "full": None,
        "dots": policies.checkpoint_dots,
        "dots_no_batch": policies.checkpoint_dots_with_no_batch_dims,
        "offload_dots_no_batch": policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
    }[name]


def wpe_prefix(wpe_SD: jax.Array, T: int) -> jax.Array:
    """Learned embeddings of positions 0..T-1 -> [1, T, D]."""
    # a slice, not a gather over broadcast positions (which FSDP rematerialises)
    return wpe_SD[None, :T]


def segment_positions(segment_ids_BT: jax.Array) -> jax.Array:
    """[B, T] positions that restart at 0 where the segment id changes (packed rows)."""
    t_BT = jnp.broadcast_to(jnp.arange(segment_ids_BT.shape[1]), segment_ids_BT.shape)
    starts_BT = jnp.concatenate([jnp.ones_like(t_BT[:, :1], bool), jnp.diff(segment_ids_BT, axis=1) != 0], 1)
    return t_BT - jax.lax.cummax(jnp.where(starts_BT, t_BT, 0), axis=1)


def tied_head_few_rows(wte_VD: jax.Array, x_ND: jax.Array) -> jax.Array:
    """x @ wte^T -> [N, V] for the few rows of a decoding step."""
    # the [V, D] table as the left operand, rows as they lie in memory: XLA on CPU streams it
    # ~2x faster than x @ wte^T, which packs it first
    return jnp.dot(wte_VD, x_ND.T).T


class GPT(nn.Module):
    config: GPTConfig
    lora: Any = None  # models.lora.LoraSpec: the "lora" collection's adapters added (models/lora.py)

    @nn.compact
    def __call__(
        self,
        tokens_BT,
        positions=None,
        cache: KVCache | None = None,
        deterministic: bool = True,
        logits_at=None,
        segment_ids_BT=None,
        hidden: bool = False,
    ):
        """tokens [B, T] -> logits [B, T, V]; with a cache (and positions [B, T], default
        0..T-1) the keys/values are written at `positions` and (logits, cache) comes back.
        With `logits_at` [B] (time indices), the logits are those of one position per row: [B, 1, V].
        `segment_ids_BT` (training on packed rows, no cache): attention stays inside each run of
        equal ids and positions restart at 0 in each, so every example sees what it would alone.
        With `hidden`, the final hidden states [B, T, D] (after ln_f; with a cache, and the cache)
        come back instead: `head_logits` applies the head, a chunk at a time (losses.chunked_cross_
        entropy), `unembedding` hands it to the fused loss (losses.fused_cross_entropy)."""
        c = self.config
        check_tokens(tokens_BT, c, cache)
        dtype, pdtype = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
        B, T = tokens_BT.shape
        if segment_ids_BT is not None:
            if cache is not None:
                raise ValueError(
                    "segment_ids_BT is for training on packed rows; decoding takes a cache instead"
                )
            positions = segment_positions(segment_ids_BT) if positions is None else positions
        implicit_positions = positions is None
        if implicit_positions:
            positions = jnp.broadcast_to(jnp.arange(T), (B, T))

        wte = Embedding(
            c.padded_vocab_size,
            c.n_embd,
            dtype=dtype,
            param_dtype=pdtype,
            embedding_init=normal_init(0.02, ("vocab", "embed")),
            name="wte",
        )
        x_BTD = wte(tokens_BT)
        if c.embed_scale:  # Gemma: sqrt(D) rounded to the compute dtype first, as transformers does
            x_BTD = x_BTD * jnp.asarray(math.sqrt(c.n_embd), dtype)
        if c.pos_embedding != "rope":  # rope: positions rotate queries and keys inside each attention
            x_BTD = x_BTD + self._position_embeddings(positions, implicit_positions)
        x_BTD = nn.Dropout(c.embd_dropout)(x_BTD, deterministic=deterministic)
        kv_layers, real_BT = None, None
        if cache is not None:
            kv_layers = [cache.layer(i) for i in range(c.n_layer)]
            # what window layers' rings may take in (models/cache.py): not a prefill's padding after
            # logits_at, nor positions past the cache (which a full-length buffer drops too)
            real_BT = positions < cache.max_len
            if logits_at is not None:
                real_BT &= jnp.arange(T)[None] <= jnp.asarray(logits_at)[:, None]
        # whether a decoding step takes the decode kernels: decided once, read by every block and the head
        kernels = NO_KERNELS if kv_layers is None else decode_kernels(B * T)
        x_BTD, kv_layers = self._blocks(
            x_BTD, positions, kv_layers, deterministic, tokens_BT, segment_ids_BT, real_BT, kernels
        )
        if logits_at is not None:  # a prefill draws from one position: skip the head (1/3 of GPT-2's FLOPs)
            x_BTD = jnp.take_along_axis(x_BTD, jnp.asarray(logits_at)[:, None, None], axis=1)
        if hidden:  # ln_f's output, the head left to the caller (with a cache: and the cache)
            h_BTD = norm(c.norm, c.bias, c.layer_norm_epsilon, dtype, pdtype, "ln_f")(x_BTD)
            return h_BTD if cache is None else (h_BTD, cache.with_layers(kv_layers))
        logits_BTV = finish_logits(c, self._head(wte, x_BTD, kernels))
        if cache is None:
            return logits_BTV
        return logits_BTV, cache.with_layers(kv_layers)

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

    def _blocks(
        self, x_BTD, positions_BT, kv_layers, deterministic: bool, tokens_BT=None, seg_BT=None, real_BT=None,
        kernels: DecodeKernels = NO_KERNELS,
    ):  # fmt: skip
        """The n_layer blocks; kv_layers (or None) holds each layer's cache.KVLayer, handed to its block."""
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
            (x_BTD, _, _, _), stacked = nn.scan(
                scan_cls,
                variable_axes={"params": 0, "intermediates": 0, "lora": 0, ROUTER: 0},  # lora: models/lora.py
                split_rngs={"params": True, "dropout": True},
                length=c.n_layer,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )(c, deterministic, self.lora, kernels, name="h")((x_BTD, positions_BT, seg_BT, real_BT), stacked)
            if stacked is not None:
                kv_layers = [jax.tree_util.tree_map(lambda x, i=i: x[i], stacked) for i in range(c.n_layer)]
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
            block = block_cls(c, deterministic, layer=i, lora=self.lora, kernels=kernels, name=f"h_{i}")
            x_BTD, kv = block(x_BTD, positions_BT, kv, ve_layers[i], seg_BT, real_BT)
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

    def _head(self, wte, x_BTD, kernels: DecodeKernels = NO_KERNELS):
        """ln_f and the head: one kernel with the decode kernels' products (ln_f in the head's GEMV)."""
        c = self.config
        dtype, pdtype = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
        B, T, D = x_BTD.shape
        table, x_dtype, pre_norm = (wte.embedding if c.tie_embeddings else None), x_BTD.dtype, None
        tiles = table is None or pallas_decode.takes(B * T, table.shape[0], D, x_dtype, table.dtype, dtype)
        if kernels.products and c.norm in pallas_decode.NORMS and tiles:
            pre_norm = layers.NormParams(c.norm, c.bias, c.layer_norm_epsilon, pdtype, name="ln_f")(D)
        else:  # on [B, T, D], as `hidden` returns it
            x_BTD = norm(c.norm, c.bias, c.layer_norm_epsilon, dtype, pdtype, "ln_f")(x_BTD)
        x_ND = x_BTD.reshape(B * T, D)  # 2-D operands: see layers.MLP
        if pre_norm is not None and table is not None:  # interpreted off GPUs (FLAXGPT_DECODE_KERNELS=on)
            y_NV = pallas_decode.gemv(
                x_ND, table, norm=pre_norm, rows_w=True, dtype=dtype, interpret=target.platform() != "gpu"
            )
            return y_NV.reshape(B, T, -1)
        if not c.tie_embeddings:
            lm_head = Linear(
                c.padded_vocab_size,
                use_bias=False,
                dtype=dtype,
                param_dtype=pdtype,
                kernel_init=normal_init(0.0 if c.zero_init_proj else 0.02, ("embed", "vocab")),
                name="lm_head",
            )
            return lm_head(x_ND, pre_norm=pre_norm).reshape(B, T, -1)
        if B * T <= 64:
            return tied_head_few_rows(wte.embedding.astype(dtype), x_ND.astype(dtype)).reshape(B, T, -1)
        return wte.attend(x_ND).reshape(B, T, -1)


def finish_logits(config: GPTConfig, logits_BTV: jax.Array) -> jax.Array:
    """The head's raw output [..., padded V] -> the logits callers see: [..., V], soft-capped."""
    # padded vocabulary rows exist for speed only: callers never see them
    logits_BTV = logits_BTV[..., : config.vocab_size]
    if config.logit_softcap:  # bounded logits (Gemma 2), in float32
        logits_BTV = config.logit_softcap * jnp.tanh(logits_BTV.astype(jnp.float32) / config.logit_softcap)
    return logits_BTV


def head_logits(config: GPTConfig, params, x_BTD: jax.Array) -> jax.Array:
    """The LM head on hidden states from GPT(config)(tokens, hidden=True) -> logits [B, T, V], as
    the model's own forward computes them (tied: x @ wte^T, else x @ lm_head, in config.dtype)."""
    dtype = jnp.dtype(config.dtype)
    B, T, D = x_BTD.shape
    x_ND = x_BTD.reshape(B * T, D).astype(dtype)  # 2-D operands: see layers.MLP
    if config.tie_embeddings:
        logits_NV = jnp.dot(x_ND, params["wte"]["embedding"].astype(dtype).T)
    else:
        logits_NV = jnp.dot(x_ND, params["lm_head"]["kernel"].astype(dtype))
    return finish_logits(config, logits_NV.reshape(B, T, -1))


def unembedding(config: GPTConfig, params) -> linear_xent.Head:
    """The LM head as head_logits applies it, for the fused loss (train/losses.py): its weight in
    config.dtype, tied ([Vp, D] token table) or not ([D, Vp] lm_head kernel), and the soft-cap."""
    dtype = jnp.dtype(config.dtype)
    if config.tie_embeddings:
        table_VD = params["wte"]["embedding"].astype(dtype)
        return linear_xent.Head(table_VD, "VD", config.vocab_size, config.logit_softcap)
    kernel = params["lm_head"]["kernel"]
    kind = getattr(kernel, "dtype", None)  # a QuantizedWeight (quantize_params) has none
    if kind is None or not jnp.issubdtype(kind, jnp.floating):
        raise ValueError(
            "the fused loss takes a float lm_head, not a quantized one: set optim.loss_impl=logits"
        )
    return linear_xent.Head(kernel.astype(dtype), "DV", config.vocab_size, config.logit_softcap)


@functools.partial(jax.jit, static_argnums=0)  # one program: init run eagerly compiles op by op (~3 s)
def init_params(config: GPTConfig, rng: jax.Array):
    """Plain (unboxed) float parameters: {'wte': ..., 'h_0': ..., ...}."""
    dummy = jnp.zeros((1, min(8, config.block_size)), jnp.int32)
    return nn.unbox(GPT(config).init(rng, dummy)["params"])


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

    Params from `quantize_params` decode through the quantized matmuls (models/linear.py).
    """
    if config.scan_layers:  # decode unrolled: each layer reads its own cache buffer in place
        params = unstack_layers(params, config.n_layer)
        config = dataclasses.replace(config, scan_layers=False)
    config = dataclasses.replace(config, remat="none")  # no gradients here
    return jax.tree_util.Partial(_apply_with_cache(config), params)


def quantize_params(config: GPTConfig, params, mode: str):
    """Weight-only int8 (per-output-channel scales) or bf16 weights for decoding -> (config, params).

    Dense kernels, a mixture of experts' stacked expert weights (per expert) and the token embedding
    are quantized (see flaxgpt/models/quantize.py); wpe, LayerNorms, biases and routers stay float32.
    A tied head becomes an untied lm_head sharing the quantized table (its rows are the head's output
    channels), so the decode-time head is one quantized matmul.
    """
    quantize.check_mode(mode)
    if config.scan_layers:
        params = unstack_layers(params, config.n_layer)
    params, wte = {k: v for k, v in params.items() if k != "wte"}, params["wte"]["embedding"]
    # a mixture of experts' stacked experts are quantized per expert; its routers stay float32: the
    # top-k is discrete (rounding the [D, E] router would change which experts run), and they are small
    qparams = quantize.quantize_tree(params, mode, stacked=("experts_fc", "experts_proj"), keep=("router",))
    table = quantize.quantize_rows(wte, mode, name="wte")  # after the tree: its check sees every weight
    qparams["wte"] = {"embedding": table}
    if config.tie_embeddings:
        qparams["lm_head"] = {"kernel": table}  # the same arrays: one copy in memory
    return quantized_config(config), qparams


def quantized_config(config: GPTConfig) -> GPTConfig:
    """The config quantize_params' weights decode with: an untied head (the table shared), unrolled,
    no float8 (a training product; the weights are int8 or bf16 now)."""
    off = dict(tie_embeddings=False, scan_layers=False, remat="none", fp8=False, fp8_experts=False)
    return dataclasses.replace(config, **off)
