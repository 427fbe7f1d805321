"""GRPO's engine rollouts (train.grpo_rollout.EngineRollouts.sample) of this checkout against another
commit's, the same model, prompts and settings, alternating (benchmarks/harness.py).

    git worktree add ../old d9de538
    python benchmarks/rollout_ab.py --against ../old            # 4 rounds
    python benchmarks/rollout_ab.py --against ../old --quick    # a smoke run

A random Llama-style GPT (--layers x --dim, float32, vocabulary 512), --prompts prompts of 24 tokens x
--group completions of --completion tokens each (temperature 1; EOS off, so every completion runs its
length), --slots slots; a round times --calls sample() calls after one untimed (compiles) and reports
their median (wall and CPU seconds of the process). The other side runs DIR/benchmarks/rollout_ab.py
(this file, copied there) so that its harness puts DIR's flaxgpt on the path. Figure: seconds a
rollout (> 1: this checkout is faster).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

import harness  # noqa: E402  (first: the benchmarks' one sys.path rule, see harness.py)


def run_side(a) -> dict:
    import jax

    from flaxgpt.decode.sampling import Sampling
    from flaxgpt.models.gpt import LLAMA_STYLE, GPTConfig, init_params
    from flaxgpt.train.grpo_rollout import EngineRollouts

    W = 24 + a.completion
    cfg = GPTConfig(
        **LLAMA_STYLE, vocab_size=512, block_size=W, n_layer=a.layers, n_head=a.dim // 64,
        n_kv_head=max(1, a.dim // 128), n_embd=a.dim, mlp_hidden=4 * a.dim,
    )  # fmt: skip
    params = init_params(cfg, jax.random.key(0))
    rng = jax.random.key(1)
    prompts = jax.random.randint(rng, (a.prompts, 24), 3, 512).tolist()
    rollouts = EngineRollouts(
        cfg, Sampling(temperature=1.0), max_new_tokens=a.completion, slots=a.slots, max_len=W
    )
    times, cpu = [], []
    for call in range(a.calls + 1):
        t, c = time.perf_counter(), time.process_time()
        _, out = rollouts.sample(params, prompts, a.group, seed=call)
        if call:
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
    assert all(len(o) == a.completion for o in out), [len(o) for o in out]
    return {
        "rollout_s": statistics.median(times), "rollout_cpu_s": statistics.median(cpu),
        "tokens": a.prompts * a.group * a.completion,
    }  # fmt: skip


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", required=False, help="another checkout (a git worktree)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--completion", type=int, default=64)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--side", action="store_true", help=argparse.SUPPRESS)
    harness.add_arguments(p)
    a = p.parse_args(argv)
    if a.quick:
        a.layers, a.dim, a.prompts, a.group, a.completion, a.slots, a.calls = 2, 128, 2, 4, 16, 8, 1
    if a.side:
        return harness.print_result(run_side(a))
    if not a.against:
        p.error("--against DIR (another checkout) is required")
    args = [x for x in (argv if argv is not None else sys.argv[1:])]
    other = Path(a.against) / "benchmarks" / Path(__file__).name
    shutil.copy(__file__, other)
    sides = [
        harness.Side(f"rollouts of {a.against}", [sys.executable, str(other), *args, "--side"]),
        harness.Side("rollouts (this checkout)", [sys.executable, __file__, *args, "--side"]),
    ]
    figures = [
        harness.Figure(
            "rollout s (lower: > 1x)", sides[1].name, "rollout_s", sides[0].name, "rollout_s",
            higher_is_better=False,
        ),
        harness.Figure(  # CPU seconds of the process: steadier than wall time on a shared machine
            "rollout CPU s (lower: > 1x)", sides[1].name, "rollout_cpu_s", sides[0].name, "rollout_cpu_s",
            higher_is_better=False,
        ),
    ]  # fmt: skip
    report = harness.compare(sides, figures, rounds=a.rounds, pause=a.pause)
    print(report.table())


if __name__ == "__main__":
    main()
