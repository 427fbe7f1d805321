"""A kernel-by-kernel cost of an optimized GPU/TPU program: what one call launches, moves and computes.

    cost = hlo_cost.estimate(compiled.as_text(), peak_flops=989e12, bandwidth=3.35e12)
    cost.kernels, cost.hbm_bytes, cost.matmul_flops, cost.bound_s, cost.top(5)
    token = hlo_cost.estimate(text, 989e12, 3.35e12, computation=body)  # one run of a loop's body

XLA's own cost analysis counts a while loop's body once, so a step built of loops (scan over layers,
micro-batches, a chunked loss) looks many times cheaper than it is; and a roofline over the whole step
(all FLOPs at peak, all bytes at full bandwidth) hides that memory-bound kernels and matmuls take turns.
Here every kernel the program launches is costed on its own, max(FLOPs / peak, bytes / bandwidth),
and multiplied by the trip counts of the loops around it (XLA's `known_trip_count`, or on TPUs, whose
programs lack it, the loop's own `counter < N` condition and start). Bytes are each
kernel's operands read once and its results written once, with two corrections that matter in loops:
a buffer updated in place (dynamic-update-slice) counts only the slice written, and an operand that a
kernel only slices counts only the slice read. A loop whose trip count XLA cannot know (decoding until
every row stops) counts once: its figures are per iteration. Matmul FLOPs come from each dot's shapes; cuDNN's
attention from its q/k/v shapes (causal: half the score matrix). It is a lower bound per kernel, not a
simulation: launch gaps, caches and overlap are not modelled (`launch_s` adds a fixed cost per kernel).
"""

from __future__ import annotations

import dataclasses
import math
import re

_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->\s*(.*)\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"\b(pred|[subf]\d+|bf16|f8e\w+|c64|c128)\[([\d,]*)\]")
_BITS = {"pred": 8, "bf16": 16, "c64": 64, "c128": 128}
_FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
    "replica-id", "opt-barrier", "add-dependency", "domain", "iota",
}  # fmt: skip
_ASYNC_DONE = ("-done", "-update")


