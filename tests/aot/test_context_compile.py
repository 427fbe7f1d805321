"""A recipe with mesh.context compiled for a TPU v5e-8 (libtpu's abstract devices, no TPU): the train
step over data 2 x fsdp 2 x context 2 holds the ring's collective-permutes and says its mesh; a
block_size the axis cannot balance is refused in one line before compiling."""

import pytest

from flaxgpt.aot import compile as aot
from flaxgpt.aot import targets
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
