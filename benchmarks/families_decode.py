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
transformers' their sliding-window cache. Random weights are made once by transformers and saved as
Hugging Face directories which both sides load (flaxgpt through flaxgpt.hf), float32, greedy, a
16-token prompt; prefill included, compilation excluded (as benchmarks/llama_decode.py). Each side
runs in its own process through benchmarks/harness.py (the order alternating every round, --pause
seconds of rest before each run, at least 4 rounds); the transformers side under --torch_python.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import harness  # noqa: E402  (first: the benchmarks' one sys.path rule, see harness.py)
import numpy as np
from sample_throughput import row  # noqa: E402

MODELS = ("gemma3-style", "qwen3-style")
PROMPT_LEN = 16


def hf_config(name: str, layers: int):
    import transformers

    shared = dict(
        vocab_size=50257, hidden_size=768, intermediate_size=2048, num_hidden_layers=layers,
        max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
        pad_token_id=0,
    )  # fmt: skip
    if name == "gemma3-style":
        return transformers.Gemma3TextConfig(
            **shared, num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
            sliding_window=128,
        )  # fmt: skip
    return transformers.Qwen3Config(**shared, num_attention_heads=6, num_key_value_heads=2, head_dim=128)


def save_side(a):
    """The two models' random weights as Hugging Face directories under a.model_dir."""
    import torch
    import transformers

    classes = {"gemma3-style": transformers.Gemma3ForCausalLM, "qwen3-style": transformers.Qwen3ForCausalLM}
    for name in MODELS:
        torch.manual_seed(0)
        classes[name](hf_config(name, a.layers)).save_pretrained(os.path.join(a.model_dir, name))
    return {}


def prompts(batches):
    rs = np.random.RandomState(0)
    return {B: rs.randint(0, 50257, (B, PROMPT_LEN)).astype(np.int32) for B in batches}


def flax_side(a, batches):
    import jax

    from flaxgpt.decode import sampling
    from flaxgpt.hf import pretrained as hf
    from flaxgpt.models import gpt
    from flaxgpt.models.cache import KVCache
    from flaxgpt.models.gpt import count_params

    out = {}
    for name in MODELS:
        cfg, params = hf.load_pretrained(os.path.join(a.model_dir, name))
        W = sampling.cache_length(cfg.block_size, PROMPT_LEN, a.new_tokens)
        step = gpt.step_fn(cfg, params)
        for B, prompt in prompts(batches).items():

            def run(n, B=B, prompt=prompt, step=step, cfg=cfg, W=W):
                t0 = time.perf_counter()
                _, lens = sampling.generate(
                    step, KVCache.for_config(cfg, B, W), prompt, np.full(B, PROMPT_LEN), max_new_tokens=n,
                    rng=jax.random.key(0), temperature=0,
                )  # fmt: skip
                assert (lens == n).all(), lens
                return time.perf_counter() - t0

            warm = run(2)
            tok_s = B * a.new_tokens / float(np.median([run(a.new_tokens) for _ in range(a.repeats)]))
            kv_mib = (
                sum(x.nbytes for x in jax.tree_util.tree_leaves(KVCache.for_config(cfg, 1, 1024))) / 2**20
            )
            for field, v in dict(params=count_params(params), mib=kv_mib, tok_s=tok_s, warm=warm).items():
                out[f"{name} b{B} {field}"] = v  # flat: the harness compares one key per figure
    return out


def hf_side(a, batches):
    import torch
    import transformers

    out = {"versions": f"transformers {transformers.__version__}, torch {torch.__version__}"}
    out["threads"] = torch.get_num_threads()
    for name in MODELS:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.join(a.model_dir, name), dtype=torch.float32
        ).eval()
        for B, prompt in prompts(batches).items():
            out[f"{name} b{B}"], _ = harness.hf_generate(model, prompt, a.new_tokens, a.repeats)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--batch_sizes", default="1,8")
    p.add_argument("--layers", type=int, default=12, help="transformer blocks (12: GPT-2 124M's)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per side and round (their median)")
    p.add_argument("--torch_python", default=sys.executable, help="interpreter for the transformers side")
    harness.add_arguments(p)
    p.add_argument("--side", choices=["flaxgpt", "hf", "save"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--model_dir", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    batches = [int(b) for b in a.batch_sizes.split(",")]
    if a.side:
        side = {"flaxgpt": flax_side, "hf": hf_side, "save": lambda a, _: save_side(a)}[a.side]
        return harness.print_result(side(a, batches))
    with tempfile.TemporaryDirectory() as model_dir:
        args = ["--new_tokens", str(a.new_tokens), "--batch_sizes", a.batch_sizes, "--layers", str(a.layers)]
        args += ["--repeats", str(a.repeats), "--model_dir", model_dir]
        harness.run_side(harness.Side("save", [a.torch_python, __file__, *args, "--side", "save"]), 0)
        sides = [
            harness.Side("flaxgpt", [sys.executable, __file__, *args, "--side", "flaxgpt"]),
            harness.Side("transformers", [a.torch_python, __file__, *args, "--side", "hf"]),
        ]
        keys = [f"{name} b{B}" for name in MODELS for B in batches]
        figures = [
            harness.Figure(f"decoding {k} (tok/s)", "flaxgpt", f"{k} tok_s", "transformers", k) for k in keys
        ]
        report = harness.compare(sides, figures, rounds=a.rounds, pause=a.pause)
    first = report.results[0]["flaxgpt"]
    print(
        f"\nrandom weights, float32, greedy, prompt {PROMPT_LEN}, {a.new_tokens} new tokens, {a.layers} "
        f"layers, median of {a.repeats} per round; {os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}\n"
    )
    print(report.table() + "\n")
    widths = (14, 6, 9, 10, 11)
    row("model", "batch", "params", "KV MiB/1k", "flax tok/s", widths=widths)
    for k in keys:
        name, B = k.rsplit(" b", 1)
        fx = float(np.median(report.values("flaxgpt", f"{k} tok_s")))
        row(
            name,
            B,
            f"{first[f'{k} params'] / 1e6:.1f}M",
            f"{first[f'{k} mib']:.1f}",
            f"{fx:.1f}",
            widths=widths,
        )
    compile_s = ", ".join(f"{k} {first[f'{k} warm']:.1f}" for k in keys)
    print("\nKV MiB/1k: flaxgpt's float32 KV cache for one 1024-token sequence (window layers: their ring)")
    print(f"compile s (round 1): {compile_s}")


if __name__ == "__main__":
    main()
