"""Export by round trip (flaxgpt.hf.roundtrip): random GPTConfigs drawn over every field, exported as
every family, either write a config.json the family reads back as the same model, or are refused in one
line naming fields that do differ; and a few such exports, weights and all, compute the same logits
after loading back. Configs alone for the draws: no downloads, no transformers."""

import dataclasses
import math
import random
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from flaxgpt.hf import families, roundtrip
from flaxgpt.hf import pretrained as hf
from flaxgpt.models.attention import ATTENTION_IMPLS
from flaxgpt.models.gpt import GPT, abstract_params
from flaxgpt.models.gpt_config import REMAT_POLICIES, GPTConfig
from flaxgpt.models.layers import ACTIVATIONS, NORMS, SINUSOID_LAYOUTS
from flaxgpt.models.rope import ROPE_SCALINGS

DRAWS = 400
BOOL = (False, True)
# every GPTConfig field -> the values a draw picks from (a function of the fields drawn so far where
# they constrain it); a field GPTConfig gains fails test_every_field_is_drawn until it has a line here
DOMAIN = {
    "context_impl": ("ring", "ulysses"),  # a run-time choice: not exported (hf/roundtrip.NOT_EXPORTED)
    "fp8": BOOL,  # likewise
    "fp8_experts": BOOL,  # likewise
    "vocab_size": (50, 64, 257),
    "block_size": (16, 32, 64),
    "n_layer": (1, 2, 3, 4, 7),
    "n_head": (1, 2, 4),
    "n_embd": lambda d: tuple(d["n_head"] * k for k in (8, 16)),
    "pos_embedding": ("learned", "sinusoidal", "rope"),
    "sinusoid_layout": SINUSOID_LAYOUTS,
    "activation": ACTIVATIONS,
    "tie_embeddings": BOOL,
    "bias": BOOL,
    "qkv_bias": BOOL,
    "dropout": (0.0, 0.1),
    "embd_dropout": (-1.0, 0.0, 0.2),
    "attn_dropout": (-1.0, 0.0, 0.2),
    "resid_dropout": (-1.0, 0.0, 0.2),
    "layer_norm_epsilon": (1e-5, 1e-6),
    "dtype": ("float32", "bfloat16"),
    "param_dtype": ("float32", "bfloat16"),
    "pad_vocab_multiple": (1, 64),
    "attention_impl": ATTENTION_IMPLS,
    "scan_layers": BOOL,
    "remat": REMAT_POLICIES,
    "norm": NORMS,
    "glu": BOOL,
    "mlp_hidden": lambda d: (0, 24, 4 * d["n_embd"]),
    "n_kv_head": lambda d: (0, 1, max(1, d["n_head"] // 2), d["n_head"]),
    "qk_norm": BOOL,
    "rope_theta": (10000.0, 500000.0),
    # a stretch of rotary positions: a model without them has none (GPTConfig refuses one)
    "rope_scaling": lambda d: ROPE_SCALINGS if d.get("pos_embedding") == "rope" else ("none",),
    "rope_factor": (1.0, 4.0),
    "rope_low_freq_factor": (1.0, 2.0),
    "rope_high_freq_factor": (4.0, 8.0),
    "rope_original_max_len": lambda d: (8, d["block_size"], 8192),  # dynamic exports at block_size
    "rope_attention_factor": (0.0, 1.5),
    "rope_beta_fast": (32.0, 16.0),
    "rope_beta_slow": (1.0, 2.0),
    "rope_truncate": BOOL,
    "sliding_window": lambda d: (0, 5, d["block_size"], 2 * d["block_size"]),
    "logit_softcap": (0.0, 30.0),
    "head_size": lambda d: (0, d["n_embd"] // d["n_head"], 12),
    "window_pattern": (0, 1, 2, 6),
    "rope_local_theta": (0.0, 10000.0, 500000.0),
    "query_pre_attn_scalar": (0.0, 16.0, 24.0),
    "attn_softcap": (0.0, 50.0),
    "post_norms": BOOL,
    "embed_scale": BOOL,
    "hf_context": lambda d: (0, d["block_size"], 2 * d["block_size"]),  # an imported context block_size hid
    "hf_window": lambda d: (0, d["block_size"] + 3),  # ... and its window
    "zero_init_proj": BOOL,
    "unet_skips": BOOL,
    "value_embeds": (0, 1),
    "num_experts": (0, 2, 4),
    "experts_per_token": (1, 2),
    "expert_hidden": (0, 16),
    "norm_topk_prob": BOOL,
    "decoder_sparse_step": (1, 2),
    "mlp_only_layers": ((), (0,), (1, 5)),
    "shared_expert_hidden": (0, 32),
    "shared_expert_gate": BOOL,
    "router_aux_loss_coef": (0.001, 0.02),
    "router_z_loss_coef": (0.0, 0.001),
}
# drawn afresh every time, in this order (later ones read earlier ones)
SIZES = "vocab_size block_size n_layer n_head n_embd n_kv_head mlp_hidden rope_scaling rope_original_max_len"
SIZES = SIZES.split()
# drawn afresh when the style has them, and then non-zero: each family's own models come up
STYLE_SIZES = (
    "head_size sliding_window query_pre_attn_scalar num_experts experts_per_token expert_hidden "
    "shared_expert_hidden"
).split()
# a style per family, from its presets
STYLES = [{}] + [
    GPTConfig.PRESETS[name]
    for name in "smollm2-135m mistral-7b-v0.1 qwen2.5-0.5b qwen3-0.6b gemma-2-2b gemma-3-1b mixtral-8x7b "
    "qwen3-30b-a3b qwen1.5-moe-a2.7b".split()
]


def draw(rng: random.Random) -> GPTConfig:
    """A GPTConfig in a family's style, its sizes redrawn and 0 to 3 of any of its fields changed."""
    while True:
        d = dict(rng.choice(STYLES))
        for name in SIZES:
            d[name] = rng.choice(_values(name, d))
        for name in STYLE_SIZES:
            if d.get(name):
                d[name] = rng.choice([v for v in _values(name, d) if v])
        for name in rng.sample(sorted(DOMAIN), rng.choice((0, 1, 2, 3))):
            d[name] = rng.choice(_values(name, d))
        try:
            return GPTConfig(**d)
        except ValueError:  # a combination GPTConfig refuses: draw again
            continue


def _values(name, d):
    values = DOMAIN[name]
    return values(d) if callable(values) else values


def read_back_raw(config, model_type):
    """What the family's own mapping writes and reads, without the check: (back, None) or (None, error)."""
    family = families.FAMILIES[model_type]
    try:
        written = family.config_to_hf(config, model_type, family, None)
        return family.config_from_hf(written, family, block_size=config.block_size), None
    except ValueError as e:
        return None, str(e)


def written(config, model_type):
    family = families.FAMILIES[model_type]
    return family.written_as(config) if family.written_as else config


def test_every_field_is_drawn():
    assert set(DOMAIN) == {f.name for f in dataclasses.fields(GPTConfig)}


def test_export_reads_back_equal_or_refuses_naming_a_field_that_differs():
    rng = random.Random(0)
    held = dict.fromkeys(families.FAMILIES, 0)
    scalings_held = dict.fromkeys(ROPE_SCALINGS, 0)  # rotary models each scaling of which was exported
    refused = dict.fromkeys(families.FAMILIES, 0)
    for _ in range(DRAWS):
        config = draw(rng)
        for model_type in families.FAMILIES:
            try:
                hf_config = families.config_to_hf(config, model_type)
            except ValueError as e:
                refused[model_type] += 1
                check_refusal(config, model_type, str(e))
                continue
            held[model_type] += 1
            scalings_held[config.rope_scaling] += config.pos_embedding == "rope"
            back = families.config_from_hf(hf_config, block_size=config.block_size)  # as a run reads it
            assert roundtrip.normal_form(back) == roundtrip.normal_form(written(config, model_type)), (
                model_type,
                config,
            )
            # and literally: the exported fields come back as they were, once put in normal form
            free = {name: getattr(config, name) for name in roundtrip.NOT_EXPORTED}
            assert roundtrip.differences(written(config, model_type), dataclasses.replace(back, **free)) == []
    # every family both holds and refuses a good share of the draws
    assert min(held.values()) >= 10 and min(refused.values()) >= 10, (held, refused)
    assert min(scalings_held.values()) >= 10, scalings_held


def check_refusal(config, model_type, message):
    assert "\n" not in message
    assert message.startswith(f"a {model_type} checkpoint cannot hold "), message
    assert message.endswith(("no family flaxgpt exports holds it",)) or re.search(
        r"; export it as \w+$", message
    )
    other = re.search(r"; export it as (\w+)$", message)
    if other:  # the family offered instead holds it
        families.config_to_hf(config, other.group(1))
    back, error = read_back_raw(config, model_type)
    if error is not None:  # the format has no name for a value, or its reader refuses the file
        assert error in message
        return
    named = re.findall(r"(\w+)=[^=]+? \(it would read back as ", message)
    assert named, message
    mine = roundtrip.normal_form(written(config, model_type))
    theirs = roundtrip.normal_form(back)
    assert all(mine[name] != theirs[name] for name in named), (message, mine, theirs)


def test_the_two_export_bugs_are_refused_or_fixed():
    """GPT-2 dropped mlp_hidden, n_kv_head, sliding_window and post_norms silently; Llama wrote
    rope_type "default" for rope_scaling="linear"."""
    for field, value in dict(mlp_hidden=100, n_kv_head=4, sliding_window=100, post_norms=True).items():
        with pytest.raises(ValueError, match=rf"^a gpt2 checkpoint cannot hold {field}={value!r} \(it would"):
            families.config_to_hf(GPTConfig(**{field: value}), "gpt2")
    linear = GPTConfig.preset("smollm2-135m", rope_scaling="linear", rope_factor=4.0)
    for model_type in ("llama", "mistral"):
        written_config = families.config_to_hf(linear, model_type)
        assert written_config["rope_scaling"] == {
            "rope_type": "linear",
            "factor": 4.0,
            "rope_theta": 100000.0,
        }
        assert families.config_from_hf(written_config) == linear


# the same model spelled another way than its family reads it back: each must be held
SAME_MODEL = [
    ("gpt2", "gpt2", dict(n_kv_head=12, head_size=64, mlp_hidden=3072, query_pre_attn_scalar=64.0)),
    ("gpt2", "gpt2", dict(bias=False, qkv_bias=False, pos_embedding="sinusoidal", sinusoid_layout="halves")),
    ("gpt2", "gpt2", dict(rope_theta=5.0, rope_factor=4.0, rope_local_theta=1.0)),
    (
        "gpt2",
        "gpt2",
        dict(experts_per_token=1, norm_topk_prob=False, decoder_sparse_step=3, mlp_only_layers=(1,)),
    ),
    ("gpt2", "gpt2", dict(sliding_window=1024, window_pattern=30)),  # a window covering the context
    (
        "gpt2",
        "gpt2",
        dict(dropout=0.1, dtype="bfloat16", param_dtype="bfloat16", scan_layers=True, remat="full"),
    ),
    (
        "gpt2",
        "gpt2",
        dict(zero_init_proj=True, pad_vocab_multiple=64, attention_impl="xla", router_z_loss_coef=0.1),
    ),
    (
        "smollm2-135m",
        "llama",
        dict(rope_factor=8.0, rope_high_freq_factor=2.0, head_size=64, sliding_window=8192),
    ),
    ("smollm2-135m", "llama", dict(rope_scaling="linear", rope_factor=2.0, rope_original_max_len=4)),
    # YaRN's attention factor 0 stands for 0.1 ln(factor) + 1; llama3's low/high factors are not yarn's
    (
        "smollm2-135m",
        "llama",
        dict(rope_scaling="yarn", rope_factor=4.0, rope_attention_factor=0.1 * math.log(4.0) + 1.0),
    ),
    ("smollm2-135m", "qwen2", dict(qkv_bias=True, rope_scaling="yarn", rope_low_freq_factor=3.0)),
    ("smollm2-135m", "llama", dict(rope_scaling="dynamic", rope_original_max_len=8192, rope_beta_fast=2.0)),
    ("mistral-7b-v0.1", "mistral", dict(block_size=1024)),  # its 4096 window covers the context
    ("gemma-2-2b", "gemma2", dict(sliding_window=0, window_pattern=0)),  # every layer global
    ("gemma-2-2b", "gemma2", dict(query_pre_attn_scalar=0.0, head_size=256)),
    ("gemma-3-1b", "gemma3_text", dict(window_pattern=30)),  # longer than the model: every layer local
    ("gemma-3-1b", "gemma3_text", dict(rope_local_theta=0.0)),  # the window layers' base is the global one
    ("gemma-3-1b", "gemma3_text", dict(block_size=256)),  # the 512 window covers it, its rope still local
    ("qwen3-30b-a3b", "qwen3_moe", dict(mlp_only_layers=(100,))),
    ("qwen3-30b-a3b", "qwen3_moe", dict(decoder_sparse_step=2, mlp_only_layers=(0, 2))),  # dense anyway
    ("mixtral-8x7b", "mixtral", dict(mlp_hidden=100, expert_hidden=14336)),  # no dense layer to size
]


@pytest.mark.parametrize("preset, model_type, fields", SAME_MODEL, ids=lambda x: str(x)[:40])
def test_the_same_model_spelled_otherwise_is_held(preset, model_type, fields):
    config = GPTConfig.preset(preset, **fields)
    back = families.config_from_hf(families.config_to_hf(config, model_type))
    assert roundtrip.differences(written(config, model_type), back) == []


# ---------------------------------------------------------------- the same function, weights and all


def test_exported_models_compute_the_same_logits_after_loading_back(tmp_path):
    """Drawn models that a family holds but reads back spelled otherwise (a window covering the context,
    zero biases, n_kv_head=0, ...), exported with random weights and loaded back: the same logits, so
    what normal_form calls the same is: GPT-2 and the two families with their own rules for windows."""
    rng, todo = random.Random(1), {"gpt2", "mistral", "gemma3_text"}
    while todo:
        config = dataclasses.replace(draw(rng), dtype="float32", param_dtype="float32")
        model_type = families.family_of(config)
        if model_type not in todo or config.n_layer > 3:
            continue
        try:
            back = families.config_from_hf(families.config_to_hf(config, model_type))
        except ValueError:  # not held: test_export_reads_back_equal_or_refuses_naming_a_field_that_differs
            continue
        if back == dataclasses.replace(config, **{n: getattr(back, n) for n in roundtrip.NOT_EXPORTED}):
            continue  # spelled the same: nothing to prove
        todo.remove(model_type)
        same_logits(config, model_type, str(tmp_path / model_type), np.random.RandomState(len(todo)))


def same_logits(config, model_type, directory, rs):
    shapes = nn.unbox(abstract_params(config))
    params = jax.tree.map(lambda x: rs.normal(0, 0.2, x.shape).astype(np.float32), shapes)
    hf.write(config, params, directory, model_type)
    loaded_config, loaded = hf.load_pretrained(directory)
    tokens = jnp.asarray(rs.randint(0, config.vocab_size, (1, config.block_size)))

    @jax.jit  # one compile for both models
    def both(params, loaded):
        want = GPT(config).apply({"params": params}, tokens)
        return want, GPT(loaded_config).apply({"params": loaded}, tokens)

    want, got = both(params, loaded)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5, err_msg=f"{model_type}: {config}")
