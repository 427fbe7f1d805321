"""Beam search (and greedy decoding, its one-beam case) against brute force, on fake models with
known log-probs and a fake cache type that has only `take_rows`."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

from flaxgpt.decode.beam_search import beam_search, length_penalty

PAD, BOS, EOS, V = 0, 1, 2, 5


def markov2(seed, eos_bias=0.0):
    """A fake model whose next-token log-probs depend on the last two tokens: (logits table
    [prev, cur, next], float64 log-probs)."""
    table = np.random.default_rng(seed).normal(size=(V, V, V)) * 2.0
    table[..., EOS] += eos_bias
    return jnp.asarray(table, jnp.float32), np.asarray(jax.nn.log_softmax(table, axis=-1), np.float64)


@struct.dataclass
class PrevTokenCache:
    """A cache type beam search has never heard of: only `take_rows`, as the contract says."""

    prev_R: jax.Array  # [R] the token before the current one

    def take_rows(self, rows_R):
        return PrevTokenCache(self.prev_R[rows_R])


def make_step(table):
    """The cache holds the token before the current one, so beam search only gets the right
    answer if it moves the cache's rows with the beams."""

    def step(tokens_R1, positions_R1, cache):
        prev_R, cur_R = cache.prev_R, tokens_R1[:, 0]
        return table[prev_R, cur_R][:, None, :], PrevTokenCache(cur_R)

    return step


@functools.partial(jax.jit, static_argnames=("beam", "max_len", "alpha"))
def _beam(table, cache, beam, max_len, alpha):
    B = cache.prev_R.shape[0] // beam
    return beam_search(
        make_step(table),
        cache,
        batch_size=B,
        beam_size=beam,
        max_len=max_len,
        bos_id=BOS,
        eos_id=EOS,
        pad_id=PAD,
        alpha=alpha,
    )


def run_beam(table, first_prev_B, beam, max_len, alpha):
    cache = PrevTokenCache(jnp.repeat(jnp.asarray(first_prev_B, jnp.int32), beam))  # [B * W]
    seqs, scores = _beam(table, cache, beam, max_len, alpha)
    return np.asarray(seqs), np.asarray(scores)


def run_greedy(table, first_prev_B, max_len):
    """Greedy decoding is beam search with one beam and no length penalty: [B, max_len]."""
    return run_beam(table, first_prev_B, 1, max_len, 0.0)[0][:, 0]


def numpy_greedy(logp, first_prev, max_len):
    """The argmax at every step until EOS, in plain NumPy; pad after."""
    out, prev, cur = [], first_prev, BOS
    while len(out) < max_len and (not out or out[-1] != EOS):
        prev, cur = cur, int(np.argmax(logp[prev, cur]))
        out.append(cur)
    return out + [PAD] * (max_len - len(out))


def brute_force(logp, first_prev, max_len, alpha):
    """Every sequence of <= max_len tokens that ends in EOS (or is cut at max_len): scores."""
    out = {}
    for n in range(1, max_len + 1):
        for body in itertools.product([t for t in range(V) if t != EOS], repeat=n - 1):
            for last in [EOS] if n < max_len else range(V):
                seq, prev, cur, total = body + (last,), first_prev, BOS, 0.0
                for tok in seq:
                    total += logp[prev, cur, tok]
                    prev, cur = cur, tok
                if seq[-1] == EOS:  # only finished sequences compete (the tiny models always finish)
                    out[seq] = total / float(length_penalty(len(seq), alpha))
    return out


def strip(row):
    row = list(row)
    return tuple(row[: row.index(EOS) + 1]) if EOS in row else tuple(row)


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_beam_search_finds_the_exact_best_sequences(alpha):
    # <= 4**3 live prefixes x 5 tokens = 320 candidates <= 2 * beam: the search is exhaustive
    max_len, beam = 4, 256
    table, logp = markov2(0, eos_bias=1.0)
    first_prev = [0, 3, 4]
    seqs, scores = run_beam(table, first_prev, beam, max_len, alpha)
    for b, prev in enumerate(first_prev):
        ranked = sorted(brute_force(logp, prev, max_len, alpha).items(), key=lambda kv: -kv[1])
        for w in range(5):  # the five best, in order, with their scores
            assert strip(seqs[b, w]) == ranked[w][0]
            np.testing.assert_allclose(scores[b, w], ranked[w][1], rtol=1e-5)
        assert all(t == PAD for t in seqs[b, 0][len(ranked[0][0]) :])


def test_small_beam_matches_brute_force_and_beats_greedy_somewhere():
    """A beam of 3 over random models never beats the true best, and on some seed it beats greedy
    (else the test could not tell beam search from greedy)."""
    max_len, better = 5, 0
    for seed in range(20):
        table, logp = markov2(seed)
        beam_seqs, beam_scores = run_beam(table, [0], 3, max_len, 0.0)
        greedy = strip(run_greedy(table, [0], max_len)[0])
        every = brute_force(logp, 0, max_len, 0.0)
        assert beam_scores[0, 0] <= max(every.values()) + 1e-5
        assert strip(beam_seqs[0, 0]) in every
        if greedy in every:
            better += beam_scores[0, 0] > every[greedy] + 1e-4
    assert better > 0


def test_beam_size_one_equals_greedy():
    for seed in range(5):
        table, logp = markov2(seed)
        first_prev = np.array([0, 1, 3, 4, 0, 3])
        seqs, _ = run_beam(table, first_prev, 1, 12, 0.0)
        want = [numpy_greedy(logp, prev, 12) for prev in first_prev]
        np.testing.assert_array_equal(seqs[:, 0], want)


def test_no_eos_within_max_len_returns_the_best_live_prefix():
    table, logp = markov2(1, eos_bias=-1e4)  # EOS never wins
    seqs, scores = run_beam(table, [0], 4, 3, 0.6)
    assert EOS not in seqs[0, 0] and len(seqs[0, 0]) == 3
    assert np.all(np.isfinite(scores)) and scores[0, 0] >= scores[0, 1]


def test_every_returned_beam_is_a_real_sequence():
    """Some beams finish within max_len, some do not: the slots no finished sequence fills hold the best
    live prefixes, after the finished ones (they were all-PAD rows scored -1e9)."""
    table, logp = markov2(3, eos_bias=-2.0)
    seqs, scores = run_beam(table, [0, 1], 6, 3, 0.6)
    for b in range(2):
        finished = [EOS in row for row in seqs[b]]
        assert any(finished) and not all(finished), finished  # the case at hand
        assert finished == sorted(finished, reverse=True)  # finished first
        assert np.all(scores[b] > -1e8) and all(row[0] != PAD for row in seqs[b])


def test_greedy_stops_rows_at_eos_and_pads_after():
    table, _ = markov2(2, eos_bias=3.0)
    for row in run_greedy(table, [0, 1, 3, 4], 8):
        assert EOS in row
        assert np.all(row[list(row).index(EOS) + 1 :] == PAD)


def test_bad_arguments_are_errors():
    step, cache = make_step(markov2(0)[0]), PrevTokenCache(jnp.zeros((2,), jnp.int32))
    ids = dict(batch_size=1, max_len=3, bos_id=BOS, eos_id=EOS)
    with pytest.raises(ValueError, match="alpha"):
        beam_search(step, cache, beam_size=2, alpha=-1.0, **ids)
    with pytest.raises(ValueError, match="beam_size"):
        beam_search(step, cache, beam_size=0, **ids)