def _bytes(type_text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(type_text):
        bits = _BITS.get(dtype) or int(re.sub(r"\D", "", dtype.split("e")[0]) or 8)
        total += math.prod(int(d) for d in filter(None, dims.split(","))) * bits // 8
    return total


def _dims(type_text: str) -> list[int]:
    m = _ARRAY.search(type_text)
    return [int(d) for d in filter(None, m.group(2).split(","))] if m else []


@dataclasses.dataclass
class Instr:
    name: str
    type: str
    op: str
    operands: list[str]
    attrs: str
    args: str = ""  # the text inside the parentheses (a parameter's index)


def _split_operands(rest: str) -> tuple[list[str], str, str]:
    """`%a, %b, /*index=5*/%c), attrs...` -> (['a', 'b', 'c'], 'attrs...', the text inside)."""
    depth, i = 1, 0
    while i < len(rest) and depth:
        depth += {"(": 1, ")": -1}.get(rest[i], 0)
        i += 1
    inside, attrs = rest[: i - 1], rest[i:]
    names = re.findall(r"%([\w.\-]+)", inside)
    return names, attrs, inside


def parse(hlo: str) -> tuple[dict, str]:
    """{computation name: [Instr]}, and the entry computation's name."""
    comps, entry, current = {}, "", None
    for line in hlo.splitlines():
        m = _COMP.match(line)
        if m and not line.startswith(" "):
            current = comps.setdefault(m.group(2), [])
            if m.group(1):
                entry = m.group(2)
            continue
        if current is None:
            continue
        m = _INSTR.match(line)
        if m:
            operands, attrs, inside = _split_operands(m.group(5))
            current.append(Instr(m.group(2), m.group(3), m.group(4), operands, attrs, inside))
    return comps, entry


@dataclasses.dataclass
class Kernel:
    name: str
    op: str
    count: int  # launches per call of the program
    bytes: float  # per launch
    flops: float  # per launch
    seconds: float  # per launch (its own roofline)


@dataclasses.dataclass
class Cost:
    kernels: int = 0  # launches per call
    hbm_bytes: float = 0.0
    matmul_flops: float = 0.0
    bound_s: float = 0.0  # sum over launches of max(flops / peak, bytes / bandwidth) + launch_s
    memory_bound_s: float = 0.0  # the part of bound_s spent in kernels limited by bytes
    by_kernel: list = dataclasses.field(default_factory=list)

    def top(self, n: int = 10) -> list[Kernel]:
        return sorted(self.by_kernel, key=lambda k: -k.count * k.seconds)[:n]


def _called(attrs: str, key: str) -> list[str]:
    m = re.search(key + r"=\{?([^},]+(?:,\s*%[\w.\-]+)*)\}?", attrs)
    return re.findall(r"%?([\w.\-]+)", m.group(1)) if m else []


def _trip_count(loop: Instr, comps: dict, caller: str) -> int:
    """A while loop's iterations: XLA's known_trip_count (GPU programs carry it), else read from the
    loop itself (TPU programs do not): a condition whose root is `counter < N` (N a constant) over a
    counter that starts at a constant, as JAX's scan and fori_loop build it (step 1, from 0 unless the
    start says otherwise). Anything else (decoding until every row stops) counts once."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', loop.attrs)
    if m:
        return int(m.group(1))
    cond = comps.get((_called(loop.attrs, "condition") or [""])[0], [])
    if not cond or cond[-1].op != "compare" or len(cond[-1].operands) != 2:
        return 1
    named = {i.name: i for i in cond}
    a, b = (named.get(name) for name in cond[-1].operands)
    direction = (re.search(r"direction=(\w+)", cond[-1].attrs) or [None, ""])[1]
    counter, limit = (a, b) if direction == "LT" else (b, a) if direction == "GT" else (None, None)
    if counter is None or counter.op != "get-tuple-element" or limit is None or limit.op != "constant":
        return 1
    index = int((re.search(r"index=(\d+)", counter.attrs) or [0, 0])[1])
    start = 0
    calling = {i.name: i for i in comps.get(caller, [])}
    init = calling.get(loop.operands[0]) if loop.operands else None
    if init is not None and init.op == "tuple" and index < len(init.operands):
        value = calling.get(init.operands[index])
        while value is not None and value.op in ("copy", "bitcast") and value.operands:
            value = calling.get(value.operands[0])
        start = _constant(value) if value is not None and value.op == "constant" else 0
    n = _constant(limit) - start
    return n if n > 0 else 1


def _constant(instr: Instr) -> int:
    try:
        return int(instr.args.strip())
    except ValueError:
        return 0


def _dot_flops(instr: Instr, types: dict) -> float:
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.attrs)
    if not m or not instr.operands:
        return 0.0
    lhs = _dims(types.get(instr.operands[0], ""))
    k = math.prod(lhs[int(d)] for d in filter(None, m.group(1).split(",")) if int(d) < len(lhs))
    return 2.0 * math.prod(_dims(instr.type)) * k


def _gemm_custom_call_flops(instr: Instr, types: dict) -> float:
    m = re.search(r'"lhs_contracting_dimensions":\["?([\d", ]*)"?\]', instr.attrs)
    if not m or not instr.operands:
        return 0.0
    lhs = _dims(types.get(instr.operands[0], ""))
    k = math.prod(lhs[int(d)] for d in re.findall(r"\d+", m.group(1)) if int(d) < len(lhs))
    return 2.0 * math.prod(_dims(instr.type)) * k


def _attention_flops(instr: Instr, types: dict) -> float:
    """cuDNN fused attention: q, k, v [B, T, H, D] (operand layouts as traced); forward 2 matmuls
    (QK^T, PV), backward 5 (recomputed QK^T, dV, dP, dQ, dK); causal masks half the scores."""
    q = _dims(types.get(instr.operands[0], "")) if instr.operands else []
    k = _dims(types.get(instr.operands[1], "")) if len(instr.operands) > 1 else []
    if len(q) != 4 or len(k) != 4:
        return 0.0
    B, T, H, D = q
    S = k[1]
    matmuls = 5 if "Backward" in instr.attrs else 2
    causal = 0.5 if "CAUSAL" in instr.attrs.upper() or "causal" in instr.attrs else 1.0
    return matmuls * 2.0 * B * H * T * S * D * causal


class _Model:
    def __init__(self, comps: dict):
        self.comps = comps
        self.types = {c: {i.name: i.type for i in instrs} for c, instrs in comps.items()}
        self._fused = {}

    def fused(self, comp: str) -> tuple[float, dict, int]:
        """A fused computation's (dot FLOPs, {parameter index: bytes actually read}, bytes of its
        results updated in place that are not written)."""
        if comp in self._fused:
            return self._fused[comp]
        instrs = self.comps.get(comp, [])
        types = self.types.get(comp, {})
        flops = sum(_dot_flops(i, types) for i in instrs if i.op == "dot")
        users = {}
        for i in instrs:
            for pos, o in enumerate(i.operands):
                users.setdefault(o, []).append((i, pos))
        reads, unwritten = {}, 0
        for i in instrs:
            if i.op != "parameter":
                continue
            index = int(i.args)
            use = users.get(i.name, [])
            if use and all(u.op in ("dynamic-slice", "slice", "gather") and pos == 0 for u, pos in use):
                reads[index] = sum(_bytes(u.type) for u, _ in use)
            elif use and all(u.op == "dynamic-update-slice" and pos == 0 for u, pos in use):
                reads[index] = 0  # updated in place: neither read nor rewritten whole
                updates = [_bytes(types.get(u.operands[1], "")) for u, _ in use if len(u.operands) > 1]
                unwritten += sum(_bytes(i.type) - n for n in updates)
        self._fused[comp] = (flops, reads, unwritten)
        return self._fused[comp]

    def kernel(self, comp: str, instr: Instr) -> tuple[float, float]:
        """(bytes, flops) of one launch of `instr` in computation `comp`."""
        types = self.types[comp]
        operand_bytes = [_bytes(types.get(o, "")) for o in instr.operands]
        out = _bytes(instr.type)
        flops = 0.0
        if instr.op == "fusion":
            called = _called(instr.attrs, "calls")
            if called:
                flops, reads, unwritten = self.fused(called[0])
                for index, n in reads.items():
                    if index < len(operand_bytes):
                        operand_bytes[index] = n
                out = max(0, out - unwritten)
        elif instr.op == "custom-call":
            if "__cudnn$fmha" in instr.attrs:
                flops = _attention_flops(instr, types)
            elif "gemm" in instr.attrs or "matmul" in instr.attrs:
                flops = _gemm_custom_call_flops(instr, types)
        elif instr.op == "dot":
            flops = _dot_flops(instr, types)
        elif instr.op == "dynamic-update-slice":  # in place: the update read and written
            upd = operand_bytes[1] if len(operand_bytes) > 1 else 0
            return 2.0 * upd, 0.0
        elif instr.op in ("dynamic-slice", "slice"):
            return 2.0 * out, 0.0
        return float(sum(operand_bytes) + out), flops


def loop_body(hlo: str) -> str:
    """The name of the body of the entry computation's one while loop (a decode call's token loop:
    `estimate(hlo, ..., computation=loop_body(hlo))` is a token's kernels)."""
    comps, entry = parse(hlo)
    bodies = [_called(i.attrs, "body") for i in comps[entry] if i.op == "while"]
    if len(bodies) != 1:
        raise ValueError(f"the entry computation has {len(bodies)} while loops, not one")
    return bodies[0][0]


