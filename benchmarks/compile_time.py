"""Compile time of the full train step (forward, backward, AdamW) against depth, with and without
scan_layers and remat. Nothing runs: `jit(train_step).lower(abstract state, abstract batch).compile()`.

A narrow model keeps this on a laptop CPU; compile time depends on the number of ops, not width.

    python benchmarks/compile_time.py                           # 12 and 48 layers, loop vs scan
    python benchmarks/compile_time.py --layers 12,24,48 --remat none,full --n_embd 256
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import harness  # noqa: E402, F401  (first: the benchmarks' one sys.path rule, see harness.py)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from configs import default  # noqa: E402
from flaxgpt.models import gpt  # noqa: E402
from flaxgpt.train import trainer  # noqa: E402
from flaxgpt.train.losses import cross_entropy  # noqa: E402
from flaxgpt.train.optim import make_optimizer  # noqa: E402


class SyntheticTask:
    """Just the language-model loss (lm_task.LMObjective's over a full policy): no dataset needed."""

    def __init__(self, config: gpt.GPTConfig):
        self.model = gpt.GPT(config)

    def loss(self, params, batch, rng, train: bool, frozen=None):
        logits_BTV = self.model.apply({"params": params}, batch["inputs"], deterministic=not train)
        return cross_entropy(logits_BTV, batch["targets"])


def compile_seconds(config: gpt.GPTConfig, batch_size: int) -> tuple[float, float]:
    """(trace + lower seconds, XLA compile seconds) of one train step."""
    tx, schedule = make_optimizer(default.get_config().optim, max_iters=600_000)
    step = trainer.make_train_step(SyntheticTask(config), tx, schedule, grad_accum=1)

    def init(rng):
        params = gpt.init_params(config, rng)
        return trainer.TrainState(step=jnp.int32(0), params=params, opt_state=tx.init(params), rng=rng)

    state = jax.eval_shape(init, jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((1, batch_size, config.block_size), jnp.int32)  # [grad_accum, B, T]
    batch = {"inputs": tokens, "targets": tokens}
    t0 = time.perf_counter()
    lowered = jax.jit(step, donate_argnums=0).lower(state, batch)
    t1 = time.perf_counter()
    lowered.compile()
    return t1 - t0, time.perf_counter() - t1


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="12,48")
    ap.add_argument("--scan", default="false,true", help="scan_layers values to try")
    ap.add_argument("--remat", default="none", help="remat policies to try: none,full,dots,dots_no_batch")
    ap.add_argument("--n_embd", type=int, default=128)
    ap.add_argument("--n_head", type=int, default=4)
    ap.add_argument("--block_size", type=int, default=64)
    ap.add_argument("--vocab_size", type=int, default=512)
    ap.add_argument("--batch_size", type=int, default=4)
    args = ap.parse_args()
    print(
        f"train step (fwd + bwd + AdamW) on {jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"n_embd {args.n_embd}, n_head {args.n_head}, T {args.block_size}, B {args.batch_size}"
    )
    print("| layers | scan_layers | remat | trace + lower (s) | compile (s) | total (s) |")
    print("| ---: | --- | --- | ---: | ---: | ---: |")
    for remat in args.remat.split(","):
        for n_layer in map(int, args.layers.split(",")):
            for scan in (s.strip().lower() == "true" for s in args.scan.split(",")):
                config = gpt.GPTConfig(
                    vocab_size=args.vocab_size,
                    block_size=args.block_size,
                    n_layer=n_layer,
                    n_head=args.n_head,
                    n_embd=args.n_embd,
                    scan_layers=scan,
                    remat=remat,
                )
                lower_s, compile_s = compile_seconds(config, args.batch_size)
                print(
                    f"| {n_layer} | {scan} | {remat} | {lower_s:.1f} | {compile_s:.1f} | "
                    f"{lower_s + compile_s:.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
