"""benchmarks/device_profile.py: a function's kernels, their time and the device's idle share, read from
JAX's profiler (on this CPU its XLA thunks; on a GPU the device plane, as a synthetic one here)."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.profiler import ProfileData

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # its `import harness`, as `python benchmarks/...` finds it
import device_profile as dp  # noqa: E402


def test_a_cpu_run_is_counted_by_op_for_its_module_only():
    @jax.jit
    def heavy_step(x):
        return jnp.tanh(x @ x).sum() + jnp.cos(x).max()

    @jax.jit
    def other(x):
        return x * 2

    x = jnp.ones((128, 128))
    heavy_step(x).block_until_ready(), other(x).block_until_ready()

    def run():
        for _ in range(3):
            heavy_step(x), other(x)
        return heavy_step(x)

    p = dp.profile(run, per=4, module="heavy_step")
    ops = {t["op"] for t in p["top"]}
    assert p["kernels_per"] >= 2 and ops and not any("multiply" in op for op in ops), p  # none of other's
    assert all(t["count_per"] == 1.0 for t in p["top"])  # each op of the step once a call
    assert 0 < p["busy_us_per"] <= p["sum_us_per"] + 0.1 and p["busy_us_per"] <= p["wall_us_per"]
    assert p["unattributed"] == 0
    line = dp.summary(p, step="a step")
    assert line.startswith(f"{p['kernels_per']} kernels a step, device busy {p['busy_us_per']} of ")
    assert dp.profile(run, per=4, module="no such module")["kernels_per"] == 0


def test_a_cpu_loop_counts_its_bodys_thunks_not_the_loop():
    """On a CPU the while thunk's event holds its body's: the body's ops are counted, the loop not."""

    @jax.jit
    def looped(x, n):
        return jax.lax.fori_loop(0, n, lambda i, y: jnp.tanh(y @ y), x)  # a trip count known at run time

    x = jnp.ones((64, 64)) / 64
    looped(x, 3).block_until_ready()
    p = dp.profile(lambda: looped(x, 3), per=1, module="looped")
    assert p["top"] and not any(dp.CONTROL.fullmatch(t["op"]) for t in p["top"]), p["top"]
    counts = {t["op"]: t["count_per"] for t in p["top"]}
    assert 3 in counts.values() and max(counts.values()) <= 4, counts  # the body's ops; the condition's n + 1


def test_a_cpu_run_after_libtpu_loaded_still_counts_the_cpu():
    """libtpu (loaded by an ahead-of-time TPU compile in the same process) adds an empty
    /device:CUSTOM plane to every trace: the CPU's thunks are still the ones counted."""
    pytest.importorskip("libtpu", reason="the TPU targets need libtpu: pip install 'jax[tpu]==<jax version>'")
    from flaxgpt.aot import targets

    targets.get("v5e-8").devices()  # libtpu's topology: loads the plugin in this process
    f = jax.jit(lambda x: jnp.tanh(x @ x))
    x = jnp.ones((64, 64))
    f(x).block_until_ready()
    assert dp.profile(lambda: f(x), per=1)["kernels_per"] >= 1


def test_busy_time_counts_overlapping_intervals_once():
    assert dp.busy_ns([]) == 0
    assert dp.busy_ns([(0, 10), (5, 10), (30, 5), (31, 2)]) == 15 + 5
    assert dp.busy_ns([(10, 5), (0, 100)]) == 100


GPU_PLANE = """
planes {
  id: 1
  name: "/device:GPU:0"
  lines {
    id: 1
    name: "Stream #7(Compute)"
    timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 2000000
             stats { metadata_id: 10 str_value: "fusion.1" }
             stats { metadata_id: 11 str_value: "jit__decode_chunk" } }
    events { metadata_id: 1 offset_ps: 4000000 duration_ps: 2000000
             stats { metadata_id: 10 str_value: "fusion.1" }
             stats { metadata_id: 11 str_value: "jit__decode_chunk" } }
    events { metadata_id: 2 offset_ps: 5000000 duration_ps: 3000000 }
    events { metadata_id: 3 offset_ps: 9000000 duration_ps: 1000000
             stats { metadata_id: 10 str_value: "fusion.9" }
             stats { metadata_id: 11 str_value: "jit__prefill" } }
  }
  event_metadata { key: 1 value { id: 1 name: "loop_add_fusion_1" } }
  event_metadata { key: 2 value { id: 2 name: "gemm_fusion_dot_2" } }
  event_metadata { key: 3 value { id: 3 name: "input_reduce_fusion" } }
  stat_metadata { key: 10 value { id: 10 name: "hlo_op" } }
  stat_metadata { key: 11 value { id: 11 name: "hlo_module" } }
}
planes { id: 2 name: "/host:CPU" }
planes {
  id: 3
  name: "/device:CUSTOM:Megascale Trace"
  lines { id: 1 name: "x" timestamp_ns: 0 events { metadata_id: 1 offset_ps: 0 duration_ps: 5 } }
  event_metadata { key: 1 value { id: 1 name: "not a kernel" } }
}
"""


def test_a_gpu_plane_gives_its_kernels_by_op_else_by_name():
    """The device plane's events, whatever their stats (a graph's kernel without its op keeps its
    name and counts as unattributed), of the module asked for; the host's events not counted, nor
    libtpu's CUSTOM plane's."""
    data = ProfileData.from_text_proto(GPU_PLANE)
    evs, unattributed = dp.events(data, "decode_chunk")
    # offsets in ps from the line's 1000 ns
    assert evs == [("fusion.1", 1000, 2000), ("fusion.1", 5000, 2000), ("gemm_fusion_dot_2", 6000, 3000)]
    assert unattributed == 1
    assert dp.busy_ns([(s, d) for _, s, d in evs]) == 2000 + 4000  # [1000, 3000) and [5000, 9000)
    assert len(dp.events(data)[0]) == 4  # every module
