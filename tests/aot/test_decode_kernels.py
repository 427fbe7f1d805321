"""Decoding's fused kernels (kernels.pallas_decode, kernels.pallas_decode_attention) compiled for h100-1:
with FLAXGPT_DECODE_KERNELS=on (auto keeps XLA's path: the kernels measured slower on an H200,
models.linear.decode_kernels) the sampling program's token loop takes them, five a layer and one for ln_f and
the tied head, with the caches updated in place (no copy of a cache buffer), and launches fewer kernels
than XLA's path (FLAXGPT_DECODE_KERNELS=off); the prefill keeps XLA's path. The token loop's kernels
(its while body, docs/accelerators.md's "kernels a token") are pinned from above."""

import re

import jax
import jax.numpy as jnp
import pytest

from flaxgpt.aot import hlo_cost
from flaxgpt.kernels import pallas_decode, pallas_decode_attention, pallas_qgemv

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


def token_loop(hlo: str, branch=max):
    """The decode call's while body (its token loop): (its name, computations, its hlo_cost a token,
    each conditional counted by its `branch`: max, its largest; min, what runs when no row needs it)."""
    comps, body = hlo_cost.parse(hlo)[0], hlo_cost.loop_body(hlo)
    return body, comps, hlo_cost.estimate(hlo, 989e12, 3.35e12, computation=body, branch=branch)


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


LLAMA = dict(n_head=4, n_kv_head=2, n_embd=128, norm="rmsnorm", glu=True, activation="silu", bias=False,
             qkv_bias=False, pos_embedding="rope", tie_embeddings=False)  # fmt: skip


def greedy_cost(monkeypatch, mode: str, **model):
    """A greedy token (max_k 0, as the lease's decode parts: no filter, no draw) of a 2-layer bf16 model
    (GPT-2's blocks, or `model`'s) whose vocabulary is padded (250 -> 256, as GPT-2's 50257 -> 50304),
    compiled for h100-1 -> (its config, the token loop's hlo_cost when no row needs a conditional's
    pass: branch=min)."""
    from flaxgpt.aot import programs, targets
    from flaxgpt.models.gpt import GPTConfig

    monkeypatch.setenv("FLAXGPT_DECODE_KERNELS", mode)
    jax.clear_caches()
    base = dict(vocab_size=250, pad_vocab_multiple=64, n_layer=2, n_head=2, n_embd=64, block_size=64,
                dtype="bfloat16", param_dtype="bfloat16")  # fmt: skip
    mc = GPTConfig(**{**base, **model})
    return mc, programs.greedy_token(mc, targets.get("h100-1"), chunk=8)


def greedy_token(monkeypatch, mode: str, **model):
    """greedy_cost's config and the token loop's kernels, by name."""
    mc, cost = greedy_cost(monkeypatch, mode, **model)
    return mc, [k.name for k in cost.by_kernel for _ in range(k.count)]


def test_a_greedy_token_takes_the_layers_kernels_and_ten_more_on_h100(monkeypatch):
    """docs/accelerators.md's "Counting a greedy token" (GPT-2 124M: 61 Pallas calls + 11 = 72, against
    180 on XLA's path), pinned on a small model: 5 kernels a layer and ln_f + the head, then the
    embedding add, the position's min with the cache's end, the logits' slice to the vocabulary, the
    argmax (one pass at 250 columns; GPT-2's 50257 take two) and the loop's six updates. A skip branch
    that copies the logits (logit_bias' conditional before `sampling.take` ended it in the argmax), or a
    layer's kernel split in two, fails it."""
    pytest.importorskip("jax_cuda12_plugin", reason="the GPU targets need the CUDA plugin (not in CI)")
    mc, kernels = greedy_token(monkeypatch, "on")
    pallas = [k for k in kernels if k.startswith("pallas_call")]
    assert len(pallas) == 5 * mc.n_layer + 1, kernels
    assert len(kernels) - len(pallas) <= 10, [k for k in kernels if k not in pallas]
    _, xla = greedy_token(monkeypatch, "off")
    assert len(xla) >= len(kernels) + 6 * mc.n_layer, xla  # XLA's path: 36 here


