"""Decoding throughput of a Llama-style model of GPT-2 124M's size: flaxgpt vs transformers.

    python benchmarks/llama_decode.py --torch_python VENV/bin/python   # batch 1 and 8, 256 new tokens
    python benchmarks/llama_decode.py --new_tokens 8 --batch_sizes 1 --n_kv_heads 4 --pause 1   # a smoke run

The Llama-style model has GPT-2 124M's shape (12 layers, width 768, 12 heads, vocabulary 50257,
tied head, context 1024) with RoPE, RMSNorm, no biases and a SwiGLU MLP of hidden size 2048 (three
768 x 2048 matrices: GPT-2's MLP parameter count), and 12 (multi-head) or fewer (grouped-query)
key/value heads. Random weights, float32, greedy, a 16-token prompt; prefill included, compilation
excluded, as benchmarks/sample_throughput.py. flaxgpt's GPT-2 runs on the same shapes so the two
paths compare per parameter (tokens/s x parameters). The KV cache bytes show what grouped-query
attention saves. Each side runs in its own process through benchmarks/harness.py (the order
alternating every round, --pause seconds of rest before each run, at least 4 rounds); the
transformers side under --torch_python (a venv with the torch / transformers to compare against).
"""

from __future__ import annotations

import argparse
import os
import sys

import harness  # noqa: E402  (first: the benchmarks' one sys.path rule, see harness.py)
import numpy as np
from sample_throughput import row  # noqa: E402


def prompts(batches, prompt_len):
    rs = np.random.RandomState(0)
    return {B: rs.randint(0, 50257, (B, prompt_len)).astype(np.int32) for B in batches}


def models(n_kv_heads: str):
    """(name, n_kv_head or None for GPT-2) for every model the benchmark runs."""
    return [("gpt2", None)] + [(f"llama-style J={j}", int(j)) for j in n_kv_heads.split(",")]


def llama_config(n_kv_head: int):
    from flaxgpt.models.gpt import LLAMA_STYLE, GPTConfig

    return GPTConfig(**LLAMA_STYLE, n_layer=12, n_head=12, n_kv_head=n_kv_head, n_embd=768, mlp_hidden=2048)


def flax_side(a, batches):
    import jax
    from sample_throughput import timed_generate

    from flaxgpt.models import gpt
    from flaxgpt.models.cache import KVCache
    from flaxgpt.models.gpt import GPTConfig, count_params, init_params

    out = {}
    for name, j in models(a.n_kv_heads):
        cfg = GPTConfig.gpt2() if j is None else llama_config(j)
        params = init_params(cfg, jax.random.key(0))
        cache = KVCache.for_config(cfg, 1, 1024)
        mib = sum(x.nbytes for x in cache.k + cache.v) / 2**20
        step = gpt.step_fn(cfg, params)
        for B, prompt in prompts(batches, a.prompt_len).items():
            warm, tok_s, _ = timed_generate(step, cfg, prompt, a.new_tokens, a.repeats)
            for field, v in dict(params=count_params(params), mib=mib, tok_s=tok_s, warm=warm).items():
                out[f"{name} b{B} {field}"] = v  # flat: the harness compares one key per figure
        del params, step
    return out


def hf_side(a, batches):
    import torch
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    out = {"versions": f"transformers {transformers.__version__}, torch {torch.__version__}"}
    out["threads"] = torch.get_num_threads()
    for name, j in models(a.n_kv_heads):
        torch.manual_seed(0)
        if j is None:
            model = GPT2LMHeadModel(GPT2Config())
        else:
            model = LlamaForCausalLM(
                LlamaConfig(
                    vocab_size=50257, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                    num_attention_heads=12, num_key_value_heads=j, max_position_embeddings=1024,
                    tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
                )
            )  # fmt: skip
        model.eval()
        for B, prompt in prompts(batches, a.prompt_len).items():
            out[f"{name} b{B}"], _ = harness.hf_generate(model, prompt, a.new_tokens, a.repeats)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt_len", type=int, default=16)
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--batch_sizes", default="1,8")
    p.add_argument("--n_kv_heads", default="12,4", help="key/value heads of the Llama-style runs")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per side and round (their median)")
    p.add_argument("--torch_python", default=sys.executable, help="interpreter for the transformers side")
    harness.add_arguments(p)
    p.add_argument("--side", choices=["flaxgpt", "hf"], default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    batches = [int(b) for b in a.batch_sizes.split(",")]
    if a.side:
        return harness.print_result((flax_side if a.side == "flaxgpt" else hf_side)(a, batches))
    args = [
        "--prompt_len",
        str(a.prompt_len),
        "--new_tokens",
        str(a.new_tokens),
        "--batch_sizes",
        a.batch_sizes,
    ]
    args += ["--n_kv_heads", a.n_kv_heads, "--repeats", str(a.repeats)]
    sides = [
        harness.Side("flaxgpt", [sys.executable, __file__, *args, "--side", "flaxgpt"]),
        harness.Side("transformers", [a.torch_python, __file__, *args, "--side", "hf"]),
    ]
    keys = [f"{name} b{B}" for name, _ in models(a.n_kv_heads) for B in batches]
    figures = [
        harness.Figure(f"decoding {k} (tok/s)", "flaxgpt", f"{k} tok_s", "transformers", k) for k in keys
    ]
    report = harness.compare(sides, figures, rounds=a.rounds, pause=a.pause)
    first = report.results[0]["flaxgpt"]
    print(
        f"\nrandom weights, float32, greedy, prompt {a.prompt_len}, {a.new_tokens} new tokens, median of "
        f"{a.repeats} per round; {os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}\n"
    )
    print(report.table() + "\n")
    widths = (22, 6, 9, 10, 11, 13)
    row("model", "batch", "params", "KV MiB/1k", "flax tok/s", "Mparam*tok/s", widths=widths)
    for k in keys:
        name, B = k.rsplit(" b", 1)
        n, fx = first[f"{k} params"], float(np.median(report.values("flaxgpt", f"{k} tok_s")))
        row(
            name,
            B,
            f"{n / 1e6:.1f}M",
            f"{first[f'{k} mib']:.1f}",
            f"{fx:.1f}",
            f"{fx * n / 1e6:,.0f}",
            widths=widths,
        )
    compile_s = ", ".join(f"{k} {first[f'{k} warm']:.1f}" for k in keys)
    print(f"\nKV MiB/1k: the float32 KV cache of one 1024-token sequence; compile s (round 1): {compile_s}")


if __name__ == "__main__":
    main()
