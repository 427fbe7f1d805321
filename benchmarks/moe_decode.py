"""Decoding a tiny Mixtral-shaped mixture of experts: flaxgpt vs transformers' generate.

    python benchmarks/moe_decode.py --rounds 4 --pause 20            # batch 1 and 8, 128 new tokens
    python benchmarks/moe_decode.py --new_tokens 8 --layers 1 --rounds 4 --pause 0   # a smoke run

The model is Mixtral's architecture at a size a CPU decodes in seconds: 4 layers, width 512, 8 query
heads of 64 sharing 2 key/value heads (Mixtral's 4:1), 8 experts of hidden size 1792 (Mixtral's
3.5 x width) each token through its top 2, vocabulary 32000 (Mixtral's), untied head, RoPE, RMSNorm.
Random weights are made once by transformers (`MixtralForCausalLM`) and saved as a Hugging Face
directory which both sides load (flaxgpt through flaxgpt.hf's Mixtral import); float32, greedy, a
16-token prompt; prefill included, compilation excluded (as benchmarks/families_decode.py). flaxgpt
decodes with `sampling.generate` (prefill, then a jitted loop of one-token steps); transformers with
`generate` under its default experts implementation (reported). Each side runs in its own process
through benchmarks/harness.py (the order alternating every round, --pause seconds of rest before each
run, at least 4 rounds); the transformers side under --torch_python.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import harness  # noqa: E402  (first: the benchmarks' one sys.path rule, see harness.py)
import numpy as np

PROMPT_LEN = 16
VOCAB = 32000


def hf_config(a):
    import transformers

    return transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=a.width, intermediate_size=a.expert_hidden,
        num_hidden_layers=a.layers, num_attention_heads=a.width // 64,
        num_key_value_heads=max(1, a.width // 256), num_local_experts=a.experts, num_experts_per_tok=2,
        max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=0,
    )  # fmt: skip


def save_side(a):
    """The model's random weights as a Hugging Face directory, a.model_dir."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(hf_config(a))
    model.save_pretrained(a.model_dir)
    return {"params": sum(p.numel() for p in model.parameters())}


def prompts(batches):
    rs = np.random.RandomState(0)
    return {B: rs.randint(0, VOCAB, (B, PROMPT_LEN)).astype(np.int32) for B in batches}


def flax_side(a, batches):
    import jax

    from flaxgpt.decode import sampling
    from flaxgpt.hf import pretrained as hf
    from flaxgpt.models import gpt
    from flaxgpt.models.cache import KVCache

    cfg, params = hf.load_pretrained(a.model_dir)
    W = sampling.cache_length(cfg.block_size, PROMPT_LEN, a.new_tokens)
    step = gpt.step_fn(cfg, params)
    out = {}
    for B, prompt in prompts(batches).items():

        def run(n, B=B, prompt=prompt):
            t0 = time.perf_counter()
            toks, lens = sampling.generate(
                step, KVCache.for_config(cfg, B, W), prompt, np.full(B, PROMPT_LEN), max_new_tokens=n,
                rng=jax.random.key(0), temperature=0,
            )  # fmt: skip
            assert (lens == n).all(), lens
            return time.perf_counter() - t0, np.asarray(toks)

        out[f"b{B} warm"] = run(2)[0]
        times, toks = zip(*[run(a.new_tokens) for _ in range(a.repeats)])
        out[f"b{B}"] = B * a.new_tokens / float(np.median(times))
        out[f"b{B} first"] = [int(t) for t in toks[0][0, : a.new_tokens][:8]]  # greedy tokens: equal to hf's
    return out


def hf_side(a, batches):
    import torch
    import transformers

    model = transformers.MixtralForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32).eval()
    out = {"threads": torch.get_num_threads(), "experts": str(model.config._experts_implementation)}
    for B, prompt in prompts(batches).items():
        out[f"b{B}"], gen = harness.hf_generate(model, prompt, a.new_tokens, a.repeats)
        out[f"b{B} first"] = [int(t) for t in gen[0, PROMPT_LEN : PROMPT_LEN + 8]]
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--batch_sizes", default="1,8")
    p.add_argument("--layers", type=int, default=4, help="decoder layers, every one sparse")
    p.add_argument("--width", type=int, default=512, help="width (heads of 64, width/256 KV heads)")
    p.add_argument("--experts", type=int, default=8, help="experts per layer (each token through 2)")
    p.add_argument("--expert_hidden", type=int, default=1792, help="each expert's hidden size")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per side and round (their median)")
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
        args = [f"--{k}={getattr(a, k)}" for k in ("new_tokens", "batch_sizes", "layers", "width", "experts")]
        args += [f"--expert_hidden={a.expert_hidden}", f"--repeats={a.repeats}", f"--model_dir={model_dir}"]
        saved = harness.run_side(harness.Side("save", [a.torch_python, __file__, *args, "--side", "save"]), 0)
        sides = [
            harness.Side("flaxgpt", [sys.executable, __file__, *args, "--side", "flaxgpt"]),
            harness.Side("transformers", [a.torch_python, __file__, *args, "--side", "hf"]),
        ]
        figures = [
            harness.Figure(f"decoding batch {B} (tok/s)", "flaxgpt", f"b{B}", "transformers", f"b{B}")
            for B in batches
        ]
        report = harness.compare(sides, figures, rounds=a.rounds, pause=a.pause)
    fx, hf = report.results[0]["flaxgpt"], report.results[0]["transformers"]
    print(
        f"\nMixtral-shaped, random weights ({saved['params'] / 1e6:.1f}M parameters: {a.layers} layers, "
        f"width {a.width}, {a.experts} experts of {a.expert_hidden}, top 2, vocabulary {VOCAB}), float32, "
        f"greedy, prompt {PROMPT_LEN}, {a.new_tokens} new tokens, median of {a.repeats} per round; "
        f"{os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}; transformers' experts implementation "
        f"{hf['experts']!r}, {hf['threads']} torch threads\n"
    )
    print(report.table() + "\n")
    for B in batches:
        same = fx[f"b{B} first"] == hf[f"b{B} first"]
        print(f"batch {B}: compile s (round 1) {fx[f'b{B} warm']:.1f}; first greedy tokens equal: {same}")


if __name__ == "__main__":
    main()
