"""Qwen3, Gemma 2 and Gemma 3 (text) import/export against transformers (PyTorch CPU), both directions.

Tiny random models whose sliding window (5) is shorter than the prompts stand in for published weights:
every option of these families (QK-norm, heads of their own width, soft-caps, the local/global layer
pattern, Gemma 3's local rotary base and linear scaling, post-norms, (1 + w) norms, GeGLU, scaled
embeddings) is exercised; nothing is downloaded. The speculative decoder and the serving engine over
these windows are tests/hf/test_window_decoding.py's (against transformers' greedy tokens too).
"""

import dataclasses
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never touch the network, even by accident

import jax
import numpy as np
import pytest
import torch
import transformers

from flaxgpt.hf import families
from flaxgpt.hf import llama as hf_llama
from flaxgpt.hf import pretrained as hf
from flaxgpt.models.gpt import GPTConfig
from tests.hf.test_llama import flax_greedy, flax_logits, raises_one_line, ref_logits, torch_greedy

V = 300
TINY = dict(
    vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=24, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
    pad_token_id=0,
)  # fmt: skip
GEMMA = dict(sliding_window=5, query_pre_attn_scalar=20)
FAMILIES = {  # model_type -> (config class, model class, what this family's tiny model exercises)
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(tie_word_embeddings=False)),
    "gemma2": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        # eager: the one attention of transformers that applies the softcap (5.17 defaulted Gemma 2 to
        # sdpa, which leaves it out; 5.24 refuses sdpa for it)
        dict(GEMMA, attn_logit_softcapping=5.0, final_logit_softcapping=3.0, attn_implementation="eager"),
    ),
    "gemma3_text": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(
            GEMMA,
            # kept in the config, never applied by transformers' Gemma 3: flaxgpt capped attention with it
            attn_logit_softcapping=5.0,
            attn_implementation="eager",
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
        ),
    ),
}
TOKENS = np.random.RandomState(0).randint(0, V, (2, 24))


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(model_type, directory, transformers model), every parameter perturbed; Gemma 3's in shards."""
    model_type = request.param
    config_cls, model_cls, extra = FAMILIES[model_type]
    directory = str(tmp_path_factory.mktemp(model_type))
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**TINY, **extra})).eval()
    with torch.no_grad():
        for p in model.parameters():  # peaked logits: no argmax ties in the greedy comparisons
            p.add_(0.15 * torch.randn_like(p))
    kw = {"max_shard_size": "100KB"} if model_type == "gemma3_text" else {}
    model.save_pretrained(directory, **kw)
    return model_type, directory, model


def test_import_logits_and_greedy_tokens_past_the_window_match_transformers(family):
    model_type, directory, model = family
    config, params = hf.load_pretrained(directory)
    expect = {"qwen3": (0, 0.0, 0.0), "gemma2": (2, 5.0, 3.0), "gemma3_text": (6, 0.0, 0.0)}[model_type]
    assert (config.window_pattern, config.attn_softcap, config.logit_softcap) == expect
    assert config.head_dim == 24 and config.n_embd // config.n_head == 16
    np.testing.assert_allclose(
        flax_logits(config, params, TOKENS), ref_logits(model, TOKENS), atol=1e-4, rtol=0
    )
    prompt = [int(t) for t in TOKENS[0, :9]]  # longer than the window: decoding sees only the last 5 keys
    assert flax_greedy(config, params, prompt, 14) == torch_greedy(model, prompt, 14)


def test_export_loads_in_transformers_with_the_same_logits_and_tokens(family, tmp_path):
    model_type, directory, _ = family
    scan = model_type == "qwen3"  # the Gemmas' layers differ: scan_layers is refused for them
    config, params = hf.load_pretrained(directory, scan_layers=scan, pad_vocab_multiple=64)
    params = jax.tree_util.tree_map(lambda x: x * 1.1, params)  # not the file we read
    hf.export_pretrained(config, params, str(tmp_path))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager")
    model = model.eval()
    assert type(model).__name__ == families.FAMILIES[model_type].architecture
    np.testing.assert_allclose(
        ref_logits(model, TOKENS), flax_logits(config, params, TOKENS), atol=1e-4, rtol=0
    )
    prompt = [int(t) for t in TOKENS[1, :8]]
    assert torch_greedy(model, prompt, 10) == flax_greedy(config, params, prompt, 10)
    if model_type == "gemma3_text":  # a capped attention Gemma 3 cannot express: refused, not dropped
        with pytest.raises(ValueError, match="attn_softcap"):
            hf.export_pretrained(dataclasses.replace(config, attn_softcap=5.0), params, str(tmp_path / "c"))


