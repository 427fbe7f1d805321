"""Many LoRA adapters in one server, never merged: a tiny random Llama directory (with a tokenizer.json)
and random PEFT adapters made with peft (non-zero B: each changes the tokens). Rows of different
adapters decode in one engine step and give, each, the greedy tokens of its adapter merged into the
base (flaxgpt.load_pretrained(base, adapter=...)); serve.py with --adapter NAME=DIR serves them to the
openai client, loads and unloads adapters at run time (--allow_runtime_lora, under --adapter_root), and
answers bad names and bad loads. The privilege rules themselves: test_adapter_security.py."""

import concurrent.futures
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import openai
import pytest
import transformers

import flaxgpt
from flaxgpt.data.hf_tokenizer import HFTokenizer
from flaxgpt.decode.sampling import Rows, Sampling
from flaxgpt.serve import launch
from flaxgpt.serve.adapters import AdapterPool
from tests.hf.test_llama import make_hf_model
from tests.hf.test_llama_cli import make_tokenizer
from tests.hf.test_peft import LLAMA_TARGETS, make_adapter
from tests.procs import xla_flags
from tests.serve import references
from tests.serve.test_serve import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
W, N = 32, 10  # the window; new tokens per request
PROMPTS = [[1, 17, 42, 99, 5], [1, 250, 3, 77], [1, 8, 8, 160, 200, 31], [1, 64]]
ADAPTERS = {  # name -> (peft target_modules, rank, alpha, extra LoraConfig fields)
    "a1": (LLAMA_TARGETS, 4, 8.0, {}),
    "a2": (["q_proj", "v_proj"], 8, 4.0, {"use_rslora": True}),
    "a3": (["gate_proj", "up_proj", "down_proj", "o_proj"], 2, 16.0, {}),
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    make_hf_model("llama", root / "base")
    make_tokenizer(str(root / "base"))
    for name, (targets, r, alpha, extra) in ADAPTERS.items():
        base = transformers.AutoModelForCausalLM.from_pretrained(root / "base")  # peft changes its model
        make_adapter(base, root / name, targets, r=r, alpha=alpha, **extra)
    # bad adapters: one for a narrower Llama (shapes), one on the LM head (a module flaxgpt never adapts)
    make_adapter(make_hf_model("llama", root / "other", hidden_size=32), root / "other_base", ["q_proj"])
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "base")
    make_adapter(base, root / "head", ["q_proj", "lm_head"])
    return root


def merged_tokens(root, name) -> list[list[int]]:
    """The reference: greedy tokens of the adapter merged into the base (None: the base alone), each
    prompt a row of one batch (rows are independent)."""
    config, params = flaxgpt.load_pretrained(str(root / "base"), adapter=name and str(root / name))
    return references.greedy_rows(config, params, PROMPTS, W, N)


@pytest.fixture(scope="module")
def reference(dirs):
    """(adapter name or None, prompt index) -> the merged model's tokens."""
    return {(name, i): out for name in (None, *ADAPTERS) for i, out in enumerate(merged_tokens(dirs, name))}


def test_the_adapters_change_the_tokens(server, reference):
    """Else every comparison below would pass with adapters ignored. (`server` first: serve.py starts
    compiling now, while the tests before the end-to-end one run.)"""
    for i in range(len(PROMPTS)):
        assert len({tuple(reference[name, i]) for name in (None, *ADAPTERS)}) == 4, i


def test_pool_swaps_least_recently_used_and_unload_waits_for_holders():
    writes = []
    pool = AdapterPool(lambda path: f"w:{path}", lambda slot, w: writes.append((slot, w)), slots=3)
    x, y, z = (pool.load(n, n) for n in "xyz")
    assert pool.acquire(None) == 0 and pool.acquire(x) == 1 and pool.acquire(y) == 2
    assert pool.acquire(z) is None  # both slots held by running requests: z waits
    pool.release(1)
    assert pool.acquire(x) == 1 and writes == [(1, "w:x"), (2, "w:y")]  # resident: no write
    pool.release(1), pool.release(1), pool.release(2)
    assert pool.acquire(z) == 2  # y used less recently than x: evicted
    assert writes[-1] == (2, "w:z") and pool.resident_names() == [None, "x", "z"]
    pool.unload("z")  # held: keeps its slot, gone for new requests
    assert pool.get("z") is None and pool.resident_names()[2] == "z"
    pool.release(2)
    assert pool.resident_names() == [None, "x", None]
    with pytest.raises(ValueError, match="already loaded"):
        pool.load("x", "again")
    with pytest.raises(KeyError):
        pool.unload("z")


