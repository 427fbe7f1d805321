"""Mixtral and Qwen3-MoE in the family table (flaxgpt.hf.families): their sparse layers' key tables and
their config.json both ways.

Both are the Llama (Mixtral) or Qwen3 (Qwen3-MoE) decoder whose MLP is a mixture of experts in the
sparse layers (flaxgpt/models/moe.py). Published checkpoints, and transformers 5's save_pretrained
(which fuses the experts in memory but writes them one by one), store each expert's projections as
tensors of their own: Mixtral's block_sparse_moe.experts.{e}.w1 / w3 / w2 (gate / up / down) and
block_sparse_moe.gate (the router), Qwen3-MoE's mlp.experts.{e}.gate_proj / up_proj / down_proj and
mlp.gate. flaxgpt.hf.rotary stacks them into experts_fc [E, D, 2F] (gate | up) and experts_proj
[E, F, D]; Qwen3-MoE's dense layers (mlp_only_layers, decoder_sparse_step) keep Qwen3's MLP keys.

Shape letters: D n_embd, E experts, F each expert's hidden size.
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
# GPTConfig fields of the experts that a checkpoint fixes (beside llama.ARCH_FIELDS)
MOE_FIELDS = ("num_experts", "experts_per_token", "expert_hidden", "norm_topk_prob")
MOE_FIELDS += ("decoder_sparse_step", "mlp_only_layers")


def config_from_hf(hf: dict, family, **fields) -> GPTConfig:
    """A Mixtral or Qwen3-MoE config.json (as a dict) -> GPTConfig; `fields` set the free fields."""
    model_type = hf.get("model_type")
    fixed = [f for f in fields if f in MOE_FIELDS]
    if fixed:
        raise ValueError(f"{fixed[0]} is fixed by the pretrained checkpoint and cannot be overridden")
    qwen = model_type == "qwen3_moe"
    E = hf.get("num_experts") if qwen else hf.get("num_local_experts")
    E = E or hf.get("num_local_experts")  # transformers 5 writes Qwen3-MoE's num_experts under this name
    if not E or "num_experts_per_tok" not in hf:
        raise ValueError(f"{model_type} config.json has no number of experts or num_experts_per_tok")
    if hf.get("router_jitter_noise"):
        raise ValueError(
            f"{model_type} config with router_jitter_noise={hf['router_jitter_noise']!r} is not supported"
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
    return llama.config_from_hf(hf, family, **{**experts, **fields})


def config_to_hf(config: GPTConfig, model_type: str, family, special_ids: dict | None = None) -> dict:
    """GPTConfig -> the config.json of Mixtral or Qwen3-MoE; a config it cannot express is an error."""
    c = config
    need = {"num_experts": c.num_experts or 1}  # any number of experts, but some
    if model_type == "mixtral":  # every layer sparse, weights always renormalised
        need.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=())
    for field, value in need.items():
        if getattr(c, field) != value:
            raise ValueError(f"{model_type} needs {field}={value!r}, this model has {getattr(c, field)!r}")
    hf = llama.config_to_hf(dataclasses.replace(c, num_experts=0), model_type, family, special_ids)
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
    return hf
