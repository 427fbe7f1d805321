"""kernels.pallas_decode_attention (Pallas' interpreter on a CPU, compiled on a GPU): the step's key
and value written into the cache (in place; positions >= S dropped) and attention over positions <=
pos, against a float64 reference, for grouped heads, several blocks of the cache, a soft-cap, float32
and bfloat16; q, k and v handed over as one array, each sequence's heads q | k | v."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxgpt.kernels.pallas_decode_attention import attend, why_not

# Pallas' interpreter on a CPU; on a GPU (a lease's `tests` part) the compiled Triton kernels
INTERPRET = jax.default_backend() != "gpu"


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


def packed(q_NGK, kn_NK, vn_NK, B):
    """Cache rows n = b * J + j (J = N / B) as attend takes them: [B, H + 2J, K], sequence b's query
    heads (j-major, G a key/value head), then its J keys, then its J values."""
    N, G, K = q_NGK.shape
    J = N // B
    return jnp.concatenate(
        [q_NGK.reshape(B, J * G, K), kn_NK.reshape(B, J, K), vn_NK.reshape(B, J, K)], axis=1
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "N,G,S,K,pos,softcap",
    [
        (3, 1, 32, 16, [5, 0, 31], 0.0),  # one block of 32; the first and the last position
        (2, 4, 128, 32, [100, 130], 0.0),  # two blocks; 130 >= S: dropped, every position attended
        (2, 2, 64, 16, [63, 17], 5.0),  # Gemma 2's soft-cap
        # five blocks: more than the AHEAD queued (their loads clipped to the last block), and fewer
        (4, 1, 320, 16, [319, 200, 64, 1], 0.0),
    ],
)
@pytest.mark.parametrize("B", [1, 0])  # 0: a sequence a cache row (J = 1)
def test_equals_float64_reference(N, G, S, K, pos, softcap, dtype, B):
    ks = jax.random.split(jax.random.key(N * S + G), 5)
    q = jax.random.normal(ks[0], (N, G, K)).astype(dtype)
    kn, vn = (jax.random.normal(k, (N, K)).astype(dtype) for k in ks[1:3])
    kc, vc = (jax.random.normal(k, (N, S, K)).astype(dtype) for k in ks[3:5])
    B = B or N  # 1: one sequence of N key/value heads, all at its position pos[0]
    pos = jnp.asarray(pos[:B], jnp.int32)
    want = reference(q, kn, vn, jnp.repeat(pos, N // B), kc, vc, K**-0.5, softcap)
    got = attend(packed(q, kn, vn, B), pos, kc, vc, scale=K**-0.5, softcap=softcap, interpret=INTERPRET)
    assert [a.dtype for a in got] == [jnp.dtype(dtype)] * 3
    assert got[0].shape == (B, N // B * G, K)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == "float32" else dict(atol=0.03, rtol=0.03)
    np.testing.assert_allclose(np.asarray(got[0], np.float64).reshape(N, G, K), want[0], **tol)
    for g, w in zip(got[1:], want[1:]):  # the writes exact, the rest of the cache as it was
        np.testing.assert_array_equal(np.asarray(g, np.float64), w)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "N,G,S,K,pos,B",
    [
        (2, 4, 128, 32, [100, 130], 2),  # 2 ranges of 64; 130 >= S: dropped, both ranges attended
        (4, 1, 320, 16, [200], 1),  # 5 ranges, the last 3 past pos: no positions, merged as nothing
        (4, 2, 320, 16, [319, 63, 64, 0], 4),  # all 5; only the first; the second's first; the new key
    ],
)
def test_a_long_cache_split_into_ranges_equals_the_reference(N, G, S, K, pos, B, dtype):
    """span: a cache longer than it split into ranges of `span` positions, a program each, their softmax
    terms merged after (flash-decoding's split): the float64 reference, whichever ranges hold pos."""
    ks = jax.random.split(jax.random.key(S + K), 5)
    q = jax.random.normal(ks[0], (N, G, K)).astype(dtype)
    kn, vn = (jax.random.normal(k, (N, K)).astype(dtype) for k in ks[1:3])
    kc, vc = (jax.random.normal(k, (N, S, K)).astype(dtype) for k in ks[3:5])
    pos = jnp.asarray(pos, jnp.int32)
    want = reference(q, kn, vn, jnp.repeat(pos, N // B), kc, vc, K**-0.5, 0.0)
    got = attend(packed(q, kn, vn, B), pos, kc, vc, scale=K**-0.5, span=64, interpret=INTERPRET)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == "float32" else dict(atol=0.03, rtol=0.03)
    np.testing.assert_allclose(np.asarray(got[0], np.float64).reshape(N, G, K), want[0], **tol)
    for g, w in zip(got[1:], want[1:]):  # each new key and value written once, by its first range
        np.testing.assert_array_equal(np.asarray(g, np.float64), w)


def test_shapes_it_cannot_take_are_one_line():
    def attend_ones(B, C, N, S=64, K=16, **kw):  # q|k|v [B, C, K] over caches [N, S, K]
        cache = jnp.ones((N, S, K))
        return attend(jnp.ones((B, C, K)), jnp.zeros(B, jnp.int32), cache, cache, scale=1.0, **kw)

    assert why_not(2, 2, 64, 16) == "" and "powers of two" in why_not(2, 3, 64, 16)
    with pytest.raises(ValueError, match=r"head dim K=24 must be powers of two.*FLAXGPT_DECODE_KERNELS=off"):
        attend_ones(2, 3, 2, K=24)
    for S in (80, 48, 8):  # a block of positions is a Triton tile: 64, or the whole cache as a power of two
        assert (
            why_not(1, 1, S, 16)
            == f"cache length S={S} must be a multiple of 64, or a power of two from 16 below it"
        )
    assert why_not(1, 1, 16, 16) == why_not(1, 1, 128, 16) == ""
    # 4 sequences over 6 cache rows (not a multiple); 2 over 6 (J 3) with C 10: H 4, which 3 does not divide
    with pytest.raises(ValueError, match=r"^decode attention: q\|k\|v \(4, 3, 16\) of 4 sequences over 6"):
        attend_ones(4, 3, 6)
    with pytest.raises(ValueError, match=r"N must be B x J and C = H \+ 2J with J dividing H$"):
        attend_ones(2, 10, 6)
    with pytest.raises(ValueError, match=r"^decode attention: span=96 is not a multiple of the block of 64"):
        attend_ones(1, 3, 1, S=128, span=96)


def test_a_position_a_sequence_serves_its_heads():
    """2 sequences of 3 key/value heads (2 query heads each) at their own positions: each cache row
    attends as if it were a sequence of its own (6 sequences of one head) at its sequence's position;
    the output heads in the sequence's order."""
    N, G, S, K, B = 6, 2, 128, 16, 2
    ks = jax.random.split(jax.random.key(3), 5)
    q = jax.random.normal(ks[0], (N, G, K))
    kn, vn = (jax.random.normal(k, (N, K)) for k in ks[1:3])
    kc, vc = (jax.random.normal(k, (N, S, K)) for k in ks[3:5])
    pos_B = jnp.asarray([70, 3], jnp.int32)
    got = attend(packed(q, kn, vn, B), pos_B, kc, vc, scale=0.25, interpret=INTERPRET)
    want = attend(packed(q, kn, vn, N), jnp.repeat(pos_B, N // B), kc, vc, scale=0.25, interpret=INTERPRET)
    np.testing.assert_array_equal(got[0].reshape(N, G, K), want[0].reshape(N, G, K))
    for g, w in zip(got[1:], want[1:], strict=True):
        np.testing.assert_array_equal(g, w)
