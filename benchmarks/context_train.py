"""Training over a mesh "context" axis on 8 simulated CPU devices: tokens/s and memory per device
against the sequence length, for context 1, 2, 4 and 8 (issue #53).

    python benchmarks/context_train.py                                  # 2k-64k x context 1, 2, 4, 8
    python benchmarks/context_train.py --lengths 8192 --contexts 1,8 --impl ulysses
    python benchmarks/context_train.py --lengths 256,512 --contexts 1,2 --steps 1   # a smoke run
    python benchmarks/context_train.py --lengths 32768,65536 --steps 0    # memory a device only

Each (length, context) pair runs in a process of its own (8 CPU devices, JAX_NUM_CPU_DEVICES): a
tiny GPT (2 layers, 64 wide, 4 heads, RoPE, float32) trains on one row of random tokens a step, its
tokens split over `context` devices (mesh data 1 x context c; context 1 is one device's XLA
attention over the whole row). The step is flaxgpt's own (train.steps.make_steps: AdamW, donation,
shardings), compiled ahead of being run: memory per device is `memory_analysis()` of the compiled
program (arguments + temporaries + outputs - donated), as `flaxgpt aot` counts it. Then `steps`
steps are timed after one untimed step: tokens/s = length x steps / seconds, and the process's CPU
time a step (all its device threads: what the step costs whatever share of the CPU other jobs leave
it, the figure the growth columns divide on a loaded machine).

A run is skipped, and says why in the table, when its compiled memory over the devices it uses is
more than --max_host_gb (the simulated devices share this host's RAM) or when it has not finished
in --timeout seconds (compile and steps; its memory is still shown if the compile finished, and
its untimed first step, a bound, if that finished); longer rows of that context are then only
compiled (memory a device, no steps).
Beside each row: the share of the step's model FLOPs that is attention (flaxgpt.models.flops:
12 L H K T per token of 6 N + 12 L H K T), and the step's CPU time and wall time over the shortest
length's, against the FLOPs over the shortest length's: "the step's time grows no worse than the
attention FLOPs do".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import harness  # noqa: F401  (first: the benchmarks' one sys.path rule, see harness.py)

DEVICES = 8


MODEL = dict(n_layer=2, n_head=4, n_embd=64, pos_embedding="rope", pad_vocab_multiple=8, dropout=0.0)
VOCAB = 256


def recipe(length: int, context: int, impl: str, steps: int):
    """The default recipe with the tiny model, one row a step over data 1 x context `context`."""
    from configs import default

    c = default.get_config()
    c.init_from, c.data.dir = "scratch", "/nonexistent"  # never read: the batches are made here
    c.model.update(MODEL, block_size=length, context_impl=impl, vocab_size=VOCAB)
    c.mesh.data, c.mesh.fsdp, c.mesh.context = 1, 1, context
    c.batch_size, c.grad_accum, c.max_iters = 1, 1, steps + 2  # the schedule decays after its warmup
    c.optim.warmup_steps = 1
    return c


def run_one(length: int, context: int, impl: str, steps: int, max_host_gb: float) -> None:
    """One (length, context) pair in this process: a JSON line after the compile, after the untimed
    step and after the timed ones (the parent keeps the last that came); steps 0: the compile only."""
    import jax
    import numpy as np

    from flaxgpt import sharding
    from flaxgpt.models import registry as models
    from flaxgpt.models.flops import flops_per_token
    from flaxgpt.train.steps import make_steps
    from flaxgpt.train.tasks import Task

    config = recipe(length, context, impl, steps)
    mc = models.config_from(config.model, VOCAB)
    devices = jax.devices()[:context]
    mesh = sharding.make_mesh(1, 1, devices, context=context)
    task = Task.abstract(config, mc)
    built = make_steps(config, task, mesh)
    state = jax.jit(built.init_state, out_shardings=built.state_shardings.replace(frozen=None))(
        jax.random.key(0)
    )
    state = state.replace(frozen=built.frozen)
    rng = np.random.default_rng(0)
    batch = {}
    for name, (shape, dtype) in task.batch_shapes(1).items():
        host = rng.integers(0, VOCAB, size=(1, *shape)).astype(dtype)
        batch[name] = jax.device_put(host, built.train_batch_sharding(host.ndim))
    t0 = time.perf_counter()
    compiled = built.train_step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    m = compiled.memory_analysis()
    per_device = m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
    per_device -= m.alias_size_in_bytes
    fpt = flops_per_token(mc, length)
    attn_share = 3 * 4 * mc.n_layer * mc.n_head * mc.head_dim * length / fpt["train"]
    out = dict(length=length, context=context, impl=impl, gb=per_device / 1e9, compile_s=compile_s,
               attn_share=attn_share, train_flops=fpt["train"] * length)  # fmt: skip
    print(json.dumps(out), flush=True)
    if per_device * context > max_host_gb * 1e9:
        out["skipped"] = f"needs {per_device * context / 1e9:.1f} GB of host RAM (> {max_host_gb:g})"
        print(json.dumps(out), flush=True)
        return
    if not steps:
        return
    t0 = time.perf_counter()
    state, metrics = compiled(state, batch)  # untimed: the first run's allocations
    jax.block_until_ready(metrics)
    out["first_step_s"] = time.perf_counter() - t0
    print(json.dumps(out), flush=True)
    t0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    seconds, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    out.update(step_s=seconds / steps, cpu_s=cpu_s / steps, tokens_s=length * steps / seconds)
    out["loss"] = float(metrics["loss"])
    print(json.dumps(out), flush=True)


def run_all(args) -> list[dict]:
    """Every pair in its own process, shortest first; each result line as it comes."""
    rows = []
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(DEVICES)}
    too_slow = {}  # context -> the length whose steps did not finish: longer ones are compiled only
    for length in args.lengths:
        for context in args.contexts:
            steps = 0 if context in too_slow else args.steps
            cmd = [sys.executable, __file__, "--one", f"{length},{context}", "--impl", args.impl,
                   "--steps", str(steps), "--max_host_gb", str(args.max_host_gb)]  # fmt: skip
            last = dict(length=length, context=context, impl=args.impl)
            try:
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
                lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
                if lines:
                    last = lines[-1]
                elif done.returncode:
                    error = [x for x in done.stderr.splitlines() if x.strip()][-1:]
                    last["skipped"] = f"failed: {error[0][:120] if error else done.returncode}"
            except subprocess.TimeoutExpired as e:
                stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
                lines = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
                last = lines[-1] if lines else last
                last["skipped"] = f"over {args.timeout:g} s (compile and steps)"
            if "step_s" not in last and "skipped" not in last:
                why = f"{too_slow[context]:,} tokens took over {args.timeout:g} s" if steps else "--steps 0"
                last["skipped"] = f"compiled only ({why})"
            if "over" in last.get("skipped", ""):
                too_slow[context] = length
            print(json.dumps(last), flush=True)
            rows.append(last)
    return rows


def table(rows: list[dict]) -> str:
    base = {}  # context -> the shortest measured length's (step_s, train FLOPs, cpu_s)
    lines = [
        "| tokens a row | context | memory a device (compiled) | tokens/s | step | CPU time a step | "
        "attention FLOPs | CPU time / shortest's | step / shortest's | FLOPs / shortest's |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        gb = f"{r['gb']:.3f} GB" if "gb" in r else "—"
        share = f"{r['attn_share']:.0%}" if "attn_share" in r else "—"
        cpu = "—"
        if "step_s" in r:
            b = base.setdefault(r["context"], (r["step_s"], r["train_flops"], r.get("cpu_s")))
            speed, step = f"{r['tokens_s']:,.0f}", f"{r['step_s']:.2f} s"
            cpu, cpu_growth = (f"{r['cpu_s']:.1f} s", f"{r['cpu_s'] / b[2]:.1f}x") if b[2] else ("—", "—")
            growth = cpu_growth, f"{r['step_s'] / b[0]:.1f}x", f"{r['train_flops'] / b[1]:.1f}x"
        else:
            speed, step, growth = f"skipped: {r.get('skipped', '?')}", "—", ("—", "—", "—")
            if "first_step_s" in r:  # the untimed step finished: a bound, not a measurement
                step = f"first {r['first_step_s']:.0f} s"
        lines.append(f"| {r['length']:,} | {r['context']} | {gb} | {speed} | {step} | {cpu} | {share} | "
                     f"{growth[0]} | {growth[1]} | {growth[2]} |")  # fmt: skip
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048,4096,8192,16384,32768,65536", help="tokens a row")
    ap.add_argument("--contexts", default="1,2,4,8", help="context axis sizes, comma-separated")
    ap.add_argument("--impl", default="ring", choices=("ring", "ulysses"), help="model.context_impl")
    ap.add_argument("--steps", type=int, default=1, help="timed steps after one untimed (0: compile only)")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds a pair may take in all")
    ap.add_argument("--max_host_gb", type=float, default=8.0, help="RAM the simulated devices may use")
    ap.add_argument(
        "--table", default="", help="files of earlier runs' JSON lines, comma-separated: their table only"
    )
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # length,context: a child process
    args = ap.parse_args()
    if args.table:  # the last line of each (length, context), shortest first
        rows = {}
        for name in args.table.split(","):
            for line in open(name):
                if line.startswith("{"):
                    r = json.loads(line)
                    rows[r["length"], r["context"]] = r
        return print(table(sorted(rows.values(), key=lambda r: (r["length"], r["context"]))))
    if args.one:
        length, context = map(int, args.one.split(","))
        return run_one(length, context, args.impl, args.steps, args.max_host_gb)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.contexts = [int(x) for x in args.contexts.split(",")]
    rows = run_all(args)
    print(table(rows))


if __name__ == "__main__":
    main()
