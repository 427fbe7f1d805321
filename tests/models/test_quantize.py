"""Weight-only int8 / bf16 decoding: the CPU kernel, quantization error, and model quality."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flaxgpt.decode.sampling import generate
from flaxgpt.kernels.qmatmul import MAX_KERNEL_ROWS, kernel_available, qmatmul
from flaxgpt.models import quantize
from flaxgpt.models.cache import KVCache
from flaxgpt.models.gpt import GPT, GPTConfig, init_params, quantize_params, step_fn


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.bfloat16])
@pytest.mark.parametrize("M", [1, 3, 9, MAX_KERNEL_ROWS + 6])
def test_qmatmul_matches_numpy(dtype, M):
    # K = 40 leaves a tail after the vector lanes; N = 131 a partial block and an odd last row
    rs = np.random.RandomState(M)
    K, N = 40, 131
    x = rs.randn(M, K).astype(np.float32)
    if dtype == jnp.int8:
        w = jnp.asarray(rs.randint(-127, 128, (N, K)), jnp.int8)
    else:
        w = jnp.asarray(rs.randn(N, K), jnp.bfloat16)
    scale = rs.rand(N).astype(np.float32)
    want = x @ (np.asarray(w.astype(jnp.float32)) * scale[:, None]).T
    got = np.asarray(jax.jit(qmatmul)(jnp.asarray(x), w, jnp.asarray(scale)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_kernel_builds_here():
    # the CPU kernel is what makes quantized decoding fast; its absence would pass silently
    assert kernel_available()


def test_int8_rows_error_bound():
    rs = np.random.RandomState(0)
    w = rs.randn(6, 50).astype(np.float32) * np.array([1e-3, 1, 10, 0, 5, 1e2], np.float32)[:, None]
    q = quantize.quantize_rows(w, "int8")
    assert q.w.dtype == jnp.int8 and q.scale.shape == (6,)
    back = np.asarray(q.w, np.float32) * np.asarray(q.scale)[:, None]
    # per-output-channel: each row's error is at most half its own step, max|row| / 254
    bound = np.abs(w).max(axis=1, keepdims=True) / 254 + 1e-12
    assert np.all(np.abs(back - w) <= bound * 1.0001)
    assert np.all(back[3] == 0)  # an all-zero row stays zero


@pytest.mark.parametrize("mode", ["int8", "bf16"])
def test_weights_on_a_device_quantize_there_to_the_host_values(mode):
    """A weight already on a device is quantized by one jitted program (an H100 quantizes an 8B
    model in seconds, not minutes of host copies): the host path's values exactly, for Dense kernels
    (transposed), rows and expert stacks (XLA would multiply by a broadcast divisor's reciprocal, an
    ulp off numpy's division: 1 scale in 14 here before the divisor was materialized)."""
    rs = np.random.RandomState(1)
    scales = np.array([1e-3, 1, 10, 0, 5, 1e2, 3], np.float32)
    kernel = rs.randn(9, 7).astype(np.float32) * scales  # [K, N]: columns are output channels
    stack = rs.randn(2, 9, 7).astype(np.float32) * scales
    tree = lambda kernel, stack: {"d": {"kernel": kernel}, "e": stack}  # noqa: E731
    host = quantize.quantize_tree(tree(kernel, stack), mode, stacked=("e",))
    dev = quantize.quantize_tree(tree(jnp.asarray(kernel), jnp.asarray(stack)), mode, stacked=("e",))
    rows_host = quantize.quantize_rows(kernel.T, mode)
    rows_dev = quantize.quantize_rows(jnp.asarray(kernel.T), mode)
    for a, b in [(host["d"]["kernel"], dev["d"]["kernel"]), (host["e"], dev["e"]), (rows_host, rows_dev)]:
        assert a.w.dtype == b.w.dtype and a.w.shape == b.w.shape
        np.testing.assert_array_equal(np.asarray(a.w, np.float32), np.asarray(b.w, np.float32))
        np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))
    assert host["d"]["kernel"].w.shape == (7, 9)


def test_unknown_mode_is_one_line_error():
    with pytest.raises(ValueError, match=r"unknown quantization mode 'int3'; choose one of int8, bf16, int4"):
        quantize_params(GPTConfig(vocab_size=8, n_layer=1, n_head=1, n_embd=8), {}, "int3")


