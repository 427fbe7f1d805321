"""The devices a program is being traced for: the mesh context's, else this host's default backend.

    with jax.set_mesh(mesh):          # or jax.sharding.use_abstract_mesh(mesh.abstract_mesh) inside jit
        platform(), device_kind()     # -> "tpu", "TPU v5 lite" for a mesh of (abstract) v5e devices

Kernel choices (attention_impl="auto", Pallas interpret mode) ask here rather than
`jax.default_backend()`, so a program compiled ahead of time for a TPU or a GPU this host does not
have (jax.experimental.topologies) holds the kernels the real run would. The trainer traces its steps
under its mesh (flaxgpt.sharding.under_mesh); without a mesh context the host's devices decide.
"""

from __future__ import annotations

import jax


def _device():
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    return device if device is not None else jax.devices()[0]


def device():
    """The first device traced for: a jax Device, or a mesh's abstract device (flaxgpt aot)."""
    return _device()


def platform() -> str:
    """ "tpu", "gpu" (CUDA or ROCm) or "cpu"."""
    name = _device().platform
    return "gpu" if name in ("cuda", "rocm") else name


def one_device() -> bool:
    """Whether the program is traced for one device: XLA cannot split a custom call (a Pallas or FFI
    kernel) over a mesh, so kernels are taken only then."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.empty or mesh.size == 1


def device_kind() -> str:
    """As the device reports it: "TPU v5 lite", "NVIDIA H100 80GB HBM3", "cpu"."""
    return _device().device_kind