def test_one_row_products_read_each_weight_once_on_h100(monkeypatch):
    """linear.product at GPT-2's width (one layer, bf16, XLA's path): XLA takes a one-row product of a
    weight under its 10M-entry threshold as a multiply and a sum, writing c_proj's whole [3072, 768]
    and [768, 768] products to HBM between two kernels; the row taken twice is a GEMM reading each
    weight once. GPT-2 124M's token: 505 -> 366 MB in 180 kernels (docs/accelerators.md)."""
    pytest.importorskip("jax_cuda12_plugin", reason="the GPU targets need the CUDA plugin (not in CI)")
    from flaxgpt.models import linear

    costs = {}
    for below in (0, linear.XLA_GPU_REDUCED_BELOW):  # 0: every product as XLA takes one row
        monkeypatch.setattr(linear, "XLA_GPU_REDUCED_BELOW", below)
        costs[below] = greedy_cost(monkeypatch, "off", n_layer=1, n_head=12, n_embd=768)[1]
    summed, gemm = costs.values()
    products = 2 * (3072 * 768 + 768 * 768) * 2  # c_proj's two products written and read back, bf16
    assert gemm.hbm_bytes <= summed.hbm_bytes - 0.9 * products, (summed.hbm_bytes, gemm.hbm_bytes)
    assert gemm.kernels <= summed.kernels
    assert any(k.name.startswith("gemm_fusion") for k in gemm.by_kernel)


def test_the_attention_kernel_alone_takes_a_llama_layers_cache_writes_and_attention_on_h100(monkeypatch):
    """FLAXGPT_DECODE_KERNELS=attention (the norms and products XLA's): a Llama-style layer's greedy
    token takes the attention kernel for its k and v scatters, q . k, the softmax, p . v and its
    split-K sum, and one fusion writes q | k | v with rope's rotation where q and k took one each
    and v a slice (the kernel takes them as one array): 4 a layer fewer than XLA's path (the
    Llama-3-8B shape: 589 -> 430 a token, 18 -> 13 a layer; docs/accelerators.md)."""
    pytest.importorskip("jax_cuda12_plugin", reason="the GPU targets need the CUDA plugin (not in CI)")
    mc, kernels = greedy_token(monkeypatch, "attention", **LLAMA)
    assert sum(k.startswith("pallas_call") for k in kernels) == mc.n_layer, kernels
    assert sum(k.startswith("input_concatenate_fusion") for k in kernels) == mc.n_layer, kernels  # q | k | v
    _, xla = greedy_token(monkeypatch, "off", **LLAMA)
    assert not any(k.startswith("pallas_call") for k in xla)
    assert len(xla) >= len(kernels) + 4 * mc.n_layer, (xla, kernels)  # here 45 against 36


def compiled_loop(tmp_path, fn, shapes):
    """fn's Triton kernel compiled for h100-1 (sm_90a) -> (PTX text, the ld.global before its main loop,
    the loop's instructions: from its label to the branch back; the main loop: the one with most loads)."""
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from flaxgpt.aot import targets

    mesh = Mesh(np.array(targets.get("h100-1").devices()[:1]), ("x",))
    one = NamedSharding(mesh, PartitionSpec())
    args = [jax.ShapeDtypeStruct(s, d, sharding=one) for s, d in shapes]
    jax.jit(fn).lower(*args).compile(compiler_options={"xla_dump_to": str(tmp_path)})
    entry = re.compile(r"\.entry (decode_gemv|qgemv|decode_attention)\b")
    (ptx,) = [t for p in tmp_path.glob("*.ptx") if entry.search(t := p.read_text())]
    lines = [line.strip() for line in ptx.splitlines()]
    loops = []  # (its label's line, its branch back): the labels a later line branches back to
    for top, line in enumerate(lines):
        if re.match(r"^\$L\w+:$", line):
            branch = re.compile(rf"bra(\.uni)?\s+{re.escape(line[:-1])};")
            back = [i for i in range(top, len(lines)) if branch.search(lines[i])]
            loops += [(top, back[-1])] if back else []
    top, back = max(loops, key=lambda tb: sum("ld.global" in line for line in lines[tb[0] : tb[1]]))
    prologue = sum("ld.global" in line for line in lines[:top])
    return ptx, prologue, lines[top:back]


