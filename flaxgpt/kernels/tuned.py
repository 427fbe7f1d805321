"""Tilings measured on a card, taken by the decoding GEMV kernels in place of their built-in defaults.

    python benchmarks/kernel_sweep.py --tiles_out tiles.json   # on the GPU: the fastest correct tilings
    FLAXGPT_GEMV_TILES=tiles.json FLAXGPT_DECODE_KERNELS=on python sample.py ...

The kernels' defaults (pallas_decode.default_tiles, pallas_qgemv.default_tiles) were chosen on paper and
the best tiling depends on the card (its SMs, L2 and bandwidth) as much as on the shape, so the one
kernel_sweep.py measured fastest per (kernel, N, K, rows) is kept in a file. A kernel traced without
`tiles=` looks up its kernel, N and K there and takes the entry measured at the most rows not above its
own (the sweep times 1 row, and 4 for the Llama-3-8B shapes); a shape the file does not hold keeps the
default. It also decides one route (kernels.qmatmul.route, `beats_xla`): int8 decoding rows on one GPU,
FLAXGPT_QMATMUL unset, take pallas_qgemv where the sweep timed it faster than XLA's dot beside it. Read
when the product is traced, as the other FLAXGPT_ settings: set it before the program is compiled. A
file that cannot be read, or a tiling that does not fit the shape it names, is an error of one line
naming the file (a wrong file never silently falls back to the defaults it was meant to replace).

The file (JSON): {"device": "NVIDIA H200", "jax": "0.11.2", "tiles": [{"kernel": "bf16", "N": 768,
"K": 3072, "M": 1, "tiles": [block_n, block_k, num_warps, num_stages, split_k], "best_gbps": 1234.5,
"default_gbps": 987.6, "xla_gbps": 1100.2}, ...]} (the figures optional: without both best and XLA's,
the route stays XLA's).
Kernels (`kernel_name`): "bf16" / "f16" / "f32" for pallas_decode's float weights as flax's [K, N], the
same + "_rows" for its rows [N, K] (`rows_w`), "int8", and "int4_g<group>" for pallas_qgemv.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import jax.numpy as jnp

ENV = "FLAXGPT_GEMV_TILES"
_FLOATS = {jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.float16): "f16", jnp.dtype(jnp.float32): "f32"}


def kernel_name(w_dtype, rows_w: bool = False, group: int = 0) -> str:
    """The file's name for a kernel: a float GEMV's weights (`rows_w`: as rows [N, K]), int8, int4's group."""
    dtype = jnp.dtype(w_dtype)
    if dtype == jnp.int8:
        return "int8"
    if dtype == jnp.uint8:  # int4, two a byte
        return f"int4_g{group}"
    return _FLOATS.get(dtype, dtype.name) + ("_rows" if rows_w else "")


def write(path: Path, entries: list[dict], device: str, jax_version: str) -> None:
    """The file from entries {kernel, N, K, M, tiles (a pallas_decode.Tiles or its list), gbps}."""
    rows = ",\n  ".join(json.dumps(dict(e, tiles=list(e["tiles"]))) for e in entries)  # an entry a line
    head = json.dumps({"device": device, "jax": jax_version})[:-1]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'{head}, "tiles": [\n  {rows}\n]}}\n' if rows else f'{head}, "tiles": []}}\n')


def _unreadable(path: str, err: OSError) -> ValueError:
    return ValueError(f"{ENV}={path}: cannot read it ({err.strerror}); unset it for the defaults")


@functools.lru_cache(maxsize=4)
def _read(path: str, mtime_ns: int) -> dict[tuple[str, int, int], list[tuple[int, tuple[int, ...], bool]]]:
    """(kernel, N, K) -> [(M, tiles, whether it beat XLA's product)] sorted by M; mtime_ns keys the
    cache (a rewritten file is read again). Whether a tiling fits its shape is the kernel's rule
    (Tiles.why_not), checked where it is taken."""
    where = f"{ENV}={path}"
    try:
        entries = json.loads(Path(path).read_text())["tiles"]
        table: dict = {}
        for i, e in enumerate(entries):
            try:
                tiles = tuple(int(v) for v in e["tiles"])
                key, M = (str(e["kernel"]), int(e["N"]), int(e["K"])), int(e["M"])
                if not 2 <= len(tiles) <= 5:
                    raise ValueError(f"{len(tiles)} numbers where [block_n, block_k, warps, stages, split_k]")
                speeds = [e.get(k) for k in ("best_gbps", "xla_gbps")]
                beat = None not in speeds and float(speeds[0]) > float(speeds[1])
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(f"entry {i} is not {{kernel, N, K, M, tiles}}: {err}") from None
            table.setdefault(key, []).append((M, tiles, beat))
    except OSError as err:
        raise _unreadable(path, err) from None
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{where}: not a tiles file ({type(err).__name__}: {err}); write one with "
                         "benchmarks/kernel_sweep.py --tiles_out") from None  # fmt: skip
    except ValueError as err:
        raise ValueError(f"{where}: {err}; write it with benchmarks/kernel_sweep.py --tiles_out") from None
    return {k: sorted(v) for k, v in table.items()}


def _entry(kernel: str, N: int, K: int, M: int) -> tuple[int, tuple[int, ...], bool] | None:
    path = os.environ.get(ENV)
    if not path:
        return None
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError as err:
        raise _unreadable(path, err) from None
    fits = [e for e in _read(path, mtime).get((kernel, N, K), []) if e[0] <= M]
    return fits[-1] if fits else None


def lookup(kernel: str, N: int, K: int, M: int) -> tuple[int, ...] | None:
    """The file's tiling for this kernel and shape at the most rows <= M (FLAXGPT_GEMV_TILES), or None:
    no file set, or none measured for the shape (the kernel's default then)."""
    entry = _entry(kernel, N, K, M)
    return entry and entry[1]


def beats_xla(kernel: str, N: int, K: int, M: int) -> bool:
    """Whether the file's sweep measured the kernel, at its tiling for this shape and rows, faster than
    XLA's product of the same shape (best_gbps > xla_gbps); False without a file or a measurement."""
    entry = _entry(kernel, N, K, M)
    return bool(entry and entry[2])


def source() -> str:
    """Where a kernel's tilings come from, for its errors: the file when one is set."""
    path = os.environ.get(ENV)
    return f" (from {ENV}={path})" if path else ""
