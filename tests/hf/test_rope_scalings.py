"""YaRN and dynamic NTK rotary scalings (models/rope.py) against transformers 5 (PyTorch CPU).

The frequencies and attention factor equal transformers' ROPE_INIT_FUNCTIONS; tiny random models of
every rotary family, whose original context (32) is shorter than the prompt (80), give transformers'
logits and greedy tokens through the KV cache; both config.json formats read the same; export writes
what transformers reads back the same, or refuses in one line. Nothing is downloaded.
"""

import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never touch the network, even by accident

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from flaxgpt.decode.sampling import generate
from flaxgpt.hf import families, roundtrip
from flaxgpt.hf import pretrained as hf
from flaxgpt.models.cache import KVCache
from flaxgpt.models.gpt import step_fn as gpt_step_fn
from flaxgpt.models.gpt_config import GPTConfig
from flaxgpt.models.rope import RoPE
from tests.hf.test_llama import flax_logits, raises_one_line, ref_logits, torch_greedy

V = 300
ORIGINAL = 32  # the context the scalings extend
BLOCK = 128  # what flaxgpt is asked to run: 4 x ORIGINAL
PROMPT = np.random.RandomState(1).randint(3, V, (1, 80))  # longer than ORIGINAL
TINY = dict(
    vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, rope_theta=1000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip
GEMMA = dict(head_dim=24, sliding_window=5, query_pre_attn_scalar=20)
T = transformers
FAMILIES = {  # model_type -> (config class, model class, the family's own options)
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, {}),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(sliding_window=6)),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, {}),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(head_dim=24)),
    # eager: transformers applies Gemma 2's softcap there only (5.17 defaulted it to sdpa, without it)
    "gemma2": (
        T.Gemma2Config,
        T.Gemma2ForCausalLM,
        dict(GEMMA, attn_logit_softcapping=5.0, attn_implementation="eager"),
    ),
    "gemma3_text": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, dict(GEMMA, sliding_window_pattern=2)),
}
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL)
# each family's YaRN exercises one more of its options (Qwen's published files use the older "type")
YARN_EXTRA = {
    "llama": dict(truncate=False, beta_fast=16.0),
    "mistral": dict(attention_factor=1.25),
    "qwen2": dict(mscale=1.0, mscale_all_dim=0.5),  # DeepSeek's attention factor
    "qwen3": dict(beta_slow=2.0),
    "gemma2": {},
    "gemma3_text": {},
}
DYNAMIC = dict(rope_type="dynamic", factor=4.0)


def rope_entry(model_type, scaling):
    """(the family's config.json rope entry for `scaling`, max_position_embeddings)."""
    if scaling == "yarn":
        entry = dict(YARN, rope_theta=1000.0, **YARN_EXTRA[model_type])
        max_len = BLOCK
    else:  # transformers' dynamic NTK scales from max_position_embeddings itself
        entry, max_len = dict(DYNAMIC, rope_theta=1000.0), ORIGINAL
    if model_type == "gemma3_text":
        local = {"rope_type": "default", "rope_theta": 100.0}
        return {"full_attention": entry, "sliding_attention": local}, max_len
    return entry, max_len


def make(model_type, scaling, directory):
    config_cls, model_cls, extra = FAMILIES[model_type]
    rope, max_len = rope_entry(model_type, scaling)
    torch.manual_seed(0)
    model = model_cls(
        config_cls(**TINY, **extra, rope_parameters=rope, max_position_embeddings=max_len)
    ).eval()
    with torch.no_grad():
        for p in model.parameters():  # peaked logits: no argmax ties in the greedy comparisons
            p.add_(0.15 * torch.randn_like(p))
    model.save_pretrained(directory)
    return model


def flax_greedy(config, params, prompt, n):
    """generate over a KV cache of the whole block: one prefill of the prompt, then a token a step."""
    cache = KVCache.for_config(config, batch=1, max_len=config.block_size)
    out, _ = generate(
        gpt_step_fn(config, params), cache, np.asarray([prompt], np.int32), [len(prompt)],
        max_new_tokens=n, rng=jax.random.key(0), temperature=0.0,
    )  # fmt: skip
    return [int(t) for t in out[0, :n]]


