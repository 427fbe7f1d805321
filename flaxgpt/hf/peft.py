"""Hugging Face PEFT LoRA adapters both ways, and merging one into its base.

    spec, adapters = load_adapter("adapter_dir", config)     # adapter_config.json + adapter_model.safetensors
    export_adapter(config, spec, adapters, "out/adapter", base="base_dir")       # peft loads it

Merged into its base by flaxgpt.load_pretrained("base_dir", adapter="adapter_dir") (flaxgpt.loader);
`flaxgpt peft merge` and `flaxgpt peft export` are flaxgpt.hf_cli.

PEFT names one adapter per torch module: lora_A.weight [r, in] and lora_B.weight [out, r] (torch
layout, also for GPT-2's Conv1D); flaxgpt's are A [in, r] and B [r, out] at the Dense they adapt
(models/lora.py), a q, k or v adapter writing its column block of the fused c_attn. The key table
below is the whole mapping; every tensor is shape-checked against the base's config. A module PEFT
left out of some layers (layers_to_transform, exclude_modules) loads there as zeros: no change.
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from flaxgpt.hf import files as hf_files
from flaxgpt.models import lora
from flaxgpt.models.gpt import GPTConfig, stack_layers, unstack_layers

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# flaxgpt target -> torch module inside layer i, per family; and the layer prefix of each
HF_MODULES = {
    "llama": {
        "q": "self_attn.q_proj",
        "k": "self_attn.k_proj",
        "v": "self_attn.v_proj",
        "o": "self_attn.o_proj",
        "gate": "mlp.gate_proj",
        "up": "mlp.up_proj",
        "down": "mlp.down_proj",
    },
    "gpt2": {"qkv": "attn.c_attn", "o": "attn.c_proj", "up": "mlp.c_fc", "down": "mlp.c_proj"},
}
# a mixture of experts' stacks, which PEFT adapts as target_parameters (its ParamWrapper): one
# lora_A [E r, in] / lora_B [out, r E] pair per stack of the layer's "mlp.experts" module. Several
# stacks nest their wrappers in the module's parameter order (gate_up_proj first, innermost), so
# the first of k adapted stacks sits under k - 1 ".base_layer"s.
HF_PARAMETERS = {"experts_gate_up": "gate_up_proj", "experts_down": "down_proj"}
EXPERTS_MODULE = "mlp.experts"
LAYER_PREFIX = {"llama": "base_model.model.model.layers.{i}.", "gpt2": "base_model.model.transformer.h.{i}."}
KEY_RE = re.compile(
    r"^base_model\.model\.(?:model\.layers|transformer\.h)\.(\d+)\.(.+)\.lora_([AB])\.weight$"
)
UNSUPPORTED = {  # adapter_config fields whose non-default values flaxgpt does not implement
    "use_dora": False,
    "bias": "none",
    "lora_bias": False,
    "modules_to_save": None,
    "trainable_token_indices": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "alora_invocation_tokens": None,  # activated LoRA: applied from those tokens on only
    "use_bdlora": False,
}
# initialisations that rewrite the base weights when PEFT loads the adapter (W - scale A0 B0, LoftQ's
# quantized base): the saved A and B fit that rewritten base, not the model flaxgpt loads
BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
# modules outside the layers PEFT may adapt, which flaxgpt's LoRA does not
OUTSIDE = ("embed_tokens", "lm_head", "wte", "wpe")


def _family(config: GPTConfig) -> str:
    return "llama" if config.glu else "gpt2"


def _targeted(hf: dict, family: str, i: int, target: str) -> bool:
    """Whether PEFT, given adapter_config.json `hf`, adapts layer i's module for `target` (its
    check_target_module_exists, for the fields flaxgpt reads): target_modules as a regex (full match)
    or names (equal, or a suffix after a dot), layers_to_transform, exclude_modules alike."""
    key = LAYER_PREFIX[family].format(i=i).removeprefix("base_model.model.") + HF_MODULES[family][target]

    def matches(spec) -> bool:
        if isinstance(spec, str):
            return re.fullmatch(spec, key) is not None
        return any(key == name or key.endswith(f".{name}") for name in spec or ())

    layers = hf.get("layers_to_transform")
    layers = [layers] if isinstance(layers, int) else layers
    targets = hf.get("target_modules")
    return (
        (targets is None or targets == "all-linear" or matches(targets))
        and (layers is None or i in layers)
        and not (hf.get("exclude_modules") and matches(hf["exclude_modules"]))
    )


def _hf_name(family: str, target: str) -> str:
    if target in HF_PARAMETERS:
        return f"{EXPERTS_MODULE}.{HF_PARAMETERS[target]}"
    return HF_MODULES[family][target]


def _expert_targets(directory: str, target_parameters) -> list[str]:
    """PEFT's target_parameters -> flaxgpt's expert targets, in the experts module's parameter order."""
    by_param = {p: t for t, p in HF_PARAMETERS.items()}
    names = [name.rsplit(".", 1)[-1] for name in target_parameters]
    unknown = [n for n, name in zip(names, target_parameters) if n not in by_param]
    if unknown:
        raise ValueError(
            f"{directory}: target_parameters {list(target_parameters)}: flaxgpt adapts only the experts' "
            f"{' and '.join(by_param)}"
        )
    return [t for t in HF_PARAMETERS if HF_PARAMETERS[t] in names]


