"""Decoding a tiny Mixtral-shaped mixture of experts: flaxgpt vs transformers' generate.

    python benchmarks/moe_decode.py --rounds 4 --pause 20            # batch 1 and 8, 128 new tokens
    python benchmarks/moe_decode.py --new_tokens 8 --layers 1 --rounds 4 --pause 0   # a smoke run

The model is Mixtral's architecture at a size a CPU decodes in seconds: 4 layers, width 512, 8 query
heads of 64 sharing 2 key/value heads (Mixtral's 4:1), 8 experts of hidden size 1792 (Mixtral's
3.5 x width) each token through its top 2, vocabulary 32000 (Mixtral's), untied head, RoPE, RMSNorm.
flaxgpt loads it through flaxgpt.hf's Mixtral import and decodes with `sampling.generate` (prefill,
then a jitted loop of one-token steps); transformers with `generate` under its default experts
implementation (reported). Weights, timing, the harness and the table: benchmarks/decode_bench.py.
"""

from __future__ import annotations

import argparse

import decode_bench  # first: it imports harness (the benchmarks' one sys.path rule)

VOCAB = 32000


def hf_config(a: argparse.Namespace, name: str):
    import transformers

    return transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=a.width, intermediate_size=a.expert_hidden,
        num_hidden_layers=a.layers, num_attention_heads=a.width // 64,
        num_key_value_heads=max(1, a.width // 256), num_local_experts=a.experts, num_experts_per_tok=2,
        max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=0,
    )  # fmt: skip


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--width", type=int, default=512, help="width (heads of 64, width/256 KV heads)")
    p.add_argument("--experts", type=int, default=8, help="experts per layer (each token through 2)")
    p.add_argument("--expert_hidden", type=int, default=1792, help="each expert's hidden size")


if __name__ == "__main__":
    decode_bench.main(
        __doc__, lambda a: ["mixtral-style"], hf_config, add_flags, new_tokens=128, repeats=3, layers=4,
        describe=lambda a: (
            f"Mixtral-shaped ({a.layers} layers, width {a.width}, {a.experts} experts of {a.expert_hidden}, "
            f"top 2, vocabulary {VOCAB})"
        ),
    )  # fmt: skip
