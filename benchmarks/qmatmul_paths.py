"""Why flaxgpt has its own CPU kernel for int8 / bf16 weights: each way of multiplying by GPT-2's
weight matrices with compact weights, timed on XLA:CPU.

    python benchmarks/qmatmul_paths.py

For each GPT-2 124M shape (c_fc [768, 3072], mlp c_proj [3072, 768], the LM head [768, 50304])
and 1 or 8 rows of activations: float32 x @ w; bf16 weights in an XLA dot (activations cast to
bf16); int8 weights converted to float32, then an XLA dot; qwix's weight-only int8 (qwix.quantize
with per-channel scales, qwix.dot_general); and flaxgpt.kernels.qmatmul (the jax.ffi kernel). Enough
distinct copies of each matrix are cycled that they do not fit in cache (~200 MB), as in decoding,
where every step reads every weight once. Milliseconds per call, the fastest of 6 passes.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from flaxgpt.kernels.qmatmul import qmatmul
from flaxgpt.models.quantize import quantize_rows

SHAPES = [(768, 3072), (3072, 768), (768, 50304)]
DIMS = (((1,), (0,)), ((), ()))


def best_ms(f, args_list, passes=6):
    jax.block_until_ready(f(*args_list[0]))  # compile
    times = []
    for _ in range(passes):
        for args in args_list:
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times.append(time.perf_counter() - t0)
    return 1000 * min(times)


def main():
    import qwix

    paths = {
        "f32 dot": (lambda w: jnp.asarray(w), jax.jit(lambda x, w: x @ w)),
        "bf16 XLA dot": (
            lambda w: jnp.asarray(w, jnp.bfloat16),
            jax.jit(lambda x, w: jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)),
        ),
        "int8 convert+dot": (
            lambda w: quantize_rows(w.T, "int8"),
            jax.jit(lambda x, q: x @ (q.w.astype(jnp.float32) * q.scale[:, None]).T),
        ),
        "qwix int8": (
            lambda w: qwix.quantize(jnp.asarray(w), jnp.int8, channelwise_axes=[1]),
            jax.jit(lambda x, w: qwix.dot_general(x, w, DIMS)),
        ),
        "flaxgpt int8 kernel": (
            lambda w: quantize_rows(w.T, "int8"),
            jax.jit(lambda x, q: qmatmul(x, q.w, q.scale)),
        ),
        "flaxgpt bf16 kernel": (
            lambda w: quantize_rows(w.T, "bf16"),
            jax.jit(lambda x, q: qmatmul(x, q.w, q.scale)),
        ),
    }
    rs = np.random.RandomState(0)
    load = os.getloadavg()[0]
    print(f"jax {jax.__version__}, qwix {qwix.__version__}, {os.cpu_count()} cores, load {load:.2f}")
    print(f"| shape [K, N] | rows | {' | '.join(paths)} |")
    print("|---|---:|" + "---:|" * len(paths))
    for K, N in SHAPES:
        copies = max(2, int(200e6 // (K * N * 4)))
        ws = [rs.randn(K, N).astype(np.float32) * 0.02 for _ in range(copies)]
        for B in (1, 8):
            x = jnp.asarray(rs.randn(B, K).astype(np.float32))
            cells = []
            for make, f in paths.values():
                weights = [make(w) for w in ws]
                cells.append(f"{best_ms(f, [(x, w) for w in weights]):.3f}")
                del weights
            print(f"| [{K}, {N}] | {B} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