def test_engine_rows_of_different_adapters_match_merged(dirs, reference):
    """One engine, four slots: a1, the base, a2 and a1 again decode together; then a3, not resident
    (two adapter slots, both held), swaps in once a2's request ends, and a1 unloaded mid-request
    still finishes its rows with a1."""
    config, params = flaxgpt.load_pretrained(str(dirs / "base"))
    named = [(n, str(dirs / n)) for n in ("a1", "a2", "a3")]
    sched = launch.scheduler_for(
        config, params, None, slots=4, max_len=W, prefill_chunk=16, prefix_cache_tokens=0,
        adapters=named, max_adapters=2, max_lora_rank=8,
    )  # fmt: skip
    engine, pool = sched.engine, sched.adapters
    rows = Rows.of(Sampling(temperature=0.0), max_new_tokens=N)
    got, held = {}, {}

    def start(b, name, i):
        slot = pool.acquire(pool.get(name) if name else None)
        assert slot is not None, name
        prefix = engine.prefill(PROMPTS[i], rows, adapter=slot)
        engine.insert(prefix, b)
        got[b], held[b] = (name, i, [int(prefix.first)]), slot

    def run_until_done():
        while True:
            tokens_BC, new_B, done_B = engine.generate()
            for b, (_, _, out) in got.items():
                out += tokens_BC[b, : new_B[b]].tolist()
            if done_B.all():
                return

    for b, (name, i) in enumerate([("a1", 0), (None, 1), ("a2", 2), ("a1", 3)]):
        start(b, name, i)
    assert pool.acquire(pool.get("a3")) is None  # a1 and a2 hold both adapter slots
    pool.unload("a1")  # its two requests keep their slot
    run_until_done()
    for name, i, out in got.values():
        assert out == reference[name, i], (name, i)
    for b in range(4):
        pool.release(held[b])
    assert pool.resident_names() == [None, None, "a2"]  # a1's slot emptied once its requests ended
    got.clear()
    start(0, "a3", 0)  # into a1's emptied slot
    start(1, "a2", 1)  # still resident
    start(2, None, 2)
    run_until_done()
    for name, i, out in got.values():
        assert out == reference[name, i], (name, i)
    assert pool.swaps == 3  # a1, a2, a3: each written once


