"""benchmarks/grpo_seeds.py: the seeds' table, mean and worst from their metrics.jsonl, the CPU kind,
a real run of train.py per seed (progress printed, the table from what the run logged), and its
refusals: an existing run directory left as it is, a failing run's one line."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the configs/ package
_spec = importlib.util.spec_from_file_location("grpo_seeds", ROOT / "benchmarks/grpo_seeds.py")
seeds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(seeds)

from configs import grpo_toy  # noqa: E402
from flaxgpt.data import prepare  # noqa: E402


def write_run(run_dir: Path, curve: dict[int, float]) -> None:
    run_dir.mkdir(parents=True)
    rows = [{"step": s, "time": 0.0, "val_reward": v, "best_val_loss": None} for s, v in curve.items()]
    rows.insert(1, {"step": 1, "loss": 0.5})  # a training step's line: no val_reward
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_mean_worst_and_columns(tmp_path):
    curves = {0: {0: 0.1, 50: 0.4, 100: 0.8}, 1: {0: 0.2, 50: 0.3, 100: 0.5}, 2: {0: 0.1, 50: 0.9, 100: 0.9}}
    table, summary = seeds.report(curves, every=50)
    assert summary["finals"] == {0: 0.8, 1: 0.5, 2: 0.9}
    assert summary["mean"] == pytest.approx((0.8 + 0.5 + 0.9) / 3) and summary["worst"] == 0.5
    lines = table.splitlines()
    assert lines[0] == "| step | 0 | 50 | 100 |" and lines[1] == "| --- | ---: | ---: | ---: |"
    assert lines[3] == "| val_reward, seed 1 | 0.2 | 0.3 | **0.5** |"
    # about 8 columns on the evaluations' steps: every 50 of 400 evaluated each 10; 60 of 500 each 5
    ten = {s: 0.5 for s in range(0, 401, 10)}
    assert (
        seeds.report({0: ten})[0].splitlines()[0]
        == "| step | " + " | ".join(map(str, range(0, 401, 50))) + " |"
    )
    five = {s: 0.5 for s in range(0, 501, 5)}
    assert seeds.report({0: five})[0].splitlines()[0].endswith("| 420 | 480 | 500 |")
    # a seed that stopped early: its last evaluation is its final, in bold where the others have none
    table, summary = seeds.report({0: {0: 0.1, 100: 0.6}, 1: {0: 0.1, 40: 0.7}}, every=100)
    assert summary["finals"] == {0: 0.6, 1: 0.7}
    assert table.splitlines()[3] == "| val_reward, seed 1 | 0.1 | **0.7** |"
    with pytest.raises(ValueError, match="seed\\(s\\) \\[1\\] logged no val_reward"):
        seeds.report({0: {0: 0.1}, 1: {}})
    write_run(tmp_path / "r", {0: 0.25, 10: 0.5})
    with open(tmp_path / "r/metrics.jsonl", "a") as f:
        f.write('{"step": 20, "val_rew')  # the line train.py is writing as the run is read
    assert seeds.read_curve(tmp_path / "r") == {0: 0.25, 10: 0.5}


def test_cpu_kind_reads_the_vector_width():
    info = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 {}\n\nprocessor\t: 1\n"
    assert seeds.cpu_kind(info.format("avx512f avx512bw")) == "AMD EPYC, AVX-512, 2 cores"
    assert seeds.cpu_kind(info.format("")) == "AMD EPYC, AVX2, 2 cores"


def test_report_only_tabulates_and_existing_runs_are_left_alone(tmp_path, capsys):
    for s, final in ((0, 0.9), (1, 0.7)):
        write_run(tmp_path / f"runs_s{s}", {0: 0.1, 20: final})
    config = str(ROOT / "configs/grpo_toy.py")
    prefix = str(tmp_path / "runs")
    seeds.main(["--config", config, "--seeds", "0,1", "--out_prefix", prefix, "--report_only"])
    out = capsys.readouterr().out
    assert "| val_reward, seed 1 | 0.1 | **0.7** |" in out
    assert "mean 0.800, worst 0.700" in out and ("AVX-512" in out or "AVX2" in out)
    before = (tmp_path / "runs_s0/metrics.jsonl").read_text()
    with pytest.raises(SystemExit):  # train.py would resume them: refused, nothing run or written
        seeds.main(["--config", config, "--seeds", "0", "--out_prefix", prefix])
    assert "exist(s) (train.py would resume them)" in capsys.readouterr().err
    assert (tmp_path / "runs_s0/metrics.jsonl").read_text() == before
    assert not (tmp_path / "runs_s0.log").exists()


def test_a_seed_runs_train_py_and_a_failing_run_is_one_line(tmp_path):
    grpo_toy.write_prompts(tmp_path / "toy.jsonl", n=80)
    prepare.main(["--dataset", "prompts", "--input", str(tmp_path / "toy.jsonl"), "--tokenizer", "char",
                  "--out_dir", str(tmp_path / "data")])  # fmt: skip
    script, config = str(ROOT / "benchmarks/grpo_seeds.py"), str(ROOT / "configs/grpo_toy.py")
    cmd = [sys.executable, script, "--config", config]
    tiny = ["max_iters=2", "eval_interval=1", "batch_size=8", "model.n_layer=1", "grpo.num_generations=4"]
    tiny += ["grpo.eval_prompts=8", f"data.dir={tmp_path / 'data'}", "tensorboard=False", "plot=False"]
    run = cmd + ["--seeds", "3", "--out_prefix", str(tmp_path / "toy"), *(f"--set={kv}" for kv in tiny)]
    p = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-1500:] + p.stderr[-1500:]
    logged = seeds.read_curve(tmp_path / "toy_s3")
    assert sorted(logged) == [0, 1, 2]  # evaluations at steps 0, 1, 2, each printed as it landed
    for step, value in logged.items():
        assert f"seed 3 step {step}: val_reward {value:.3f}" in p.stdout
    assert f"| val_reward, seed 3 | {logged[0]:.3g} | {logged[1]:.3g} | **{logged[2]:.3g}** |" in p.stdout
    assert f"mean {logged[2]:.3f}, worst {logged[2]:.3f}" in p.stdout
    # a run train.py refuses: its last line, the seed and the log named, in one line
    bad = cmd + ["--seeds", "0", "--out_prefix", str(tmp_path / "bad"), *(f"--set={kv}" for kv in tiny)]
    bad.append("--set=grpo.num_generations=0")
    p = subprocess.run(bad, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith("grpo_seeds: seed 0: train.py exited 1: ") and "bad_s0.log" in p.stderr
