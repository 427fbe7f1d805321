"""benchmarks/gpu_lease.py on the CPU (--dry_run, tiny shapes): its parts run and report rows, a part
that fails or runs out of time costs its own rows only, and its process group is ended with it."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import xla_flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # its `import harness`, as `python benchmarks/...` finds it
_spec = importlib.util.spec_from_file_location("gpu_lease", ROOT / "benchmarks/gpu_lease.py")
lease = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lease)


def test_dry_run_parts_report_rows_and_failures(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [sys.executable, "benchmarks/gpu_lease.py", "--dry_run", "--out", str(out), "--work", str(work)]
    cmd += [
        "--parts",
        "kernel_sweep,decode_attention,recipe,decode_gpt2,fused_loss,fp8_moe,nanogpt",
        "--nanogpt_model",
        str(tmp_path / "absent.py"),
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    # one device, as on the lease; the suite's faster-compiling CPU emitters kept (tests/conftest.py)
    env["XLA_FLAGS"] = xla_flags()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = json.loads((out / "lease.json").read_text())
    by_part = {}
    for r in rows:
        by_part.setdefault(r["part"], []).append(r)
    # kernel_sweep.py's dry run (one tiny shape, interpreted): the ceiling, the best of its 2 tilings per
    # kernel (bf16's weights also as rows) at 1 and 4 rows against XLA's, the three MoE products; every
    # row in OUT/kernel_sweep.json
    sweep = {r["what"]: r for r in by_part["kernel_sweep"]}
    assert next(w for w in sweep).startswith("copy ceiling") and len(sweep) == 1 + 8 + 3 + 1, list(sweep)
    for w in ("bf16", "int8", "int4", "bf16_rows"):
        assert sweep[f"tiny tiny {w} M=1: best of 2 tilings"]["best_gbps"] > 0
        assert sweep[f"tiny tiny {w} M=4: best of 1 tilings"]["xla_gbps"] > 0
    moe = [r for w, r in sweep.items() if w.startswith("MoE ")]
    assert [r["what"].split(":")[0] for r in moe] == [
        "MoE dense dots over static groups", "MoE moe.tiled_grouped_matmul", "MoE jax.lax.ragged_dot"
    ] and all(r["step_ms"] > 0 for r in moe)  # fmt: skip
    assert sweep["20 GEMV rows, 0 skipped by the budget"]["result"] == "kernel_sweep.json"
    swept = json.loads((out / "kernel_sweep.json").read_text())
    assert all(r["ok"] for r in swept if r["section"] == "gemv")  # each tiling's output the float32 product's
    # the best tilings as kernels.tuned's file (FLAXGPT_GEMV_TILES), brought back in OUT: each kernel of
    # the tiny shape (w [256, 64]) at 1 and 4 rows
    tiles = json.loads((out / "gemv_tiles.json").read_text())["tiles"]
    kernels = ("bf16", "bf16_rows", "int8", "int4_g128")
    assert sorted((e["kernel"], e["M"]) for e in tiles) == sorted((k, M) for k in kernels for M in (1, 4))
    assert all((e["N"], e["K"]) == (64, 256) and len(e["tiles"]) == 5 for e in tiles)
    # decode_attention.py's dry run: XLA's path and the kernel (interpreted) at 2 tiny cases, the same outputs
    attention = [r["what"] for r in by_part["decode_attention"]]
    assert attention == [f"tiny attention, cache {S}, position {p}" for S, p in ((64, 10), (128, 127))]
    assert all(" us a layer: " in r["result"] and r["us"] > 0 for r in by_part["decode_attention"])
    attention = json.loads((out / "decode_attention.json").read_text())
    assert [r["ok"] for r in attention if r["form"] == "kernel"] == [True] * 2
    recipe = by_part["recipe"][0]
    assert recipe["tokens_per_s"] > 0 and recipe["step_ms"] > 0  # read back from the run's metrics.jsonl
    decodes = {r["what"]: r for r in by_part["decode_gpt2"] if r["what"].startswith("decode ")}
    kinds = (
        "float",
        "float+attention",
        "bf16",
        "int8",
    )  # +attention: the attention kernel alone, interpreted
    assert set(decodes) == {f"decode tiny {m} batch 1" for m in kinds}
    assert all(r["tokens_per_s"] > 0 for r in decodes.values())
    assert len(decodes) == len(by_part["decode_gpt2"])  # profiles are the profile parts' (below)
    fused = {r["what"].rpartition(" ")[2]: r for r in by_part["fused_loss"]}  # logits, fused, pallas
    assert set(fused) == {"logits", "fused", "pallas"} and all(r["step_ms"] > 0 for r in fused.values())
    # the same step from the same start: the same loss whichever path computes it
    assert abs(float(fused["fused"]["result"][5:]) - float(fused["logits"]["result"][5:])) < 1e-3
    # the mixture's layer (fp8_layer.py --preset mixtral-8x7b: 4 experts, top 2 here), its experts in float8
    moe = {r["what"].rpartition(" ")[2]: r for r in by_part["fp8_moe"]}
    assert set(moe) == {"bf16", "fp8", "fp8_experts"} and all(r["tokens_per_s"] > 0 for r in moe.values())
    assert moe["fp8_experts"]["result"].endswith("x bf16 (target >= 1.3x)")
    assert moe["fp8"]["what"].startswith("Mixtral-8x7B layer fwd+bwd, 64 tokens")
    assert moe["fp8"]["result"].endswith("x bf16 (target >= 1.3x)")
    # the missing nanoGPT file is that part's one row, named in it; the other parts are unaffected
    assert by_part["nanogpt"][0]["what"].startswith("exit 1: no nanoGPT model.py at")
    assert "| recipe | train.py configs/shakespeare_char_cpu.py" in p.stdout
    assert "===== decode_gpt2" in (out / "logs.txt").read_text()


def test_each_group_fits_one_call_and_sweeps_before_the_parts_taking_its_tilings():
    """A group is one device call of at most 10 minutes: its parts' limits add up to 600 s at most. The
    parts that take kernel_sweep's tilings (FLAXGPT_GEMV_TILES: *_pallas, *_kernels, *_profile) come
    after it where a group holds both, so they measure the card's tilings in the same call."""
    for name, parts in lease.GROUPS.items():
        assert sum(lease.PARTS[p] for p in parts) <= 600, (name, parts)
        if "kernel_sweep" in parts:
            takers = [p for p in parts if p.endswith(("_pallas", "_kernels", "_profile"))]
            assert all(parts.index("kernel_sweep") < parts.index(p) for p in takers), (name, parts)
    assert {"decode_llama8b_pallas", "decode_gpt2_kernels"} <= set(lease.GROUPS["targets"])