def spills(ptx: str) -> str:
    """ptxas -v's report of the PTX for sm_90a: '' without spills, else the line."""
    import subprocess

    nvcc = pytest.importorskip("nvidia.cuda_nvcc", reason="ptxas comes with the CUDA plugin's nvcc wheel")
    ptxas = next(iter(nvcc.__path__)) + "/bin/ptxas"
    r = subprocess.run([ptxas, "-v", "-arch=sm_90a", "-", "-o", "/dev/null"], input=ptx, capture_output=True,
                       text=True, check=True)  # fmt: skip
    bad = [
        line for line in r.stderr.splitlines() if "spill" in line and not re.search(r"\b0 bytes spill", line)
    ]
    return "\n".join(bad)


BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
GEMVS = {  # a product each kernel takes at batch 1: (the call, its operands' shapes and dtypes)
    "bf16 [K, N] + residual": (
        lambda x, w, r: pallas_decode.gemv(x, w, residual_MN=r),
        [((1, 3072), BF16), ((3072, 768), BF16), ((1, 768), BF16)],
    ),
    "bf16 rows": (lambda x, w: pallas_decode.gemv(x, w, rows_w=True), [((1, 768), BF16), ((768, 768), BF16)]),
    "int8": (pallas_qgemv.gemv, [((1, 4096), BF16), ((4096, 4096), jnp.dtype(jnp.int8)), ((4096,), F32)]),
    "int4": (pallas_qgemv.gemv, [((1, 4096), BF16), ((4096, 2048), jnp.dtype(jnp.uint8)), ((4096, 32), F32)]),
    "attention": (  # GPT-2's 12 heads over a cache of 1024: q | k | v [1, 36, 64]
        lambda qkv, pos, kc, vc: pallas_decode_attention.attend(qkv, pos, kc, vc, scale=0.125),
        [((1, 36, 64), BF16), ((1,), jnp.dtype(jnp.int32))] + [((12, 1024, 64), BF16)] * 2,
    ),
    "attention 8B": (  # the Llama-3-8B shape's 8 key/value heads of 4 over 8192 positions: 8 ranges a head
        lambda qkv, pos, kc, vc: pallas_decode_attention.attend(qkv, pos, kc, vc, scale=128**-0.5),
        [((1, 48, 128), BF16), ((1,), jnp.dtype(jnp.int32))] + [((8, 8192, 128), BF16)] * 2,
    ),
}


@pytest.mark.parametrize("what", GEMVS)
def test_gemv_loops_load_steps_ahead_without_spills(tmp_path, what):
    """The decoding kernels' loops as compiled for an H100 (the 2026-11-29 lease timed the GEMVs at ~5 us
    a call where XLA's took ~1.8; their PTX showed each step's loads asked for at its top and waited on
    by its own sums, two steps' loads never in flight at once): the first steps' weights (the
    attention's first key and value blocks) are asked for before the loop, and each step asks for a
    later one's before its own products; at batch 1 the bf16 GEMVs sum whole tiles (no shuffle a step),
    the attention's products are tensor-core MMAs (205 shuffles a block before); ptxas spills no
    register."""
    pytest.importorskip("jax_cuda12_plugin", reason="the GPU targets need the CUDA plugin (not in CI)")
    ptx, prologue, loop = compiled_loop(tmp_path, *GEMVS[what])
    # each step's queued loads (weight tile and x: 4 + 1 vector loads at [K, N], 2 + 1 as rows, int8's
    # 4 + 1, int4's weights and scales of 2 groups, the attention's 4 of a key and a value block at 8
    # warps; it also reads q, the new key and value, pos first): two steps' before the loop (3 stages;
    # the attention's AHEAD) where the loop as the lease timed it had none
    queued = {
        "bf16 [K, N] + residual": 5,
        "bf16 rows": 3,
        "int8": 5,
        "int4": 4,
        "attention": 4,
        "attention 8B": 8,
    }
    queued = queued[what]
    assert prologue >= 2 * queued, (what, prologue)
    first_math = next(i for i, line in enumerate(loop) if re.match(r"(fma|mul|add)\.(rn\.)?f32", line))
    assert sum("ld.global" in line for line in loop[:first_math]) >= queued, what
    shuffles = sum(line.startswith("shfl") for line in loop)
    if what.startswith("bf16"):
        assert shuffles == 0, what
    if what.startswith(
        "attention"
    ):  # q . k and p . v on the tensor cores, not multiplies summed across threads
        assert any(line.startswith("mma.sync") for line in loop) and shuffles <= 40, shuffles
    assert not spills(ptx), what
