"""Scoring over several processes: each process scores its share of the requests on its own devices,
and every process gets every score back.

    scorer = ProcessShards(local)   # local: a scoring.Scorer over jax.local_devices(), after cluster.join
    scores = scorer.score(requests)            # as Scorer.score: every request's Score, in order

A request's log-likelihood needs no other request, and the model of an evaluation fits one host
(it did before the job grew), so the requests are split, not the model: process p takes the p-th
contiguous block of the requests (groups, for score_choices), scores it with its Scorer's own
batches and compiled shapes, and one all-gather (jax.experimental.multihost_utils.process_allgather)
returns the scores of every block. A global mesh would instead make every process run every batch
in lockstep, with shapes that must agree across processes, for a model that needs no splitting.
A score equals the one-process score up to float rounding (its batch may be padded to another
shape): logprobs are float32 on the device, gathered as float32.

Shape letters: P processes, R scores a process (the largest block's), S = 2 (logprob, greedy).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils

from flaxgpt.eval.scoring import Score


def block(n: int, count: int, index: int) -> range:
    """The items of process `index` among `count`: a contiguous block, the first ones a longer by one."""
    size, extra = divmod(n, count)
    start = index * size + min(index, extra)
    return range(start, start + size + (index < extra))


class ProcessShards:
    """A Scorer's score / score_choices over the job's processes (see the module docstring); every
    process must make the same calls with the same requests."""

    def __init__(self, scorer, index: int | None = None, count: int | None = None):
        self.scorer = scorer
        self.index = jax.process_index() if index is None else index
        self.count = jax.process_count() if count is None else count
        self.tokens_seen = 0  # every process's, as one Scorer over all the requests counts them

    @property
    def block_size(self) -> int:
        return self.scorer.block_size

    def score(self, requests) -> list[Score]:
        requests = list(requests)
        n, before = len(requests), self.scorer.tokens_seen
        scores = self.scorer.score([requests[i] for i in block(n, self.count, self.index)])
        lengths = [[[len(requests[i][1])] for i in block(n, self.count, p)] for p in range(self.count)]
        mine = [[s] for s in scores]
        return [g[0] for g in self._gather(mine, lengths, self.scorer.tokens_seen - before)]

    def score_choices(self, groups) -> list[list[Score]]:
        groups = list(groups)
        n, before = len(groups), self.scorer.tokens_seen
        scores = self.scorer.score_choices([groups[i] for i in block(n, self.count, self.index)])
        lengths = [
            [[len(c) for c in groups[i][1]] for i in block(n, self.count, p)] for p in range(self.count)
        ]
        return self._gather(scores, lengths, self.scorer.tokens_seen - before)

    def _gather(self, mine, lengths, tokens: int) -> list[list[Score]]:
        """Every process's groups of scores, process 0's first. lengths[p][g]: the continuation
        lengths of process p's group g (each Score's n_tokens), known to every process."""
        R = max(sum(len(g) for g in groups) for groups in lengths)
        local_RS = np.zeros((R, 2), np.float32)
        flat = [s for group in mine for s in group]
        local_RS[: len(flat)] = [(s.logprob, s.greedy) for s in flat]
        if self.count == 1:
            all_PRS, tokens_P = local_RS[None], np.array([tokens])
        else:  # one collective a call: the same shapes on every process
            all_PRS, tokens_P = multihost_utils.process_allgather((local_RS, np.array([tokens], np.int32)))
        self.tokens_seen += int(np.sum(tokens_P))
        out = []
        for p, groups in enumerate(lengths):
            rows = iter(np.asarray(all_PRS[p]))
            out += [[Score(float(lp), bool(g), n) for n, (lp, g) in zip(group, rows)] for group in groups]
        return out