def test_the_sweeps_programs_compile_for_an_h100():
    """kernel_sweep.py --compile_for (its dry-run plan: 2 tilings of each kernel and layout, XLA's
    products, the three MoE forms) on this CPU: every program compiles, each kernel call one Triton
    custom call."""
    pytest.importorskip("jax_cuda12_plugin", reason="the GPU targets need the CUDA plugin (not in CI)")
    cmd = [sys.executable, "benchmarks/kernel_sweep.py", "--dry_run", "--compile_for", "h100-1"]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    p = subprocess.run(cmd, cwd=ROOT, env=dict(env, JAX_PLATFORMS="cpu"), capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    gemv = [r for r in rows if "impl" in r]
    # bf16, its rows layout, int8, int4; 1 row: 3 each; 4 rows: 2
    assert len(gemv) == 4 * (3 + 2) and not any("error" in r for r in gemv)
    assert all(r["triton_calls"] == (r["calls"] if r["impl"] == "pallas" else 0) for r in gemv)
    moe = {r["what"]: r for r in rows if "what" in r}
    assert moe["MoE dense dots over static groups"]["flops_x"] == 1.0
    assert moe["MoE jax.lax.ragged_dot"]["flops_x"] >= 1.0  # jaxlib 0.10.2: 4.0, every group over every row
    last = p.stdout.splitlines()[-1]
    assert last.startswith("23 programs compiled for h100-1 in ") and last.endswith(" s, 0 failed"), last


def test_the_attention_programs_compile_for_an_h100_in_place():
    """decode_attention.py --compile_for h100-1: every case's two programs compile; the kernel's is its
    call and one q | k | v fusion a layer where XLA's path takes 3-6, and neither copies a cache
    buffer (donated: written in place, as decoding's)."""
    pytest.importorskip("jax_cuda12_plugin", reason="the GPU targets need the CUDA plugin (not in CI)")
    cmd = [sys.executable, "benchmarks/decode_attention.py", "--compile_for", "h100-1"]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    p = subprocess.run(cmd, cwd=ROOT, env=dict(env, JAX_PLATFORMS="cpu"), capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    assert len(rows) == 2 * 6 and not any(r["cache_copies"] for r in rows)
    # caches over SPAN positions: their ranges' softmax terms merged by XLA after the kernel, a kernel more
    # at most (here fused with the program's stack of the outputs)
    from flaxgpt.kernels.pallas_decode_attention import SPAN

    assert all(r["kernels_a_layer"] < (2.1 if r["S"] <= SPAN else 3.1) for r in rows if r["form"] == "kernel")
    assert all(r["kernels_a_layer"] > 3 for r in rows if r["form"] == "xla")


def test_a_part_out_of_time_is_one_row_and_leaves_nothing_running(tmp_path, monkeypatch):
    a = lease.main.__globals__["argparse"].Namespace(
        out=tmp_path, work=tmp_path, dry_run=True, nanogpt_model=tmp_path / "x.py", recipe_args=[],
        gpt2_batches=(1,), llama_batches=(1,), test_paths="tests", test_workers=2, gemv_tiles=tmp_path / "t",
        profile_tokens=0,
    )  # fmt: skip
    # a part whose process starts a child that would outlive it
    script = tmp_path / "sleeper.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        'print(\'ROW {"part": "slow", "what": "started"}\', flush=True)\n'
        "time.sleep(60)\n"
    )
    monkeypatch.setattr(lease, "__file__", str(script))
    rows = lease.run_part(a, "slow", 3)
    assert [r["what"] for r in rows][0] == "started"
    assert rows[-1]["what"].startswith("time limit 3 s") and rows[-1]["part_s"] < 30
    left = subprocess.run(["pgrep", "-f", "time.sleep\\(60\\)"], capture_output=True, text=True).stdout
    assert not left.strip()


@pytest.mark.parametrize(
    "part, preset, args, sides",
    [
        ("grouped_moe", "mixtral-8x7b", ["--grouped", "pallas"], ["bf16", "fp8", "fp8_experts"]),
        ("fp8", "llama-3-8b", [], ["bf16", "fp8"]),
    ],
)
def test_fp8_layer_parts_run_its_script_and_report_a_row_a_side(tmp_path, monkeypatch, capsys, part, preset,
                                                                args, sides):  # fmt: skip
    """The parts over fp8_layer.py: fp8 (a Llama-3-8B layer, bf16 then float8) and grouped_moe (the
    Mixtral layer with --grouped pallas, FLAXGPT_GROUPED; the script's own dry run of that is 27 s, too
    slow for here: the command and the rows are checked, with fp8_layer.py's output stood in by the
    figures it writes). fp8_moe runs the same helper for real in the dry run above."""
    import argparse

    ran = []

    def fake_run(cmd, **kw):
        ran.append(cmd)
        figures = {"step_ms": 2.0, "tokens_per_s": 32.0, "compile_s": 1.0}
        result = {"tokens_per_step": 64, "speedup": 1.5, **{s: figures for s in sides}}
        if "fp8_experts" in sides:
            result["speedup_fp8_experts"] = 0.5
        Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(result))

    monkeypatch.setattr(lease.subprocess, "run", fake_run)
    getattr(lease, f"part_{part}")(argparse.Namespace(work=tmp_path, dry_run=True))
    (cmd,) = ran
    assert cmd[1].endswith("benchmarks/fp8_layer.py") and cmd[cmd.index("--preset") + 1] == preset
    assert cmd[cmd.index("--json") + 2 : -1] == args and cmd[-1] == "--dry_run"
    rows = lease.rows_in(capsys.readouterr().out)
    assert [r["what"].rpartition(" ")[2] for r in rows] == sides and all(r["part"] == part for r in rows)
    expected = [None, "1.5x bf16 (target >= 1.3x)", "0.5x bf16 (target >= 1.3x)"][: len(sides)]
    assert [r["result"] for r in rows] == expected
    assert ("Pallas grouped GEMM" in rows[0]["what"]) == (part == "grouped_moe")


