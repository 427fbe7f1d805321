"""Decoding's fused kernels (kernels.pallas_decode) compiled for h100-1: on a GPU target the sampling
program's token loop takes them (auto), four a layer, and launches fewer kernels than XLA's path
(FLAXGPT_DECODE_KERNELS=off); the prefill keeps XLA's path."""

import re

import jax
import pytest


def compile_sample(tmp_path, mode, monkeypatch):
    from flaxgpt.aot import compile as aot
    from flaxgpt.aot import targets
    from tests.aot.test_compile import tiny

    monkeypatch.setenv("FLAXGPT_DECODE_KERNELS", mode)
    jax.clear_caches()  # read when traced: a trace of the other mode must not be reused
    rows, mc = aot.run(
        tiny(model__n_layer=2, batch_size=1, grad_accum=1), targets.get("h100-1"), ("sample",),
        dump=tmp_path, print_fn=lambda *_: None,
    )  # fmt: skip
    by = {r.program: r for r in rows}
    hlo = {p: (tmp_path / f"{p}.h100-1.hlo.txt").read_text() for p in by}
    kernels = {
        p: len(re.findall(r"custom-call\(.*__gpu\$xla\.gpu\.triton.*decode_gemv", t)) for p, t in hlo.items()
    }
    return by, kernels, mc


def test_the_token_loop_takes_four_kernels_a_layer_on_h100(tmp_path, monkeypatch):
    pytest.importorskip("jax_cuda12_plugin", reason="the GPU targets need the CUDA plugin (not in CI)")
    on, kernels, mc = compile_sample(tmp_path / "on", "auto", monkeypatch)
    assert kernels == {"sample.prefill": 0, "sample.decode": 4 * mc.n_layer}
    off, kernels, _ = compile_sample(tmp_path / "off", "off", monkeypatch)
    assert kernels == {"sample.prefill": 0, "sample.decode": 0}
    assert all(r.fits(0.1) for r in (*on.values(), *off.values()))
    # each layer: ln_1's and ln_2's passes, the one-row products' separate sums and the residual adds gone
    assert on["sample.decode"].kernels <= off["sample.decode"].kernels - 4 * mc.n_layer
