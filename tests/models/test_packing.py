"""Packed rows: the loss of a packed batch equals the same examples unpacked, for learned and rotary
positions, unrolled and scanned layers, the XLA path and the splash kernel (interpret mode)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxgpt.data import packing
from flaxgpt.models.gpt import GPT, GPTConfig, init_params, segment_positions
from flaxgpt.train.losses import cross_entropy

GPT2 = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=50)
LLAMA = dict(GPT2, pos_embedding="rope", norm="rmsnorm", glu=True, activation="silu", n_kv_head=1, bias=False)
LLAMA_SW = dict(LLAMA, sliding_window=5)


def examples(lengths, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(1, 50, n + 1)
        mask = (rng.random(n + 1) < 0.6).astype(np.uint8)
        mask[1] = 1  # at least one counted target
        out.append(packing.example(ids, mask))
    return out


def sharp(params):
    """Weights x4: peaked attention, so a leak across examples would move the loss visibly."""
    return jax.tree_util.tree_map(lambda p: 4 * p, params)


def mean_loss(config, params, batch, segments: bool):
    logits = GPT(config).apply(
        {"params": params},
        jnp.asarray(batch["inputs"]),
        segment_ids_BT=batch.get("segment_ids") if segments else None,
    )
    total, n = cross_entropy(logits, jnp.asarray(batch["targets"]), jnp.asarray(batch["loss_mask"]))
    return float(total / n)


def unpacked(exs, T):
    """Each example alone in its own row, right-padded (the causal mask hides the padding)."""
    out = {k: np.zeros((len(exs), T), np.int32) for k in ("inputs", "targets", "loss_mask")}
    for r, (x, y, m) in enumerate(exs):
        out["inputs"][r, : len(x)], out["targets"][r, : len(x)], out["loss_mask"][r, : len(x)] = x, y, m
    return out


@pytest.mark.parametrize(
    "arch, extra",
    [(GPT2, {}), (LLAMA, {}), (LLAMA_SW, {}), (LLAMA, dict(scan_layers=True, remat="full"))],
    ids=["learned", "rope", "rope_window", "rope_scan_remat"],
)
def test_packed_loss_equals_unpacked(arch, extra):
    T = 24
    config = GPTConfig(block_size=T, **arch, **extra)
    params = sharp(init_params(config, jax.random.key(0)))
    exs = examples([5, 9, 3, 14, 7, 11, 2])
    rows = packing.pack(exs, T)
    assert len(rows["inputs"]) < len(exs)  # several examples share rows
    assert (rows["segment_ids"].max(axis=1) >= 2).any()
    assert 0 <= packing.padding_fraction(rows["segment_ids"]) < 0.5
    packed = mean_loss(config, params, rows, segments=True)
    alone = mean_loss(config, params, unpacked(exs, T), segments=False)
    np.testing.assert_allclose(packed, alone, rtol=0, atol=1e-5)
    # without segment ids the examples would see each other: the figure differs
    assert abs(mean_loss(config, params, rows, segments=False) - alone) > 1e-3


def test_packed_loss_with_the_splash_kernel_in_interpret_mode():
    T = 128  # the kernel's block
    config = GPTConfig(block_size=T, **LLAMA, attention_impl="pallas")
    params = sharp(init_params(config, jax.random.key(1)))
    exs = examples([60, 40, 70, 20, 50], seed=1)
    rows = packing.pack(exs, T)
    xla = GPTConfig(block_size=T, **LLAMA)
    want = mean_loss(xla, params, unpacked(exs, T), segments=False)
    np.testing.assert_allclose(mean_loss(config, params, rows, segments=True), want, rtol=0, atol=1e-5)


def test_segment_positions_and_plan():
    seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(segment_positions(seg), [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))])
    rows = packing.plan([6, 5, 4, 3, 2, 2], 8)  # best fit decreasing: 6+2, 5+3, 4+2
    assert sorted(sorted(r) for r in rows) == [[0, 4], [1, 3], [2, 5]]
    with pytest.raises(ValueError, match="example 1 has 9 tokens, more than block_size 8"):
        packing.plan([3, 9], 8)
