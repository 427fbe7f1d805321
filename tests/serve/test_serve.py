"""serve.py as clients use it: a server process on 127.0.0.1 over a tiny run, real HTTP requests.

One process serves every test in order (compiling takes most of the time); the last test sends
it SIGTERM. Loops that wait for the server are bounded.
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import jax
import pytest

from flaxgpt.data.tokenizers import CharTokenizer
from flaxgpt.models.gpt import GPTConfig, init_params
from flaxgpt.runs.checkpoint import Checkpointer
from tests.procs import xla_flags

ROOT = Path(__file__).resolve().parents[2]
CHARS = sorted(set("abcdefghijklmnopqrstuvwxyz ROMEO:\n"))
W = 256  # the window; slots 2, queue 1: a third waiting request gets 429
# wide enough that 240 tokens take ~0.5 s on 2 quiet cores: a hang-up or SIGTERM sent a few ms
# after the first token lands long before the sequences could finish on their own
E = 512


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc, url):
    """Until serve.py answers /health; a server that exits or stays silent fails the test."""
    for _ in range(600):  # compiling on a loaded 2-core machine: at most 5 minutes
        if proc.poll() is not None:
            pytest.fail(f"server exited {proc.returncode}:\n{proc.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    pytest.fail("server not healthy after 300 s")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    cfg = GPTConfig(vocab_size=len(CHARS), block_size=W, n_layer=2, n_head=2, n_embd=E)
    (out / "config.json").write_text(json.dumps({"model": {"kind": "gpt", **cfg.to_dict()}}))
    (out / "meta.json").write_text(json.dumps({"tokenizer": CharTokenizer(CHARS).to_meta()}))
    ckpt = Checkpointer(out, async_save=False)
    ckpt.save(1, {"params": init_params(cfg, jax.random.key(0))}, extra={})
    ckpt.close()
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags()}
    cmd = [sys.executable, str(ROOT / "serve.py"), "--out_dir", str(out), "--port", str(port)]
    cmd += ["--slots", "2", "--max_queue", "1", "--model_name", "tiny"]
    cmd += ["--prefill_chunk", "32"]  # prompt buckets 16, 24, 32 (not 9 up to W) to compile at start
    cmd += ["--max_len", str(2 * W)]  # past the model's context: served at W, with a warning
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url)
    yield proc, url
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def test_ready_line_names_the_address_model_and_context(server):
    """Once healthy, serve.py has said where it listens, what it serves and the window (#55)."""
    proc, url = server
    lines = []

    def read():
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("ready on "):
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=30)
    assert lines and lines[-1].strip() == (
        f"ready on {url}: model tiny, context {W} tokens (a prompt plus max_tokens must fit)"
    ), "".join(lines)
    assert f"--max_len {2 * W} is past the model's context of {W} positions; serving {W}" in "".join(lines)


def complete(url, **body):
    return httpx.post(f"{url}/v1/completions", json={"model": "tiny", **body}, timeout=60)


