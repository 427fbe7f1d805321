"""sample.py on a tiny run directory saved by flaxgpt.runs.checkpoint: output, streaming, seeds, bad input."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from flaxgpt.data.tokenizers import CharTokenizer
from flaxgpt.models.gpt import GPTConfig, init_params
from flaxgpt.runs.checkpoint import Checkpointer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import sample  # noqa: E402
from tests.procs import xla_flags  # noqa: E402

CHARS = sorted(set("abcdefghij ROMEO:\n"))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    cfg = GPTConfig(vocab_size=len(CHARS), block_size=16, n_layer=1, n_head=2, n_embd=16)
    (out / "config.json").write_text(json.dumps({"model": {"kind": "gpt", **cfg.to_dict()}}))
    (out / "meta.json").write_text(json.dumps({"tokenizer": CharTokenizer(CHARS).to_meta()}))
    ckpt = Checkpointer(out, async_save=False)
    ckpt.save(3, {"params": init_params(cfg, jax.random.key(0))}, extra={})
    ckpt.close()
    return out


def sample_main(capsys, *args):
    code = sample.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_single_sample_streams_same_seed_same_text(run_dir, capsys):
    args = ["--out_dir", str(run_dir), "--start", "ROMEO:", "--max_new_tokens", "40", "--seed", "3"]
    code, out, _ = sample_main(capsys, *args)
    assert code == 0 and out.startswith("ROMEO:") and len(out) == len("ROMEO:") + 40 + 1
    assert sample_main(capsys, *args)[1] == out
    assert sample_main(capsys, *args[:-1], "4")[1] != out
    # streaming (one row, 16-token chunks) equals the batched path: same row of a 2-sample batch
    code, out2, _ = sample_main(capsys, *args, "--num_samples", "2")
    assert out2.split("\n" + sample.SEPARATOR + "\n")[0] == out.rstrip("\n")


def test_prompts_file_and_greedy(run_dir, tmp_path, capsys):
    (tmp_path / "p.txt").write_text("abc\n\nROMEO:\n")
    code, out, _ = sample_main(
        capsys,
        "--out_dir",
        str(run_dir),
        "--prompts_file",
        str(tmp_path / "p.txt"),
        "--num_samples",
        "2",
        "--temperature",
        "0",
        "--max_new_tokens",
        "30",
    )
    parts = out.split(sample.SEPARATOR + "\n")
    assert code == 0 and len(parts) == 5 and parts[-1] == ""
    assert parts[0].startswith("abc") and parts[2].startswith("ROMEO:")
    assert parts[0] == parts[1] and parts[2] == parts[3]  # greedy: both samples agree


def test_long_and_empty_prompts_warn(run_dir, capsys):
    code, out, err = sample_main(
        capsys,
        "--out_dir",
        str(run_dir),
        "--start",
        "abcdefghij" * 3,
        "--max_new_tokens",
        "20",
        "--step",
        "3",
    )
    assert code == 0 and "longer than the context (16)" in err and out.startswith("efghij" + "abcdefghij")
    code, out, err = sample_main(capsys, "--out_dir", str(run_dir), "--start", "", "--max_new_tokens", "5")
    assert code == 0 and "empty prompt: starting from '\\n'" in err


def test_init_from_gpt2_directory_and_empty_prompt(tmp_path, capsys):
    from flaxgpt.hf.pretrained import export_pretrained

    cfg = GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=16)  # GPT-2's vocabulary, tiny body
    export_pretrained(cfg, init_params(cfg, jax.random.key(1)), str(tmp_path / "hf"))
    args = ["--init_from", str(tmp_path / "hf"), "--max_new_tokens", "8", "--temperature", "0"]
    code, out, err = sample_main(capsys, *args, "--start", "")
    assert code == 0 and "<|endoftext|>" not in out and out.endswith("\n"), err
    code, out2, err = sample_main(capsys, *args, "--start", "Hello", "--num_samples", "2")
    assert code == 0 and out2.startswith("Hello") and out2.count(sample.SEPARATOR) == 2, err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--start", "ROMEO: xyz"], "characters not in the vocabulary: 'xyz'"),
        (["--top_p", "0"], "top_p must be in (0, 1], got 0.0"),  # flaxgpt.decode.sampling's own words
        (["--top_p", "1.5"], "top_p must be in (0, 1], got 1.5"),
        (["--temperature", "-1"], "temperature must be a finite number >= 0 (0 = greedy), got -1.0"),
        (["--top_k", "-2"], "top_k must be >= 0 (0 = no top-k), got -2"),
        (["--num_samples", "0"], "--num_samples must be >= 1, got 0"),
        (["--step", "99"], "99"),
    ],
)
def test_bad_input_is_one_line(run_dir, capsys, args, message):
    code, _, err = sample_main(capsys, "--out_dir", str(run_dir), *args)
    assert code == 1 and message in err and err.startswith("error: ")
    assert len(err.strip().splitlines()) == 1, err


def test_cli_subprocess_and_missing_checkpoint(run_dir, tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(), JAX_NUM_CPU_DEVICES="1")
    cmd = [sys.executable, str(ROOT / "sample.py"), "--max_new_tokens", "12", "--start", "abc"]
    r = subprocess.run(
        [*cmd, "--out_dir", str(run_dir)], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and r.stdout.startswith("abc") and len(r.stdout) == 3 + 12 + 1, r.stderr
    assert re.search(rf"^loaded {re.escape(str(run_dir))} step \d+ \(the latest\)$", r.stderr, re.M), r.stderr
    r = subprocess.run(
        [*cmd, "--out_dir", str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("error: ") and str(tmp_path) in r.stderr, r.stderr