def load_adapter(directory: str, config: GPTConfig) -> tuple[lora.LoraSpec, dict]:
    """A PEFT LoRA directory -> (LoraSpec, flaxgpt adapters) for the base `config`, every tensor checked."""
    cfg_file, weights = os.path.join(directory, ADAPTER_CONFIG), os.path.join(directory, ADAPTER_WEIGHTS)
    if not (os.path.isfile(cfg_file) and os.path.isfile(weights)):
        raise FileNotFoundError(
            f"{directory} is not a PEFT adapter: it needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}"
        )
    hf = hf_files.read_json(cfg_file, "an adapter config object")
    for key in ("r", "lora_alpha"):
        value = hf.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{cfg_file} has {key}={value!r}; a LoRA adapter's {key} is a positive number")
    if hf.get("peft_type", "LORA") != "LORA":
        raise ValueError(
            f"{directory}: peft_type {hf.get('peft_type')!r} is not supported; only LORA adapters load"
        )
    for name, default in UNSUPPORTED.items():
        value = hf.get(name)
        empty = value in (None, False, "none") or (isinstance(value, (list, dict)) and not value)
        if value != default and not empty:
            raise ValueError(f"{directory}: {name}={hf[name]!r} is not supported (flaxgpt loads plain LoRA)")
    init = hf.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(BASE_REWRITING_INITS):
        raise ValueError(
            f"{directory}: init_lora_weights={init!r} rewrites the base weights when PEFT loads it, which "
            "flaxgpt does not; save it as plain LoRA with PEFT's save_pretrained(..., "
            "path_initial_model_for_weight_conversion=...)"
        )
    family = _family(config)
    to_target = {module: t for t, module in HF_MODULES[family].items()}
    stacks = _expert_targets(directory, hf.get("target_parameters") or [])
    for depth, t in enumerate(reversed(stacks)):  # the last stack's wrapper is the outermost
        to_target[EXPERTS_MODULE + ".base_layer" * depth] = t
    try:
        tensors = load_file(weights)
    except SafetensorError as e:
        raise hf_files.safetensors_error(weights, e) from None
    found: dict = {}  # (layer, target) -> {"A": array, "B": array}
    for key, x in tensors.items():
        m = KEY_RE.match(key)
        target = m and to_target.get(m.group(2))
        outside = next((name for name in OUTSIDE if f".{name}." in key), None)
        if outside:
            raise ValueError(
                f"{directory}: tensor {key} adapts {outside}; flaxgpt's LoRA adapts the layers' linear "
                f"weights only ({', '.join(HF_MODULES[family].values())})"
            )
        if not m or target is None or not key.startswith(LAYER_PREFIX[family].format(i=m.group(1))):
            raise ValueError(
                f"{directory}: tensor {key} is not a LoRA weight of a {family}-family model "
                f"(an adapter for another architecture?)"
            )
        found.setdefault((int(m.group(1)), target), {})[m.group(3)] = x
    known = lora.model_targets(config)
    for (i, t), _ in found.items():
        if t not in known:  # a dense model's MLP on a mixture of experts, or expert stacks on a dense one
            raise ValueError(
                f"{directory}: layer {i}'s {t} adapter has no such weight in this base (it has "
                f"{', '.join(known)}): an adapter for another architecture?"
            )
    targets = sorted({t for _, t in found}, key=known.index)
    if not targets:
        raise ValueError(f"{directory}: {ADAPTER_WEIGHTS} holds no LoRA weights")
    flat = dataclasses.replace(config, scan_layers=False)
    spec = lora.LoraSpec.make(
        flat,
        int(hf["r"]),
        float(hf["lora_alpha"]),
        float(hf.get("lora_dropout") or 0.0),
        targets,
        rslora=bool(hf.get("use_rslora")),
    )
    adapters: dict = {}
    shapes = lora.adapter_shapes(flat, spec)
    for i in range(config.n_layer):
        for t in targets:
            if t in lora.EXPERT_PARAMS and not config.layer_is_sparse(i):
                continue  # a dense layer of a mixture (mlp_only_layers): no expert stacks
            pair = found.pop((i, t), None)
            node = adapters.setdefault(f"h_{i}", {})
            for name in lora.SITES[t]:
                node = node.setdefault(name, {})
            if pair is None and t not in lora.EXPERT_PARAMS and not _targeted(hf, family, i, t):
                # a module the adapter's config leaves out here (layers_to_transform, exclude_modules, a
                # target list naming some layers): zeros, which change nothing, as PEFT's base there
                site = shapes[(f"h_{i}", *lora.SITES[t])]
                node.update({k: np.zeros(site[k], np.float32) for k in (f"{t}_a", f"{t}_b")})
                continue
            if pair is None or set(pair) != {"A", "B"}:
                raise ValueError(
                    f"{directory}: layer {i} has no complete {_hf_name(family, t)} adapter (A and B)"
                )
            a, b = pair["A"].astype(np.float32), pair["B"].astype(np.float32)
            if t in lora.EXPERT_PARAMS:  # A [E r, in] expert-major, B [out, r E] rank-major (PEFT's layout)
                E = config.num_experts
                a, b = a.reshape(E, -1, a.shape[-1]), b.reshape(b.shape[0], -1, E).transpose(2, 1, 0)
                node[f"{t}_a"], node[f"{t}_b"] = (
                    np.ascontiguousarray(a.transpose(0, 2, 1)),
                    np.ascontiguousarray(b),
                )
            else:
                node[f"{t}_a"], node[f"{t}_b"] = np.ascontiguousarray(a.T), np.ascontiguousarray(b.T)
    if found:
        raise ValueError(
            f"{directory}: adapters for layer {min(found)[0]}, but the base has {config.n_layer} layers"
        )
    lora.check_adapters(flat, spec, adapters, what=f"{directory}:")
    adapters = jax.tree_util.tree_map(jax.numpy.asarray, adapters)
    if config.scan_layers:  # the spec's columns do not depend on the layout
        adapters = stack_layers(adapters, config.n_layer)
    return spec, adapters


