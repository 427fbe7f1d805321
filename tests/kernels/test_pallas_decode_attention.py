"""kernels.pallas_decode_attention in Pallas interpret mode: the step's key and value written into the
cache (in place; positions >= S dropped) and attention over positions <= pos, against a float64
reference, for grouped heads, several blocks of the cache, a soft-cap, float32 and bfloat16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxgpt.kernels.pallas_decode_attention import attend, why_not


def reference(q, kn, vn, pos, kc, vc, scale, softcap):
    """float64: the caches with the writes, and softmax(logits) . v over positions <= pos."""
    q, kn, vn, kc, vc = (np.asarray(a, np.float64) for a in (q, kn, vn, kc, vc))
    N, G, K = q.shape
    S = kc.shape[1]
    kc, vc = kc.copy(), vc.copy()
    y = np.zeros((N, G, K))
    for n in range(N):
        p = int(pos[n])
        if p < S:
            kc[n, p], vc[n, p] = kn[n], vn[n]
        s = scale * q[n] @ kc[n].T  # [G, S]
        s = softcap * np.tanh(s / softcap) if softcap else s
        s = np.where(np.arange(S)[None] <= p, s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        y[n] = (w / w.sum(-1, keepdims=True)) @ vc[n]
    return y, kc, vc


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "N,G,S,K,pos,softcap",
    [
        (3, 1, 48, 16, [5, 0, 47], 0.0),  # one block of 48; the first and the last position
        (2, 4, 128, 32, [100, 130], 0.0),  # two blocks; 130 >= S: dropped, every position attended
        (2, 2, 64, 16, [63, 17], 5.0),  # Gemma 2's soft-cap
        # five blocks: more than the AHEAD queued (their loads clipped to the last block), and fewer
        (4, 1, 320, 16, [319, 200, 64, 1], 0.0),
    ],
)
def test_equals_float64_reference(N, G, S, K, pos, softcap, dtype):
    ks = jax.random.split(jax.random.key(N * S + G), 5)
    q = jax.random.normal(ks[0], (N, G, K)).astype(dtype)
    kn, vn = (jax.random.normal(k, (N, K)).astype(dtype) for k in ks[1:3])
    kc, vc = (jax.random.normal(k, (N, S, K)).astype(dtype) for k in ks[3:5])
    pos = jnp.asarray(pos, jnp.int32)
    want = reference(q, kn, vn, pos, kc, vc, K**-0.5, softcap)
    got = attend(q, kn, vn, pos, kc, vc, scale=K**-0.5, softcap=softcap, interpret=True)
    assert [a.dtype for a in got] == [jnp.dtype(dtype)] * 3
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == "float32" else dict(atol=0.03, rtol=0.03)
    np.testing.assert_allclose(np.asarray(got[0], np.float64), want[0], **tol)
    for g, w in zip(got[1:], want[1:]):  # the writes exact, the rest of the cache as it was
        np.testing.assert_array_equal(np.asarray(g, np.float64), w)


def test_shapes_it_cannot_take_are_one_line():
    assert why_not(2, 2, 64, 16) == "" and "powers of two" in why_not(2, 3, 64, 16)
    x = jnp.ones((2, 1, 24))
    with pytest.raises(ValueError, match=r"head dim K=24 must be powers of two.*FLAXGPT_DECODE_KERNELS=off"):
        attend(
            x,
            x[:, 0],
            x[:, 0],
            jnp.zeros(2, jnp.int32),
            jnp.ones((2, 64, 24)),
            jnp.ones((2, 64, 24)),
            scale=1.0,
        )
    assert (
        why_not(1, 1, 80, 16) == "cache length S=80 must be >= 16 and a multiple of 64 (or smaller than it)"
    )


def test_a_position_a_sequence_serves_its_heads():
    """pos_B with B < N: sequence b's N / B key/value heads (consecutive cache rows) take its position,
    as the same position repeated per row does (no broadcast kernel first); N / B must be whole."""
    N, S, K = 6, 128, 16
    ks = jax.random.split(jax.random.key(3), 5)
    q = jax.random.normal(ks[0], (N, 1, K))
    kn, vn = (jax.random.normal(k, (N, K)) for k in ks[1:3])
    kc, vc = (jax.random.normal(k, (N, S, K)) for k in ks[3:5])
    pos_B = jnp.asarray([70, 3], jnp.int32)  # 2 sequences of 3 heads
    got = attend(q, kn, vn, pos_B, kc, vc, scale=0.25, interpret=True)
    want = attend(q, kn, vn, jnp.repeat(pos_B, 3), kc, vc, scale=0.25, interpret=True)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    with pytest.raises(ValueError, match=r"^decode attention: 4 positions for 6 cache rows \(a divisor"):
        attend(q, kn, vn, jnp.zeros(4, jnp.int32), kc, vc, scale=0.25, interpret=True)