def test_bad_input_is_one_line_errors(family, tmp_path):
    model_type, directory, _ = family
    with open(os.path.join(directory, "config.json")) as fh:
        cfg = json.load(fh)

    def write(name, drop=(), **changes):
        d = str(tmp_path / name)
        os.makedirs(d)
        for f in os.listdir(directory):
            if f != "config.json":
                os.symlink(os.path.join(directory, f), os.path.join(d, f))
        with open(os.path.join(d, "config.json"), "w") as fh:
            json.dump({k: v for k, v in {**cfg, **changes}.items() if k not in drop}, fh)
        return d

    missing = f"{model_type} config.json has no head_dim"
    raises_one_line(ValueError, missing, hf.load_pretrained, write("no_head_dim", drop=("head_dim",)))
    if model_type == "qwen3":
        raises_one_line(
            ValueError, "use_sliding_window=True", hf.load_pretrained, write("sw", use_sliding_window=True)
        )
        return
    long = f"{model_type} sliding_window 200 is longer than max_position_embeddings 128"
    raises_one_line(ValueError, long, hf.load_pretrained, write("window", sliding_window=200))
    scanned = lambda: hf.load_pretrained(directory, scan_layers=True)  # noqa: E731
    raises_one_line(ValueError, "need scan_layers=False", scanned)
    if model_type == "gemma3_text":  # sharded: one shard gone
        d = write("shard")
        shard = sorted(n for n in os.listdir(d) if n.startswith("model-0"))[-1]
        os.remove(os.path.join(d, shard))
        raises_one_line(FileNotFoundError, f"1 are missing: {shard}$", hf.load_pretrained, d)


def test_a_context_shorter_than_the_window_keeps_the_local_rotary_base(family, tmp_path):
    """block_size below the window: the window layers are then global in effect, but keep their own
    rotary base (Gemma 3), so logits on a short input are unchanged; exported, the model declares the
    checkpoint's window and context again (not block_size's), and computes the original's logits."""
    model_type, directory, model = family
    config, params = hf.load_pretrained(directory, block_size=4)
    assert config.sliding_window in (0, 4) and config.block_size == 4
    np.testing.assert_allclose(
        flax_logits(config, params, TOKENS[:, :4]), ref_logits(model, TOKENS[:, :4]), atol=1e-4
    )
    hf.export_pretrained(config, params, str(tmp_path))
    written = json.loads((tmp_path / "config.json").read_text())
    source = json.loads(open(os.path.join(directory, "config.json")).read())
    keys = ["max_position_embeddings"] + ["sliding_window"] * (model_type != "qwen3")  # (Qwen3's: unused)
    assert [written.get(k) for k in keys] == [source.get(k) for k in keys]
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager")
    np.testing.assert_allclose(ref_logits(exported.eval(), TOKENS), ref_logits(model, TOKENS), atol=1e-5)


# the published config.json files (architecture entries) and parameter counts (model cards: Qwen3 0.6B,
# 1.7B (with the tied head counted once), 4B, 8.2B; Gemma 2 2.6B, 9.2B; Gemma 3 1B, 3.88B text-only)
QWEN3 = dict(
    model_type="qwen3", vocab_size=151936, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None, attention_bias=False, hidden_act="silu",
    use_sliding_window=False, tie_word_embeddings=True,
)  # fmt: skip
GEMMA2 = dict(
    model_type="gemma2", vocab_size=256000, head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
    max_position_embeddings=8192, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
    rms_norm_eps=1e-6, rope_theta=10000.0, hidden_activation="gelu_pytorch_tanh",
)  # fmt: skip
GEMMA3 = dict(
    model_type="gemma3_text", head_dim=256, query_pre_attn_scalar=256, rms_norm_eps=1e-6,
    rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window_pattern=6,
    hidden_activation="gelu_pytorch_tanh",
    attn_logit_softcapping=None, final_logit_softcapping=None,
)  # fmt: skip
PUBLISHED = {
    "qwen3-0.6b": (596_049_920, dict(QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                     num_attention_heads=16)),
    "qwen3-1.7b": (1_720_574_976, dict(QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                       num_attention_heads=16)),
    "qwen3-4b": (4_022_468_096, dict(QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                                     num_attention_heads=32)),
    "qwen3-8b": (8_190_735_360, dict(QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                     num_attention_heads=32, tie_word_embeddings=False)),
    "gemma-2-2b": (2_614_341_888, dict(GEMMA2, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                                       num_attention_heads=8, num_key_value_heads=4)),
    "gemma-2-9b": (9_241_705_984, dict(GEMMA2, hidden_size=3584, intermediate_size=14336,
                                       num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8)),
    "gemma-3-1b": (999_885_952, dict(GEMMA3, vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                                     num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                                     sliding_window=512, max_position_embeddings=32768, rope_scaling=None)),
    "gemma-3-4b-text": (3_880_263_168, dict(
        GEMMA3, vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
        num_attention_heads=8, num_key_value_heads=4, sliding_window=1024, max_position_embeddings=131072,
        rope_scaling={"rope_type": "linear", "factor": 8.0})),
}  # fmt: skip


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_have_the_published_shapes_and_parameter_counts(name):
    """The preset equals what its config.json maps to, and flaxgpt's count equals both the
    published figure and transformers' own model built from that config (on the meta device)."""
    from flaxgpt.tools import summary

    total, hf_config = PUBLISHED[name]
    preset = GPTConfig.preset(name)
    mapped = families.config_from_hf(hf_config)
    fields = hf_llama.ARCH_FIELDS + ("block_size",)
    assert {f: getattr(mapped, f) for f in fields} == {f: getattr(preset, f) for f in fields}
    assert summary.summarize(preset)["totals"]["total"] == total
    config_cls = transformers.AutoConfig.for_model(hf_config["model_type"]).__class__
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config_cls(**hf_config))
    assert sum(p.numel() for p in model.parameters()) == total


