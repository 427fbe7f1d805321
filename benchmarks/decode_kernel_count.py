"""Kernels a greedy decoding token launches, compiled for one H100 on this machine (no GPU needed).

    python benchmarks/decode_kernel_count.py                      # GPT-2 124M and the Llama-3-8B shape
    python benchmarks/decode_kernel_count.py --models gpt2 --modes off,on --weights float,rows

For each model, weight layout (float: flax's [K, N] in bf16, as sample.py decodes float weights at
--dtype bfloat16; rows: `--quantize bf16`'s [N, K], the lease's "bf16" rows) and FLAXGPT_DECODE_KERNELS
mode (off: XLA's path; attention: the attention kernel alone; on: every decode kernel,
docs/accelerators.md's "Kernel switches"), sample.py's decode program at batch 1, greedy (`max_k` 0:
no filter or draw, as gpu_lease.py's decode parts), compiled for `flaxgpt aot`'s h100-1 target
(flaxgpt.aot.programs.greedy_token); its token loop (the while body) costed by flaxgpt.aot.hlo_cost,
each conditional by its smallest branch (what a greedy row runs): kernels a token, the Pallas calls
among them, the cost model's HBM bytes and bound at 3.35 TB/s. Compiled, not measured: the launches a
lease's tokens/s divide into. Needs the CUDA plugin (`pip install "jax[cuda12]"`) for the target, not
a GPU.
"""

from __future__ import annotations

import argparse
import os

import harness

MODELS = {  # name: GPTConfig.preset arguments (the lease's decode parts' shapes)
    "gpt2": ("gpt2", dict(pad_vocab_multiple=64)),
    "llama8b": ("llama-3-8b", dict(block_size=1024)),
}
MODES = ("off", "attention", "on")
# weights: flax's [K, N] in bf16 (sample.py's float weights, param_dtype bfloat16), or `--quantize bf16`'s
# rows [N, K] (the lease's "bf16" rows)
WEIGHTS = {"float": None, "rows": "bf16"}


def count(model: str, mode: str, weights: str) -> dict:
    import jax

    from flaxgpt.aot import programs, targets
    from flaxgpt.models.gpt import GPTConfig

    os.environ["FLAXGPT_DECODE_KERNELS"] = mode  # read when the step is traced
    jax.clear_caches()  # the same config traced in another mode must not be reused
    preset, kw = MODELS[model]
    mc = GPTConfig.preset(preset, dtype="bfloat16", param_dtype="bfloat16", **kw)
    token = programs.greedy_token(mc, targets.get("h100-1"), quantize=WEIGHTS[weights])
    pallas = sum(k.count for k in token.by_kernel if k.name.startswith("pallas_call"))
    return dict(model=model, weights=weights, mode=mode, layers=mc.n_layer, kernels=token.kernels,
                pallas=pallas, hbm_mb=round(token.hbm_bytes / 1e6),
                bound_us=round(token.bound_s * 1e6, 1))  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated FLAXGPT_DECODE_KERNELS modes")
    ap.add_argument("--weights", default="float", help=f"comma-separated, of {', '.join(WEIGHTS)}")
    a = ap.parse_args(argv)
    models, modes, weights = a.models.split(","), a.modes.split(","), a.weights.split(",")
    bad = [m for m in models if m not in MODELS] + [m for m in modes if m not in MODES]
    bad += [w for w in weights if w not in WEIGHTS]
    if bad:
        raise SystemExit(
            f"error: unknown {bad}: models are {', '.join(MODELS)}, modes {', '.join(MODES)}, "
            f"weights {', '.join(WEIGHTS)}"
        )
    try:
        import jax_cuda12_plugin  # noqa: F401
    except ImportError:
        raise SystemExit(
            'error: compiling for h100-1 needs the CUDA plugin: pip install "jax[cuda12]"'
        ) from None
    rows = [count(m, mode, w) for m in models for w in weights for mode in modes]
    cols = ("model", "weights", "mode", "layers", "kernels", "pallas", "hbm_mb", "bound_us")
    print(harness.markdown(rows, cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