def test_the_step_profile_part_profiles_its_step(tmp_path, capfd, monkeypatch):
    """The part step_profile: train_throughput.py --profile (for real, on the CPU: 3 steps timed, 3
    profiled), its row, then the profile's against the timed step, its heaviest ops in
    OUT/profiles.json."""
    import argparse

    monkeypatch.delenv("JAX_NUM_CPU_DEVICES")  # one device, as on the lease (the step's process inherits)
    monkeypatch.setenv("XLA_FLAGS", xla_flags())
    lease.part_step_profile(argparse.Namespace(work=tmp_path, out=tmp_path, dry_run=True))
    step, prof = lease.rows_in(capfd.readouterr().out)
    assert step["what"] == "train step, batch 12, attention auto"
    assert step["part"] == prof["part"] == "step_profile"
    assert prof["what"] == "profile " + step["what"] and prof["kernels_per_step"] > 10
    timed = f"of the timed {1000 * step['step_ms']:.1f} us"
    assert " kernels a step, device busy " in prof["result"] and timed in prof["result"], prof["result"]
    (saved,) = json.loads((tmp_path / "profiles.json").read_text())
    assert saved["part"] == "step_profile" and saved["per"] == 3 and saved["top"]


def test_epilogues_times_the_step_fused_then_plain(tmp_path, monkeypatch, capsys):
    """The part epilogues: train_throughput.py twice, FLAXGPT_EPILOGUES on then off (read when the step is
    traced), a row each with its loss (the dry run above runs the same helper for real in fused_loss)."""
    import argparse

    ran = []

    def fake_run(cmd, env=None, **kw):
        ran.append((cmd, env["FLAXGPT_EPILOGUES"]))
        figures = dict(batch_size=4, tokens_per_s=10.0, mfu=0.1, step_ms=3.0, peak_memory_gib=0.5, loss=4.25)
        Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(figures))

    monkeypatch.setattr(lease.subprocess, "run", fake_run)
    lease.part_epilogues(argparse.Namespace(work=tmp_path, dry_run=True))
    assert [e for _, e in ran] == ["on", "off"]
    assert all(c[1].endswith("benchmarks/train_throughput.py") and "--step" in c for c, _ in ran)
    rows = lease.rows_in(capsys.readouterr().out)
    assert [r["what"] for r in rows] == [
        f"train step, batch 4, MLP and q/k/v epilogues {m}" for m in ("fused", "plain")
    ] and all(r["result"] == "loss 4.25" and r["part"] == "epilogues" for r in rows)  # fmt: skip


