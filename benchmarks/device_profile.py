"""What the device did while a function ran, from JAX's own profiler: its kernels, their time, the gaps.

    from device_profile import profile
    p = profile(lambda: decode(32), per=31, module="decode_chunk")  # 31 tokens in the token loop
    p["kernels_per"], p["busy_us_per"], p["wall_us_per"], p["top"]  # top: [{op, count_per, us_per, mean_us}]
    print(summary(p))   # "180.0 kernels a token, device busy 120.3 of 377.1 us (32%); ..."

Why: the leases timed tokens/s and divided by the compiled program's kernel count (2026-11-29: "~1.9 us
a launch", "the decode GEMVs ~5 us a call"), which cannot tell a slow kernel from a gap between
kernels. The profile can: `busy` is the union of the kernels' intervals on the device (so two streams'
overlap counts once), `wall` the function's time under the profiler, and what is neither is the
device waiting (launches, the host, a graph's node gaps). Each op's count and time a step say which
kernels take it.

Events: on GPUs and TPUs those of the device planes (/device:GPU:0 ...: kernels, copies; not libtpu's
/device:CUSTOM planes), on a CPU (no device plane with events) the
XLA thunks on the host's threads (the events with an `hlo_op` stat, but loops and conditionals, whose
events hold their bodies': how the tests check this on a CPU); grouped by their `hlo_op` stat, else
their name (a kernel the profiler could not tie to its op, as inside a CUDA graph); kept where their
`hlo_module` contains `module` (events without the stat are kept and counted as `unattributed`). The
xplane file is read with jax.profiler.ProfileData (jaxlib's own reader: no TensorBoard or xprof
needed) and deleted after.
"""

from __future__ import annotations

import glob
import re
import tempfile
import time
from collections.abc import Callable

# a CPU's control-flow thunks (a while loop, a conditional, a call), whose events hold their bodies' thunks
CONTROL = re.compile(r"(while|cond|conditional|call)(\.\d+)?")


def device_planes(data) -> list:
    """The accelerators' planes that hold events. libtpu, once loaded (an ahead-of-time TPU compile),
    adds a "/device:CUSTOM:Megascale Trace" plane of its own to every trace, empty on a CPU."""
    return [
        p for p in data.planes
        if p.name.startswith("/device:") and not p.name.startswith("/device:CUSTOM")
        and any(True for line in p.lines for _ in line.events)
    ]  # fmt: skip


def events(data, module: str = "") -> tuple[list[tuple[str, int, int]], int]:
    """([(op, start_ns, duration_ns)], unattributed) of `data` (a jax.profiler.ProfileData): the device
    planes' events, or where there are none the host's XLA thunks, of modules containing `module`."""
    devices = device_planes(data)
    planes = devices or [p for p in data.planes if p.name == "/host:CPU"]
    out, unattributed = [], 0
    for plane in planes:
        for line in plane.lines:
            for e in line.events:
                stats = dict(e.stats)
                if not devices and ("hlo_op" not in stats or CONTROL.match(str(stats["hlo_op"]))):
                    continue  # the host's own events (Python, PjRt, pools), and loops holding thunks
                if "hlo_module" not in stats:
                    unattributed += 1
                elif module not in str(stats["hlo_module"]):
                    continue
                out.append((str(stats.get("hlo_op", e.name)), int(e.start_ns), int(e.duration_ns)))
    return out, unattributed


def busy_ns(intervals: list[tuple[int, int]]) -> int:
    """The length of the union of [start, start + duration) intervals."""
    total, end = 0, None
    for start, duration in sorted(intervals):
        stop = start + duration
        if end is None or start >= end:
            total, end = total + duration, stop
        elif stop > end:
            total, end = total + stop - end, stop
    return total


def profile(fn: Callable[[], object], per: int, module: str = "", top: int = 25) -> dict:
    """Run fn() once under jax.profiler.trace -> the device's events a step (`per` steps in the run,
    e.g. tokens): counts, busy and summed kernel time, wall time, the `top` ops by time."""
    import jax
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            wall_s = time.perf_counter() - t0
        files = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        if not files:
            raise RuntimeError(f"jax.profiler.trace wrote no .xplane.pb under {d}")
        data = ProfileData.from_file(files[0])
        if jax.devices()[0].platform != "cpu" and not device_planes(data):  # never the host's as kernels
            raise RuntimeError("the trace holds no device events: can the profiler reach the device (CUPTI)?")
        evs, unattributed = events(data, module)
    by_op: dict[str, list[int]] = {}
    for op, _, dur in evs:
        by_op.setdefault(op, []).append(dur)
    ops = sorted(by_op.items(), key=lambda kv: -sum(kv[1]))
    return dict(
        per=per,
        kernels_per=round(len(evs) / per, 1),
        busy_us_per=round(busy_ns([(s, d) for _, s, d in evs]) / per / 1e3, 1),
        sum_us_per=round(sum(d for _, _, d in evs) / per / 1e3, 1),
        wall_us_per=round(wall_s / per * 1e6, 1),
        unattributed=unattributed,
        top=[
            dict(
                op=op,
                count_per=round(len(ds) / per, 2),
                us_per=round(sum(ds) / per / 1e3, 2),
                mean_us=round(sum(ds) / len(ds) / 1e3, 2),
            )
            for op, ds in ops[:top]
        ],  # fmt: skip
    )


def summary(p: dict, ops: int = 5, step: str = "a token", timed_us: float | None = None) -> str:
    """One line: kernels and device time a step against its wall time under the profiler (or
    `timed_us`, the step timed without it: the profiler may slow the host, or run a CUDA graph's
    kernels one by one), then the heaviest ops."""
    wall = timed_us or p["wall_us_per"]
    share = p["busy_us_per"] / wall if wall else 0
    against = f"the timed {wall}" if timed_us else f"{wall}"
    heavy = ", ".join(f"{t['op']} {t['mean_us']} us x {t['count_per']}" for t in p["top"][:ops])
    return (f"{p['kernels_per']} kernels {step}, device busy {p['busy_us_per']} of {against} us "
            f"({share:.0%}); {heavy}")  # fmt: skip
