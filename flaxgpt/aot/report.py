"""What a compiled program costs on its target: memory per device, the attention kernel, collectives,
compile time and a roofline bound, from `compiled.memory_analysis()`, `compiled.as_text()` (the
optimized HLO) and `compiled.cost_analysis()`.

    row = report.analyze(program, target)      # a Row; row.fits, row.total, row.collectives ...
    print(report.table([row, ...], target))

Collectives are counted in the program text: one inside a loop (scan over layers or micro-batches)
counts once, though it runs every iteration; bytes are the per-device result size of each.
FLOPs: XLA's cost analysis where the backend gives one (TPU; it includes rematerialized work), else
flaxgpt's own count (flaxgpt.models.flops.flops_per_token). The step-time lower bound is
max(FLOPs / peak, bytes / HBM bandwidth), bytes being XLA's "bytes accessed" but at least every
argument read and every output written once (decoding: the weights and the cache read per token); the
MFU ceiling is the model's FLOPs over that bound. For GPU and TPU targets the program is also costed
kernel by kernel (flaxgpt.aot.hlo_cost: loop trips counted, each kernel its own roofline): `kernels`
launched per call, the HBM bytes they move, and the sum of their bounds (`kernels >= ms`), which is
what a step of loops and memory-bound kernels is measured against.
"""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path

from flaxgpt.aot import hlo_cost

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_ARRAY = re.compile(r"\b(pred|[subf]\d+|bf16|f8e\w+|c64|c128)\[([\d,]*)\]")
_BITS = {"pred": 8, "bf16": 16, "c64": 64, "c128": 128}


@dataclasses.dataclass
class Row:
    program: str
    devices: int
    note: str = ""
    parameters: int = 0  # per device, bytes
    optimizer: int = 0
    arguments: int = 0  # every argument (parameters, optimizer state, batch, cache)
    temporary: int = 0
    output: int = 0
    aliased: int = 0  # outputs written into donated arguments
    code: int = 0
    total: int = 0  # arguments + temporaries + outputs not aliased + code
    memory: int = 0  # the target's per device
    error: str = ""  # the compiler's refusal (RESOURCE_EXHAUSTED)
    kernel: str = ""
    collectives: dict = dataclasses.field(default_factory=dict)  # kind -> (count, bytes)
    compile_s: float = 0.0
    flops: float = 0.0  # per device per call
    flops_source: str = ""  # xla | model
    bytes_accessed: float = 0.0  # per device per call (a lower bound; see the module docstring)
    model_flops: float = 0.0  # per device per call
    step_s: float = 0.0
    mfu_ceiling: float = 0.0
    kernels: int = 0  # launched per call (hlo_cost), loop trips counted
    hbm_bytes: float = 0.0  # moved by those kernels
    kernel_bound_s: float = 0.0  # the sum of each kernel's own roofline

    def fits(self, headroom: float = 0.0) -> bool:
        return not self.error and self.total <= (1 - headroom) * self.memory


