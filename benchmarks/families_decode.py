"""Decoding throughput of Gemma-3-style and Qwen3-style models of GPT-2 124M's size: flaxgpt vs transformers.

    python benchmarks/families_decode.py --torch_python VENV/bin/python   # batch 1 and 8, 256 new tokens
    python benchmarks/families_decode.py --new_tokens 16 --layers 2 --pause 1   # a smoke run

Both models have GPT-2 124M's size (12 layers, width 768, vocabulary 50257, tied head, context 1024,
an MLP of hidden size 2048 with three matrices: GPT-2's MLP parameter count) and their family's
architecture: Gemma 3 text (GeGLU, (1 + w) RMSNorms also after each branch, QK-norm, scaled
embeddings, 4 query heads of 256 sharing 1 key/value head, logits scaled by 1/sqrt(256), five
sliding-window layers of window 128 then one global, rotary bases 10k local / 1M global) and Qwen3
(SwiGLU, QK-norm, 6 query heads of 128, 2 key/value heads). The window is shrunk with the model so
that a 16 + 256-token generation passes it: flaxgpt's window layers keep rings of 128 positions,
transformers' their sliding-window cache. Weights, timing, the harness and the table:
benchmarks/decode_bench.py.
"""

from __future__ import annotations

import argparse

import decode_bench  # first: it imports harness (the benchmarks' one sys.path rule)

MODELS = ["gemma3-style", "qwen3-style"]


def hf_config(a: argparse.Namespace, name: str):
    import transformers

    shared = dict(
        vocab_size=50257, hidden_size=768, intermediate_size=2048, num_hidden_layers=a.layers,
        max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
        pad_token_id=0,
    )  # fmt: skip
    if name == "gemma3-style":
        return transformers.Gemma3TextConfig(
            **shared, num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
            sliding_window=128,
        )  # fmt: skip
    return transformers.Qwen3Config(**shared, num_attention_heads=6, num_key_value_heads=2, head_dim=128)


if __name__ == "__main__":
    decode_bench.main(
        __doc__, lambda a: MODELS, hf_config, new_tokens=256, repeats=1, layers=12,
        describe=lambda a: f"GPT-2 124M's size, {a.layers} layers",
    )  # fmt: skip