def test_completions_models_health_and_staggered_exactness(server):
    _, url = server
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny"
    r = complete(url, prompt="ROMEO:", max_tokens=20, temperature=0)
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion", body
    assert len(body["choices"][0]["text"]) == 20 and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 20, "total_tokens": 26}
    # token-id prompt == the same text; greedy is deterministic
    ids = [CHARS.index(c) for c in "ROMEO:"]
    assert (
        complete(url, prompt=ids, max_tokens=20, temperature=0).json()["choices"][0]["text"]
        == body["choices"][0]["text"]
    )
    # staggered concurrent requests (more than the slots) == each alone, sampled ones included
    temperatures, top_ks, top_ps = [0, 0.9, 1.3], [0, 5], [1, 0.8]
    reqs = [
        dict(prompt="abc" * (i + 1), max_tokens=15 + 9 * i, seed=i, temperature=temperatures[i % 3],
             top_k=top_ks[i % 2], top_p=top_ps[i % 2])
        for i in range(5)
    ]  # fmt: skip
    alone = [complete(url, **q).json()["choices"][0]["text"] for q in reqs]
    together = [None] * len(reqs)

    def send(i):  # as a client does: a 429 (slots 2 + queue 1 < 5 requests) is retried
        for _ in range(1200):
            r = complete(url, **reqs[i])
            if r.status_code != 429:
                break
            time.sleep(0.05)
        together[i] = r.json()["choices"][0]["text"]

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
        time.sleep(0.02)  # arrivals while others decode
    for t in threads:
        t.join(timeout=120)
    assert together == alone
    # n choices: choice j is its own stream (different samples), all of max_tokens
    body = complete(url, prompt="ab", max_tokens=10, n=2, seed=3, temperature=1.0).json()
    texts = [c["text"] for c in body["choices"]]
    assert [c["index"] for c in body["choices"]] == [0, 1] and texts[0] != texts[1]
    assert body["usage"]["completion_tokens"] == 20 and body["usage"]["prompt_tokens"] == 2  # once, as OpenAI
    assert (
        complete(url, prompt="ab", max_tokens=10, seed=3, temperature=1.0).json()["choices"][0]["text"]
        == texts[0]
    )


def test_stop_strings_and_openai_client_streaming(server):
    _, url = server
    full = complete(url, prompt="ROMEO:", max_tokens=40, seed=1).json()["choices"][0]["text"]
    stop = full[10:12]
    cut = complete(url, prompt="ROMEO:", max_tokens=40, seed=1, stop=[stop, "\x00"]).json()["choices"][0]
    assert cut["text"] == full[: full.index(stop)] and cut["finish_reason"] == "stop"

    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    chunks = list(
        client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=40, seed=1, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].choices[0].finish_reason == "length"
    usage = client.completions.create(
        model="tiny", prompt="ab", max_tokens=5, stream=True, stream_options={"include_usage": True}
    )
    assert [c.usage for c in usage][-1].completion_tokens == 5
    assert (
        client.completions.create(
            model="tiny", prompt="ab", max_tokens=3, extra_body={"top_k": 2}
        ).usage.total_tokens
        == 5
    )
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model="tiny", prompt="ab", max_tokens=3, top_p=0)
    # raw SSE: data lines ending with [DONE]
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={"prompt": "ab", "max_tokens": 3, "stream": True}
    ) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream") and lines[-1] == "data: [DONE]"


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"prompt": "ab", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "ab", "max_tokens": W}, f"context window of {W}"),
        ({"prompt": "a" * (W + 5)}, f"context window is {W}"),
        ({"prompt": "ab", "temperature": -1}, "temperature"),
        ({"prompt": "ab", "top_p": 1.5}, "top_p"),
        ({"prompt": "ab", "max_tokens": "7"}, "max_tokens"),
        ({"prompt": "ab", "n": 0}, "'n'"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": [1, 999]}, "token ids"),
        ({"prompt": "ab", "stream": "yes"}, "stream"),
        ({"prompt": "ab", "stop": [1]}, "stop"),
        ({"prompt": "ab", "logprobs": 21}, "logprobs"),
        ({"prompt": "ab", "logit_bias": {"999": 5}}, "outside the vocabulary"),
        ({"prompt": "ab", "min_p": 2}, "min_p"),
        ({"prompt": "ab", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "ab", "stop_token_ids": [999]}, "stop_token_ids"),
        (
            {
                "prompt": "ab",
                "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}},
            },
            "schema",
        ),
        ({"prompt": "ab", "structured_outputs": {"regex": "(ab"}}, "regex"),
        ({"prompt": "ab", "structured_outputs": {"choice": []}}, "choice"),
        ({"prompt": "QQ#"}, "vocabulary"),
        ({}, "prompt"),
        ([1, 2], "JSON object"),
    ],
)
def test_bad_input_is_400(server, body, needle):
    _, url = server
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"


def test_unknown_model_is_404_listing_the_models(server):
    _, url = server
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "ab", "model": "gpt-4"}, timeout=30)
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert (
        err["code"] == "model_not_found"
        and "'gpt-4' does not exist; this server serves tiny" in err["message"]
    )