def export_adapter(config: GPTConfig, spec: lora.LoraSpec, adapters, out_dir: str, base: str = "") -> str:
    """Write out_dir/adapter_config.json + adapter_model.safetensors that peft's PeftModel loads."""
    lora.check_adapters(config, spec, adapters)
    adapters = jax.device_get(adapters)
    if config.scan_layers:
        adapters = unstack_layers(adapters, config.n_layer)
    family = _family(config)
    foreign = [t for t in spec.targets if t not in HF_MODULES[family] and t not in HF_PARAMETERS]
    if foreign:
        raise ValueError(
            f"{', '.join(foreign)} adapters have no PEFT counterpart: no Hugging Face family has a mixture "
            "of experts without gated experts"
        )
    tensors = {}
    stacks = [t for t in HF_PARAMETERS if t in spec.targets]
    for i in range(config.n_layer):
        for t in spec.targets:
            node = adapters[f"h_{i}"]
            for name in lora.SITES[t]:
                node = node.get(name, {})
            if f"{t}_a" not in node:  # an expert target in a dense layer
                continue
            a, b = np.asarray(node[f"{t}_a"], np.float32), np.asarray(node[f"{t}_b"], np.float32)
            if t in lora.EXPERT_PARAMS:  # see load_adapter: A [E r, in], B [out, r E]
                module = EXPERTS_MODULE + ".base_layer" * (len(stacks) - 1 - stacks.index(t))
                a, b = (
                    a.transpose(0, 2, 1).reshape(-1, a.shape[1]),
                    b.transpose(2, 1, 0).reshape(b.shape[2], -1),
                )
            else:
                module, a, b = HF_MODULES[family][t], a.T, b.T
            key = LAYER_PREFIX[family].format(i=i) + module
            tensors[f"{key}.lora_A.weight"] = np.ascontiguousarray(a)
            tensors[f"{key}.lora_B.weight"] = np.ascontiguousarray(b)
    modules = [HF_MODULES[family][t] for t in spec.targets if t not in lora.EXPERT_PARAMS]
    hf = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "use_rslora": spec.rslora,
        # GPT-2's attn.c_proj and mlp.c_proj share a name: peft matches a target by its dotted suffix
        "target_modules": [
            m if family == "gpt2" and m.endswith("c_proj") else m.split(".")[-1] for m in modules
        ]
        or None,  # peft takes target_parameters alone
        "target_parameters": [_hf_name(family, t) for t in stacks] or None,
        "fan_in_fan_out": family == "gpt2",  # GPT-2's Conv1D keeps weights [in, out]
        "bias": "none",
        "inference_mode": True,
        "init_lora_weights": True,
    }
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, ADAPTER_WEIGHTS + ".tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(out_dir, ADAPTER_WEIGHTS))
    hf_files.write_json(hf, os.path.join(out_dir, ADAPTER_CONFIG))
    return out_dir
