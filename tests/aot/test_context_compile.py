"""A recipe with mesh.context compiled for a TPU v5e-8 (libtpu's abstract devices, no TPU): the train
step over data 2 x fsdp 2 x context 2 holds the ring's collective-permutes and says its mesh; a
block_size the axis cannot balance is refused in one line before compiling; the long-context recipe
(configs/llama3_8b_long.py) compiles over a context axis of 8 on a Llama of tiny shape; on a TPU target
its Ulysses (around the splash kernel `auto` picks there) is refused in one line before tracing."""

import json

import pytest

from configs import llama3_8b_long
from flaxgpt.aot import compile as aot
from flaxgpt.aot import programs, targets
from tests.aot.test_compile import tiny

pytest.importorskip("libtpu", reason="the TPU targets need libtpu: pip install 'jax[tpu]==<jax version>'")


def test_the_ring_compiles_for_v5e_8():
    recipe = tiny(mesh__data=2, mesh__fsdp=2, mesh__context=2, model__pos_embedding="rope")
    (train,), _ = aot.run(recipe, targets.get("v5e-8"), ("train",), print_fn=lambda *_: None)
    assert "x context 2 (ring attention)" in train.note
    count, nbytes = train.collectives["collective-permute"]
    assert count > 0 and nbytes > 0


def test_a_length_the_ring_cannot_balance_is_refused():
    recipe = tiny(mesh__context=4, model__block_size=36)
    with pytest.raises(
        SystemExit, match="error: sequence length 36 is not divisible by 2 x mesh.context = 8"
    ):
        aot.run(recipe, targets.get("v5e-8"), ("train",), print_fn=lambda *_: None)


def long_recipe(tmp_path):
    """configs/llama3_8b_long.py over a Llama of tiny shape (its config.json only: aot reads no weights)."""
    tiny_llama = dict(
        model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
    )  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(tiny_llama))
    recipe = llama3_8b_long.get_config()
    recipe.init_from, recipe.data.dir = str(tmp_path), "/nonexistent"
    recipe.model.block_size = 256  # the recipe's layout, a short row: a multiple of 2 x 8
    return recipe


def test_the_long_context_recipe_compiles_over_a_context_axis_of_8(tmp_path):
    """The recipe (LoRA over a bfloat16 base, Ulysses over context 8, Llama 3.1's RoPE) for the 8 CPU
    devices: its mesh and RoPE scaling are the recipe's, and Ulysses' all-to-alls are in the step."""
    recipe = long_recipe(tmp_path)
    (train,), mc = aot.run(recipe, targets.get("cpu"), ("train",), print_fn=lambda *_: None)
    assert "x context 8 (ulysses attention)" in train.note and mc.rope_scaling == "llama3"
    assert train.collectives["all-to-all"][0] > 0


def test_ulysses_around_the_splash_kernel_is_refused_before_tracing(tmp_path, monkeypatch):
    """On a v5p-8 (context 4) `auto` is the splash kernel, which Ulysses cannot run: one line, before
    the step is built (make_steps never called), naming both ways out."""

    def never(*_):
        raise AssertionError("the train step was built before the refusal")

    monkeypatch.setattr(programs, "make_steps", never)
    recipe = long_recipe(tmp_path)
    recipe.mesh.context = 4  # a v5p-8 is 4 megacore devices
    with pytest.raises(SystemExit) as refused:
        aot.run(recipe, targets.get("v5p-8"), ("train",), print_fn=lambda *_: None)
    assert str(refused.value) == (
        "error: context_impl=ulysses cannot run the splash kernel (auto on TPU): its own shard_map would "
        "nest inside Ulysses'; use model.context_impl=ring or model.attention_impl=xla "
        "(target v5p-8: 4 devices)"
    )
