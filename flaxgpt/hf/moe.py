"""Mixtral, Qwen2-MoE and Qwen3-MoE in the family table (flaxgpt.hf.families): their sparse layers' key
tables and their config.json both ways.

Each is the Llama (Mixtral), Qwen2 (Qwen2-MoE) or Qwen3 (Qwen3-MoE) decoder whose MLP is a mixture of
experts in the sparse layers (flaxgpt/models/moe.py); Qwen2-MoE's also has a shared expert with a
sigmoid gate (mlp.shared_expert.*, mlp.shared_expert_gate: flaxgpt's mlp/shared_expert, a dense MLP,
and mlp/shared_expert_gate). Published checkpoints, and transformers 5's save_pretrained
(which fuses the experts in memory but writes them one by one), store each expert's projections as
tensors of their own: Mixtral's block_sparse_moe.experts.{e}.w1 / w3 / w2 (gate / up / down) and
block_sparse_moe.gate (the router), Qwen2-MoE's and Qwen3-MoE's mlp.experts.{e}.gate_proj / up_proj /
down_proj and mlp.gate. flaxgpt.hf.rotary stacks them into experts_fc [E, D, 2F] (gate | up) and experts_proj
[E, F, D]; Qwen2/3-MoE's dense layers (mlp_only_layers, decoder_sparse_step) keep the dense MLP keys.

Shape letters: D n_embd, E experts, F each expert's hidden size, S the shared expert's.
"""

from __future__ import annotations

import dataclasses

from flaxgpt.hf import llama
from flaxgpt.models.gpt_config import GPTConfig

# HF name inside a sparse layer i ("{e}": each expert) -> (flaxgpt path in h_{i}, part of the
# stacked tensor it fills: expert e's gate / up columns, or all of expert e's slice)
MIXTRAL_SPARSE_KEYS = {
    "block_sparse_moe.gate.weight": (("mlp", "router", "kernel"), None),  # [E, D]
    "block_sparse_moe.experts.{e}.w1.weight": (("mlp", "experts_fc"), "gate"),  # [F, D]
    "block_sparse_moe.experts.{e}.w3.weight": (("mlp", "experts_fc"), "up"),  # [F, D]
    "block_sparse_moe.experts.{e}.w2.weight": (("mlp", "experts_proj"), None),  # [D, F]
}
QWEN3_MOE_SPARSE_KEYS = {
    "mlp.gate.weight": (("mlp", "router", "kernel"), None),  # [E, D]
    "mlp.experts.{e}.gate_proj.weight": (("mlp", "experts_fc"), "gate"),  # [F, D]
    "mlp.experts.{e}.up_proj.weight": (("mlp", "experts_fc"), "up"),  # [F, D]
    "mlp.experts.{e}.down_proj.weight": (("mlp", "experts_proj"), None),  # [D, F]
}
# Qwen2-MoE: Qwen3-MoE's experts and router, and a shared expert (a dense MLP) with its sigmoid gate
QWEN2_MOE_SPARSE_KEYS = {
    **QWEN3_MOE_SPARSE_KEYS,
    "mlp.shared_expert.gate_proj.weight": (("mlp", "shared_expert", "c_fc", "kernel"), "gate"),  # [S, D]
    "mlp.shared_expert.up_proj.weight": (("mlp", "shared_expert", "c_fc", "kernel"), "up"),  # [S, D]
    "mlp.shared_expert.down_proj.weight": (("mlp", "shared_expert", "c_proj", "kernel"), None),  # [D, S]
    "mlp.shared_expert_gate.weight": (("mlp", "shared_expert_gate", "kernel"), None),  # [1, D]
}
# GPTConfig fields of the experts that a checkpoint fixes (beside llama.ARCH_FIELDS)
MOE_FIELDS = ("num_experts", "experts_per_token", "expert_hidden", "norm_topk_prob")
MOE_FIELDS += ("decoder_sparse_step", "mlp_only_layers", "shared_expert_hidden", "shared_expert_gate")


def config_from_hf(hf: dict, family, **fields) -> GPTConfig:
    """A Mixtral, Qwen2-MoE or Qwen3-MoE config.json (as a dict) -> GPTConfig; `fields` set the free
    fields."""
    model_type = hf.get("model_type")
    fixed = [f for f in fields if f in MOE_FIELDS]
    if fixed:
        raise ValueError(f"{fixed[0]} is fixed by the pretrained checkpoint and cannot be overridden")
    qwen = model_type in ("qwen2_moe", "qwen3_moe")
    E = hf.get("num_experts") if qwen else hf.get("num_local_experts")
    E = E or hf.get("num_local_experts")  # transformers 5 writes Qwen3-MoE's num_experts under this name
    if not E or "num_experts_per_tok" not in hf:
        raise ValueError(f"{model_type} config.json has no number of experts or num_experts_per_tok")
    if hf.get("router_jitter_noise"):
        raise ValueError(
            f"{model_type} config with router_jitter_noise={hf['router_jitter_noise']!r} is not supported"
        )
    if model_type == "qwen2_moe" and not hf.get("qkv_bias", True):
        raise ValueError(
            "qwen2_moe config with qkv_bias=False is not supported (Qwen2's q, k, v have biases)"
        )
    experts = dict(
        num_experts=E,
        experts_per_token=hf["num_experts_per_tok"],
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)) if qwen else True,
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
    )
    if qwen:
        experts.update(
            expert_hidden=hf["moe_intermediate_size"],
            decoder_sparse_step=hf.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
        )
    if model_type == "qwen2_moe":
        if not hf.get("shared_expert_intermediate_size"):
            raise ValueError("qwen2_moe config.json has no shared_expert_intermediate_size")
        experts.update(shared_expert_hidden=hf["shared_expert_intermediate_size"], shared_expert_gate=True)
    return llama.config_from_hf(hf, family, **{**experts, **fields})


def config_to_hf(config: GPTConfig, model_type: str, family, special_ids: dict | None = None) -> dict:
    """GPTConfig -> the config.json of Mixtral, Qwen2-MoE or Qwen3-MoE, what it holds of it: what it has no
    key for is left out (families.Family.export_config reads the file back and refuses a model that
    changed); a model without experts (Qwen2-MoE: without a shared expert), which it always has, is an
    error."""
    c = config
    if not c.num_experts:
        raise ValueError(f"a {model_type} checkpoint cannot hold num_experts=0 (its MLPs are experts)")
    if model_type == "qwen2_moe" and not c.shared_expert_hidden:
        raise ValueError("a qwen2_moe checkpoint cannot hold shared_expert_hidden=0 (it has a shared expert)")
    dense = dataclasses.replace(c, num_experts=0, shared_expert_hidden=0, shared_expert_gate=False)
    hf = llama.config_to_hf(dense, model_type, family, special_ids)
    hf.update(
        num_experts_per_tok=c.experts_per_token,
        router_aux_loss_coef=c.router_aux_loss_coef,
        output_router_logits=False,
    )
    if model_type == "mixtral":
        hf.update(
            num_local_experts=c.num_experts, intermediate_size=c.expert_mlp_hidden, router_jitter_noise=0.0
        )
    else:
        hf.update(
            num_experts=c.num_experts,
            moe_intermediate_size=c.expert_mlp_hidden,
            norm_topk_prob=c.norm_topk_prob,
            decoder_sparse_step=c.decoder_sparse_step,
            mlp_only_layers=list(c.mlp_only_layers),
        )
    if model_type == "qwen2_moe":
        hf.update(shared_expert_intermediate_size=c.shared_expert_hidden, qkv_bias=True)
    return hf
