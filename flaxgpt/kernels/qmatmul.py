"""x @ w^T * scale with int8, bfloat16 or int4 weights: a CPU kernel for decoding, XLA elsewhere.

    y_MN = qmatmul(x_MK, w_NK, scale_N)      # w int8 or bfloat16, rows = output channels
    y_MN = qmatmul(x_MK, w_NH, scale_NG)     # int4 packed as uint8 [N, K/2], scales per group: kernels.int4

On CPU, few rows (decoding: M <= MAX_KERNEL_ROWS) go to a small C++ kernel registered with
`jax.ffi` (csrc/qmatmul.cc): XLA on CPU converts an int8 or bf16 weight matrix to float32
before a matrix-vector product, so without the kernel compact weights decode slower than
float32 ones. The kernel is compiled once with the system's C++ compiler into
$FLAXGPT_CACHE (default ~/.cache/flaxgpt) on first use. Without a compiler, on other
backends, for many rows (prefill, where the step is compute-bound) or with
FLAXGPT_QMATMUL=xla, or a program traced over several devices (XLA cannot split a custom call), the
same product is the XLA dequantize-then-dot. FLAXGPT_QMATMUL=reduce is an experiment for GPUs and
TPUs: up to REDUCE_ROWS rows (decoding) as a multiply and a row reduction over K instead of a dot.
int4 weights take kernels.int4's XLA form (the C++ kernel reads int8 and bf16 only), except decoding
rows on one GPU, which take kernels.pallas_qgemv's Triton GEMV where it tiles the shape: measured on an
H200 (2026-11-29, docs/accelerators.md), the Llama-3-8B shape at batch 1 decoded 134 tok/s with it and
42 with XLA's unpack-then-dot form. int8 keeps XLA's fusion there (212 tok/s against the GEMV's 173),
but for the shapes where the card's own sweep measured the GEMV faster (kernels.tuned's file, set by
FLAXGPT_GEMV_TILES: benchmarks/kernel_sweep.py --tiles_out, XLA's product timed beside each kernel).
FLAXGPT_QMATMUL=pallas sends int8 and int4 decoding rows through pallas_qgemv on any platform, one
device (Pallas' interpreter off GPUs: a check, not a speed-up); FLAXGPT_QMATMUL=xla keeps XLA's forms
everywhere. `route` is the one rule.
"Other backends" means the devices the program is traced for (kernels.target: the mesh context's, else
this host's), so a program compiled ahead of time for a TPU or a GPU on this CPU holds no CPU custom call.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from flaxgpt.kernels import int4, pallas_qgemv, target, tuned

MAX_KERNEL_ROWS = 64  # above this the product is compute-bound: XLA's dot is faster
REDUCE_ROWS = 4  # FLAXGPT_QMATMUL=reduce (accelerators): decoding rows taken as a multiply-reduce
_SOURCE = Path(__file__).parent / "csrc" / "qmatmul.cc"
_TARGETS = {"int8": "FlaxgptInt8Matmul", "bfloat16": "FlaxgptBf16Matmul"}
_FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w"]


def _cpu_signature() -> str:
    """What -march=native compiles for (a cached library must not move to another CPU)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        flags = next(line for line in lines if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return f"{platform.machine()} {flags}"


def _compile() -> Path:
    cxx = os.environ.get("CXX", "g++")
    include = Path(jax.ffi.include_dir())
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    key = "\n".join([_SOURCE.read_text(), version, " ".join(_FLAGS), jax.__version__, _cpu_signature()])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("FLAXGPT_CACHE", Path.home() / ".cache" / "flaxgpt"))
    lib = cache / f"qmatmul-{digest}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:  # compile aside, then rename: atomic
        out = Path(tmp) / lib.name
        cmd = [cxx, *_FLAGS, f"-I{include}", str(_SOURCE), "-o", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip().splitlines()[-1:]}")
        os.replace(out, lib)
    return lib


@functools.cache
def kernel_available() -> bool:
    """Compile (once) and register the CPU kernel; False, with one warning, where it cannot be.
    Whether a program uses it is `qmatmul`'s choice: only when traced for CPU devices."""
    if os.environ.get("FLAXGPT_QMATMUL", "") == "xla":
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(str(_compile()))
        for name, symbol in _TARGETS.items():
            capsule = jax.ffi.pycapsule(getattr(lib, symbol))
            jax.ffi.register_ffi_target(f"flaxgpt_{name}_matmul", capsule, platform="cpu")
    except (OSError, RuntimeError, subprocess.CalledProcessError, AttributeError) as e:
        print(f"warning: quantized CPU kernel unavailable, using XLA's slower path ({e})", file=sys.stderr)
        return False
    return True