@pytest.fixture(scope="module")
def server(dirs):
    """serve.py started (not yet waited for) with a1 and a2 in two adapter slots."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags()}
    cmd = [sys.executable, str(ROOT / "serve.py"), "--init_from", str(dirs / "base"), "--port", str(port)]
    cmd += ["--adapter", f"a1={dirs / 'a1'}", "--adapter", f"a2={dirs / 'a2'}", "--model_name", "base"]
    cmd += ["--max_adapters", "2", "--max_lora_rank", "8", "--max_len", str(W), "--slots", "4"]
    cmd += ["--prefill_chunk", "16"]  # one prompt bucket: one prefill program to compile
    cmd += ["--allow_runtime_lora", "--adapter_root", str(dirs)]  # runtime loads: only under dirs
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield proc, f"http://127.0.0.1:{port}"
    proc.kill()
    proc.wait(timeout=30)


def test_served_adapters_match_merged_and_load_unload_at_run_time(dirs, reference, server):
    proc, url = server
    wait_healthy(proc, url)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    tok = HFTokenizer(str(dirs / "base"))

    def complete(name, i):
        r = client.completions.create(
            model=name or "base",
            prompt=PROMPTS[i],
            max_tokens=N,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert r.model == (name or "base")
        return r.choices[0].text

    def check(cases):
        with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
            texts = list(pool.map(lambda c: complete(*c), cases))
        for (name, i), text in zip(cases, texts, strict=True):
            assert text == tok.decode(reference[name, i]), (name, i)

    assert [m.id for m in client.models.list().data] == ["base", "a1", "a2"]
    check([("a1", 0), (None, 1), ("a2", 2), ("a1", 3), ("a2", 0), (None, 3)])

    load = lambda **body: httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=60)  # noqa: E731
    unload = lambda **body: httpx.post(f"{url}/v1/unload_lora_adapter", json=body, timeout=60)  # noqa: E731
    assert load(lora_name="a3", lora_path="a3").status_code == 200  # relative to --adapter_root
    # a3 evicts the least recently used of a1 and a2, and the next a1 or a2 swaps back in
    check([("a3", 1), ("a3", 2), (None, 0)])
    check([("a1", 2), ("a2", 1), ("a3", 3)])
    assert unload(lora_name="a2").status_code == 200
    assert [m.id for m in client.models.list().data] == ["base", "a1", "a3"]

    for name in ("a2", "nope"):
        with pytest.raises(openai.NotFoundError) as e:
            complete(name, 0)
        assert e.value.body["code"] == "model_not_found" and "base, a1, a3" in e.value.body["message"]
    bad = {
        "a1": str(dirs / "a2"),  # the name is taken
        "b1": str(dirs / "other_base"),  # shapes of another base
        "b2": str(dirs / "head"),  # lm_head: the base has no such target
        "b3": str(dirs / "missing"),
    }
    for name, path in bad.items():
        r = load(lora_name=name, lora_path=path)
        assert r.status_code == 400 and r.json()["error"]["message"], (name, r.text)
    r = load(lora_name="b4", lora_path=str(dirs.parent))  # outside --adapter_root
    assert r.status_code == 400 and "outside the adapter root" in r.json()["error"]["message"], r.text
    assert str(dirs) not in load(lora_name="b3", lora_path="missing").text  # no server path echoed
    assert unload(lora_name="nope").status_code == 404
    assert [m.id for m in client.models.list().data] == ["base", "a1", "a3"]
    check([(None, 2), ("a1", 1), ("a3", 0)])  # still serving, nothing half-loaded


def run_rows(engine, pool, cases, salts=True, prompts=PROMPTS):
    """(adapter name or None, prompt index) cases, one slot each, greedy to N tokens -> (tokens, hits)."""
    rows = Rows.of(Sampling(temperature=0.0), max_new_tokens=N)
    out, hits, held = {}, [], []
    for b, (name, i) in enumerate(cases):
        adapter = pool.get(name) if name else None
        slot = pool.acquire(adapter)
        salt = adapter.key if adapter is not None and salts else b""
        job = engine.start_prefill(prompts[i], rows, adapter=slot, salt=salt)
        hits.append(job.hit)
        while (prefix := engine.prefill_step(job)) is None:
            pass
        engine.insert(prefix, b)
        out[b], held = [int(prefix.first)], held + [slot]
    while True:
        tokens_BC, new_B, done_B = engine.generate()
        for b in out:
            out[b] += tokens_BC[b, : new_B[b]].tolist()
        if done_B.all():
            break
    for b, (_, i) in enumerate(cases):  # the replies' blocks kept, under each adapter's salt
        engine.keep(b, prompts[i] + out[b][:-1])
        pool.release(held[b])
    return [out[b] for b in range(len(cases))], hits


def test_adapters_with_the_prefix_cache_and_chunked_prefill(dirs, reference):
    """The prefix cache keys its blocks by adapter: one prompt under a1, a2 and the base never shares
    blocks across them, yet hits its own adapter's blocks (mapped in place) on the next request, and
    every row, prefilled in chunks of 4, decodes its merged model's tokens."""
    config, params = flaxgpt.load_pretrained(str(dirs / "base"))
    sched = launch.scheduler_for(
        config, params, None, slots=4, max_len=W, prefill_chunk=4, prefix_cache_tokens=64, prefix_block=4,
        adapters=[(n, str(dirs / n)) for n in ("a1", "a2")], max_adapters=2, max_lora_rank=8,
    )  # fmt: skip
    engine, pool = sched.engine, sched.adapters
    cases = [("a1", 2), ("a2", 2), (None, 2), ("a1", 0)]
    first, hits = run_rows(engine, pool, cases)
    assert hits == [0, 0, 0, 0]  # the same 6-token prompt under three adapters: no block shared
    again, hits = run_rows(engine, pool, cases)
    assert hits == [4, 4, 4, 4]  # each its own adapter's first block (the last token is never a hit)
    for (name, i), a, b in zip(cases, first, again, strict=True):
        assert a == b == reference[name, i], (name, i)
    engine.blocks.check()
    # unsalted (the bug the salt prevents): a2 would read a1's keys and values and decode other tokens
    engine.blocks.clear()
    [a1] = run_rows(engine, pool, [("a1", 2)], salts=False)[0]
    [a2], hits = run_rows(engine, pool, [("a2", 2)], salts=False)
    assert hits == [4] and a1 == reference["a1", 2] and a2 != reference["a2", 2]