def test_a_plus_attention_row_traces_its_weights_with_the_attention_kernel(tmp_path, monkeypatch, capsys):
    """decode_gpt2's "float+attention": the float row's weights decoded with FLAXGPT_DECODE_KERNELS=
    attention while its step is traced (the caches cleared first: the float row's trace of the same
    config is not reused), the other rows with the part's own mode; its rows at batch 1 only when the
    batch is more than the kernels' rows (64 > MAX_ROWS: XLA's path, a row of its own would repeat
    the float one)."""
    import argparse

    import jax
    import numpy as np

    from flaxgpt.decode import sampling

    calls, cleared = [], []

    def fake_generate(step_fn, cache, prompt, lens, max_new_tokens, **kw):
        calls.append((prompt.shape[0], os.environ.get("FLAXGPT_DECODE_KERNELS")))
        return None, np.full(prompt.shape[0], max_new_tokens)

    monkeypatch.setattr(sampling, "generate", fake_generate)
    monkeypatch.setattr(jax, "clear_caches", lambda: cleared.append(len(calls)))
    monkeypatch.setenv("FLAXGPT_DECODE_KERNELS", "off")
    from flaxgpt.models.gpt import GPTConfig

    a = argparse.Namespace(work=tmp_path, dry_run=True, part="decode_gpt2", bandwidth=None, profile_tokens=0)
    cfg = GPTConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=32, block_size=64)
    lease._decode(a, cfg, "tiny", (1, 64), ("float", "float+attention", "bf16"), 8)
    # each mode: a compiling run, then the best of 2
    assert calls == [(1, m) for m in ("off", "attention", "off") for _ in range(3)] + [(64, "off")] * 6
    assert cleared == [0, 3, 6, 9, 12]  # before each mode's first (compiling) run
    rows = lease.rows_in(capsys.readouterr().out)
    assert [r["what"] for r in rows] == [
        "decode tiny float batch 1", "decode tiny float+attention batch 1", "decode tiny bf16 batch 1",
        "decode tiny float batch 64", "decode tiny bf16 batch 64",
    ]  # fmt: skip