def test_malformed_json_and_unknown_route(server):
    _, url = server
    r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "ab",', timeout=30)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/v1/nothing").status_code == 404
    assert complete(url, prompt="ab", max_tokens=2).status_code == 200  # the engine is still fine


def wait_idle(url, seconds=60):
    for _ in range(int(seconds * 10)):
        health = httpx.get(f"{url}/health").json()
        if health["busy"] == 0:
            return health
        time.sleep(0.1)
    pytest.fail(f"still busy after {seconds} s: {health}")


def test_cancel_frees_the_slot(server):
    _, url = server
    before = httpx.get(f"{url}/health").json().get("cancelled", 0)
    # 3 sequences of 240 tokens: both slots and the one queue place are taken for a while
    long = {"prompt": "ab", "max_tokens": 240, "n": 3, "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", f"{url}/v1/completions", json=long) as stream:
            assert stream.status_code == 200
            next(stream.iter_lines())  # streaming; now hang up mid-stream
    health = wait_idle(url)
    assert health["cancelled"] >= before + 2, health  # freed before their 240 tokens


def test_more_sequences_than_slots_and_queue_is_400(server):
    _, url = server
    r = complete(url, prompt="ab", max_tokens=2, n=4)  # 2 slots + 1 queue place: never fits
    assert r.status_code == 400 and "at most 3" in r.json()["error"]["message"], r.text


@contextlib.contextmanager
def serving_in_thread(app):
    """A real uvicorn on 127.0.0.1 in a thread of this process -> its url; stopped on exit."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_full_queue_is_429_with_retry_after(tmp_path):
    """In-process, over a scheduler whose engine thread never starts: the submitted sequences stay
    queued, so the server stays full for as long as the test needs."""
    from flaxgpt.serve.launch import scheduler_for
    from flaxgpt.serve.server import create_app

    cfg = GPTConfig(vocab_size=len(CHARS), block_size=32, n_layer=1, n_head=2, n_embd=16)
    tok = CharTokenizer(CHARS)
    sched = scheduler_for(cfg, init_params(cfg, jax.random.key(0)), tok, slots=2, max_queue=1)
    app = create_app(sched, tok, model="tiny", max_len=32, vocab_size=len(CHARS))
    with serving_in_thread(app) as url:
        with httpx.Client(timeout=30) as c:
            three = {"prompt": "ab", "max_tokens": 5, "n": 3, "stream": True}  # 2 slots + the queue place
            with c.stream("POST", f"{url}/v1/completions", json=three) as stream:
                assert stream.status_code == 200
                r = c.post(f"{url}/v1/completions", json={"prompt": "ab", "max_tokens": 5})
                assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1, r.text
                assert r.json()["error"]["type"] == "rate_limit_error"
            # those three clients went away while queued: they hold no place (new clients got 429)
            for _ in range(100):
                if all(s.cancelled for s in sched.pending):
                    break
                time.sleep(0.05)
            with c.stream("POST", f"{url}/v1/completions", json={**three, "n": 1}) as stream:
                assert stream.status_code == 200
                assert "\nflaxgpt_queue_depth 1.0\n" in c.get(f"{url}/metrics").text
    assert sched.stats["rejected"] == 1 and sched.stats["cancelled"] == 3


def test_sigterm_drains_then_exits(server):
    proc, url = server
    # 3 choices on 2 slots (the queue holds 1): two rounds of 250 tokens keep the server busy
    body = {"prompt": "ab", "max_tokens": 250, "n": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        first = next(lines)
        proc.send_signal(signal.SIGTERM)  # mid-stream: this one finishes, new ones get 503
        r = complete(url, prompt="ab", max_tokens=2)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable", r.text
        rest = [line for line in lines if line]
    texts = [""] * 3
    for line in [first, *rest[:-1]]:
        choice = json.loads(line[6:])["choices"][0]
        texts[choice["index"]] += choice["text"]
    assert rest[-1] == "data: [DONE]" and [len(t) for t in texts] == [250] * 3
    assert proc.wait(timeout=60) == 0
