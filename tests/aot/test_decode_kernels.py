"""Decoding's fused kernels (kernels.pallas_decode, kernels.pallas_decode_attention) compiled for h100-1:
with FLAXGPT_DECODE_KERNELS=on (auto keeps XLA's path: the kernels measured slower on an H200,
models.linear.decode_kernels) the sampling program's token loop takes them, five a layer and one for ln_f and
the tied head, with the caches updated in place (no copy of a cache buffer), and launches fewer kernels
than XLA's path (FLAXGPT_DECODE_KERNELS=off); the prefill keeps XLA's path. The token loop's kernels
(its while body, docs/accelerators.md's "kernels a token") are pinned from above."""

import re

import jax
import pytest

from flaxgpt.aot import hlo_cost

KERNEL = re.compile(r"custom-call\(.*__gpu\$xla\.gpu\.triton.*decode_(gemv|attention)")


def compile_sample(tmp_path, mode, monkeypatch, quantize=None):
    from flaxgpt.aot import compile as aot
    from flaxgpt.aot import targets
    from tests.aot.test_compile import tiny

    monkeypatch.setenv("FLAXGPT_DECODE_KERNELS", mode)
    jax.clear_caches()  # read when traced: a trace of the other mode must not be reused
    rows, mc = aot.run(
        tiny(model__n_layer=2, batch_size=1, grad_accum=1), targets.get("h100-1"), ("sample",),
        dump=tmp_path, print_fn=lambda *_: None, quantize=quantize,
    )  # fmt: skip
    by = {r.program: r for r in rows}
    hlo = {p: (tmp_path / f"{p}.h100-1.hlo.txt").read_text() for p in by}
    return by, {p: len(KERNEL.findall(t)) for p, t in hlo.items()}, hlo, mc


def token_loop(hlo: str):
    """The decode call's while body (its token loop): (its name, computations, its hlo_cost a token)."""
    comps, entry = hlo_cost.parse(hlo)
    (body,) = [re.search(r"body=%?([\w.\-]+)", i.attrs).group(1) for i in comps[entry] if i.op == "while"]
    return body, comps, hlo_cost.estimate(hlo, 989e12, 3.35e12, computation=body)


def test_the_token_loop_takes_five_kernels_a_layer_on_h100(tmp_path, monkeypatch):
    pytest.importorskip("jax_cuda12_plugin", reason="the GPU targets need the CUDA plugin (not in CI)")
    auto, kernels_auto, _, _ = compile_sample(tmp_path / "auto", "auto", monkeypatch)
    assert kernels_auto == {"sample.prefill": 0, "sample.decode": 0}  # the default on a GPU: XLA's path
    on, kernels, hlo, mc = compile_sample(tmp_path / "on", "on", monkeypatch)
    assert kernels == {"sample.prefill": 0, "sample.decode": 5 * mc.n_layer + 1}  # + ln_f and the head
    # the token loop (the decode call's while body) updates the caches in place: no copy of a layer's
    # keys or values there (a call's entry may copy them once, as XLA's path does)
    body, comps, token = token_loop(hlo["sample.decode"])
    cache = re.compile(rf"\w+\[{mc.n_head},{mc.block_size},{mc.n_embd // mc.n_head}\]")
    assert not [i.name for i in comps[body] if i.op == "copy" and cache.match(i.type)]
    off, kernels, hlo_off, _ = compile_sample(tmp_path / "off", "off", monkeypatch)
    assert kernels == {"sample.prefill": 0, "sample.decode": 0}
    # a token of this 2-layer model at sample.py's settings: 51 kernels before ln_f went into the head's
    # GEMV and the sampling's tests, bounds checks and second max pass left the loop (XLA's path 65 -> 57;
    # here V = K = 256, so the max over the candidates is one kernel more, where GPT-2's 50257 save one:
    # GPT-2 124M 122 -> 109, docs/accelerators.md)
    assert token.kernels <= 42 and token_loop(hlo_off["sample.decode"])[2].kernels <= 57
    assert all(r.fits(0.1) for r in (*on.values(), *off.values()))
    # each layer: the norms' passes, the one-row products' separate sums, the residual adds, the cache
    # scatters and attention's two products gone
    assert on["sample.decode"].kernels <= off["sample.decode"].kernels - 6 * mc.n_layer


def test_bf16_rows_take_the_same_kernels_on_h100(tmp_path, monkeypatch):
    """`--quantize bf16` (the weights as rows [N, K]) with FLAXGPT_DECODE_KERNELS=on: the token loop takes
    the same five kernels a layer and one for ln_f + the head as float weights, its products reading the
    rows as they lie (no transpose or copy of a weight in the loop), within the float path's kernels."""
    pytest.importorskip("jax_cuda12_plugin", reason="the GPU targets need the CUDA plugin (not in CI)")
    rows, kernels, hlo, mc = compile_sample(tmp_path / "rows", "on", monkeypatch, quantize="bf16")
    assert kernels == {"sample.prefill": 0, "sample.decode": 5 * mc.n_layer + 1}
    body, comps, token = token_loop(hlo["sample.decode"])
    weight = re.compile(r"bf16\[(\d+),(\d+)\]")
    moved = [i.name for i in comps[body] if i.op in ("copy", "transpose") and weight.match(i.type)]
    assert not moved, moved
    _, _, hlo_float, _ = compile_sample(tmp_path / "float", "on", monkeypatch)
    assert token.kernels <= token_loop(hlo_float["sample.decode"])[2].kernels
    assert all(r.fits(0.1) for r in rows.values())
