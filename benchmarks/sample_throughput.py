"""Decoding throughput and quality: flaxgpt (float32, bf16 and int8 weights, speculative) vs
transformers' GPT2LMHeadModel.generate under the newest torch.

    python benchmarks/sample_throughput.py --torch_python /path/to/venv/bin/python   # the comparison
    python benchmarks/sample_throughput.py --batch_sizes 1 --modes fp32 --new_tokens 8 --repeats 1 --pause 1

GPT-2 124M config, random weights, greedy, a 16-token prompt, KV cache on both sides. Each side runs
in its own process through benchmarks/harness.py (the order alternates every round, --pause seconds
of rest before each run, at least 4 rounds: PyTorch's idle OpenMP workers spin after a run and slow
what follows); the transformers side runs with --torch_python (a venv with the torch / transformers
to compare against; default this interpreter). Times include the prefill and exclude compilation /
warm-up; each round's tok/s is the median of --repeats runs, and the table the median over rounds.

Also printed (from the first round):
- quality of bf16 / int8 weights against float32 on the same random GPT-2: max logit deviation
  (absolute, and relative to the largest |logit|) and greedy-token agreement over 4 x 64
  teacher-forced positions, and how many tokens greedy generation follows float32 exactly;
- memory-bandwidth utilisation at batch 1: weight bytes read per token (every matrix and the
  embedding table; wpe, of which a step reads one row, left out) / time per token / this
  machine's read bandwidth, measured here (np.max over 1 GiB on 1 and 2 threads, the best);
- speculative decoding with an int8 copy of the model as its own draft: acceptance and speed-up.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import threading
import time

import harness  # noqa: E402  (first: the benchmarks' one sys.path rule, see harness.py)
import numpy as np
from decode_bench import row, timed_generate

PROMPT_LEN = 16


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s read from memory: np.max over 1 GiB (SIMD, memory-bound; NumPy releases the GIL) on
    1 thread and on one per core, the best of `repeats`."""
    x = np.ones(int(gib * 2**30) // 4, np.float32)
    best = float("inf")
    for n_threads in sorted({1, os.cpu_count() or 1}):
        parts = np.array_split(x, n_threads)
        for _ in range(repeats):
            threads = [threading.Thread(target=np.max, args=(p,)) for p in parts]
            t0 = time.perf_counter()
            [t.start() for t in threads]
            [t.join() for t in threads]
            best = min(best, time.perf_counter() - t0)
    return x.nbytes / best


# ---------------------------------------------------------------- the transformers side


def hf_side(batches, n_new, repeats) -> dict:
    import torch
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).eval()
    rs = np.random.RandomState(0)
    out = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
    }
    for B in batches:
        prompt_BP = rs.randint(0, 50257, (B, PROMPT_LEN))
        out[f"b{B}"], _ = harness.hf_generate(model, prompt_BP, n_new, repeats, pad_token_id=50256)
    return out


# ---------------------------------------------------------------- the flaxgpt side


