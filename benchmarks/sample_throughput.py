"""Decoding throughput: flaxgpt.sampling.generate vs transformers' GPT2LMHeadModel.generate.

    python benchmarks/sample_throughput.py                       # the full comparison (a quiet machine)
    python benchmarks/sample_throughput.py --new_tokens 64 --lengths ""   # a short smoke run
    python benchmarks/sample_throughput.py --skip_hf             # flaxgpt only (no torch needed)

GPT-2 124M config, random weights, float32, greedy, a 16-token prompt. Both sides include the prefill
in their time and exclude compilation / warm-up (flaxgpt's compile time is printed on its own line).
The length sweep uses one cache of block_size (1024) tokens for every length, so it compiles once:
tokens/s should stay flat as the sequence grows (1024 new tokens after a 16-token prompt pass the
window once, which costs one re-prefill of 511 tokens). `transformers` is optional (pip install .[hf]).
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from flaxgpt import sampling
from flaxgpt.cache import KVCache
from flaxgpt.gpt import GPTConfig, init_params


def flax_generate(step, cfg, prompt_BP, n_new, cache_len):
    B = prompt_BP.shape[0]
    cache = KVCache.for_config(cfg, B, cache_len)
    t0 = time.perf_counter()
    toks, lens = sampling.generate(
        step,
        cache,
        prompt_BP,
        np.full(B, prompt_BP.shape[1]),
        max_new_tokens=n_new,
        rng=jax.random.key(0),
        temperature=0,
    )
    dt = time.perf_counter() - t0
    assert (lens == n_new).all(), lens
    return dt, toks


def time_flax(step, cfg, prompt_BP, n_new, cache_len):
    """-> (compile + first run seconds, timed seconds)."""
    warm, _ = flax_generate(step, cfg, prompt_BP, 2, cache_len)  # compiles prefill + decode loop
    dt, _ = flax_generate(step, cfg, prompt_BP, n_new, cache_len)
    return warm, dt


def time_hf(prompt_BP, n_new):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).eval()
    ids = torch.from_numpy(prompt_BP.astype(np.int64))
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=50256, use_cache=True)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, **kw)
        dt = time.perf_counter() - t0
    assert out.shape[1] == prompt_BP.shape[1] + n_new
    return dt


def cache_copies(step, cfg, batch, cache_len):
    """Cache-sized copies in the compiled decode loop (0 = updated in place) and donated bytes."""
    B, W = batch, cache_len
    z = jnp.zeros((B,), jnp.int32)
    state = sampling.DecodeState(
        cache=KVCache.for_config(cfg, B, W),
        window_BW=jnp.zeros((B, W), jnp.int32),
        fill_B=z + 16,
        last_B=z,
        count_B=z + 1,
        done_B=z > 0,
        step=jnp.int32(1),
        rng=jax.random.key(0),
    )
    compiled = sampling._decode_chunk.lower(
        step, state, jnp.int32(8), 64, W // 2, sampling.Sampling(0.0, 0, 1.0, None)
    ).compile()
    shape = f"f32[{B * cfg.n_head},{W},{cfg.head_dim}]"  # one layer's KVCache buffer
    n = sum(1 for line in compiled.as_text().splitlines() if f"= {shape}" in line and " copy(" in line)
    mem = compiled.memory_analysis()
    return n, getattr(mem, "alias_size_in_bytes", float("nan"))


def row(name, *cells):
    print(f"{name:<34}" + "".join(f"{c:>14}" for c in cells))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt_len", type=int, default=16)
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--batch_sizes", default="1,8")
    p.add_argument("--lengths", default="64,256,1024", help="new-token counts for the flat-time sweep")
    p.add_argument("--skip_hf", action="store_true")
    a = p.parse_args()

    cfg = GPTConfig.gpt2()
    params = init_params(cfg, jax.random.key(0))
    step = sampling.gpt_step_fn(cfg, params)
    rs = np.random.RandomState(0)
    print(
        f"GPT-2 124M, random weights, float32, greedy, prompt {a.prompt_len}, jax {jax.__version__} "
        f"on {jax.devices()[0].platform} ({os.cpu_count()} cpus)"
    )

    N = a.new_tokens
    W = sampling.cache_length(cfg.block_size, a.prompt_len, N)
    batches = [int(b) for b in a.batch_sizes.split(",")]
    prompts = {B: rs.randint(0, cfg.vocab_size, (B, a.prompt_len)).astype(np.int32) for B in batches}
    flax = {B: time_flax(step, cfg, prompts[B], N, W) for B in batches}

    lengths = [int(n) for n in a.lengths.split(",") if n]
    sweep = []
    if lengths:
        prompt_BP = rs.randint(0, cfg.vocab_size, (1, a.prompt_len)).astype(np.int32)
        sweep_warm, _ = flax_generate(step, cfg, prompt_BP, 2, cfg.block_size)
        sweep = [(n, flax_generate(step, cfg, prompt_BP, n, cfg.block_size)[0]) for n in lengths]

    # PyTorch after every flaxgpt run: its idle OpenMP workers spin for a while after each call,
    # and XLA runs that came right after them lost cores (batch 8 ran ~40% slower).
    hf = {B: float("nan") if a.skip_hf else B * N / time_hf(prompts[B], N) for B in batches}

    print(f"\n{N} new tokens, cache {W}")
    row("batch", "flaxgpt tok/s", "hf tok/s", "ratio", "compile s")
    for B in batches:
        warm, dt = flax[B]
        fx = B * N / dt
        row(str(B), f"{fx:.1f}", f"{hf[B]:.1f}", f"{fx / hf[B]:.2f}x", f"{warm:.1f}")
    if sweep:
        print(f"\nflaxgpt, batch 1, one cache of {cfg.block_size} for every length (compiled once)")
        row("new tokens", "tok/s", "ms/token", "seconds")
        print(f"  (compile + 2 tokens: {sweep_warm:.1f} s)")
        for n, dt in sweep:
            row(str(n), f"{n / dt:.1f}", f"{1000 * dt / n:.1f}", f"{dt:.1f}")

    n_copies, aliased = cache_copies(step, cfg, 1, 320)
    print(
        f"\ndecode loop (batch 1, cache 320): {n_copies} cache-sized copies; "
        f"{aliased / 2**20:.0f} MiB of donated input reused for the output"
    )


if __name__ == "__main__":
    main()