def merged_over_int8(root, run, cases) -> list[list[int]]:
    """Each case's greedy tokens from generate over the plain float32 GPT whose weights are the int8
    run's dequantized (w * scale) with the case's adapter merged in (lora.merge): the exact reference of
    an adapter over int8 weights, up to float32 rounding."""
    from flaxgpt import loader
    from flaxgpt.models import lora
    from tests.models.test_multi_lora import dequantized

    deq, out = dequantized(run.params), {}
    for name in {n for n, _ in cases}:
        params = deq
        if name is not None:
            spec, tree = loader.load_adapter(str(root / name), run.config)
            params = lora.merge(run.config, spec, deq, tree)
        out[name] = references.greedy_rows(run.config, params, PROMPTS, W, N)
    return [out[name][i] for name, i in cases]


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_adapters_over_a_mesh(dirs, reference, quantize):
    """Adapters x --mesh 4 (x int8 weights) x the prefix cache x chunked prefill, on CPU devices: the
    base loaded straight into its devices' slices (SERVE_RULES), the adapter stack on every device;
    rows of a1, a2 and the base give their merged models' greedy tokens (float weights; int8: the
    one-device engine's over the same int8 weights, and those are the tokens of each adapter merged in
    float32 into the dequantized int8 weights: adapter slots over int8 serve, composed, not refused)."""
    import jax

    from flaxgpt import sharding

    mesh = launch.serving_mesh(4, 8)  # the base's vocabulary (300) and MLP (96) split 4 ways
    run, _ = launch.load(init_from=str(dirs / "base"), mesh=mesh, quantize=quantize)
    w = jax.tree.leaves(run.params["h_0"]["mlp"])[0]
    assert w.addressable_shards[0].data.size < w.size  # split, not copied
    kw = dict(
        slots=8, max_len=W, prefill_chunk=4, prefix_cache_tokens=128, prefix_block=4,
        adapters=[(n, str(dirs / n)) for n in ("a1", "a2")], max_adapters=2, max_lora_rank=8,
    )  # fmt: skip
    many = launch.scheduler_for(run.config, run.params, None, mesh=mesh, **kw)
    cases = [("a1", 2), ("a2", 2), (None, 2), ("a1", 0), ("a2", 1), (None, 3)]
    got = run_rows(many.engine, many.adapters, cases)[0]
    again, hits = run_rows(many.engine, many.adapters, cases[:3])
    assert again == got[:3] and hits == [4, 4, 4]
    if quantize is None:
        want = [reference[c] for c in cases]
    else:  # the same int8 weights on one device
        one_run, _ = launch.load(init_from=str(dirs / "base"), quantize=quantize)
        one = launch.scheduler_for(one_run.config, one_run.params, None, **kw)
        want = run_rows(one.engine, one.adapters, cases)[0]
        assert want == merged_over_int8(dirs, one_run, cases)
    assert got == want
    assert many.engine.state.fill_B.sharding.is_equivalent_to(sharding.batch_sharding(mesh), 1)


def test_expert_adapters_on_a_mixture_of_experts_match_merged(tmp_path):
    """A tiny Mixtral (transformers') and two PEFT adapters on its expert stacks (target_parameters, one
    with q too): rows of either adapter and of the base decode in one engine, each token through its
    row's slot of its expert's adapter pair (prefills: the sorted expert path; steps: the dense one),
    and give the greedy tokens of that adapter merged into the base."""
    from flaxgpt.hf import peft as hf_peft
    from flaxgpt.models import lora
    from tests.hf.test_moe import make_hf_model as make_moe
    from tests.models.test_multi_lora import random_adapters

    make_moe("mixtral", tmp_path / "base")
    config, params = flaxgpt.load_pretrained(str(tmp_path / "base"))
    targets = {"e1": (4, 8.0, "q,experts_gate_up,experts_down"), "e2": (2, 4.0, "experts_down")}
    for seed, (name, (r, alpha, t)) in enumerate(targets.items()):
        spec = lora.LoraSpec.make(config, r, alpha, targets=t)
        tree = random_adapters(config, spec, seed)
        hf_peft.export_adapter(config, spec, tree, str(tmp_path / name), base=str(tmp_path / "base"))
    prompts = [[1, 17, 42, 99, 5], [1, 120, 3, 77], [1, 8, 8, 60, 100, 31]]
    want = {  # the merged models' tokens: (adapter or None, prompt index) -> tokens
        (name, i): out
        for name in (None, "e1", "e2")
        for i, out in enumerate(
            references.greedy_rows(
                *flaxgpt.load_pretrained(str(tmp_path / "base"), adapter=name and str(tmp_path / name)),
                prompts, W, N,
            )
        )
    }  # fmt: skip
    for i in range(len(prompts)):  # else the comparison would pass with the expert adapters ignored
        assert len({tuple(want[name, i]) for name in (None, "e1", "e2")}) == 3, i
    sched = launch.scheduler_for(
        config, params, None, slots=4, max_len=W, prefill_chunk=16, prefix_cache_tokens=0,
        adapters=[(n, str(tmp_path / n)) for n in targets], max_adapters=2, max_lora_rank=4,
    )  # fmt: skip
    cases = [("e1", 0), (None, 1), ("e2", 2), ("e2", 0)]
    got = run_rows(sched.engine, sched.adapters, cases, prompts=prompts)[0]
    assert got == [want[c] for c in cases]
