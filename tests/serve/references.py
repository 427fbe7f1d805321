"""What the serving tests compare against: generate over a plain cache, one request or one batch."""

import jax
import numpy as np

from flaxgpt.decode.sampling import generate
from flaxgpt.models.cache import KVCache
from flaxgpt.models.gpt import step_fn


def alone(step, config, window: int, prompt, rows) -> list[int]:
    """A request's tokens from generate alone (batch 1), with its Rows.of settings and seed.
    The prompt is right-padded to a multiple of 16 (at most the window): one prefill program for
    prompts of similar lengths."""
    padded = np.zeros((1, min(window, -(-len(prompt) // 16) * 16)), np.int32)
    padded[0, : len(prompt)] = prompt
    toks, n = generate(
        step, KVCache.for_config(config, 1, window), padded, [len(prompt)],
        max_new_tokens=int(rows.max_new_B[0]), rng=jax.random.key(int(rows.key_B[0, 0])),
        temperature=float(rows.temperature_B[0]), top_k=int(rows.top_k_B[0]), top_p=float(rows.top_p_B[0]),
    )  # fmt: skip
    return toks[0, : n[0]].tolist()


def greedy_rows(config, params, prompts, window: int, new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens, the prompts as the rows of one batch (rows are independent)."""
    prompt_BP = np.zeros((len(prompts), max(map(len, prompts))), np.int32)
    for b, p in enumerate(prompts):
        prompt_BP[b, : len(p)] = p
    out, _ = generate(
        step_fn(config, params), KVCache.for_config(config, len(prompts), window), prompt_BP,
        [len(p) for p in prompts], max_new_tokens=new_tokens, rng=jax.random.key(0), temperature=0.0,
    )  # fmt: skip
    return out.tolist()