def _array_bytes(text: str) -> list[int]:
    out = []
    for dtype, dims in _ARRAY.findall(text):
        bits = _BITS.get(dtype) or int(re.sub(r"\D", "", dtype.split("e")[0]) or 8)
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        out.append(n * bits // 8)
    return out


def collectives(hlo: str) -> dict:
    """{kind: (count, bytes per device)} of the collectives in an optimized HLO module's text.
    An async `-start` op's result tuple holds its operand and result: the largest is counted."""
    found = {}
    for line in hlo.splitlines():
        m = _OP.search(line)
        if not m:
            continue
        sizes = _array_bytes(m.group(1))
        nbytes = max(sizes, default=0) if m.group(3) else sum(sizes)
        count, total = found.get(m.group(2), (0, 0))
        found[m.group(2)] = (count + 1, total + nbytes)
    return found


def attention_kernel(hlo: str) -> str:
    """The attention implementation the compiled program contains."""
    if "__cudnn$fmha" in hlo:
        return "cudnn flash"
    if "tpu_custom_call" in hlo:  # Pallas on TPU compiles to Mosaic custom calls
        if "paged" in hlo:  # JAX's paged-attention kernel (flaxgpt.models.paged)
            return "pallas paged (mosaic)"
        names = set(re.findall(r'"?kernel_name"?\s*[:=]\s*\\?"?([\w.]+)', hlo))
        splash = any("splash" in n or "flash" in n for n in names) or "splash" in hlo
        return "pallas splash" if splash else "pallas (mosaic)"
    if "__gpu$xla.gpu.triton" in hlo:
        return "pallas paged (triton)" if "paged_attention" in hlo else "pallas (triton)"
    return "xla"


def _cost(compiled) -> tuple[float, float]:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # some backends raise instead of returning None
        return 0.0, 0.0
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else None
    if not cost:
        return 0.0, 0.0
    return float(cost.get("flops", 0.0) or 0.0), float(cost.get("bytes accessed", 0.0) or 0.0)


def analyze(program, target, dump: str | Path | None = None) -> Row:
    """Compile `program` for `target` and measure it; a compiler that runs out of memory is a Row
    with `error` set (it does not fit); a kernel that does not lower for the target (a Pallas kernel's
    refusal: NotImplementedError, ValueError) is a Row with `error` "does not compile: ...", so the
    other programs' figures still print; any other failure propagates."""
    row = Row(program.name, program.devices, program.note, memory=int(target.memory))
    row.parameters = program.state_bytes.get("parameters", 0)
    row.optimizer = program.state_bytes.get("optimizer", 0)
    row.model_flops = program.model_flops / program.devices
    t0 = time.perf_counter()
    try:
        compiled = program.trace().lower().compile()
    except Exception as e:
        row.compile_s = time.perf_counter() - t0
        text = str(e)
        if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():  # does not fit
            lines = [line.strip() for line in text.splitlines() if line.strip()]
            row.error = next((line for line in lines if "RESOURCE_EXHAUSTED" in line), lines[0])[:300]
            row.temporary, available = _exhausted(text)
            row.total = row.temporary + row.parameters + row.optimizer  # at least
            row.memory = available or row.memory  # what the compiler had: the HBM less its reserve
        elif isinstance(e, NotImplementedError | ValueError):  # a kernel the target cannot lower
            first = (text.strip().splitlines() or [""])[0]
            row.error = f"does not compile: {type(e).__name__}: {first[:240]}"
        else:
            raise
        return row
    row.compile_s = time.perf_counter() - t0
    m = compiled.memory_analysis()
    row.arguments, row.temporary = m.argument_size_in_bytes, m.temp_size_in_bytes
    row.output, row.aliased, row.code = (
        m.output_size_in_bytes,
        m.alias_size_in_bytes,
        m.generated_code_size_in_bytes,
    )
    row.total = row.arguments + row.temporary + row.output - row.aliased + row.code
    hlo = compiled.as_text()
    if dump:
        Path(dump).mkdir(parents=True, exist_ok=True)
        (Path(dump) / f"{program.name}.{target.name}.hlo.txt").write_text(hlo)
    row.kernel = attention_kernel(hlo)
    row.collectives = collectives(hlo)
    xla_flops, xla_bytes = _cost(compiled)
    # at least: every argument read and every output written once, and what the program says it must read
    row.bytes_accessed = max(xla_bytes, row.arguments + row.output, getattr(program, "min_bytes", 0.0))
    # XLA's count where it has one and it is not lower than the model's (a count that missed loop trips)
    row.flops, row.flops_source = (
        (xla_flops, "xla") if xla_flops >= row.model_flops else (row.model_flops, "model")
    )
    if target.peak_flops:
        compute = row.flops / target.peak_flops
        memory_time = row.bytes_accessed / target.bandwidth if target.bandwidth else 0.0
        row.step_s = max(compute, memory_time)
        row.mfu_ceiling = (row.model_flops / target.peak_flops) / row.step_s if row.step_s else 0.0
        if target.bandwidth:
            cost = hlo_cost.estimate(hlo, target.peak_flops, target.bandwidth)
            row.kernels, row.hbm_bytes, row.kernel_bound_s = cost.kernels, cost.hbm_bytes, cost.bound_s
    return row


def grpo_budget(rows: list[Row], separate: bool = False) -> Row | None:
    """GRPO's train step and its rollouts on one device's memory (None without both programs).

    The trainer keeps its serving engine between rollouts (train.grpo_rollout), so while the train
    step runs, device 0 also holds the engine's slots (its cache and row state: rollout.generate's
    arguments less the weights); while the engine decodes, it also holds what the train step keeps
    between steps (its arguments less the weights the engine reads: optimizer state, reference
    weights, the batch). On one device the engine reads the training weights themselves; over several
    it reads a copy placed by SERVE_RULES over the same devices (LoRA's base kept; full fine-tuning's
    parameters placed at each rollout), so they count in full. `separate` (grpo.engine_devices): the
    engine on devices of its own holds rollout.generate alone, the trainer's the train step and the
    copy of the trained parameters the next rollout starts from (grpo_async); nothing is shared."""
    by = {r.program: r for r in rows}
    train, gen = by.get("train"), by.get("rollout.generate")
    if train is None or gen is None:
        return None
    refused = next((r for r in (train, gen) if r.error.startswith("does not compile")), None)
    if refused is not None:  # no figures to add up
        name = "grpo (train | rollouts)" if separate else "grpo (train + rollouts)"
        note = f"not added up: {refused.program} does not compile"
        return Row(name, train.devices, note, error=refused.error)
    if separate:
        trainer_side = train.total + train.parameters
        return Row(
            "grpo (train | rollouts)", train.devices + gen.devices,
            f"separate devices: the trainer's {train.devices} hold the train step + the trained parameters' "
            f"copy ({gb(trainer_side)} GB), the engine's {gen.devices} rollout.generate ({gb(gen.total)} GB)",
            parameters=train.parameters, optimizer=train.optimizer, total=max(trainer_side, gen.total),
            memory=min(train.memory, gen.memory), error=train.error or gen.error, kernel=gen.kernel,
        )  # fmt: skip
    shared = gen.parameters if train.devices == 1 else 0
    engine_kept = gen.arguments - shared
    train_kept = max(0, train.arguments - shared)
    while_training, while_decoding = train.total + engine_kept, gen.total + train_kept
    return Row(
        "grpo (train + rollouts)", train.devices,
        f"the larger of the train step + the engine's kept slots{'' if shared else ' and weights'} "
        f"({gb(while_training)} GB) "
        f"and rollout.generate + the train step's kept state ({gb(while_decoding)} GB)",
        parameters=train.parameters, optimizer=train.optimizer, total=max(while_training, while_decoding),
        memory=min(train.memory, gen.memory), error=train.error or gen.error, kernel=gen.kernel,
    )  # fmt: skip


_EXHAUSTED = re.compile(r"\(([\d.]+)([KMGT])\)\s*exceeds available HBM\s*\(([\d.]+)([KMGT])\)")


def _exhausted(message: str) -> tuple[int, int]:
    """(bytes required, bytes available) from the TPU compiler's RESOURCE_EXHAUSTED message
    ("... HLO temporaries (49.15G) exceeds available HBM (15.75G)"), else (0, 0)."""
    m = _EXHAUSTED.search(message)
    if not m:
        return 0, 0
    unit = lambda u: 1024 ** (1 + "KMGT".index(u))  # noqa: E731
    return int(float(m.group(1)) * unit(m.group(2))), int(float(m.group(3)) * unit(m.group(4)))


def pct(x: float) -> str:
    """A percentage with two significant digits below 10% (decoding's ceilings are fractions of one)."""
    return f"{x:.0%}" if x >= 0.1 else f"{100 * x:.2g}%"


def gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def collectives_text(found: dict) -> str:
    if not found:
        return "none"
    return ", ".join(
        f"{k} {c} ({gb(b) if b >= 1e7 else f'{b / 1e6:.1f}M'}B)" for k, (c, b) in sorted(found.items())
    )


def table(rows: list[Row], target, headroom: float = 0.0) -> str:
    """A plain-text table, one line per program, the figures per device."""
    head = ("program", "params GB", "opt GB", "temp GB", "total GB", "memory GB", "fits",
            "kernel", "compile s", "TFLOP", "step >= ms", "MFU ceiling", "kernels", "HBM GB",
            "kernels >= ms")  # fmt: skip
    lines = [head]
    for r in rows:
        refused = "does not compile" if r.error.startswith("does not compile") else "compiler: out of memory"
        fits = "yes" if r.fits(headroom) else ("NO: " + (refused if r.error else "too big"))
        lines.append((
            r.program, gb(r.parameters), gb(r.optimizer), gb(r.temporary), gb(r.total),
            f"{gb(r.memory)} ({(r.memory - r.total) / 1e9:+.2f})", fits, r.kernel or "-",
            f"{r.compile_s:.1f}",
            f"{r.flops / 1e12:.3g} ({r.flops_source})" if r.flops else "-",
            f"{r.step_s * 1e3:.3g}" if r.step_s else "-",
            pct(r.mfu_ceiling) if r.mfu_ceiling else "-",
            f"{r.kernels:,}" if r.kernels else "-",
            f"{r.hbm_bytes / 1e9:.4g}" if r.kernels else "-",
            f"{r.kernel_bound_s * 1e3:.4g}" if r.kernels else "-",
        ))  # fmt: skip
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    out = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    for r in rows:
        out.append(f"{r.program}: {r.note}; collectives: {collectives_text(r.collectives)}")
        if r.error:
            out.append(f"{r.program}: {r.error}")
    return "\n".join(out)