def _imported_gpt2(tmp_path):
    """A small random GPT-2 built with transformers and imported: the real weight-import path."""
    import torch
    import transformers

    from flaxgpt.hf import pretrained as hf

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # larger than the 0.02 init: peaked logits, few argmax ties
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path, safe_serialization=True)
    return hf.load_pretrained(str(tmp_path))  # the float32 reference


@pytest.mark.parametrize("mode,max_dev,min_agree", [("int8", 0.05, 0.97), ("bf16", 0.02, 0.99)])
def test_imported_gpt2_logits_and_greedy(tmp_path, mode, max_dev, min_agree):
    config, params = _imported_gpt2(tmp_path)
    tokens = jnp.asarray(np.random.RandomState(1).randint(0, 500, (4, 48)), jnp.int32)
    ref = np.asarray(GPT(config).apply({"params": params}, tokens))
    import flaxgpt

    qconfig, qparams = flaxgpt.load_pretrained(
        str(tmp_path), quantize=mode
    )  # = quantize_params(config, params)
    step = step_fn(qconfig, qparams)
    positions = jnp.broadcast_to(jnp.arange(48), (4, 48))
    got, _ = jax.jit(step)(tokens, positions, KVCache.for_config(qconfig, 4, 64))
    got = np.asarray(got)
    deviation = np.abs(got - ref).max() / np.abs(ref).max()
    agree = np.mean(got.argmax(-1) == ref.argmax(-1))
    assert deviation < max_dev and agree >= min_agree, (deviation, agree)
    # decoding one token per step (the kernel's matrix-vector path) agrees with greedy fp32
    prompt = np.asarray(tokens[:, :8])
    greedy = dict(max_new_tokens=24, rng=jax.random.key(0), temperature=0)
    want, _ = generate(step_fn(config, params), KVCache.for_config(config, 4, 64), prompt, [8] * 4, **greedy)
    have, _ = generate(step, KVCache.for_config(qconfig, 4, 64), prompt, [8] * 4, **greedy)
    first_diff = [int(np.argmax(np.append(w != h, True))) for w, h in zip(want, have)]
    assert np.mean(first_diff) >= 12, first_diff  # greedy paths agree for many tokens
    if mode == "int8":
        assert quantize.weight_bytes(qparams) < 0.3 * quantize.weight_bytes(params)


def _loss(config, params, x, y):
    logits = GPT(config).apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def test_trained_model_perplexity_within_one_percent():
    """Train a tiny model on a learnable sequence; int8 and bf16 perplexity within 1% of fp32, int4 (groups
    of 32 and 64) within 3%."""
    config = GPTConfig(vocab_size=16, block_size=32, n_layer=2, n_head=2, n_embd=64)
    rs = np.random.RandomState(0)
    table = rs.randint(0, 16, (16, 16))  # next token = table[previous two], 80% of the time
    seq = [1, 2]
    for _ in range(8000):
        seq.append(table[seq[-1], seq[-2]] if rs.rand() < 0.8 else rs.randint(16))
    data = np.asarray(seq, np.int32)
    train, held_out = data[:6000], data[6000:]
    params = init_params(config, jax.random.key(0))
    opt = optax.adam(3e-3)

    @jax.jit
    def train_step(p, s, x, y):
        loss, g = jax.value_and_grad(lambda p: _loss(config, p, x, y))(p)
        u, s = opt.update(g, s)
        return optax.apply_updates(p, u), s, loss

    state = opt.init(params)
    for _ in range(120):
        idx = rs.randint(0, len(train) - 33, 32)
        x = np.stack([train[j : j + 32] for j in idx])
        y = np.stack([train[j + 1 : j + 33] for j in idx])
        params, state, _ = train_step(params, state, x, y)
    n = (len(held_out) - 1) // 32
    x = held_out[: n * 32].reshape(n, 32)
    y = held_out[1 : n * 32 + 1].reshape(n, 32)
    ppl = float(np.exp(_loss(config, params, x, y)))
    assert ppl < 8, ppl  # it learned something (uniform is 16)
    for mode in quantize.MODES:
        if 64 % (quantize.int4_group(mode) or 1):
            continue  # int4's groups of 128: wider than this model
        qconfig, qparams = quantize_params(config, params, mode)
        qppl = float(np.exp(_loss(qconfig, qparams, x, y)))
        assert abs(qppl / ppl - 1) < (0.03 if mode.startswith("int4") else 0.01), (mode, ppl, qppl)
