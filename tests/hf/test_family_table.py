"""hf.families: one entry per Hugging Face model_type, the only dispatch; every entry's config mapping
goes both ways (no weights: config.json dicts alone)."""

import pytest

from flaxgpt.hf import families, gemma, gpt2, llama, moe, rotary
from flaxgpt.models.gpt import GPTConfig

# a preset per family: the model_type that expresses it
PRESETS = {
    "gpt2": "gpt2",
    "smollm2-135m": "llama",
    "mistral-7b-v0.1": "mistral",
    "qwen2.5-0.5b": "qwen2",
    "qwen3-0.6b": "qwen3",
    "gemma-2-2b": "gemma2",
    "gemma-3-1b": "gemma3_text",
    "mixtral-8x7b": "mixtral",
    "qwen3-30b-a3b": "qwen3_moe",
    "qwen1.5-moe-a2.7b": "qwen2_moe",
}


def test_every_family_is_one_entry():
    assert set(families.FAMILIES) == set(PRESETS.values())
    for model_type, family in families.FAMILIES.items():
        assert families.family_for({"model_type": model_type}) is family
        assert family.architecture.endswith(("ForCausalLM", "LMHeadModel"))
        mapping = gpt2 if model_type == "gpt2" else gemma if model_type.startswith("gemma") else llama
        mapping = moe if family.sparse_keys else mapping
        assert family.config_from_hf is mapping.config_from_hf and family.config_to_hf is mapping.config_to_hf
        assert family.load is (gpt2.load_gpt2 if model_type == "gpt2" else rotary.load_rotary)
    with pytest.raises(ValueError, match="model_type 'deepseek_v3' is not supported; supported: gpt2, llama"):
        families.family_for({"model_type": "deepseek_v3"})


@pytest.mark.parametrize("preset", list(PRESETS))
def test_config_maps_both_ways(preset):
    """GPTConfig -> config.json -> GPTConfig is the same model, and the family chosen for export is
    the one whose config.json it writes."""
    config = GPTConfig.preset(preset)
    model_type = families.family_of(config)
    assert model_type == PRESETS[preset]
    hf = families.config_to_hf(config, model_type)
    assert hf["model_type"] == model_type
    assert hf["architectures"] == [families.FAMILIES[model_type].architecture]
    back = families.config_from_hf(hf)
    fields = gpt2.ARCH_FIELDS if model_type == "gpt2" else llama.ARCH_FIELDS
    assert {f: getattr(back, f) for f in fields} == {f: getattr(config, f) for f in fields}
    assert back.block_size == config.block_size
