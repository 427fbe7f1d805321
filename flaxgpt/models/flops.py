"""What a model's parameters are and what running them costs: the one FLOPs count of the project.

    parts = parameter_counts(models.abstract_params(config))   # {"attention": N, "MLP": N, ...}
    flops_per_token(config, seq_len)                           # {"forward", "train", ...} per token

The trainer's MFU, `flaxgpt summary` and the aot roofline all count with `flops_per_token`.
FLOPs per token follow nanoGPT / PaLM (Appendix B): a matmul with N weights costs
2N FLOPs per token forward and 4N backward, plus attention's scores and weighted
sum, 4*L*H*Q*T forward (Q head dim, T sequence length, the full square counted,
not just the causal half). Training = 6N + 12*L*H*Q*T, forward = 2N + 4*L*H*Q*T,
with N the weights that take part in matmuls: all parameters but the position
embeddings and, when the head is untied, the token-embedding lookup. In a mixture of experts N
counts the active weights: a token's k experts of E in each sparse layer (and the router). For the
encoder-decoder the figures are per target token with a source of the same length,
and L counts encoder layers plus twice the decoder layers (self- and cross-attention).
"""

from __future__ import annotations

import jax
import numpy as np
from flax import linen as nn

from flaxgpt.models import registry as models

PARTS = (
    "token embeddings",
    "position embeddings",
    "attention",
    "cross-attention",
    "MLP",
    "layer norms",
    "head",
    "other",
)


def _part_of(path: tuple[str, ...]) -> str:
    """Which row of the table a parameter belongs to, from its names in the tree."""
    names = [n.lower() for n in path]
    if "wte" in names or any(n.endswith("embed") for n in names):  # seq2seq: embed, src_embed, tgt_embed
        return "token embeddings"
    if "wpe" in names:
        return "position embeddings"
    if "lm_head" in names:
        return "head"
    if "cross" in names:
        return "cross-attention"
    if "attn" in names:
        return "attention"
    if "mlp" in names:
        return "MLP"
    if any(n.startswith("ln") or n.endswith("_ln") for n in names):
        return "layer norms"
    return "other"


def _leaves_with_names(params):
    flat = jax.tree_util.tree_flatten_with_path(nn.unbox(params))[0]
    for keypath, leaf in flat:
        yield tuple(str(getattr(k, "key", k)) for k in keypath), leaf


def parameter_counts(params) -> dict[str, int]:
    """Parameters per part (PARTS), from real or abstract (boxed or plain) parameters."""
    counts = dict.fromkeys(PARTS, 0)
    for path, leaf in _leaves_with_names(params):
        counts[_part_of(path)] += int(np.prod(leaf.shape))
    return counts


def inactive_expert_params(c) -> int:
    """The expert weights a token does not use: E - k experts' in each sparse layer (0: dense)."""
    if models.kind_of(c) != "gpt" or not c.num_experts:
        return 0
    F = c.expert_mlp_hidden
    per_expert = c.n_embd * (2 * F if c.glu else F) + F * c.n_embd  # experts_fc + experts_proj
    sparse = sum(c.layer_is_sparse(i) for i in range(c.n_layer))
    return sparse * (c.num_experts - c.experts_per_token) * per_expert


def flops_per_token(model_config, seq_len: int | None = None) -> dict:
    """Forward and training FLOPs per (target) token at sequence length seq_len (default block_size):
    {"forward", "train", "seq_len", "n_matmul", "attention_layers"}."""
    return flops_of(model_config, parameter_counts(models.abstract_params(model_config)), seq_len)


def flops_of(c, parts: dict, seq_len: int | None) -> dict:
    """flops_per_token from parameter counts already made (`parameter_counts`)."""
    T = seq_len or c.block_size
    # a lookup is free: the token matrices cost FLOPs only where one is the (tied) head
    n_matmul = sum(parts.values()) - parts["position embeddings"]
    n_matmul -= 0 if c.tie_embeddings else parts["token embeddings"]
    n_matmul -= inactive_expert_params(c)  # a token runs through k of the E experts
    # encoder-decoder, per target token with a source as long: every encoder layer attends
    # over S, every decoder layer over T (self) and over S (cross)
    is_gpt = models.kind_of(c) == "gpt"
    attn_layers = c.n_layer if is_gpt else c.n_enc_layer + 2 * c.n_dec_layer
    attn_fwd = 4 * attn_layers * c.n_head * c.head_dim * T  # q.k scores + weighted sum of v
    if is_gpt and c.sliding_window:  # a window layer's query reads at most its window of keys
        keys = sum(min(T, c.layer_window(i) or T) for i in range(c.n_layer))
        attn_fwd = 4 * c.n_head * c.head_dim * keys
    return {
        "seq_len": T,
        "n_matmul": n_matmul,
        "attention_layers": attn_layers,
        "forward": 2 * n_matmul + attn_fwd,
        "train": 6 * n_matmul + 3 * attn_fwd,
    }
