"""Prompt-lookup drafts for speculative decoding in the server: no draft model, the text drafts itself.

    drafts = propose(prompt_ids + reply_ids, k=4)     # up to 4 ids, [] when nothing matches

Replies often repeat their context (code edits, quoting a document, extracting fields, a summary's
names): the last few tokens have usually appeared before, followed by what comes next. So the draft
is the k tokens that followed the most recent earlier occurrence of the sequence's last n tokens
(continued periodically where they run into the end: a reply that loops is drafted k tokens ahead),
trying n = max_n first (the longest match is the likeliest to continue the same way) down to min_n
(vLLM's `ngram` method, prompt_lookup_min / prompt_lookup_max). The engine checks the drafts against
the model's greedy choices in one call (serve/runner.py `_speculate`), so a wrong draft costs only
the wider step, never a different token.

Letters: N tokens so far, n the length of the matched suffix, k drafts.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose(tokens, k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Up to k ids that followed the latest earlier occurrence of the last n tokens (n from max_n down to
    min_n), or [] when no suffix of those lengths occurred before."""
    ids_N = np.asarray(tokens, np.int64)
    N = len(ids_N)
    for n in range(min(max_n, N - 1), min_n - 1, -1):
        # windows starting at 0 .. N - n - 1: every occurrence before the suffix itself
        windows_Mn = sliding_window_view(ids_N[: N - 1], n)
        hits = np.flatnonzero((windows_Mn == ids_N[N - n :]).all(axis=1))
        if hits.size:
            start = hits[-1] + n  # what followed the latest match
            # past the end the continuation goes on from itself: a loop of period N - start is drafted
            # whole (the latest match of a repeating reply ends one token before the end)
            out = ids_N.tolist()
            for j in range(k):
                out.append(out[start + j])
            return out[N:]
    return []
