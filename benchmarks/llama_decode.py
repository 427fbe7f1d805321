"""Decoding throughput of a Llama-style model of GPT-2 124M's size: flaxgpt vs transformers.

    python benchmarks/llama_decode.py --torch_python VENV/bin/python        # batch 1 and 8, 256 new tokens
    python benchmarks/llama_decode.py --new_tokens 8 --batch_sizes 1 --layers 2 --pause 1   # a smoke run

The Llama-style model has GPT-2 124M's shape (12 layers, width 768, 12 heads, vocabulary 50257,
tied head, context 1024) with RoPE, RMSNorm, no biases and a SwiGLU MLP of hidden size 2048 (three
768 x 2048 matrices: GPT-2's MLP parameter count), and 12 (multi-head) or fewer (grouped-query)
key/value heads. GPT-2 itself runs on the same shapes so the two paths compare per parameter
(tokens/s x parameters); the KV cache bytes show what grouped-query attention saves. Weights, timing,
the harness and the table: benchmarks/decode_bench.py.
"""

from __future__ import annotations

import argparse

import decode_bench  # first: it imports harness (the benchmarks' one sys.path rule)


def models(a: argparse.Namespace) -> list[str]:
    return ["gpt2", *(f"llama-style J={j}" for j in a.n_kv_heads.split(","))]


def hf_config(a: argparse.Namespace, name: str):
    import transformers

    if name == "gpt2":
        return transformers.GPT2Config(n_layer=a.layers)
    return transformers.LlamaConfig(
        vocab_size=50257, hidden_size=768, intermediate_size=2048, num_hidden_layers=a.layers,
        num_attention_heads=12, num_key_value_heads=int(name.rpartition("=")[2]),
        max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n_kv_heads", default="12,4", help="key/value heads of the Llama-style runs")


if __name__ == "__main__":
    decode_bench.main(
        __doc__, models, hf_config, add_flags, new_tokens=256, repeats=1, layers=12,
        describe=lambda a: f"GPT-2 124M's shape, {a.layers} layers",
    )  # fmt: skip