@pytest.mark.parametrize("scaling", ["yarn", "dynamic"])
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_logits_past_the_original_context_match_transformers(model_type, scaling, tmp_path):
    model = make(model_type, scaling, str(tmp_path))
    config, params = hf.load_pretrained(str(tmp_path), block_size=BLOCK)
    assert (config.rope_scaling, config.rope_original_max_len) == (scaling, ORIGINAL)
    np.testing.assert_allclose(
        flax_logits(config, params, PROMPT), ref_logits(model, PROMPT), atol=1e-4, rtol=0
    )


# each scaling through each config writer (flaxgpt/hf/llama.py's, gemma.py's), a plain and a windowed model
DECODED = [("llama", "dynamic"), ("qwen2", "yarn"), ("gemma3_text", "dynamic"), ("gemma2", "yarn")]


@pytest.mark.parametrize("model_type, scaling", DECODED)
def test_greedy_decoding_past_the_original_context_and_export_match_transformers(
    model_type, scaling, tmp_path
):
    """One prefill of the 80-token prompt, then a token a step through the KV cache (dynamic NTK: each
    step at its own theta, the cached keys as they were rotated); then exported (dynamic: at the
    length it scales from) and loaded by transformers, which computes the source model's logits."""
    model = make(model_type, scaling, str(tmp_path / "hf"))
    config, params = hf.load_pretrained(str(tmp_path / "hf"), block_size=BLOCK)
    prompt = PROMPT[0].tolist()
    assert flax_greedy(config, params, prompt, 6) == torch_greedy(model, prompt, 6)
    out = str(tmp_path / "out")
    hf.write(dataclasses.replace(config, block_size=ORIGINAL if scaling == "dynamic" else BLOCK), params, out)
    back = FAMILIES[model_type][1].from_pretrained(out, attn_implementation="eager").eval()
    np.testing.assert_allclose(
        ref_logits(back, PROMPT), ref_logits(make(model_type, scaling, out + "2"), PROMPT), atol=1e-5, rtol=0
    )


def test_dynamic_right_padded_batch_prefill_gives_each_row_what_it_gets_alone(tmp_path):
    """Prompts of 80, 50 and 20 tokens (two past the original 32) right-padded into one batch: each
    row's prefill logits and greedy tokens are transformers' for that prompt alone (its theta from its
    own length, not the padded buffer's 80)."""
    make("llama", "dynamic", str(tmp_path))
    config, params = hf.load_pretrained(str(tmp_path), block_size=BLOCK)
    lengths = [80, 50, 20]
    prompt_BP = np.zeros((len(lengths), max(lengths)), np.int32)
    for b, n in enumerate(lengths):
        prompt_BP[b, :n] = PROMPT[0, :n] if b != 1 else PROMPT[0, -n:]
    cache = KVCache.for_config(config, batch=len(lengths), max_len=BLOCK)
    positions = np.broadcast_to(np.arange(prompt_BP.shape[1]), prompt_BP.shape)
    logits_B1V, _ = jax.jit(gpt_step_fn(config, params))(
        prompt_BP, positions, cache, logits_at=np.asarray(lengths) - 1
    )
    out, _ = generate(
        gpt_step_fn(config, params), KVCache.for_config(config, batch=len(lengths), max_len=BLOCK),
        prompt_BP, lengths, max_new_tokens=6, rng=jax.random.key(0), temperature=0.0,
    )  # fmt: skip
    for b, n in enumerate(lengths):
        alone = prompt_BP[b : b + 1, :n]
        # a fresh model per prompt: transformers' dynamic NTK keeps the longest length it has seen
        fresh = FAMILIES["llama"][1].from_pretrained(str(tmp_path)).eval()
        want = ref_logits(fresh, alone)[0, -1]
        np.testing.assert_allclose(np.asarray(logits_B1V[b, 0]), want, atol=1e-4, rtol=0)
        fresh = FAMILIES["llama"][1].from_pretrained(str(tmp_path)).eval()
        assert [int(t) for t in out[b, :6]] == torch_greedy(fresh, alone[0].tolist(), 6)


# ---------------------------------------------------------------- the frequencies, without a model


