"""serve.py --mesh 8 over 8 CPU devices: a tiny random Llama directory (with a tokenizer.json) loaded
straight into its devices' slices (sharding.SERVE_RULES) and served to the openai client with the
greedy tokens one device gives; a mesh that does not fit is one line at start-up."""

import concurrent.futures
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import openai
import pytest

import flaxgpt
from flaxgpt.data.hf_tokenizer import HFTokenizer
from tests.hf.test_llama import make_hf_model
from tests.hf.test_llama_cli import make_tokenizer
from tests.procs import xla_flags
from tests.serve import references
from tests.serve.test_serve import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
W, N = 32, 10  # the window; new tokens per request
PROMPTS = [[1, 17, 42, 99, 5], [1, 250, 3, 77], [1, 8, 8, 160, 200, 31], [1, 64], [1, 300, 2, 9]]
# vocabulary 304 and MLP hidden 96 split 8 ways (SERVE_RULES); 304 is not a multiple of 3
V = 304


def env():
    return {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags()} | {
        "JAX_NUM_CPU_DEVICES": "8"
    }


def serve_cmd(directory, *args):
    return [sys.executable, str(ROOT / "serve.py"), "--init_from", str(directory), "--max_len", str(W), *args]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sharded") / "llama"
    make_hf_model("llama", directory, vocab_size=V)
    make_tokenizer(str(directory))
    return directory


@pytest.fixture(scope="module")
def server(llama):
    """serve.py --mesh 8, started (not yet waited for): 8 slots, one per device."""
    port = free_port()
    cmd = serve_cmd(llama, "--mesh", "8", "--slots", "8", "--port", str(port), "--model_name", "llama")
    cmd += ["--prefill_chunk", "16", "--prefix_cache_tokens", "0", "--chunk", "1"]  # 3 programs to compile
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield proc, f"http://127.0.0.1:{port}"
    proc.kill()
    proc.wait(timeout=30)


def one_device_tokens(directory) -> list[list[int]]:
    """The reference: each prompt's greedy tokens on one device (rows of one batch are independent)."""
    config, params = flaxgpt.load_pretrained(str(directory))
    assert {d for x in jax.tree.leaves(params) for d in x.devices()} == {jax.devices()[0]}
    return references.greedy_rows(config, params, PROMPTS, W, N)


def test_mesh_8_serves_the_one_device_tokens(llama, server):
    reference = one_device_tokens(llama)  # while the server compiles
    proc, url = server
    wait_healthy(proc, url)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    tok = HFTokenizer(str(llama))

    def complete(i):
        r = client.completions.create(
            model="llama", prompt=PROMPTS[i], max_tokens=N, temperature=0, extra_body={"ignore_eos": True}
        )
        return r.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # decoded together, in one batch
        texts = list(pool.map(complete, range(len(PROMPTS))))
    assert texts == [tok.decode(t) for t in reference]


def test_a_mesh_that_does_not_fit_is_one_line_at_start_up(llama):
    """More devices than there are and slots that do not split (before loading), a vocabulary the
    mesh does not divide (before any weight is read): ValueErrors, printed by serve.py as one line."""
    from flaxgpt import sharding
    from flaxgpt.serve import launch

    with pytest.raises(ValueError, match=r"^--slots 4 is not divisible by --mesh 8: each device holds"):
        launch.serving_mesh(8, slots=4)
    three = sharding.make_mesh(1, 3, jax.devices()[:3])
    with pytest.raises(ValueError) as e:
        launch.load(init_from=str(llama), mesh=three)
    assert str(e.value) == (
        "--mesh 3 does not divide this model: ['lm_head']['kernel'] has 304 along the axis serving "
        "splits (MLP hidden size, vocabulary); serve it over a --mesh that divides 304"
    )
    cmd = serve_cmd(llama, "--mesh", "16")
    r = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "error: --mesh 16 asks for 16 devices; this cpu backend has 8: use --mesh 1..8"
    ], r.stderr[-3000:]
