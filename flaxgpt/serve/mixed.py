"""The mixed step's device programs: prompt tokens and decode rows in one model call (vLLM v1's
mixed batch, in the fixed shape [slots, T] a jitted program needs).

    state = hold(state, slot_1, table_1M, adapter, rows_1, seen_1V, start)   # a prefilling request's row
    state, tok_B1, lp = mixed_step(step_fn, state, stop_B, forced_BT, n_B, ends_B, max_k=...)
    forced_BT, n_B, ends_B = plan_rows({slot: tokens}, held_jobs, slots, mixed_widths(32, 1024))   # host

A prefilling request holds its slot from admission (`hold`): its block table, adapter, settings and
prompt tokens become the slot's row, which stays done (plain decode steps skip it) until `mixed_step`
feeds the rest of its prompt. In that step row b feeds n_B[b] > 0 forced prompt tokens forced_BT[b]
(written to the cache as given), or, decoding, its pending token; each row's logits are taken at its
last fed position. A decoding row then draws its next token and a row whose prompt ends here
(ends_B) its first new token, both by sampling's `take`: the first token of a held row has index 0,
no output counts and the prompt's tokens as seen, so it is the token the [1, P] prefill draws
(runner._first) with the same key and settings. A row's computation depends only on that row.

Shape letters: B slots, T the step's width, M pages per row, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from flaxgpt.decode.sampling import DecodeState, Rows, take
from flaxgpt.models.cache import AdapterCache


def hold(state: DecodeState, slot_1, table_1M, adapter, rows_1: Rows, seen_1V, start) -> DecodeState:
    """Slot slot_1[0] taken by a prefilling request whose positions < start are in its pages: its
    table, adapter slot, settings (host rows, made keyed) and prompt tokens (seen_1V) set; no token
    yet (count 0, no output counts), done until its prompt is in."""
    put = lambda x_B, v: x_B.at[slot_1].set(jnp.reshape(v, (1, *x_B.shape[1:])))  # noqa: E731
    cache: AdapterCache = state.cache
    cache = cache.replace(
        inner=cache.inner.replace(table_BM=put(cache.inner.table_BM, table_1M)),
        adapter_B=put(cache.adapter_B, adapter),
    )
    V = state.counts_BV.shape[1]
    return state.replace(
        cache=cache,
        last_B=put(state.last_B, 0),
        fill_B=put(state.fill_B, start),
        count_B=put(state.count_B, 0),
        done_B=put(state.done_B, True),
        rows=jax.tree_util.tree_map(put, state.rows, rows_1.keyed()),
        counts_BV=put(state.counts_BV, jnp.zeros((1, V), state.counts_BV.dtype)),
        seen_BV=put(state.seen_BV, seen_1V),
    )


def mixed_step(step_fn, state: DecodeState, stop_B, forced_BT, n_B, ends_B, max_k: int):
    """One model call over [B, T]: rows with n_B[b] > 0 (held, see `hold`) write their next n_B[b]
    prompt tokens forced_BT[b, :n_B[b]] and, where ends_B[b] (the prompt complete), draw their first
    new token; every other unfinished row decodes one token (its pending one fed at column 0).
    -> (state, tok_B1 with PAD for rows that drew none, Logprobs-like tuple of [B, 1] ...), as one
    plain decode step's outputs. Columns a row does not feed go past the window (nothing written)."""
    state = state.replace(done_B=state.done_B | (stop_B & (n_B == 0)))
    B, T = forced_BT.shape
    W = state.cache.max_len
    t_T = jnp.arange(T)
    prefill_B = n_B > 0
    decode_B = ~state.done_B & ~prefill_B
    tokens_BT = jnp.where(prefill_B[:, None], forced_BT, jnp.where(t_T == 0, state.last_B[:, None], 0))
    fed_B = jnp.where(prefill_B, n_B, decode_B.astype(jnp.int32))
    fed_BT = t_T < fed_B[:, None]
    positions_BT = jnp.where(fed_BT, state.fill_B[:, None] + t_T, W + t_T)
    last_B = jnp.maximum(fed_B - 1, 0)
    logits_B1V, cache = step_fn(tokens_BT, positions_BT, state.cache, logits_at=last_B)
    # take's view: the rows that draw are active; a prefill row's fill moves to its last fed position
    # (take adds the drawn token's one), or past its chunk when its prompt goes on
    draws_B = decode_B | (prefill_B & ends_B)
    fill_B = state.fill_B + jnp.where(prefill_B, n_B - ends_B.astype(jnp.int32), 0)
    view = state.replace(done_B=~draws_B, fill_B=fill_B)
    # rows that draw nothing stay done: free slots, and held rows whose prompt goes on
    state, tok_B, lp = take(view, logits_B1V[:, 0], cache, last_B, None, max_k, 0, True)
    return state, tok_B[:, None], tuple(x[:, None] for x in lp)


def mixed_widths(widest: int, window: int) -> tuple[int, ...]:
    """The mixed step's widths T (one compiled program each): powers of two from 8 below `widest`, and
    `widest` (0: no mixed step), which a request's window must exceed (its first new token follows)."""
    if not 0 <= widest <= window - 2:
        raise ValueError(
            f"the mixed step's width must be 0 (off) to {window - 2} (the window less 2), got {widest}"
        )
    return tuple(w for w in (8, 16, 32, 64, 128, 256) if w < widest) + ((widest,) if widest else ())


def plan_rows(plan: dict, held: dict, slots: int, widths) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A step's plan {slot: prompt tokens} over the held requests {slot: PrefillJob} -> the step's host
    arrays (forced_BT at the narrowest width that fits, n_B, ends_B)."""
    n_B, ends_B = np.zeros(slots, np.int32), np.zeros(slots, bool)
    forced_BT = np.zeros((slots, widths[-1]), np.int32)
    for slot, n in plan.items():
        job = held[slot]
        n_B[slot] = n = min(n, job.left)
        if not 1 <= n <= widths[-1]:
            raise ValueError(f"a mixed step feeds 1 to {widths[-1]} prompt tokens a row, got {plan}")
        ends_B[slot] = n == job.left
        forced_BT[slot, :n] = job.prompt_ids[job.done_upto : job.done_upto + n]
    T = next(w for w in widths if w >= n_B.max())
    return forced_BT[:, :T], n_B, ends_B