def hf_frequencies(rope: RoPE, seq_len=None):
    """transformers' (inv_freq, attention factor) for `rope`, through the config.json flaxgpt writes."""
    config = family_config(
        "llama", n_head=1, n_embd=rope.head_dim, block_size=rope.original_max_len,
        rope_theta=rope.theta, rope_scaling=rope.scaling, rope_factor=rope.factor,
        rope_original_max_len=rope.original_max_len, rope_attention_factor=rope.attention_factor,
        rope_beta_fast=rope.beta_fast, rope_beta_slow=rope.beta_slow, rope_truncate=rope.truncate,
    )  # fmt: skip
    hf_config = transformers.LlamaConfig(**families.config_to_hf(config, "llama"))
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope.scaling](hf_config, seq_len=seq_len)
    return inv_freq.numpy(), factor


YARNS = [
    RoPE(16, 1000.0, "yarn", 4.0, original_max_len=32),
    RoPE(64, 500000.0, "yarn", 8.0, original_max_len=4096, beta_fast=16.0, beta_slow=2.0),
    RoPE(32, 10000.0, "yarn", 3.0, original_max_len=64, truncate=False, attention_factor=0.8),
    RoPE(128, 1e6, "yarn", 40.0, original_max_len=4096),  # DeepSeek-V3's factor
]


@pytest.mark.parametrize("rope", YARNS, ids=str)
def test_yarn_frequencies_and_attention_factor_equal_transformers(rope):
    inv_freq, factor = hf_frequencies(rope)
    np.testing.assert_allclose(rope.inv_freq(), inv_freq, rtol=2e-6)
    assert rope.mscale == pytest.approx(factor, rel=1e-12)


def dynamic_reference(rope: RoPE, length: int) -> np.ndarray:
    """float64 dynamic NTK frequencies at a sequence length (the formula, written out again)."""
    K, L = rope.head_dim, max(length, rope.original_max_len)
    theta = rope.theta * (rope.factor * L / rope.original_max_len - (rope.factor - 1)) ** (K / (K - 2))
    return theta ** -(np.arange(0, K, 2) / K)


@pytest.mark.parametrize("length", [5, 32, 33, 80, 5000])
def test_dynamic_frequencies_at_each_length_equal_transformers(length):
    rope = RoPE(16, 1000.0, "dynamic", 4.0, original_max_len=32)
    positions = jnp.arange(length)[None]
    got = np.asarray(rope._dynamic_inv_freq(positions, jnp.float32))[0]
    want, factor = hf_frequencies(rope, seq_len=torch.tensor(length))
    np.testing.assert_allclose(got, want, rtol=3e-6)
    np.testing.assert_allclose(got, dynamic_reference(rope, length), rtol=3e-6)
    assert factor == 1.0
    unscaled = RoPE(16, 1000.0).inv_freq()
    if length <= 32:  # within the original context: the unscaled frequencies
        np.testing.assert_allclose(got, unscaled, rtol=1e-6)
    else:  # past it, every frequency but the first slower
        assert np.all(got[1:] < unscaled[1:] * (1 - 1e-3))