def test_decode_kernels_part_decodes_batch_1_through_the_kernels(tmp_path, monkeypatch, capsys):
    """The part decode_gpt2_kernels: FLAXGPT_DECODE_KERNELS=on before the step is traced, the float and
    bf16 weights at batch 1 only (the kernels take one row); decode_gpt2 runs the same function for
    real in the dry run above, so generate is stood in for here (the kernels' tokens:
    tests/models/test_decode_kernels.py); with kernel_sweep's tilings in --gemv_tiles, the same with
    FLAXGPT_GEMV_TILES naming them."""
    import argparse

    import numpy as np

    from flaxgpt.decode import sampling

    calls = []

    def fake_generate(step_fn, cache, prompt, lens, max_new_tokens, **kw):
        env = [os.environ.get(f"FLAXGPT_{v}") for v in ("DECODE_KERNELS", "GEMV_TILES")]
        calls.append((prompt.shape[0], *env, kw["temperature"]))
        return None, np.full(prompt.shape[0], max_new_tokens)

    monkeypatch.setattr(sampling, "generate", fake_generate)
    monkeypatch.setenv("FLAXGPT_DECODE_KERNELS", "off")  # restored after the test; the part sets "on"
    monkeypatch.setenv("FLAXGPT_GEMV_TILES", "")  # restored (unset) after the test
    tiles = tmp_path / "gemv_tiles.json"
    a = argparse.Namespace(
        work=tmp_path,
        dry_run=True,
        part="decode_gpt2_kernels",
        bandwidth=None,
        gemv_tiles=tiles,
        profile_tokens=0,
    )
    for swept in ("", ", swept tiles"):
        calls.clear()
        lease.part_decode(a, "gpt2")
        # each weight type: a compiling run, then the best of 2
        assert calls == [(1, "on", str(tiles) if swept else "", 0)] * 6
        rows = lease.rows_in(capsys.readouterr().out)
        assert [r["what"] for r in rows] == [
            f"decode tiny (decode kernels{swept}) {m} batch 1" for m in ("float", "bf16")
        ]
        assert all(r["tokens_per_s"] > 0 and r["part"] == "decode_gpt2_kernels" for r in rows)
        tiles.write_text('{"tiles": []}')  # kernel_sweep's file (here with no entry)


def test_decode_profile_part_times_then_profiles_each_row(tmp_path, monkeypatch, capsys):
    """The part decode_gpt2_profile: at batch 1 only, each mode (the decode kernels' among them, with
    kernel_sweep's tilings where the file exists) timed, then decoded again for --profile_tokens under
    the profiler: a profile row after each timed row, OUT/profiles.json; a profiler that fails is its
    row's error, the next mode still runs. generate is stood in for (the profiler itself:
    tests/test_device_profile.py)."""
    import argparse

    import device_profile
    import numpy as np

    from flaxgpt.decode import sampling

    calls = []

    def fake_generate(step_fn, cache, prompt, lens, max_new_tokens, **kw):
        calls.append((prompt.shape[0], max_new_tokens, os.environ.get("FLAXGPT_DECODE_KERNELS")))
        return None, np.full(prompt.shape[0], max_new_tokens)

    profiled = []

    def fake_profile(run, per, module):
        run()
        profiled.append((per, module))
        if len(profiled) == 2:
            raise RuntimeError("the trace holds no device events")
        top = [dict(op="fusion.1", count_per=1.0, us_per=5.0, mean_us=5.0)]
        return dict(per=per, kernels_per=72.0, busy_us_per=100.0, sum_us_per=100.0, wall_us_per=300.0,
                    unattributed=0, top=top)  # fmt: skip

    monkeypatch.setattr(sampling, "generate", fake_generate)
    monkeypatch.setattr(device_profile, "profile", fake_profile)
    monkeypatch.setenv("FLAXGPT_DECODE_KERNELS", "off")
    monkeypatch.setenv("FLAXGPT_GEMV_TILES", "")
    (tmp_path / "tiles.json").write_text('{"tiles": []}')
    a = argparse.Namespace(
        work=tmp_path, out=tmp_path, dry_run=True, part="decode_gpt2_profile", bandwidth=None,
        gemv_tiles=tmp_path / "tiles.json", profile_tokens=5,
    )  # fmt: skip
    lease.part_decode(a, "gpt2")
    modes = ("off", "attention", "on", "on")  # float, float+attention, float+on, bf16+on
    assert calls == [c for m in modes for c in [(1, 8, m)] * 3 + [(1, 5, m)]]  # compile, best of 2, profile
    assert profiled == [(4, "decode_chunk")] * 4  # 5 tokens, the first the prefill's
    assert os.environ["FLAXGPT_GEMV_TILES"] == str(tmp_path / "tiles.json")
    rows = lease.rows_in(capsys.readouterr().out)
    names = ("float", "float+attention", "float+on", "bf16+on")
    label = "tiny (swept tiles)"
    assert [r["what"] for r in rows] == [
        w for m in names for w in (f"decode {label} {m} batch 1", f"profile {label} {m} batch 1")
    ]
    assert rows[3]["result"] == "RuntimeError: the trace holds no device events"
    assert rows[1]["result"].startswith("72.0 kernels a token, device busy 100.0 of the timed ")
    assert [p["what"] for p in json.loads((tmp_path / "profiles.json").read_text())] == [
        f"{label} {m} batch 1" for m in ("float", "float+on", "bf16+on")
    ]
