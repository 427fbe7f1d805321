"""Named compile targets: an abstract device topology plus the per-device figures the report needs.

    target = targets.get("v5e-8")     # KeyError-free: an unknown name is a one-line error listing all
    devices = target.devices()        # abstract devices of the topology (libtpu / the CUDA plugin)

TPU topologies come from libtpu (`jax[tpu]`), GPU ones from the CUDA plugin (`jax[cuda12]`) and the XLA
GpuTargetConfig files in flaxgpt/aot/gpu_specs/; neither needs the hardware. v4 and v5p use the
"megacore" chip config (one device per chip, as their VMs run). Multi-host slices are one topology of
several hosts: the program compiled for it is the one every host runs.

Peak dense bf16 FLOP/s, HBM per device and HBM bandwidth are the vendors' published figures.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

GIB = 1024**3
SPECS = Path(__file__).parent / "gpu_specs"
TPU_INSTALL = 'pip install "jax[tpu]==$(python -c "import jax; print(jax.__version__)")"'
GPU_INSTALL = 'pip install "jax[cuda12]==$(python -c "import jax; print(jax.__version__)")"'


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    platform: str  # tpu | cuda | cpu
    topology: str  # libtpu's topology_name ("v5e:2x4") or the CUDA plugin's "hosts x 1 x gpus"
    hosts: int
    memory: float  # bytes of HBM per device
    peak_flops: float  # dense bf16 FLOP/s per device
    bandwidth: float  # HBM bytes/s per device
    chip_config: str = "default"  # TPU: megacore = one device per chip (v4, v5p)
    host_bounds: tuple = (2, 2, 1)  # TPU: chips per host
    spec: str = ""  # GPU: the GpuTargetConfig file in gpu_specs/

    @property
    def n_devices(self) -> int:
        """Devices of the topology (without starting the plugin; the host CPU counts as one)."""
        if self.platform == "cpu":
            return 1
        dims = self.topology.split(":")[-1].split("x")
        n = 1
        for d in dims:
            n *= int(d)
        return n

    @property
    def kind(self) -> str:
        return {"tpu": "TPU", "cuda": "NVIDIA GPU", "cpu": "host CPU"}[self.platform]

    def devices(self) -> list:
        """The topology's abstract devices (this process compiles for all of them)."""
        prepare_environment(self.platform)
        import jax
        from jax.experimental import topologies

        if self.platform == "cpu":
            return jax.devices("cpu")
        try:
            if self.platform == "tpu":
                topo = topologies.get_topology_desc(
                    platform="tpu",
                    topology_name=self.topology,
                    chip_config_name=self.chip_config,
                    chips_per_host_bounds=self.host_bounds,
                    num_slices=1,
                )
            else:
                spec = (SPECS / self.spec).read_text()
                topo = topologies.get_topology_desc(
                    platform="cuda", target_config=spec, topology=self.topology
                )
        except Exception as e:  # the plugin is missing (or cannot start): say how to install it
            install = TPU_INSTALL if self.platform == "tpu" else GPU_INSTALL
            raise SystemExit(
                f"error: cannot build the {self.name} topology ({type(e).__name__}: {_first_line(e)}); "
                f"install the {'libtpu' if self.platform == 'tpu' else 'CUDA plugin'}: {install}"
            ) from None
        return list(topo.devices)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]


def prepare_environment(platform: str) -> None:
    """Before the plugin starts: libtpu would take /tmp/libtpu_lockfile (a second compiling process
    would fail) and the CUDA plugin would look for a GPU and check its driver; neither is needed to
    compile. These are read when the plugin starts, not when jax is imported."""
    if platform == "tpu":
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no metadata server off Google Cloud
    elif platform == "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def _tpu(name, topology, hosts, memory_gib, tflops, gbps, megacore=False, bounds=(2, 2, 1)):
    chip = "megacore" if megacore else "default"
    return Target(name, "tpu", topology, hosts, memory_gib * GIB, tflops * 1e12, gbps * 1e9, chip, bounds)


def _gpu(name, gpu, hosts, per_host):
    # memory: the spec file's device_memory_size (what the device reports: 79.1 GiB of an H100's 80)
    memory, tflops, gbps = {"h100": (84929347584, 989, 3350), "h200": (150754820096, 989, 4800)}[gpu]
    return Target(
        name, "cuda", f"{hosts}x1x{per_host}", hosts, memory, tflops * 1e12, gbps * 1e9, spec=f"{gpu}.txtpb"
    )


# per device: v4 32 GiB / 275 TFLOP/s / 1228 GB/s; v5e 16 GiB / 197 / 819; v5p 95 GiB / 459 / 2765;
# v6e (Trillium) 32 GiB / 918 / 1640; H100 SXM 80 GB / 989 / 3350; H200 141 GB / 989 / 4800
TARGETS = {
    t.name: t
    for t in (
        _tpu("v4-8", "v4:2x2x1", 1, 32, 275, 1228, megacore=True),
        _tpu("v5e-1", "v5e:1x1", 1, 16, 197, 819, bounds=(1, 1, 1)),
        _tpu("v5e-4", "v5e:2x2", 1, 16, 197, 819),
        _tpu("v5e-8", "v5e:2x4", 1, 16, 197, 819, bounds=(2, 4, 1)),
        _tpu("v5p-8", "v5p:2x2x1", 1, 95, 459, 2765, megacore=True),
        _tpu("v6e-1", "v6e:1x1", 1, 32, 918, 1640, bounds=(1, 1, 1)),
        _tpu("v6e-8", "v6e:2x4", 1, 32, 918, 1640, bounds=(2, 4, 1)),
        _tpu("v5e-256", "v5e:16x16", 64, 16, 197, 819),
        _tpu("v5p-64", "v5p:4x4x2", 8, 95, 459, 2765, megacore=True),
        _tpu("v5p-128", "v5p:4x4x4", 16, 95, 459, 2765, megacore=True),
        _tpu("v6e-256", "v6e:16x16", 64, 32, 918, 1640),
        _gpu("h100-1", "h100", 1, 1),
        _gpu("h100-8", "h100", 1, 8),
        _gpu("2x8-h100", "h100", 2, 8),
        _gpu("h200-1", "h200", 1, 1),
        _gpu("h200-8", "h200", 1, 8),
        # this host: the CPU recipes' target (memory: what the machine has, no published peak)
        Target("cpu", "cpu", "host", 1, 16 * GIB, 0.0, 0.0),
    )
}


def get(name: str) -> Target:
    if name not in TARGETS:
        raise SystemExit(f"error: unknown target {name!r}; targets: {', '.join(TARGETS)}")
    return TARGETS[name]


def recipe_targets(path: str) -> list[str]:
    """The targets a recipe names in its docstring (`Targets: v5e-8, h100-1`), checked against TARGETS."""
    import ast

    doc = ast.get_docstring(ast.parse(Path(path).read_text())) or ""
    lines = [line for line in doc.splitlines() if line.strip().startswith("Targets:")]
    if not lines:
        raise SystemExit(
            f"error: {path} names no targets; add a docstring line like `Targets: v5e-8, h100-1`"
        )
    spec = lines[0].split(":", 1)[1].split("(")[0]  # a parenthesis after the names is a remark
    names = [n.strip() for n in spec.split(",") if n.strip()]
    for n in names:
        get(n)
    return names


def smallest(names: list[str]) -> Target:
    """The target of `names` with the least memory in all (devices x memory per device)."""
    return min((get(n) for n in names), key=lambda t: (t.n_devices * t.memory, t.n_devices))