def rotate64(x, angles, m=1.0):
    """float64 rotate_half of x [B, T, H, K] by angles [B, T, K/2], cos and sin times m."""
    cos, sin = (m * np.concatenate([f(angles)] * 2, -1)[:, :, None] for f in (np.cos, np.sin))
    x = np.asarray(x, np.float64)
    K = x.shape[-1]
    return x * cos + np.concatenate([-x[..., K // 2 :], x[..., : K // 2]], -1) * sin


def test_dynamic_rotates_each_row_by_its_own_length_in_one_program():
    """Row 0 is a prefill of 20 tokens (unscaled), row 1 a decode step at 79 (theta of 80): each row
    as it would be alone, both in one compiled call whose positions are values, not shapes."""
    rope = RoPE(16, 1000.0, "dynamic", 4.0, original_max_len=32)
    x = jax.random.normal(jax.random.key(0), (2, 20, 2, 16))
    positions = jnp.stack([jnp.arange(20), jnp.full(20, 79)])
    apply = jax.jit(rope.apply)
    got = apply(x, positions)
    angles = np.stack(
        [
            np.asarray(positions[b], np.float64)[:, None] * dynamic_reference(rope, L)
            for b, L in ((0, 20), (1, 80))
        ]
    )
    np.testing.assert_allclose(got, rotate64(x, angles), atol=2e-5)
    apply(x, positions + 7)  # other lengths: the same program
    assert apply._cache_size() == 1


def test_yarn_scales_the_rotation_and_its_gradient_by_the_attention_factor():
    rope = YARNS[2]
    x = jax.random.normal(jax.random.key(0), (2, 6, 3, 32))
    w = jax.random.normal(jax.random.key(1), (2, 6, 3, 32))
    pos = jnp.array([[0, 1, 2, 3, 4, 5], [9, 60, 61, 62, 200, 7]])
    angles = np.asarray(pos, np.float64)[..., None] * rope.inv_freq()
    np.testing.assert_allclose(rope.apply(x, pos), rotate64(x, angles, rope.mscale), atol=2e-5)
    got = jax.grad(lambda x: jnp.sum(rope.apply(x, pos) * w))(x)
    np.testing.assert_allclose(got, rotate64(w, -angles, rope.mscale), atol=2e-5)  # m R^T w


def test_bad_rope_fields_are_one_line_errors():
    rope = dict(pos_embedding="rope", n_head=2, n_embd=32)
    for fields, match in [
        (dict(rope_scaling="yarn", rope_factor=0.5), "yarn rope_factor must be >= 1"),
        (dict(rope_scaling="dynamic", rope_factor=0.0), "rope_factor must be > 0"),
        (
            dict(rope_scaling="yarn", rope_beta_fast=1.0, rope_beta_slow=2.0),
            "0 < rope_beta_slow <= rope_beta_fast",
        ),
        (dict(rope_scaling="yarn", rope_attention_factor=-1.0), "rope_attention_factor must be >= 0"),
        (dict(rope_scaling="dynamic", rope_original_max_len=0), "rope_original_max_len must be >= 1"),
        (dict(rope_scaling="dynamic", n_embd=4), r"dynamic rope scaling needs head_dim > 2"),
        (dict(rope_scaling="longrope"), "rope_scaling='longrope' is not one of"),
    ]:
        raises_one_line(ValueError, match, lambda f=fields: GPTConfig(**{**rope, **f}))


# ---------------------------------------------------------------- config.json, both ways


def hf_config(model_type, **rope_keys):
    base = dict(
        model_type=model_type, vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, head_dim=16, max_position_embeddings=ORIGINAL, sliding_window=8,
        query_pre_attn_scalar=16,
    )  # fmt: skip
    return {**base, **rope_keys}


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "mixtral", "gemma2"])
def test_both_config_formats_read_the_same(model_type):
    """Qwen's published YaRN snippet (rope_scaling with "type", rope_theta beside it) and transformers
    5's rope_parameters give one GPTConfig; so do the two spellings of dynamic."""
    extra = dict(num_local_experts=2, num_experts_per_tok=2) if model_type == "mixtral" else {}
    for entry in (dict(factor=4.0, original_max_position_embeddings=8, beta_fast=16.0), dict(factor=2.0)):
        kind = "yarn" if "original_max_position_embeddings" in entry else "dynamic"
        old = hf_config(model_type, rope_theta=5e5, rope_scaling={"type": kind, **entry}, **extra)
        new = hf_config(model_type, rope_parameters={"rope_type": kind, "rope_theta": 5e5, **entry}, **extra)
        a, b = families.config_from_hf(old), families.config_from_hf(new)
        assert a == b and (a.rope_scaling, a.rope_theta, a.rope_factor) == (kind, 5e5, entry["factor"])
        assert a.rope_original_max_len == (
            8 if kind == "yarn" else ORIGINAL
        )  # dynamic: max_position_embeddings


def test_a_top_level_original_length_and_a_missing_factor_read_as_transformers_does():
    # transformers: a top-level original_max_position_embeddings wins; yarn's factor defaults to the ratio
    c = families.config_from_hf(
        hf_config("qwen2", original_max_position_embeddings=8, rope_scaling={"type": "yarn"})
    )
    assert (c.rope_original_max_len, c.rope_factor) == (8, ORIGINAL / 8)


def test_block_size_may_reach_the_scaled_context_and_defaults_to_max_position_embeddings():
    rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16}
    assert families.config_from_hf(hf_config("llama", rope_parameters=rope)).block_size == ORIGINAL
    assert families.config_from_hf(hf_config("llama", rope_parameters=rope), block_size=64).block_size == 64
    too_long = r"block_size 65 is longer than the checkpoint's yarn reach \(original 16 x factor 4.0\) 64"
    llama = hf_config("llama", rope_parameters=rope)
    raises_one_line(ValueError, too_long, lambda: families.config_from_hf(llama, block_size=65))
    dynamic = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    assert (
        families.config_from_hf(hf_config("gemma2", rope_parameters=dynamic), block_size=64).block_size == 64
    )


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_longrope_is_refused_in_one_line(model_type):
    entry = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    if model_type == "gemma3_text":
        entry = {"full_attention": entry, "sliding_attention": {"rope_type": "default"}}
    why = r"type 'longrope' is not implemented \(Phi-3's LongRoPE; no family flaxgpt loads uses it\)"
    raises_one_line(ValueError, why, families.config_from_hf, hf_config(model_type, rope_parameters=entry))


