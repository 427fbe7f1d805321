"""Mixtral, Qwen2-MoE and Qwen3-MoE import/export against transformers (PyTorch CPU), and the router's
load-balancing loss against transformers' router_aux_loss.

Tiny random models made by transformers (4 experts, top-2; Qwen3-MoE with a dense layer among the
sparse ones and without renormalised weights; Qwen2-MoE with a gated shared expert, qkv biases and
every second layer sparse) stand in for published weights: nothing is downloaded.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never touch the network, even by accident

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from flaxgpt.hf import families
from flaxgpt.hf import pretrained as hf
from flaxgpt.models.gpt import GPT
from flaxgpt.models.moe import ROUTER, router_losses
from tests.hf.test_llama import flax_greedy, flax_logits, ref_logits, torch_greedy

V = 128
TINY = dict(
    vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, num_experts_per_tok=2, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
FAMILIES = {  # model_type -> (config class, model class, what this family's tiny model exercises)
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(num_local_experts=4)),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            num_experts=4,
            moe_intermediate_size=24,
            head_dim=16,
            num_hidden_layers=3,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        ),
    ),  # fmt: skip
    "qwen2_moe": (
        transformers.Qwen2MoeConfig,
        transformers.Qwen2MoeForCausalLM,
        dict(
            num_experts=4,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            num_hidden_layers=4,
            decoder_sparse_step=2,
        ),
    ),  # fmt: skip
}
SPARSE_LAYER = {"mixtral": 0, "qwen3_moe": 0, "qwen2_moe": 1}  # each tiny model's first sparse layer
TOKENS = np.random.RandomState(0).randint(0, V, (2, 16))


def make_hf_model(model_type, directory):
    config_cls, model_cls, extra = FAMILIES[model_type]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**TINY, **extra})).eval()
    with torch.no_grad():
        for p in model.parameters():  # peaked logits: no argmax ties in the greedy comparisons
            p.add_(0.15 * torch.randn_like(p))
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    model_type = request.param
    directory = str(tmp_path_factory.mktemp(model_type))
    return model_type, directory, make_hf_model(model_type, directory)


def test_import_logits_greedy_tokens_and_aux_loss_match_transformers(family):
    model_type, directory, model = family
    config, params = hf.load_pretrained(directory)
    assert (config.num_experts, config.experts_per_token) == (4, 2)
    sparse = [config.layer_is_sparse(i) for i in range(config.n_layer)]
    assert sparse == {
        "mixtral": [True, True], "qwen3_moe": [True, False, True], "qwen2_moe": [False, True, False, True]
    }[model_type]  # fmt: skip
    first = f"h_{sparse.index(True)}"
    assert params[first]["mlp"]["experts_fc"].shape == (4, 32, 2 * config.expert_mlp_hidden)
    if model_type == "qwen2_moe":  # the shared expert and its gate
        assert params[first]["mlp"]["shared_expert"]["c_fc"]["kernel"].shape == (32, 2 * 40)
        assert params[first]["mlp"]["shared_expert_gate"]["kernel"].shape == (32, 1)
    np.testing.assert_allclose(
        flax_logits(config, params, TOKENS), ref_logits(model, TOKENS), atol=1e-4, rtol=0
    )
    prompt = [int(t) for t in TOKENS[0, :5]]
    assert flax_greedy(config, params, prompt, 10) == torch_greedy(model, prompt, 10)

    # transformers' load_balancing_loss_func over the sparse layers' router logits
    with torch.no_grad():
        ref_aux = float(model(torch.tensor(TOKENS), output_router_logits=True).aux_loss)
    _, state = GPT(config).apply({"params": params}, jnp.asarray(TOKENS), mutable=[ROUTER])
    aux, z = router_losses(state[ROUTER], config.num_experts)
    np.testing.assert_allclose(float(aux), ref_aux, atol=1e-5, rtol=0)
    assert np.isfinite(float(z)) and float(z) > 0


def test_export_loads_in_transformers_with_the_same_logits(family, tmp_path):
    model_type, directory, _ = family
    # Mixtral's layers are all sparse: scanned, its experts are stacked [L, E, ...]
    config, params = hf.load_pretrained(directory, scan_layers=model_type == "mixtral")
    params = jax.tree_util.tree_map(lambda x: x * 1.1, params)  # not the file we read
    assert families.family_of(config) == model_type
    hf.write(config, params, str(tmp_path))
    written = load_file(str(tmp_path / "model.safetensors"))
    prefix = "block_sparse_moe.experts.3.w2" if model_type == "mixtral" else "mlp.experts.3.down_proj"
    i = SPARSE_LAYER[model_type]
    assert f"model.layers.{i}.{prefix}.weight" in written  # per-expert tensors, as published checkpoints
    if model_type == "qwen2_moe":
        assert written[f"model.layers.{i}.mlp.shared_expert_gate.weight"].shape == (1, 32)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert type(model).__name__ == families.FAMILIES[model_type].architecture
    np.testing.assert_allclose(
        ref_logits(model, TOKENS), flax_logits(config, params, TOKENS), atol=1e-4, rtol=0
    )


def test_missing_expert_tensor_is_one_line_and_nothing_is_written(family, tmp_path):
    model_type, directory, _ = family
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    name = {  # an expert's tensor; Qwen2-MoE's shared expert's
        "mixtral": "model.layers.0.block_sparse_moe.experts.2.w3",
        "qwen3_moe": "model.layers.0.mlp.experts.2.up_proj",
        "qwen2_moe": "model.layers.1.mlp.shared_expert.up_proj",
    }[model_type]
    del tensors[name + ".weight"]
    broken = tmp_path / "broken"
    broken.mkdir()
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    (broken / "config.json").write_text(open(os.path.join(directory, "config.json")).read())
    with pytest.raises(ValueError, match=rf"missing \['{name}\.weight'\] unexpected \[\]") as e:
        hf.load_pretrained(str(broken))
    assert "\n" not in str(e.value)

    # export of params that lack an expert's slice: refused before any file is written
    config, params = hf.load_pretrained(directory)
    h = f"h_{SPARSE_LAYER[model_type]}"
    params[h]["mlp"]["experts_fc"] = params[h]["mlp"]["experts_fc"][:3]
    out = tmp_path / "out"
    with pytest.raises(
        ValueError, match=rf"param {h}/mlp/experts_fc has shape \(3, 32, \d+\), expected \(4,"
    ) as e:
        hf.export_pretrained(config, params, str(out))
    assert "\n" not in str(e.value) and not (out.exists() and any(out.iterdir()))


def test_config_maps_both_ways_and_refuses_what_a_family_cannot_express():
    from flaxgpt.models.gpt_config import GPTConfig

    presets = (
        ("mixtral-8x7b", "mixtral"),
        ("qwen3-30b-a3b", "qwen3_moe"),
        ("qwen1.5-moe-a2.7b", "qwen2_moe"),
    )
    for preset, model_type in presets:
        config = GPTConfig.preset(preset)
        assert families.family_of(config) == model_type
        back = families.config_from_hf(families.config_to_hf(config, model_type))
        assert back == config
    dense_layer = GPTConfig.preset("qwen3-30b-a3b", qk_norm=False, mlp_only_layers=(3,))
    with pytest.raises(ValueError, match=r"mlp_only_layers=\(3,\) \(it would read back as \(\)\); no family"):
        families.config_to_hf(dense_layer, "mixtral")
    with pytest.raises(
        ValueError, match="llama checkpoint cannot hold num_experts=8 .*; export it as mixtral$"
    ):
        families.config_to_hf(GPTConfig.preset("mixtral-8x7b"), "llama")
    with pytest.raises(
        ValueError, match="^a mixtral checkpoint cannot hold num_experts=0 .*; export it as llama$"
    ):
        families.config_to_hf(GPTConfig.preset("smollm2-135m"), "mixtral")
    shared = GPTConfig.preset("mixtral-8x7b", shared_expert_hidden=64)
    with pytest.raises(
        ValueError, match=r"^a mixtral checkpoint cannot hold shared_expert_hidden=64 \(it would"
    ):
        families.config_to_hf(shared, "mixtral")
    with pytest.raises(
        ValueError, match=r"^a qwen2_moe checkpoint cannot hold shared_expert_hidden=0 \(it has"
    ):
        families.config_to_hf(GPTConfig.preset("mixtral-8x7b", qkv_bias=True), "qwen2_moe")
    with pytest.raises(ValueError, match="shared_expert_hidden 64 needs num_experts > 0"):
        GPTConfig.preset("qwen2.5-0.5b", shared_expert_hidden=64)
    with pytest.raises(ValueError, match="shared_expert_gate needs a shared expert"):
        GPTConfig.preset("mixtral-8x7b", shared_expert_gate=True)
    with pytest.raises(ValueError, match="experts_per_token 9 must be in \\[1, num_experts 8\\]: lower"):
        GPTConfig.preset("mixtral-8x7b", experts_per_token=9)


def test_peft_lora_on_expert_weights_loads_trains_and_exports_as_peft(family, tmp_path):
    """A PEFT adapter on q_proj and the experts' stacks (target_parameters: gate_up_proj, down_proj):
    merged and unmerged logits equal peft's, the gradients of every adapter tensor equal torch's, and
    the exported adapter (grads in adapter layout, too) reloads in peft with the same tensors."""
    import peft
    from safetensors.torch import load_file as load_torch

    import flaxgpt
    from flaxgpt.hf import peft as hf_peft
    from flaxgpt.models import lora

    model_type, directory, _ = family
    base_model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    torch.manual_seed(1)
    cfg = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False,
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )  # fmt: skip
    pmodel = peft.get_peft_model(base_model, cfg)
    pmodel.save_pretrained(tmp_path / "adapter")
    weights_BTV = np.random.RandomState(2).randn(*TOKENS.shape, V).astype(np.float32)
    logits = pmodel(torch.tensor(TOKENS)).logits
    (logits * torch.tensor(weights_BTV)).sum().backward()
    want = logits.detach().numpy()

    config, merged = flaxgpt.load_pretrained(directory, adapter=str(tmp_path / "adapter"))
    np.testing.assert_allclose(flax_logits(config, merged, TOKENS), want, atol=1e-4, rtol=0)
    config, base = hf.load_pretrained(directory)
    spec, adapters = hf_peft.load_adapter(str(tmp_path / "adapter"), config)
    assert spec.targets == ("q", "experts_gate_up", "experts_down")
    loss = lambda a: jnp.sum(lora.apply(config, spec, base, a, TOKENS) * weights_BTV)  # noqa: E731
    grads = jax.jit(jax.grad(loss))(adapters)
    np.testing.assert_allclose(
        np.asarray(jax.jit(lambda a: lora.apply(config, spec, base, a, TOKENS))(adapters)), want, atol=1e-4
    )
    hf_peft.export_adapter(config, spec, grads, str(tmp_path / "grads"))
    torch_grads = {
        n.replace(".default", ""): p.grad.numpy() for n, p in pmodel.named_parameters() if p.grad is not None
    }
    ours = load_file(str(tmp_path / "grads" / "adapter_model.safetensors"))
    assert sorted(ours) == sorted(torch_grads)
    for name, g in ours.items():
        np.testing.assert_allclose(g, torch_grads[name], atol=2e-4, rtol=1e-3, err_msg=name)

    hf_peft.export_adapter(config, spec, adapters, str(tmp_path / "out"), base=directory)
    reloaded = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(directory), tmp_path / "out"
    ).eval()
    np.testing.assert_allclose(ref_logits(reloaded, TOKENS), want, atol=1e-5, rtol=0)
    src = load_torch(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    back = load_torch(str(tmp_path / "out" / "adapter_model.safetensors"))
    assert sorted(src) == sorted(back) and all(torch.equal(src[k], back[k]) for k in src)