def quality(cfg, params, modes, step_of):
    """Logit deviation, teacher-forced greedy agreement and generated-prefix agreement vs float32."""
    import jax
    import jax.numpy as jnp

    from flaxgpt.models.cache import KVCache

    rs = np.random.RandomState(1)
    tokens = jnp.asarray(rs.randint(0, cfg.vocab_size, (4, 64)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(64), (4, 64))
    rows = {}
    ref = None
    for mode in ["fp32", *modes]:
        c, step = step_of(mode)
        logits, _ = jax.jit(step)(tokens, positions, KVCache.for_config(c, 4, 64))
        logits = np.asarray(logits)
        if ref is None:
            ref = logits
            continue
        dev = np.abs(logits - ref).max()
        rows[mode] = dict(
            max_dev=float(dev),
            rel_dev=float(dev / np.abs(ref).max()),
            agree=float(np.mean(logits.argmax(-1) == ref.argmax(-1))),
        )
    return rows


def speculative_run(cfg, params, step_of, n_new, repeats, k=4):
    import jax

    from flaxgpt.decode import sampling
    from flaxgpt.decode.speculative import speculative_generate
    from flaxgpt.models.cache import KVCache

    _, target = step_of("fp32")
    dcfg, draft = step_of("int8")
    prompt = np.random.RandomState(2).randint(0, cfg.vocab_size, (1, PROMPT_LEN)).astype(np.int32)
    W = sampling.cache_length(cfg.block_size, PROMPT_LEN, n_new + k + 1)

    def run(n):
        t0 = time.perf_counter()
        caches = KVCache.for_config(cfg, 1, W), KVCache.for_config(dcfg, 1, W)
        toks, lens, stats = speculative_generate(
            target, caches[0], draft, caches[1], prompt, [PROMPT_LEN],
            max_new_tokens=n, rng=jax.random.key(0), draft_tokens=k, temperature=0,
        )  # fmt: skip
        return time.perf_counter() - t0, toks, stats

    run(2)
    runs = [run(n_new) for _ in range(repeats)]
    dt = float(np.median([r[0] for r in runs]))
    plain, _ = sampling.generate(
        target, KVCache.for_config(cfg, 1, W), prompt, [PROMPT_LEN], max_new_tokens=n_new,
        rng=jax.random.key(0), temperature=0,
    )  # fmt: skip
    return dict(tok_s=n_new / dt, stats=runs[-1][2], same=bool((runs[-1][1] == plain).all()), k=k)


def flax_side(a, extras: bool) -> dict:
    """tok/s per "mode bB"; with `extras` (the first round) also weight bytes, quality and speculative."""
    import jax

    from flaxgpt.models import quantize
    from flaxgpt.models.gpt import GPTConfig, init_params, quantize_params, step_fn

    cfg = GPTConfig.gpt2()
    params = init_params(cfg, jax.random.key(0))
    steps = {"fp32": (cfg, step_fn(cfg, params))}

    def step_of(mode):
        if mode not in steps:
            qc, qp = quantize_params(cfg, params, mode)
            steps[mode] = (qc, step_fn(qc, qp), qp)
        return steps[mode][:2]

    modes = [m for m in a.modes.split(",") if m]
    batches = [int(b) for b in a.batch_sizes.split(",")]
    rs = np.random.RandomState(0)
    prompts = {B: rs.randint(0, cfg.vocab_size, (B, PROMPT_LEN)).astype(np.int32) for B in batches}
    out, first_rows = {"jax": jax.__version__}, {}
    for mode in modes:
        c, step = step_of(mode)
        for B in batches:
            warm, tok_s, toks = timed_generate(step, c, prompts[B], a.new_tokens, a.repeats)
            out[f"{mode} b{B}"], out[f"{mode} b{B} compile"] = tok_s, warm
            first_rows[mode, B] = np.asarray(toks)[0]
    if not extras:
        return out
    wpe = params["wpe"]["embedding"].nbytes
    out["weight_bytes"] = {"fp32": quantize.weight_bytes(params) - wpe}
    for mode in modes:
        if mode != "fp32":
            out["weight_bytes"][mode] = quantize.weight_bytes(steps[mode][2]) - wpe
    if "fp32" in modes:
        out["quality"] = quality(cfg, params, [m for m in modes if m != "fp32"], step_of)
        for mode in out["quality"]:
            if ("fp32", 1) in first_rows and (mode, 1) in first_rows:
                same = first_rows["fp32", 1] == first_rows[mode, 1]
                out["quality"][mode]["same_prefix"] = [int(np.argmin(np.append(same, False))), len(same)]
    if a.speculative:
        spec = speculative_run(cfg, params, step_of, a.new_tokens, a.repeats)
        st = spec.pop("stats")
        out["speculative"] = {**spec, "acceptance": float(st.acceptance), "rounds": int(st.rounds)}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--batch_sizes", default="1,8")
    p.add_argument(
        "--modes", default="fp32,bf16,int8", help="flaxgpt weight formats (fp32, bf16, int8, int4)"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed runs per side and round (their median)")
    p.add_argument("--torch_python", default=sys.executable, help="the interpreter for the transformers side")
    p.add_argument("--skip_hf", action="store_true")
    p.add_argument("--no_speculative", dest="speculative", action="store_false")
    harness.add_arguments(p)
    p.add_argument("--side", choices=["flaxgpt", "hf"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--extras", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    batches = [int(b) for b in a.batch_sizes.split(",")]
    if a.side == "hf":
        return harness.print_result(hf_side(batches, a.new_tokens, a.repeats))
    if a.side == "flaxgpt":
        return harness.print_result(flax_side(a, a.extras))

    load = os.getloadavg()
    bandwidth = read_bandwidth()
    common = ["--batch_sizes", a.batch_sizes, "--new_tokens", str(a.new_tokens), "--repeats", str(a.repeats)]
    common += ["--modes", a.modes] + ([] if a.speculative else ["--no_speculative"])
    flax_argv = lambda r: [sys.executable, __file__, *common, "--side", "flaxgpt"] + ["--extras"] * (r == 0)  # noqa: E731
    sides = [harness.Side("flaxgpt", flax_argv)]
    if not a.skip_hf:
        sides.append(harness.Side("transformers", [a.torch_python, __file__, *common, "--side", "hf"]))
    modes = [m for m in a.modes.split(",") if m]
    figures = [
        harness.Figure(
            f"decoding GPT-2 124M, batch {B}, flaxgpt {m} vs float32 (tok/s)",
            "flaxgpt",
            f"{m} b{B}",
            "transformers",
            f"b{B}",
        )
        for m in modes
        for B in batches
        if not a.skip_hf
    ]
    report = harness.compare(sides, figures, rounds=a.rounds, pause=a.pause)
    first = report.results[0]["flaxgpt"]

    def median(key):
        return float(np.median(report.values("flaxgpt", key)))

    print(
        f"\nGPT-2 124M, random weights, greedy, prompt {PROMPT_LEN}, {a.new_tokens} new tokens, "
        f"median of {a.repeats} per round; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, "
        f"load average before {load[0]:.2f}, after {os.getloadavg()[0]:.2f}"
    )
    print(
        f"measured read bandwidth {bandwidth / 1e9:.1f} GB/s; compile s (round 1): "
        + ", ".join(f"{m} b{B} {first[f'{m} b{B} compile']:.1f}" for m in modes for B in batches)
    )
    print("\n" + report.table())
    print("\nbatch 1: weight bytes read per token / time per token (median over rounds) / measured bandwidth")
    row("flaxgpt weights", "MB/token", "ms/token", "GB/s", "of peak", widths=(26, 12, 12, 10, 12))
    for mode, nbytes in first["weight_bytes"].items():
        if 1 in batches:
            tok_s = median(f"{mode} b1")
            gbs = nbytes * tok_s / 1e9
            cells = f"{nbytes / 1e6:.0f}", f"{1000 / tok_s:.1f}", f"{gbs:.1f}", f"{gbs * 1e9 / bandwidth:.0%}"
            row(mode, *cells, widths=(26, 12, 12, 10, 12))
    if first.get("quality"):
        print("\nquality vs float32 (4 x 64 teacher-forced positions of the same random GPT-2)")
        row("flaxgpt weights", "max |dlogit|", "relative", "argmax =", widths=(26, 14, 12, 12))
        for mode, q in first["quality"].items():
            row(
                mode,
                f"{q['max_dev']:.4f}",
                f"{q['rel_dev']:.2%}",
                f"{q['agree']:.1%}",
                widths=(26, 14, 12, 12),
            )
            if "same_prefix" in q:
                n_same, n = q["same_prefix"]
                print(f"{mode}: greedy generation equals float32's for the first {n_same} of {n} tokens")
    if first.get("speculative"):
        sp = first["speculative"]
        base = first.get("fp32 b1", float("nan"))
        print(
            f"\nspeculative, batch 1 (round 1): float32 target, its int8 copy drafting {sp['k']} tokens: "
            f"{sp['tok_s']:.1f} tok/s ({sp['tok_s'] / base:.2f}x float32 plain decoding, same process), "
            f"{sp['acceptance']:.1%} of drafted tokens accepted, {a.new_tokens / max(sp['rounds'], 1):.2f} "
            f"tokens per target call; output identical to plain greedy: {sp['same']}"
        )


if __name__ == "__main__":
    main()
