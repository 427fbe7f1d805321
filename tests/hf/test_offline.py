"""Loading without the network (#55, docs/pretrained.md 'Offline'): `--init_from gpt2` finds a tiny GPT-2
that transformers wrote, copied into a Hugging Face cache as `hf download openai-community/gpt2` leaves it
and into a plain directory, with HF_HUB_OFFLINE=1; a name in neither is one line naming the cache it
looked in and the command that fills it. The sample.py process also shows that a CPU run with libtpu
installed (the tpu-aot extra) prints none of libtpu's log lines."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from huggingface_hub import constants

import flaxgpt
from flaxgpt.models.gpt import GPT

ROOT = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"  # any 40 hex digits: refs/main names the snapshot


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    """A 1-layer GPT-2 with GPT-2's vocabulary (sample.py encodes with GPT-2's BPE), saved by
    transformers; its logits for a few tokens."""
    directory = tmp_path_factory.mktemp("tiny_gpt2")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    tokens = np.array([[15496, 11, 314, 716]])  # "Hello, I am"
    with torch.no_grad():
        logits = model(torch.tensor(tokens)).logits.numpy()
    return directory, tokens, logits


def hub_cache(root: Path, directory: Path, repo: str = "openai-community/gpt2") -> Path:
    """`root` laid out as huggingface_hub's cache holding `directory`'s files as `repo`'s main."""
    entry = root / f"models--{repo.replace('/', '--')}"
    snapshot = entry / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(COMMIT)
    for f in ("config.json", "model.safetensors"):
        shutil.copy(directory / f, snapshot / f)
    return root


def logits_of(run, tokens):
    return np.asarray(GPT(run.config).apply({"params": run.params}, jnp.asarray(tokens)))


def test_gpt2_loads_offline_from_the_cache_and_from_a_directory(tiny_gpt2, tmp_path, monkeypatch):
    directory, tokens, ref = tiny_gpt2
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache(tmp_path / "cache", directory)))
    run = flaxgpt.load("gpt2")  # the name, from the cache: no directory of that name here
    assert run.config.n_layer == 1 and run.config.n_embd == 32
    np.testing.assert_allclose(logits_of(run, tokens), ref, atol=1e-4, rtol=0)
    np.testing.assert_allclose(logits_of(flaxgpt.load(str(directory)), tokens), ref, atol=1e-4, rtol=0)


def test_a_model_in_no_cache_is_one_line_naming_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.chdir(tmp_path)  # no folder named gpt2 where it looks first
    with pytest.raises(ConnectionError) as e:
        flaxgpt.load("gpt2")
    msg = str(e.value)
    assert "\n" not in msg and f"Hugging Face cache {tmp_path / 'empty'}, and HF_HUB_OFFLINE is set" in msg
    assert "hf download openai-community/gpt2" in msg and "pass a local directory with config.json" in msg


def test_sample_py_offline_from_the_cache_prints_no_libtpu_lines(tiny_gpt2, tmp_path):
    """The README's `python sample.py --init_from gpt2`, as a user without the network runs it: jax picks
    its platform itself (no JAX_PLATFORMS), so with libtpu installed it probes for a TPU."""
    directory, _, _ = tiny_gpt2
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub_cache(tmp_path / "cache", directory)))
    argv = ["--init_from", "gpt2", "--start", "Hello", "--max_new_tokens", "3", "--temperature", "0"]
    out = subprocess.run(
        [sys.executable, str(ROOT / "sample.py"), *argv],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("Hello")
    if tpu_chips() == 0:  # on a TPU machine libtpu's lines are its own: a TPU is there
        assert not [line for line in out.stderr.splitlines() if "libtpu" in line.lower() or "TPU" in line]


def tpu_chips() -> int:
    from jax._src import hardware_utils

    return hardware_utils.num_available_tpu_chips_and_device_id()[0]
