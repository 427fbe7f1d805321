"""Compile a recipe's programs for an accelerator it names, on this machine, and check they fit.

    flaxgpt aot --config configs/gpt2_124m.py --target v5e-8
    flaxgpt aot --config configs/gpt2_124m.py --config.grad_accum=32 --target h100-1
    flaxgpt aot --config configs/shakespeare_char.py --target v5e-1 --programs train,eval
    flaxgpt aot --config configs/finetune_llama.py ... --target v5e-8 --programs serve --serve_devices 8 \
        --quantize int8                      # the serving engine over 8 chips, int8 weights
    flaxgpt aot --list                       # the targets

Overrides are train.py's (`--config.section.key=value`, the recipe locked). For each program (train,
eval, sample = prefill + decode, serve = prefill + generate, rollout = GRPO's engine prefill +
generate) a progress line as it is compiled (`compiled train in N.N s`), then one line of the table,
figures per device: parameters, optimizer state, temporaries and the total against the target's
memory, the attention kernel, compile time, FLOPs, the roofline step-time bound and MFU ceiling; then
its collectives; with serve, the serve.py command that runs the compiled programs (`serve_command`).
Exit 1 when a program does not fit (with --headroom F: within (1 - F) of the memory). --dump DIR writes the
optimized HLO of each program. TPU targets need libtpu (`pip install "jax[tpu]==<jax version>"`),
GPU ones the CUDA plugin (`pip install "jax[cuda12]==<jax version>"`); no accelerator is needed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time

from flaxgpt import extras
from flaxgpt.aot import targets as targets_lib

# programs.GROUPS, named here too: flaxgpt.aot.programs imports jax, which must wait for the target
GROUPS = ("train", "eval", "sample", "serve", "rollout")  # rollout: GRPO recipes only
USAGE = "flaxgpt aot --config configs/<recipe>.py [--config.key=value ...] --target NAME"


def parse(argv):
    p = argparse.ArgumentParser(prog="flaxgpt aot", usage=USAGE, description=__doc__.splitlines()[0])
    p.add_argument("--target", help=f"one of {', '.join(targets_lib.TARGETS)}")
    p.add_argument(
        "--programs", default=",".join(GROUPS), help=f"comma-separated: {','.join(GROUPS)} (rollout: GRPO's)"
    )
    p.add_argument("--dump", default=None, help="write each program's optimized HLO here")
    p.add_argument("--slots", type=int, default=8, help="serve: the engine's slots")
    p.add_argument("--max_len", type=int, default=0, help="sample/serve: the cache window (0 = block_size)")
    p.add_argument("--quantize", default=None, help="sample/serve: weight-only (models/quantize.py MODES)")
    p.add_argument(
        "--serve_devices", type=int, default=1, help="serve: devices the engine runs over (weights fsdp)"
    )
    p.add_argument(
        "--speculative_tokens", type=int, default=0,
        help="serve: also the speculative step checking this many drafted tokens per slot (serve.speculate)",
    )  # fmt: skip
    p.add_argument("--vocab_size", type=int, default=0, help="when neither the recipe nor its data says")
    p.add_argument("--headroom", type=float, default=0.0, help="fraction of memory to keep free")
    p.add_argument("--list", action="store_true", help="print the targets and exit")
    args, rest = p.parse_known_args(argv)
    return args, rest


KEYS = "every key is listed in configs/default.py and flaxgpt/train/sections.py"


def load_config(rest: list[str]):
    """The recipe with train.py's overrides: ml_collections' config flag (locked), errors in one line."""
    from absl import flags
    from ml_collections import config_flags

    from flaxgpt.train.config_check import (
        ConfigError,
        check,
        ignored_model_override,
        load_recipe,
        unknown_override,
    )

    paths = [a.split("=", 1)[1] for a in rest if a.startswith("--config=")]
    paths += [rest[i + 1] for i, a in enumerate(rest[:-1]) if a == "--config"]
    if not paths:
        raise SystemExit(f"error: no --config recipe; usage: {USAGE}")
    unknown = [a for a in rest if not a.startswith("--config")]
    if unknown and unknown != [paths[-1]]:
        raise SystemExit(f"error: unexpected arguments {unknown}; usage: {USAGE}")
    try:
        recipe = load_recipe(paths[-1])  # a broken recipe: one line (ml_collections: a traceback)
        message = unknown_override(recipe, rest)  # across sections: did you mean optim.learning_rate?
        if message:
            raise SystemExit(f"error: {message} ({KEYS})")
        argv = ["flaxgpt aot", f"--config={paths[-1]}", *[a for a in rest if a.startswith("--config.")]]
        fv = flags.FlagValues()  # the overrides are found in sys_argv (ml_collections' default: sys.argv)
        config_flags.DEFINE_config_file(
            "config", None, "a recipe file", flag_values=fv, lock_config=True, sys_argv=argv
        )
        fv(argv)
        config = fv.config
        check(config)
        message = ignored_model_override(config, rest)
        if message:
            raise SystemExit(f"error: {message}")
    except (ConfigError, flags.Error, AttributeError, KeyError, ValueError, TypeError) as e:
        msg = " ".join(str(e).replace("\\n", " ").split())
        if len(msg) > 1 and msg[0] == msg[-1] and msg[0] in "'\"":  # repr-quoted by KeyError
            msg = msg[1:-1]
        if isinstance(e, AttributeError | KeyError):
            msg = f"unknown config key {msg} ({KEYS})"
        raise SystemExit(f"error: {msg}") from None
    return config, paths[-1]


@contextlib.contextmanager
def _no_persistent_cache(off: bool):
    """JAX's persistent compilation cache (JAX_COMPILATION_CACHE_DIR) off while `off`: it would keep a
    GPU topology's programs, compiled for devices this machine lacks, and fail to read them back on the
    next run, a warning a program ("PjRtCompiler must be constructed with a Client"); `run` compiles
    inside it (the command, benchmarks/aot_targets.py)."""
    import jax

    before = jax.config.jax_enable_compilation_cache
    if off:
        jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)


def run(config, target, groups=GROUPS, *, slots=8, max_len=0, vocab_size=0, quantize=None,
        serve_devices=1, dump=None, mc=None, print_fn=print, speculative_tokens=0):  # fmt: skip
    """Compile every program of `groups` for `target` -> (report rows, model config)."""
    devices = target.devices()  # first: the plugin's environment is set before jax starts it
    from flaxgpt.aot import programs as programs_lib
    from flaxgpt.aot import report
    from flaxgpt.models.quantize import check_mode

    if quantize is not None:
        try:
            check_mode(quantize)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None

    # the whole of it: JAX decides at a process's first compile whether it uses the persistent cache
    with _no_persistent_cache(target.platform == "cuda"):
        if mc is None:
            mc, source = programs_lib.model_config(config, vocab_size)
            print_fn(f"model: {source}")
        try:
            progs = programs_lib.build(
                config, devices, groups, mc=mc, slots=slots, max_len=max_len, quantize=quantize,
                serve_devices=serve_devices, speculative_tokens=speculative_tokens,
            )  # fmt: skip
        except ValueError as e:  # a mesh or batch that does not divide the target's devices
            raise SystemExit(f"error: {e} (target {target.name}: {len(devices)} devices)") from None
        rows = []
        for program in progs:  # one line as each compiles: a big model's programs take minutes together
            rows.append(report.analyze(program, target, dump))
            error = rows[-1].error
            failed = ""
            if error:  # the kernel's own words, or the compiler's long out-of-memory text in short
                failed = (
                    f" ({error})"
                    if error.startswith("does not compile")
                    else " (out of memory: does not fit)"
                )
            print_fn(f"compiled {program.name} in {rows[-1].compile_s:.1f} s{failed}")
    # a GRPO recipe: the train step and its engine on one device, or each on its own (grpo.engine_devices)
    separate = bool(config.get("grpo", {}).get("engine_devices", 0))
    budget = report.grpo_budget(rows, separate)
    return rows + ([budget] if budget else []), mc


def versions(platform: str) -> str:
    import importlib.metadata as md

    import jax

    out = [f"jax {jax.__version__}"]
    for dist in {"tpu": ("libtpu",), "cuda": ("jax-cuda12-plugin", "nvidia-cudnn-cu12")}.get(platform, ()):
        try:
            out.append(f"{dist} {md.version(dist)}")
        except md.PackageNotFoundError:
            pass
    return ", ".join(out)


def main(argv=None) -> int:
    args, rest = parse(sys.argv[1:] if argv is None else argv)
    if args.list:
        print(targets_table())
        return 0
    if not args.target:
        raise SystemExit(f"error: no --target; targets: {', '.join(targets_lib.TARGETS)}")
    target = targets_lib.get(args.target)
    if target.platform in extras.PLATFORM_EXTRAS:  # libtpu or the CUDA plugin, before the recipe loads
        extras.require(extras.PLATFORM_EXTRAS[target.platform], f"flaxgpt aot --target {target.name}")
    groups = tuple(g.strip() for g in args.programs.split(",") if g.strip())
    bad = [g for g in groups if g not in GROUPS]
    if bad or not groups:
        raise SystemExit(f"error: --programs {args.programs!r}: choose from {', '.join(GROUPS)}")
    if not 0 <= args.headroom < 1:
        raise SystemExit(f"error: --headroom {args.headroom} must be in [0, 1)")
    for flag, value, low in (("slots", args.slots, 1), ("max_len", args.max_len, 0)):
        if value < low:  # (a negative size was a reshape traceback, or accepted)
            raise SystemExit(
                f"error: --{flag} {value} must be >= {low}" + (" (0: block_size)" if low == 0 else "")
            )
    if args.speculative_tokens < 0:
        raise SystemExit(f"error: --speculative_tokens {args.speculative_tokens} must be >= 0 (0: off)")
    config, path = load_config(rest)
    t0 = time.perf_counter()
    rows, mc = run(config, target, groups, slots=args.slots, max_len=args.max_len, vocab_size=args.vocab_size,
                   quantize=args.quantize, serve_devices=args.serve_devices, dump=args.dump,
                   speculative_tokens=args.speculative_tokens,
                   print_fn=functools.partial(print, flush=True))  # fmt: skip
    from flaxgpt.aot import report

    print(
        f"{path} on {target.name} ({len(target.devices())} {target.kind} devices, {target.hosts} host(s), "
        f"{report.gb(target.memory)} GB each; {versions(target.platform)}); compiled, not measured, "
        f"in {time.perf_counter() - t0:.1f} s"
    )
    print(report.table(rows, target, args.headroom))
    if any(r.program.startswith("serve.") for r in rows):
        settings = dict(
            slots=args.slots,
            max_len=args.max_len,
            quantize=args.quantize,
            devices=args.serve_devices,
            speculative_tokens=args.speculative_tokens,
        )
        print(f"serve.py running these programs: {serve_command(config, mc, **settings)}")
    misfits = [r.program for r in rows if not r.fits(args.headroom)]
    if misfits:
        verb = "does" if len(misfits) == 1 else "do"
        print(f"error: {', '.join(misfits)} {verb} not fit {target.name}", file=sys.stderr)
        return 1
    return 0


def serve_command(
    config, mc, *, slots: int, max_len: int, quantize=None, devices: int = 1, speculative_tokens: int = 0
) -> str:
    """The serve.py command whose engine runs the serve programs compiled for these settings: the
    recipe's weights (init_from, or its run directory) in their dtype, the slots, window and prefill
    chunk (128: programs.serve_programs'), weight-only `quantize`, over `devices` (--mesh: the same
    data 1 x fsdp N mesh and SERVE_RULES)."""
    from flaxgpt import loader

    init_from = config.get("init_from", "auto")
    source = f"--out_dir {config.out_dir}" if init_from in loader.FRESH_STARTS else f"--init_from {init_from}"
    W = min(max_len or mc.block_size, mc.block_size)
    cmd = (
        f"python serve.py {source} --dtype {mc.param_dtype} --slots {slots} --max_len {W} --prefill_chunk 128"
    )
    cmd += f" --quantize {quantize}" if quantize else ""
    cmd += f" --speculative_ngram {speculative_tokens}" if speculative_tokens else ""
    return cmd + (f" --mesh {devices}" if devices > 1 else "")


def targets_table() -> str:
    lines = ["target    platform  topology    hosts  memory/device  peak bf16 TFLOP/s  HBM GB/s"]
    for t in targets_lib.TARGETS.values():
        lines.append(
            f"{t.name:<9} {t.platform:<9} {t.topology:<11} {t.hosts:<6} {t.memory / 1e9:>8.1f} GB "
            f"{t.peak_flops / 1e12:>15.0f}   {t.bandwidth / 1e9:>8.0f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
