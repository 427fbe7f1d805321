"""PEFT LoRA adapters against peft itself: loaded, merged, exported and bad adapters, on tiny random
Llama / Qwen2 / GPT-2 models made with transformers (random non-zero B: init_lora_weights=False)."""

import dataclasses
import json
import re

import jax
import numpy as np
import peft
import pytest
import torch
import transformers

import flaxgpt
from flaxgpt import hf_cli
from flaxgpt.hf import peft as hf_peft
from flaxgpt.hf import pretrained as hf
from flaxgpt.models import lora
from tests.hf.test_llama import TOKENS, flax_logits, make_hf_model, ref_logits

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_gpt2(directory):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=300, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    model.save_pretrained(directory)
    return model


def make_adapter(model, directory, targets, r=4, alpha=8.0, **kw):
    torch.manual_seed(1)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **kw)
    pmodel = peft.get_peft_model(model, cfg).eval()
    pmodel.save_pretrained(directory)
    return pmodel


CASES = {  # name -> (base maker, peft target_modules, extra LoraConfig fields)
    "llama_all": (lambda d: make_hf_model("llama", d), LLAMA_TARGETS, {}),
    "qwen2_kv_rslora": (
        lambda d: make_hf_model("qwen2", d),
        ["k_proj", "v_proj", "up_proj"],
        {"use_rslora": True},
    ),
    "gpt2_all": (make_gpt2, ["c_attn", "c_proj", "c_fc"], {"fan_in_fan_out": True}),
    # modules PEFT leaves out of some layers: zeros there (exported as such: peft's logits again)
    "llama_some_layers": (
        lambda d: make_hf_model("llama", d),
        ["q_proj", "down_proj"],
        {"layers_to_transform": [1], "exclude_modules": ["model.layers.1.mlp.down_proj"]},
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def adapted(request, tmp_path_factory):
    base_dir, adapter_dir = tmp_path_factory.mktemp("base"), tmp_path_factory.mktemp("adapter")
    make_base, targets, extra = CASES[request.param]
    pmodel = make_adapter(make_base(base_dir), adapter_dir, targets, **extra)
    return base_dir, adapter_dir, pmodel, ref_logits(pmodel)


def test_load_matches_peft(adapted):
    base_dir, adapter_dir, _, want = adapted
    config, merged = flaxgpt.load_pretrained(str(base_dir), adapter=str(adapter_dir))
    assert np.abs(flax_logits(config, merged) - want).max() < 1e-4
    # unmerged: the adapters added by the linear layers, over the float32 and a scan-layers base
    config, base = hf.load_pretrained(str(base_dir), scan_layers=True)
    spec, adapters = hf_peft.load_adapter(str(adapter_dir), config)
    got = jax.jit(lambda b, a: lora.apply(config, spec, b, a, TOKENS))(base, adapters)
    assert np.abs(np.asarray(got) - want).max() < 1e-4


def test_export_loads_in_peft(adapted, tmp_path):
    base_dir, adapter_dir, pmodel, want = adapted
    config, base = hf.load_pretrained(str(base_dir))
    spec, adapters = hf_peft.load_adapter(str(adapter_dir), config)
    hf_peft.export_adapter(config, spec, adapters, str(tmp_path / "out"), base=str(base_dir))
    reloaded = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base_dir), tmp_path / "out"
    ).eval()
    assert np.abs(ref_logits(reloaded) - want).max() < 1e-5


def test_merge_cli_writes_a_plain_model(adapted, tmp_path):
    base_dir, adapter_dir, _, want = adapted
    assert (
        hf_cli.peft_main(
            ["merge", "--base", str(base_dir), "--adapter", str(adapter_dir), "--to", str(tmp_path / "m")]
        )
        == 0
    )
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert np.abs(ref_logits(merged) - want).max() < 1e-4