GEMMA_STYLE = dict(post_norms=True, norm="rmsnorm_1p", activation="gelu", embed_scale=True)
ROPE_FAMILIES = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
]


def family_config(model_type, **rope):
    """A small GPTConfig in model_type's style (the family table's own choice) with these rope fields."""
    style = {
        "llama": {}, "mistral": dict(sliding_window=8), "qwen2": dict(qkv_bias=True),
        "qwen3": dict(qk_norm=True), "gemma2": GEMMA_STYLE, "gemma3_text": dict(GEMMA_STYLE, qk_norm=True),
        "mixtral": dict(num_experts=2),
        "qwen2_moe": dict(num_experts=2, qkv_bias=True, shared_expert_hidden=32, shared_expert_gate=True),
        "qwen3_moe": dict(num_experts=2, qk_norm=True),
    }[model_type]  # fmt: skip
    base = dict(
        pos_embedding="rope", norm="rmsnorm", activation="silu", glu=True, bias=False, qkv_bias=False,
        vocab_size=V, block_size=ORIGINAL, n_layer=2, n_head=4, n_embd=64, layer_norm_epsilon=1e-6,
    )  # fmt: skip
    return GPTConfig(**{**base, **style, **rope})


SCALED = {
    "linear": dict(rope_scaling="linear", rope_factor=4.0),  # the bug: written as "default"
    "yarn": dict(rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=8, rope_beta_fast=16.0),
    "yarn_factor": dict(
        rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=8, rope_attention_factor=1.5
    ),
    "dynamic": dict(rope_scaling="dynamic", rope_factor=2.0, rope_original_max_len=ORIGINAL),
}


@pytest.mark.parametrize("model_type", ROPE_FAMILIES)
def test_every_rotary_family_writes_each_scaling_under_its_own_name_and_reads_it_back(model_type):
    for name, rope in SCALED.items():
        config = family_config(model_type, **rope)
        assert families.family_of(config) == model_type
        written = families.config_to_hf(config, model_type)
        entry = written.get("rope_scaling") or written["rope_parameters"]
        entry = entry.get("full_attention", entry)
        assert entry["rope_type"] == rope["rope_scaling"] and entry["factor"] == rope["rope_factor"], name
        back = families.config_from_hf(written)
        assert roundtrip.differences(config, back) == [], (model_type, name)


def test_export_refuses_what_config_json_cannot_express_in_one_line():
    dynamic = family_config("llama", rope_scaling="dynamic", rope_factor=2.0, rope_original_max_len=16)
    want = (
        r"^a llama checkpoint cannot hold block_size=32 with rope_scaling='dynamic': .*"
        r"set block_size=16 to export .*; no family flaxgpt exports holds it$"
    )
    raises_one_line(ValueError, want, families.config_to_hf, dynamic, "llama")
    # transformers reads Gemma 3's yarn truncate from rope_parameters itself, never the layer type's
    yarn = family_config(
        "gemma3_text", rope_scaling="yarn", rope_factor=2.0, rope_original_max_len=8, rope_truncate=False
    )
    want = r"^a gemma3_text checkpoint cannot hold rope_truncate=False \(it would read back as True\)"
    raises_one_line(ValueError, want, families.config_to_hf, yarn, "gemma3_text")
