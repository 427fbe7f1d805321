"""DAPO's dynamic sampling (Yu et al. 2025; grpo.dynamic_sampling = True): a group whose G rewards are
all equal has advantage 0 everywhere and teaches nothing, so it is dropped and the step samples more
prompts until its batch holds batch_size // G groups that differ, for at most
grpo.dynamic_sampling_rounds more rounds. A batch still short after them is filled with dropped
groups whose loss mask is zeroed (the step's shapes are fixed: the update compiles once), and
`dynamic_sampling/kept` logs the share of the batch's groups that train.

    (prompt_ids, completion_ids, total_N, trains_N), info = fill(draw, first, G, rounds)

draw(r) -> (prompt ids, completion ids, total rewards [N], ...) of round r (r = 0 is `first`, the
step's own prompts); kept groups come in the order drawn, so the same seeds give the same batch.
Shape letters: N completions (groups x G), G group size.
"""

from __future__ import annotations

import numpy as np

from flaxgpt.train import grpo_task


def _groups(drawn, G: int):
    """[(prompt ids, completion ids, rewards [G]) a group], [bool a group: its rewards differ]."""
    prompt_ids, completion_ids, total_N = drawn[0], drawn[1], np.asarray(drawn[2])
    _, zero_std_N = grpo_task.group_advantages(total_N, G, "none")
    starts = range(0, len(total_N), G)
    out = [(prompt_ids[i : i + G], completion_ids[i : i + G], total_N[i : i + G]) for i in starts]
    return out, [not z for z in zero_std_N[::G]]


def fill(draw, first, G: int, rounds: int):
    """The step's batch of groups that differ, drawn over at most `rounds` more rounds; see the module
    docstring. -> ((prompt ids, completion ids, total [N], trains [N] bool), info)."""
    groups, informative = _groups(first, G)
    n_groups = len(groups)
    kept = [g for g, ok in zip(groups, informative, strict=True) if ok]
    dropped = [g for g, ok in zip(groups, informative, strict=True) if not ok]
    r = 0
    while len(kept) < n_groups and r < rounds:
        r += 1
        more, ok_more = _groups(draw(r), G)
        kept += [g for g, ok in zip(more, ok_more, strict=True) if ok]
    chosen = kept[:n_groups]
    trains = [True] * len(chosen) + [False] * (n_groups - len(chosen))
    chosen += dropped[: n_groups - len(chosen)]  # short after every round: these train nothing
    prompt_ids = [p for g in chosen for p in g[0]]
    completion_ids = [c for g in chosen for c in g[1]]
    total_N = np.concatenate([g[2] for g in chosen])
    trains_N = np.repeat(np.array(trains, bool), G)
    info = {"dynamic_sampling/rounds": float(r), "dynamic_sampling/kept": float(np.mean(trains))}
    return (prompt_ids, completion_ids, total_N, trains_N), info
