"""A LoRA run's directory read back: the adapters it trained, their spec, and the base they adapt.

    lora = read_lora_run("out/lora_llama")          # LoraRun(config, spec, adapters, base, tokenizer)
    lora_section("out/lora_llama")                  # its config.json's `lora` section, None for a plain run

A LoRA run checkpoints only its adapters; its base is the pretrained directory named by `init_from`.
flaxgpt.load merges the two (`models.lora.merge`); `flaxgpt peft export` writes the adapters as PEFT's.
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

from flaxgpt.data import tokenizers
from flaxgpt.models import lora
from flaxgpt.models import registry as models
from flaxgpt.runs import checkpoint


class LoraRun(NamedTuple):
    config: Any  # the GPTConfig of base + adapters
    spec: lora.LoraSpec
    adapters: Any  # the checkpoint's params: the adapters alone
    base: str  # init_from: the pretrained directory the adapters were trained on
    tokenizer: Any
    base_step: int | None = None  # a run as the base: the checkpoint step they were trained on


def lora_section(out_dir) -> dict | None:
    """The `lora` section of a run's config.json when the run trained LoRA adapters (rank > 0)."""
    path = os.path.join(out_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        section = json.load(fh).get("lora") or {}
    return section if section.get("rank") else None


def read_lora_run(out_dir, step: int | None = None) -> LoraRun:
    """The adapters of checkpoint `step` (default the latest) with the spec and base they go with."""
    adapters, extra = checkpoint.load_for_inference(out_dir, step, with_extra=True)
    cfg = extra.get("config") or {}
    c, config = cfg.get("lora") or lora_section(out_dir), models.config_from(cfg["model"], saved=True)
    spec = lora.LoraSpec.make(config, c["rank"], c["alpha"], c["dropout"], c["targets"])
    with open(os.path.join(out_dir, "meta.json")) as fh:
        tok_meta = (extra.get("meta") or {}).get("tokenizer") or json.load(fh)["tokenizer"]
    tok = tokenizers.from_meta(tok_meta)
    return LoraRun(config, spec, adapters, cfg["init_from"], tok, extra.get("init_step"))
