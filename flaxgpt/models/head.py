"""The output head as the fused loss sees it (train/losses.py; the kernels in kernels/linear_xent.py):

    unembed = gpt.unembedding(config, params)        # a Head: the weight, its layout, V, the soft-cap
    s = stats(x_ND, unembed, targets_N)              # lse, target logit, sum of logits, entropy: [N]
    fused_by_default()                               # optim.loss_impl="auto": fused off the CPU

The training side (flaxgpt.train) imports models, not kernels; this is its one door to the fused
linear + cross-entropy and to the platform rule that picks it.
"""

from __future__ import annotations

from flaxgpt.kernels import linear_xent, target
from flaxgpt.kernels.linear_xent import Head, Stats  # noqa: F401  (flaxgpt.models.head.Head)


def stats(x_ND, unembed: Head, targets_N, scale: float = 1.0, block: int = 0) -> Stats:
    """linear_xent.token_stats: the Pallas kernels on one GPU, the XLA form elsewhere (pick_impl)."""
    return linear_xent.token_stats(x_ND, unembed, targets_N, scale=scale, block=block)


def fused_by_default() -> bool:
    """Whether optim.loss_impl="auto" means fused: on GPU and TPU (the devices the program is traced
    for, kernels.target), not on CPU, where the blocked form measured slower (docs/benchmarks.md)."""
    return target.platform() != "cpu"