@pytest.fixture(scope="module")
def llama_and_gpt2(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    make_adapter(make_hf_model("llama", root / "llama"), root / "llama_adapter", ["q_proj", "v_proj"])
    make_adapter(make_gpt2(root / "gpt2"), root / "gpt2_adapter", ["c_attn"], fan_in_fan_out=True)
    make_adapter(make_hf_model("llama", root / "wide", hidden_size=128), root / "wide_adapter", ["q_proj"])
    return root


@pytest.mark.parametrize(
    "base, adapter, message",
    [
        ("llama", "gpt2_adapter", "not a LoRA weight of a llama-family model"),
        ("gpt2", "llama_adapter", "not a LoRA weight of a gpt2-family model"),
        ("llama", "wide_adapter", "has shape"),
        ("llama", "llama", "is not a PEFT adapter"),
    ],
)
def test_bad_adapters_fail_in_one_line_and_write_nothing(
    llama_and_gpt2, tmp_path, capsys, base, adapter, message
):
    root = llama_and_gpt2
    assert (
        hf_cli.peft_main(
            [
                "merge",
                "--base",
                str(root / base),
                "--adapter",
                str(root / adapter),
                "--to",
                str(tmp_path / "m"),
            ]
        )
        == 1
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
    assert not (tmp_path / "m").exists()


def test_merge_onto_a_run_and_export_of_no_run_say_what_to_give(llama_and_gpt2, tmp_path, capsys):
    """--base a training run said "model_type None is not supported"; --out_dir that does not exist
    spoke of its config.json."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "meta.json").write_text("{}")
    args = ["merge", "--base", str(tmp_path / "run"), "--adapter", str(llama_and_gpt2 / "llama_adapter")]
    assert hf_cli.peft_main([*args, "--to", str(tmp_path / "m")]) == 1
    assert "is a flaxgpt training run; give a Hugging Face model directory" in capsys.readouterr().err
    assert hf_cli.peft_main(["export", "--out_dir", str(tmp_path / "none"), "--to", str(tmp_path / "a")]) == 1
    assert "none does not exist; give the LoRA training run's directory" in capsys.readouterr().err
    assert not (tmp_path / "m").exists() and not (tmp_path / "a").exists()


def test_unsupported_adapter_fields_are_refused(llama_and_gpt2, tmp_path):
    src = llama_and_gpt2 / "llama_adapter"
    (tmp_path / "a").mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    (tmp_path / "a" / "adapter_model.safetensors").write_bytes(
        (src / "adapter_model.safetensors").read_bytes()
    )
    config, _ = hf.load_pretrained(str(llama_and_gpt2 / "llama"))
    with pytest.raises(ValueError, match="use_dora"):
        hf_peft.load_adapter(str(tmp_path / "a"), config)
    # activated LoRA (applied from its invocation tokens on) was applied everywhere; BD-LoRA too
    fields = {"lora_bias": True, "trainable_token_indices": [3, 4], "alora_invocation_tokens": [5, 6]}
    for field, value in {**fields, "use_bdlora": True}.items():
        (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**cfg, field: value}))
        with pytest.raises(ValueError, match=re.escape(f"{field}={value!r} is not supported")):
            hf_peft.load_adapter(str(tmp_path / "a"), config)
    # PiSSA, OLoRA, ...: A and B fit the base PEFT rewrites on load (logits 5 off, silently)
    for init in ("pissa", "pissa_niter_2", "olora", "loftq", "corda"):
        (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**cfg, "init_lora_weights": init}))
        with pytest.raises(ValueError, match=f"init_lora_weights='{init}' rewrites the base weights"):
            hf_peft.load_adapter(str(tmp_path / "a"), config)
    # empty lists are the defaults as peft writes them (modules_to_save=[] was refused)
    for field in ("modules_to_save", "trainable_token_indices", "alora_invocation_tokens"):
        (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**cfg, field: []}))
        hf_peft.load_adapter(str(tmp_path / "a"), config)
    for init in (True, False, "gaussian", "eva"):  # initialisations of A and B alone load
        (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**cfg, "init_lora_weights": init}))
        hf_peft.load_adapter(str(tmp_path / "a"), config)


def test_layers_missing_without_a_config_that_leaves_them_out_are_refused(llama_and_gpt2):
    """An adapter of a 2-layer model on a 4-layer base of the same width (or tensors lost): nothing in its
    config leaves layers 2 and 3 out, so it is refused, not loaded as zeros there."""
    config = dataclasses.replace(hf.read_config(str(llama_and_gpt2 / "llama")), n_layer=4)
    with pytest.raises(ValueError, match=r"layer 2 has no complete self_attn\.q_proj adapter"):
        hf_peft.load_adapter(str(llama_and_gpt2 / "llama_adapter"), config)


def test_a_dense_mlp_adapter_on_a_mixture_of_experts_is_named(llama_and_gpt2, tmp_path):
    """A gate_proj adapter on a base whose layers are experts (the reverse alike) said only
    "tuple.index(x): x not in tuple"."""
    base = transformers.AutoModelForCausalLM.from_pretrained(str(llama_and_gpt2 / "llama"))
    make_adapter(base, tmp_path / "a", ["q_proj", "gate_proj"])
    config = dataclasses.replace(hf.read_config(str(llama_and_gpt2 / "llama")), num_experts=4)
    with pytest.raises(ValueError, match=r"layer 0's gate adapter has no such weight in this base \(it has "):
        hf_peft.load_adapter(str(tmp_path / "a"), config)


def test_an_adapter_on_the_embeddings_or_the_head_is_named(llama_and_gpt2, tmp_path):
    """peft adapts embed_tokens / lm_head when asked; flaxgpt's LoRA adapts the layers only: the
    refusal says so, where it said "an adapter for another architecture?"."""
    base = transformers.AutoModelForCausalLM.from_pretrained(str(llama_and_gpt2 / "llama"))
    make_adapter(base, tmp_path / "a", ["q_proj", "lm_head"])
    config, _ = hf.load_pretrained(str(llama_and_gpt2 / "llama"))
    with pytest.raises(
        ValueError,
        match=r"tensor base_model\.model\.lm_head\.\S+ adapts lm_head; flaxgpt's LoRA adapts the layers",
    ):
        hf_peft.load_adapter(str(tmp_path / "a"), config)


def test_sample_and_serve_load_a_base_with_an_adapter(tmp_path):
    import sample
    from flaxgpt.serve import launch

    base_dir, adapter_dir = tmp_path / "gpt2", tmp_path / "adapter"  # GPT-2: its BPE ships with flaxgpt
    want = ref_logits(make_adapter(make_gpt2(base_dir), adapter_dir, ["c_attn", "c_fc"], fan_in_fan_out=True))
    a = sample.build_parser().parse_args(["--init_from", str(base_dir), "--adapter", str(adapter_dir)])
    served, _ = launch.load(init_from=str(base_dir), adapter=str(adapter_dir))
    for r in (sample.load(a), served):
        assert np.abs(flax_logits(r.config, r.params) - want).max() < 1e-4
    with pytest.raises(ValueError, match="--adapter DIR goes with --init_from BASE"):
        sample.load(sample.build_parser().parse_args(["--out_dir", "x", "--adapter", str(adapter_dir)]))
