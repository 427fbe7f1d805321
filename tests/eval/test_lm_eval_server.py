"""lm-eval's `local-completions` model pointed at serve.py scores as `flaxgpt eval` does in-process.

What lm-eval 0.4 sends for a log-likelihood request (lm_eval/models/openai_completions.py,
api_models.py): the context and continuation as token ids from its own Hugging Face tokenizer
(`prompt: [[ids]]`, one request per pair with batch_size 1), `echo: true`, `max_tokens: 1`,
`logprobs: 1`, `temperature: 0`; it reads `token_logprobs[ctxlen:-1]` (the continuation: the prompt's
first entry is None, the last is the generated token's) and calls a continuation greedy when each of
its tokens' logprob equals the largest of `top_logprobs` at that position. It keeps one position
for that generated token: inputs are cut to `max_length - 1` tokens, one fewer than Hugging Face's
(and flaxgpt eval's) window, so every text here fits the window and the two agree to the example.

Half the LAMBADA texts end in the model's own greedy next word, so `acc` (the is-greedy test, which
needs a chosen token's logprob bit-equal to the top one's) is neither 0 nor 1.
"""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval's API models retry with it (lm-eval[api])

from flaxgpt.eval import evaluate as fe  # noqa: E402
from flaxgpt.eval.reference import results_by_task  # noqa: E402
from tests.eval.test_eval import sentence, write_hellaswag  # noqa: E402
from tests.procs import xla_flags  # noqa: E402
from tests.serve.test_serve import free_port, wait_healthy  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 64


def greedy_texts(model, tok, rng, k):
    """k texts whose last word is the model's greedy next token (one token, the same when re-encoded)."""
    out = []
    for _ in range(500):
        context = sentence(rng, rng.randint(3, 20))
        ids = tok.encode(context)
        with torch.no_grad():
            g = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        word = tok.decode([g])
        if word[:1] == " " and word[1:].isalpha() and tok.encode(context + word) == ids + [g]:
            out.append(context + word)
            if len(out) == k:
                return out
    raise AssertionError(f"only {len(out)} of {k} greedy texts in 500 tries")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny random GPT-2 (block 64) as Hugging Face files, HellaSwag and LAMBADA files that fit it."""
    from flaxgpt.eval.reference import write_gpt2_tokenizer

    root = tmp_path_factory.mktemp("lm_eval_server")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=BLOCK)
    ).eval()
    model.save_pretrained(root / "model")
    write_gpt2_tokenizer(root / "model")
    tok = transformers.AutoTokenizer.from_pretrained(root / "model")
    rng = random.Random(0)
    write_hellaswag(root / "hellaswag.jsonl", rng, 8)
    texts = [sentence(rng, n) for n in (5, 9, 14, 3, 25)] + greedy_texts(model, tok, rng, 4)
    assert max(len(tok.encode(t)) for t in texts) < BLOCK
    with open(root / "lambada.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return root


@pytest.fixture(scope="module")
def server(files):
    """serve.py on the same weights; started here, waited for by the test (it compiles meanwhile)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags()}
    cmd = [sys.executable, str(ROOT / "serve.py"), "--init_from", str(files / "model"), "--port", str(port)]
    cmd += ["--slots", "2", "--model_name", "tiny"]
    cmd += ["--prefill_chunk", "16"]  # one prompt bucket: fewer programs to compile at start
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield proc, f"http://127.0.0.1:{port}"
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def lm_eval_over_http(url, files):
    """{task: {metric: value, "loglikelihoods": per example}} from lm-eval's local-completions."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from flaxgpt.eval.reference import write_tasks

    tasks = {"hellaswag": files / "hellaswag.jsonl", "lambada": files / "lambada.jsonl"}
    names = write_tasks(tasks, files / "tasks")
    args = {
        "base_url": f"{url}/v1/completions",
        "model": "tiny",
        "tokenizer_backend": "huggingface",
        "tokenizer": str(files / "model"),
        "tokenized_requests": True,  # token ids, as lm-eval counts ctxlen in its own tokens
        "max_length": BLOCK,  # lm-eval sends at most max_length - 1 tokens, + 1 generated
        "num_concurrent": 1,
        "max_retries": 1,
    }
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=",".join(f"{k}={v}" for k, v in args.items()),
        tasks=names,
        task_manager=TaskManager(include_path=str(files / "tasks"), include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,
    )
    return results_by_task(out, tasks, names)


def flaxgpt_eval(files, task, tmp_path):
    out = tmp_path / f"{task}.json"
    fe.main([
        "--init_from", str(files / "model"), "--task", task, "--data", str(files / f"{task}.jsonl"),
        "--convention", "lm_eval", "--no_progress", "--output", str(out),
    ])  # fmt: skip
    return json.loads(out.read_text())


def test_lm_eval_through_the_server_matches_flaxgpt_eval(files, server, tmp_path):
    ours = {t: flaxgpt_eval(files, t, tmp_path) for t in ("hellaswag", "lambada")}  # while it compiles
    proc, url = server
    wait_healthy(proc, url)
    ref = lm_eval_over_http(url, files)
    np.testing.assert_allclose(
        ours["hellaswag"]["loglikelihoods"], ref["hellaswag"]["loglikelihoods"], atol=1e-4
    )
    np.testing.assert_allclose(ours["lambada"]["loglikelihoods"], ref["lambada"]["loglikelihoods"], atol=1e-4)
    assert ours["hellaswag"]["acc"] == ref["hellaswag"]["acc"]
    assert ours["hellaswag"]["acc_norm"] == ref["hellaswag"]["acc_norm"]
    assert 0 < ours["lambada"]["acc"] < 1  # the greedy texts hit, the random ones do not
    assert ours["lambada"]["acc"] == ref["lambada"]["acc"]
    assert ours["lambada"]["ppl"] == pytest.approx(ref["lambada"]["perplexity"], rel=1e-3)
