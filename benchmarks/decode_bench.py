"""The decoding benchmarks' one scaffold: flaxgpt's `sampling.generate` against transformers' `generate`
on the same random weights, each side in its own process through benchmarks/harness.py.

    decode_bench.main(__doc__, models, hf_config, add_flags, new_tokens=256, repeats=1, layers=12,
                      describe=lambda a: "...")

A benchmark (llama_decode.py, families_decode.py, moe_decode.py) names its models (`models(args)`) and
gives each one's transformers config (`hf_config(args, name)`), plus flags of its own (`add_flags`).
The rest is here: transformers makes every model's random weights once (seed 0) and saves them as a
Hugging Face directory, which both sides load (flaxgpt through flaxgpt.hf); then in every round each
side decodes greedily, float32, --new_tokens tokens from the same --prompt_len-token prompts at every
batch size, prefill included and compilation excluded (a 2-token run first), the median of --repeats
runs; the order of the sides alternates every round, --pause seconds of rest before each run, at least
4 rounds; the transformers side under --torch_python (a venv with the torch / transformers to compare
against; default this interpreter).

Printed: the harness's table (flaxgpt's tok/s over transformers', per model and batch), then per model
and batch its parameters, the float32 KV cache of one 1024-token sequence (window layers: their ring),
flaxgpt's tok/s (median over rounds) and tok/s x parameters, whether the first greedy tokens of row 0
equal transformers', and round 1's compile seconds.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable

import harness  # noqa: E402  (first: the benchmarks' one sys.path rule, see harness.py)
import numpy as np

FIRST = 8  # greedy tokens of row 0 compared between the sides
SIDES = ("flaxgpt", "hf", "save")


def row(*cells, widths=(26, 12, 12, 10, 12, 12)):
    print("".join(f"{c:>{w}}" if i else f"{c:<{w}}" for i, (c, w) in enumerate(zip(cells, widths))))


def batch_sizes(a) -> list[int]:
    return [int(b) for b in a.batch_sizes.split(",")]


def prompts(a, vocab: int) -> dict[int, np.ndarray]:
    """batch size -> its prompts [B, prompt_len], the same on both sides."""
    rs = np.random.RandomState(0)
    return {B: rs.randint(0, vocab, (B, a.prompt_len)).astype(np.int32) for B in batch_sizes(a)}


def model_dir(a, name: str) -> str:
    return os.path.join(a.model_dir, name.replace(" ", "_"))


def timed_generate(step, cfg, prompt_BP, n_new: int, repeats: int):
    """flaxgpt's greedy decoding of n_new tokens a row -> (compile + 2 tokens seconds, median tok/s over
    `repeats` runs, the last run's tokens [B, n_new])."""
    import jax

    from flaxgpt.decode import sampling
    from flaxgpt.models.cache import KVCache

    B, P = prompt_BP.shape
    W = sampling.cache_length(cfg.block_size, P, n_new)

    def run(n):
        cache = KVCache.for_config(cfg, B, W)
        t0 = time.perf_counter()
        toks, lens = sampling.generate(
            step, cache, prompt_BP, np.full(B, P), max_new_tokens=n, rng=jax.random.key(0), temperature=0
        )
        assert (lens == n).all(), lens
        return time.perf_counter() - t0, toks

    warm, _ = run(2)
    runs = [run(n_new) for _ in range(repeats)]
    return warm, B * n_new / float(np.median([dt for dt, _ in runs])), runs[-1][1]


def save_side(a, names, hf_config) -> dict:
    import torch
    import transformers

    for name in names:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(hf_config(a, name))
        model.save_pretrained(model_dir(a, name))
    return {}


def flax_side(a, names) -> dict:
    import jax

    from flaxgpt.hf import pretrained as hf
    from flaxgpt.models import gpt
    from flaxgpt.models.cache import KVCache

    out = {}
    for name in names:
        cfg, params = hf.load_pretrained(model_dir(a, name))
        step = gpt.step_fn(cfg, params)
        mib = sum(x.nbytes for x in jax.tree.leaves(KVCache.for_config(cfg, 1, 1024))) / 2**20
        for B, prompt in prompts(a, cfg.vocab_size).items():
            warm, tok_s, toks = timed_generate(step, cfg, prompt, a.new_tokens, a.repeats)
            first = [int(t) for t in np.asarray(toks)[0, :FIRST]]
            figures = dict(params=gpt.count_params(params), mib=mib, tok_s=tok_s, warm=warm, first=first)
            for field, v in figures.items():
                out[f"{name} b{B} {field}"] = v  # flat: the harness compares one key per figure
        del params, step
    return out