def test_config_errors_name_the_values():
    base = dict(GPTConfig.PRESETS["gemma-3-1b"], n_layer=2)
    with pytest.raises(ValueError, match="window_pattern / rope_local_theta make layers differ"):
        GPTConfig(**base, scan_layers=True)
    with pytest.raises(ValueError, match="window_pattern 6 needs a sliding_window > 0"):
        GPTConfig(**{**base, "sliding_window": 0})
    with pytest.raises(ValueError, match="attn_softcap must be >= 0"):
        GPTConfig(**base, attn_softcap=-1.0)
    with pytest.raises(
        ValueError, match="norm='rmsnorm' \\(it would read back as 'rmsnorm_1p'\\).*as qwen3$"
    ):
        families.config_to_hf(GPTConfig.preset("qwen3-0.6b"), "gemma2")


def test_config_values_of_the_wrong_type_are_one_line():
    """A string where a number belongs failed deep inside (GPTConfig's expert check, the jitted RMSNorm)
    as a traceback; a null max_position_embeddings is the default (it was a TypeError)."""
    llama = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4}  # fmt: skip
    assert families.config_from_hf({**llama, "max_position_embeddings": None}).block_size == 2048
    with pytest.raises(ValueError, match=r"llama config.json has rms_norm_eps='1e-6'; it must be a number"):
        families.config_from_hf({**llama, "rms_norm_eps": "1e-6"})
    mixtral = {**llama, "model_type": "mixtral", "num_local_experts": "4", "num_experts_per_tok": 2}
    with pytest.raises(ValueError, match=r"num_local_experts='4'; it must be an integer"):
        families.config_from_hf(mixtral)


def test_flops_count_a_window_layer_over_its_window():
    from flaxgpt.tools import summary

    c = GPTConfig.preset("gemma-3-1b")  # 26 layers: 4 global (5, 11, 17, 23), 22 over 512 keys
    T, HK = 8192, 4 * 256
    got = summary.flops_per_token(c, T)["forward"] - 2 * summary.flops_per_token(c, T)["n_matmul"]
    assert got == 4 * HK * (4 * T + 22 * 512)


def test_peft_lora_adapter_loads_merged_and_unmerged(family, tmp_path):
    """A PEFT LoRA adapter on every projection (Llama's module names) equals peft's logits."""
    import flaxgpt
    from flaxgpt.hf import peft as hf_peft
    from flaxgpt.models import lora
    from tests.hf.test_peft import LLAMA_TARGETS, make_adapter

    _, directory, _ = family
    base_model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="eager"
    ).eval()
    want = ref_logits(make_adapter(base_model, tmp_path, LLAMA_TARGETS), TOKENS)
    config, merged = flaxgpt.load_pretrained(directory, adapter=str(tmp_path))
    np.testing.assert_allclose(flax_logits(config, merged, TOKENS), want, atol=1e-4, rtol=0)
    config, base = hf.load_pretrained(directory)
    spec, adapters = hf_peft.load_adapter(str(tmp_path), config)
    got = jax.jit(lambda b, a: lora.apply(config, spec, b, a, TOKENS))(base, adapters)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)
