"""Decoding throughput of a Llama-style model of GPT-2 124M's size: flaxgpt vs transformers.

    python benchmarks/llama_decode.py                          # batch 1 and 8, 256 new tokens
    python benchmarks/llama_decode.py --new_tokens 32 --batch_sizes 1 --n_kv_heads 4   # a smoke run

The Llama-style model has GPT-2 124M's shape (12 layers, width 768, 12 heads, vocabulary 50257,
tied head, context 1024) with RoPE, RMSNorm, no biases and a SwiGLU MLP of hidden size 2048 (three
768 x 2048 matrices: GPT-2's MLP parameter count), and 12 (multi-head) or fewer (grouped-query)
key/value heads. Random weights, float32, greedy, a 16-token prompt; prefill included, compilation
excluded, as benchmarks/sample_throughput.py. flaxgpt's GPT-2 runs on the same shapes so the two
paths compare per parameter (tokens/s x parameters). The KV cache bytes show what grouped-query
attention saves.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sample_throughput import row, time_flax, time_hf  # noqa: E402

from flaxgpt import (
    gpt,  # noqa: E402
    sampling,  # noqa: E402
)
from flaxgpt.cache import KVCache  # noqa: E402
from flaxgpt.gpt import LLAMA_STYLE, GPTConfig, count_params, init_params  # noqa: E402


def llama_config(n_kv_head: int) -> GPTConfig:
    return GPTConfig(**LLAMA_STYLE, n_layer=12, n_head=12, n_kv_head=n_kv_head, n_embd=768, mlp_hidden=2048)


def time_hf_llama(cfg: GPTConfig, prompt_BP, n_new):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.mlp_hidden,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.block_size, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=None,
    )  # fmt: skip
    model = LlamaForCausalLM(hf_cfg).eval()
    ids = torch.from_numpy(prompt_BP.astype(np.int64))
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, use_cache=True)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, **kw)
        dt = time.perf_counter() - t0
    assert out.shape[1] == prompt_BP.shape[1] + n_new
    return dt


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt_len", type=int, default=16)
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--batch_sizes", default="1,8")
    p.add_argument("--n_kv_heads", default="12,4", help="key/value heads of the Llama-style runs")
    p.add_argument("--skip_hf", action="store_true")
    a = p.parse_args()
    N, rs = a.new_tokens, np.random.RandomState(0)
    batches = [int(b) for b in a.batch_sizes.split(",")]
    print(
        f"random weights, float32, greedy, prompt {a.prompt_len}, {N} new tokens, jax {jax.__version__} "
        f"on {jax.devices()[0].platform} ({os.cpu_count()} cpus)\n"
    )
    W = sampling.cache_length(1024, a.prompt_len, N)
    models = [("gpt2 (flaxgpt)", GPTConfig.gpt2())]
    models += [(f"llama-style J={j}", llama_config(int(j))) for j in a.n_kv_heads.split(",")]
    results = {}
    for name, cfg in models:
        params = init_params(cfg, jax.random.key(0))
        n_params = count_params(params)
        step = gpt.step_fn(cfg, params)
        cache = KVCache.for_config(cfg, 1, 1024)
        cache_mib = sum(x.nbytes for x in cache.k + cache.v) / 2**20
        for B in batches:
            prompt = rs.randint(0, cfg.vocab_size, (B, a.prompt_len)).astype(np.int32)
            warm, dt = time_flax(step, cfg, prompt, N, W)
            results[name, B] = (n_params, cache_mib, B * N / dt, warm, prompt)
        del params, step
    # transformers after every flaxgpt run (its idle OpenMP workers slow XLA runs that follow them)
    for name, cfg in models:
        for B in batches:
            prompt = results[name, B][4]
            if a.skip_hf:
                hf = float("nan")
            elif name.startswith("gpt2"):
                hf = B * N / time_hf(prompt, N)
            else:
                hf = B * N / time_hf_llama(cfg, prompt, N)
            results[name, B] = results[name, B][:4] + (hf,)

    row("model", "batch", "params", "KV MiB/1k", "flax tok/s", "hf tok/s", "ratio", "Mparam*tok/s")
    for (name, B), (n, mib, fx, _, hf) in results.items():
        ratio = f"{fx / hf:.2f}x"
        row(name, B, f"{n / 1e6:.1f}M", f"{mib:.1f}", f"{fx:.1f}", f"{hf:.1f}", ratio, f"{fx * n / 1e6:,.0f}")
    print("\nKV MiB/1k: the float32 KV cache of one 1024-token sequence; compile times (s): " + ", ".join(
        f"{name} b{B} {r[3]:.1f}" for (name, B), r in results.items()
    ))  # fmt: skip


if __name__ == "__main__":
    main()