def dequantize(w_NK: jax.Array, scale_N: jax.Array) -> jax.Array:
    """The float32 weight [N, K] a quantized one stands for (int4: uint8 [N, K/2] with scales [N, G])."""
    if w_NK.dtype == jnp.uint8:
        return int4.dequantize(w_NK, scale_N)
    return w_NK.astype(jnp.float32) * scale_N[:, None]


def route(M: int, N: int, K: int, wdtype, group: int = 0) -> str:
    """Which form multiplies x [M, K] by a quantized w [N, K] in the program being traced: "pallas"
    (kernels.pallas_qgemv), "int4" (kernels.int4's XLA form), "reduce" (FLAXGPT_QMATMUL=reduce's
    multiply-reduce, int8 / bf16 decoding rows off CPUs) or "dense" (int8 / bf16: the CPU kernel or
    XLA's dot, below). group: int4's group size (0 for int8 / bf16)."""
    mode = os.environ.get("FLAXGPT_QMATMUL", "")
    if mode not in ("", "pallas", "reduce", "xla"):
        raise ValueError(
            f"FLAXGPT_QMATMUL={mode!r}: use pallas, reduce or xla, or leave it unset (the default)"
        )
    int4 = jnp.dtype(wdtype) == jnp.uint8
    tiles = jnp.dtype(wdtype) in (jnp.int8, jnp.uint8) and not pallas_qgemv.why_not(M, N, K, group)
    if tiles and mode == "pallas" and target.one_device():
        return "pallas"
    # int4 on one GPU: the GEMV, 3.2x XLA's unpack-then-dot on the 8B shape (module docstring); int8
    # where the card's sweep (kernels.tuned, FLAXGPT_GEMV_TILES) measured it faster than XLA's dot
    if tiles and not mode and target.platform() == "gpu" and target.one_device():
        if int4 or tuned.beats_xla("int8", N, K, M):
            return "pallas"
    if int4:
        return "int4"
    return "reduce" if mode == "reduce" and M <= REDUCE_ROWS and target.platform() != "cpu" else "dense"


def qmatmul(x_MK: jax.Array, w_NK: jax.Array, scale_N: jax.Array) -> jax.Array:
    """(x @ w^T) * scale in float32 -> [M, N]; w_NK is int8, bfloat16 or int4 (uint8, two a byte)."""
    (M, K), N = x_MK.shape, w_NK.shape[0]
    how = route(M, N, K, w_NK.dtype, K // scale_N.shape[1] if w_NK.dtype == jnp.uint8 else 0)
    if how == "pallas":
        return pallas_qgemv.gemv(x_MK, w_NK, scale_N, interpret=target.platform() != "gpu")
    if how == "int4":
        return int4.matmul(x_MK, w_NK, scale_N)
    name = {jnp.dtype(jnp.int8): "int8", jnp.dtype(jnp.bfloat16): "bfloat16"}.get(jnp.dtype(w_NK.dtype))
    if name is None:
        raise ValueError(f"qmatmul weights must be int8, bfloat16 or int4 (uint8), got {w_NK.dtype}")
    dims = (((1,), (1,)), ((), ()))
    if how == "reduce":
        # an experiment for decoding on GPUs (benchmarks/gpu_lease.py decode_llama8b_reduce): each output
        # channel's row of w read once by a row reduction over K with the convert inside it, in place
        # of XLA's GEMM fusion, whose int8 matrix-vector products read 2.0 TB/s on an H200 (of 4.8)
        y_MN = jnp.sum(x_MK.astype(jnp.float32)[:, None, :] * w_NK.astype(jnp.float32)[None], axis=-1)
        return y_MN * scale_N
    if target.platform() != "cpu":
        # TPU / GPU: the weights widened only to 16-bit activations' dtype (int8 is exact in
        # bfloat16), accumulated in float32, so a convert XLA does not fuse into the dot writes
        # 2 bytes a weight, not 4; the MXU / tensor cores multiply bfloat16 either way
        dtype = x_MK.dtype if jnp.dtype(x_MK.dtype).itemsize == 2 else jnp.float32
        y_MN = jax.lax.dot_general(
            x_MK.astype(dtype), w_NK.astype(dtype), dims, preferred_element_type=jnp.float32
        )
        return y_MN * scale_N
    x_MK = x_MK.astype(jnp.float32)
    # traced for a CPU (above: not), and for one device: XLA cannot split a custom call over a mesh
    # (it would gather the whole weight onto every device to run it), so there XLA's dot
    if M <= MAX_KERNEL_ROWS and target.one_device() and kernel_available():
        out = jax.ShapeDtypeStruct((M, N), jnp.float32)
        return jax.ffi.ffi_call(f"flaxgpt_{name}_matmul", out)(x_MK, w_NK, scale_N.astype(jnp.float32))
    return jax.lax.dot_general(x_MK, w_NK.astype(jnp.float32), dims) * scale_N
