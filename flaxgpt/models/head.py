"""The output head as the fused loss sees it (train/losses.py; the kernels in kernels/linear_xent.py):

    unembed = gpt.unembedding(config, params)        # a Head: the weight, its layout, V, the soft-cap
    s = stats(x_ND, unembed, targets_N)              # lse, target logit, sum of logits, entropy: [N]

The training side (flaxgpt.train) imports models, not kernels; this is its one door to the fused
linear + cross-entropy.
"""

from __future__ import annotations

from flaxgpt.kernels import linear_xent
from flaxgpt.kernels.linear_xent import Head, Stats  # noqa: F401  (flaxgpt.models.head.Head)


def stats(x_ND, unembed: Head, targets_N, scale: float = 1.0, block: int = 0) -> Stats:
    """linear_xent.token_stats: the XLA form (FLAXGPT_XENT=pallas: the Triton kernels on one GPU)."""
    return linear_xent.token_stats(x_ND, unembed, targets_N, scale=scale, block=block)