def hf_side(a, names) -> dict:
    import torch
    import transformers

    out = {"versions": f"transformers {transformers.__version__}, torch {torch.__version__}"}
    out["threads"] = torch.get_num_threads()
    for name in names:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir(a, name), dtype=torch.float32)
        model.eval()
        c = model.config
        if getattr(c, "num_local_experts", 0) or getattr(c, "num_experts", 0):
            out["experts"] = str(getattr(c, "_experts_implementation", None))
        for B, prompt in prompts(a, c.vocab_size).items():
            out[f"{name} b{B}"], gen = harness.hf_generate(model, prompt, a.new_tokens, a.repeats)
            out[f"{name} b{B} first"] = [int(t) for t in gen[0, a.prompt_len : a.prompt_len + FIRST]]
    return out


def parser(doc: str, add_flags, new_tokens: int, repeats: int, layers: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt_len", type=int, default=16)
    p.add_argument("--new_tokens", type=int, default=new_tokens)
    p.add_argument("--batch_sizes", default="1,8")
    p.add_argument("--layers", type=int, default=layers, help=f"decoder layers (default {layers})")
    add_flags(p)
    p.add_argument("--repeats", type=int, default=repeats, help="timed runs a side and round (median)")
    p.add_argument("--torch_python", default=sys.executable, help="interpreter for the transformers side")
    harness.add_arguments(p)
    p.add_argument("--side", choices=SIDES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--model_dir", default=None, help=argparse.SUPPRESS)
    return p


def main(
    doc: str,
    models: Callable[[argparse.Namespace], list[str]],
    hf_config: Callable[[argparse.Namespace, str], object],
    add_flags: Callable[[argparse.ArgumentParser], None] = lambda p: None,
    *,
    new_tokens: int,
    repeats: int,
    layers: int,
    describe: Callable[[argparse.Namespace], str],
) -> None:
    a = parser(doc, add_flags, new_tokens, repeats, layers).parse_args()
    names = models(a)
    if a.side == "save":
        return harness.print_result(save_side(a, names, hf_config))
    if a.side:
        return harness.print_result((flax_side if a.side == "flaxgpt" else hf_side)(a, names))
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.argv[0], *sys.argv[1:], "--model_dir", tmp, "--side"]
        harness.run_side(harness.Side("save", [a.torch_python, *argv, "save"]), 0)
        sides = [
            harness.Side("flaxgpt", [sys.executable, *argv, "flaxgpt"]),
            harness.Side("transformers", [a.torch_python, *argv, "hf"]),
        ]
        keys = [f"{name} b{B}" for name in names for B in batch_sizes(a)]
        figures = [
            harness.Figure(f"decoding {k} (tok/s)", "flaxgpt", f"{k} tok_s", "transformers", k) for k in keys
        ]
        report = harness.compare(sides, figures, rounds=a.rounds, pause=a.pause)
    fx, hf = report.results[0]["flaxgpt"], report.results[0]["transformers"]
    experts = f"; transformers' experts implementation {hf['experts']!r}" if "experts" in hf else ""
    print(
        f"\n{describe(a)}: random weights, float32, greedy, prompt {a.prompt_len}, "
        f"{a.new_tokens} new tokens, median of {a.repeats} per round; {os.cpu_count()} cpus, "
        f"load {os.getloadavg()[0]:.2f}, {hf['threads']} torch threads{experts}\n"
    )
    print(report.table() + "\n")
    widths = (22, 6, 9, 10, 11, 13, 7, 10)
    columns = ("model", "batch", "params", "KV MiB/1k", "flax tok/s", "Mparam*tok/s", "same", "compile s")
    row(*columns, widths=widths)
    for k in keys:
        name, B = k.rsplit(" b", 1)
        n, tok_s = fx[f"{k} params"], float(np.median(report.values("flaxgpt", f"{k} tok_s")))
        same = "yes" if fx[f"{k} first"] == hf[f"{k} first"] else "no"
        cells = f"{n / 1e6:.1f}M", f"{fx[f'{k} mib']:.1f}", f"{tok_s:.1f}", f"{tok_s * n / 1e6:,.0f}"
        row(name, B, *cells, same, f"{fx[f'{k} warm']:.1f}", widths=widths)
    print(
        f"\nKV MiB/1k: flaxgpt's float32 KV cache of one 1024-token sequence (window layers: their ring); "
        f"same: row 0's first {FIRST} greedy tokens equal transformers' (round 1); compile s: flaxgpt's "
        "compile + 2 tokens (round 1)"
    )