def estimate(
    hlo: str,
    peak_flops: float,
    bandwidth: float,
    launch_s: float = 0.0,
    computation: str | None = None,
    branch=max,
) -> Cost:
    """The cost of one call of the program whose optimized HLO text is `hlo` (see the module doc), or
    of one run of its `computation` (a while loop's body: a decoding token's kernels). Each conditional
    counts as one of its branches, by instruction count: `branch=max`, the largest (an upper bound),
    or `min`, the smallest (a skip branch: what a token runs when no row needs the pass, e.g. greedy
    rows past the sampler's filter and draw)."""
    comps, entry = parse(hlo)
    model = _Model(comps)
    found: dict[tuple[str, str], Kernel] = {}

    def walk(comp: str, times: int, depth: int = 0) -> None:
        if depth > 20:
            return
        for instr in comps.get(comp, []):
            if instr.op in _FREE or instr.op.endswith(_ASYNC_DONE):
                continue
            if instr.op == "while":
                n = _trip_count(instr, comps, comp)
                for body in _called(instr.attrs, "body"):
                    walk(body, times * n, depth + 1)
                continue
            if instr.op == "conditional":
                branches = _called(instr.attrs, "branch_computations") or (
                    _called(instr.attrs, "true_computation") + _called(instr.attrs, "false_computation")
                )
                if branches:  # one branch runs: the largest (or smallest) stands for it
                    walk(branch(branches, key=lambda b: len(comps.get(b, []))), times, depth + 1)
                continue
            if instr.op in ("call", "async-start") or instr.op.endswith("-start") and "calls=" in instr.attrs:
                for c in _called(instr.attrs, "calls") or _called(instr.attrs, "to_apply"):
                    walk(c, times, depth + 1)
                if instr.op == "call":
                    continue
            nbytes, flops = model.kernel(comp, instr)
            key = (comp, instr.name)
            if key in found:
                found[key].count += times
            else:
                seconds = max(flops / peak_flops if peak_flops else 0.0, nbytes / bandwidth) + launch_s
                found[key] = Kernel(instr.name, instr.op, times, nbytes, flops, seconds)

    walk(computation or entry, 1)
    cost = Cost(by_kernel=list(found.values()))
    for k in cost.by_kernel:
        cost.kernels += k.count
        cost.hbm_bytes += k.count * k.bytes
        cost.matmul_flops += k.count * k.flops
        cost.bound_s += k.count * k.seconds
        if k.bytes / bandwidth >= (k.flops / peak_flops if peak_flops else 0.0):
            cost.memory_bound_s += k.count * k.seconds
    return cost
