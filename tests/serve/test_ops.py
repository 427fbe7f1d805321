"""Serving operations against a real uvicorn on 127.0.0.1 (in this process, a tiny model): API key,
/metrics, the access log, request limits, and a small soak (benchmarks/serve_soak.py at CI's size)."""

import asyncio
import logging

import httpx
import jax
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.serve_soak import soak
from flaxgpt.data.tokenizers import CharTokenizer
from flaxgpt.models.gpt import GPTConfig, init_params
from flaxgpt.serve.launch import scheduler_for
from flaxgpt.serve.server import create_app
from tests.serve.test_serve import CHARS, serving_in_thread

W, KEY, MAX_TOKENS, MAX_BODY = 96, "sk-test-123", 32, 4096


@pytest.fixture(scope="module")
def served():
    cfg = GPTConfig(vocab_size=len(CHARS), block_size=W, n_layer=2, n_head=2, n_embd=32)
    tok = CharTokenizer(CHARS)
    sched = scheduler_for(
        cfg, init_params(cfg, jax.random.key(0)), tok, slots=3, max_queue=4, max_tokens=MAX_TOKENS,
        prefill_chunk=16, prefix_cache_tokens=64, prefix_block=8,
    )  # fmt: skip
    sched.start()
    assert sched.ready.wait(timeout=300), "the engine did not compile in 300 s"
    app = create_app(
        sched, tok, model="tiny", max_len=W, vocab_size=len(CHARS), api_key=KEY, max_body_bytes=MAX_BODY
    )
    with serving_in_thread(app) as url:
        yield sched, url
    sched.close()


def post(url, body, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60, **kw)


def metric_values(url) -> dict:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text)
            for s in f.samples}  # fmt: skip


def test_api_key_with_the_openai_client(served):
    openai = pytest.importorskip("openai")
    _, url = served
    assert httpx.get(f"{url}/health").status_code == 200  # open without a key
    for key in (None, "Bearer", "sk-wrong"):
        r = post(url, {"prompt": "ab", "max_tokens": 2}, key=key)
        err = r.json()["error"]
        assert r.status_code == 401 and err["code"] == "invalid_api_key" and "Authorization" in err["message"]
    assert httpx.get(f"{url}/metrics").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0).completions.create(
            model="tiny", prompt="ab", max_tokens=2
        )
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model="tiny", prompt="ab", max_tokens=3).usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError, match="at most 32 tokens"):
        client.completions.create(model="tiny", prompt="ab", max_tokens=MAX_TOKENS + 1)


def test_body_and_max_tokens_limits(served):
    _, url = served
    r = post(url, {"prompt": "ab", "max_tokens": MAX_TOKENS + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    r = post(url, {"prompt": "a" * MAX_BODY, "max_tokens": 2})
    assert r.status_code == 413 and "4096 bytes" in r.json()["error"]["message"], r.text

    def chunked():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 100 + 1):
            yield b"a" * 100
        yield b'"}'

    r = httpx.post(f"{url}/v1/completions", content=chunked(), headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 413, r.text
    assert post(url, {"prompt": "ab", "max_tokens": MAX_TOKENS}).status_code == 200  # at the limit


def test_metrics_access_log_and_prefix_hits(served, caplog):
    _, url = served
    before = metric_values(url)
    system = "ROMEO: a long system prompt shared by every conversation\n"  # 59 characters: 7 blocks of 8
    with caplog.at_level(logging.INFO, logger="flaxgpt.serve.access"):
        for turn in ("hi", "how are you", "bye"):
            r = post(
                url, {"prompt": system + turn, "max_tokens": 5, "temperature": 0, "stream": turn == "bye"}
            )
            assert r.status_code == 200
        post(url, {"prompt": "ab", "max_tokens": 5}, key="wrong")
    lines = [r.getMessage() for r in caplog.records if r.name == "flaxgpt.serve.access"]
    assert len(lines) == 4 and all('"POST /v1/completions"' in x for x in lines), lines
    assert [x.split()[3] for x in lines] == ["200", "200", "200", "401"]
    m = metric_values(url)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return m.get(key, 0) - before.get(key, 0)

    assert delta("flaxgpt_requests_total", route="/v1/completions", status="200") == 3
    assert delta("flaxgpt_requests_total", route="/v1/completions", status="401") == 1
    assert delta("flaxgpt_generation_tokens_total") == 15
    assert delta("flaxgpt_prompt_tokens_total") == 3 * len(system) + len("hi" + "how are you" + "bye")
    assert delta("flaxgpt_time_to_first_token_seconds_count") == 3
    assert delta("flaxgpt_inter_token_latency_seconds_count") == 12  # 4 gaps per 5-token completion
    assert delta("flaxgpt_prefix_cache_hit_tokens_total") >= 2 * 56  # turns 2 and 3 reuse 7 blocks
    assert 0 < m[("flaxgpt_prefix_cache_hit_rate", ())] <= 1
    assert m[("flaxgpt_busy_slots", ())] == 0 and m[("flaxgpt_queue_depth", ())] == 0
    assert m[("flaxgpt_slots", ())] == 3 and m[("flaxgpt_prefix_cache_blocks", ())] > 0


def test_text_that_is_no_text_and_deep_nesting_are_400s(served):
    # valid JSON all: a lone surrogate (a string cut inside an emoji by a client) and a body nested past
    # Python's recursion limit (well under the body limit) were 500s with a traceback
    _, url = served
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    bodies = {
        '{"prompt": "ab\\ud800", "max_tokens": 2}': "unpaired UTF-16 surrogate",
        '{"prompt": "ab", "stop": ["\\udc00"], "max_tokens": 2}': "unpaired UTF-16 surrogate",
        '{"prompt": ' + "[" * 1500 + "]" * 1500 + "}": "nested too deeply",
    }
    for body, needle in bodies.items():
        for route in ("/v1/completions", "/v1/chat/completions"):
            r = httpx.post(f"{url}{route}", content=body.encode(), headers=headers, timeout=60)
            assert r.status_code == 400 and needle in r.json()["error"]["message"], (route, r.text)
    assert post(url, {"prompt": "ab", "max_tokens": 2}).status_code == 200


def test_a_handler_that_raises_is_logged_and_counted_as_500(caplog):
    """Starlette's error middleware answers the 500 outside Operations, after the exception passed
    through it: counted as a 500, not as a client gone (499)."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.requests import ClientDisconnect
    from starlette.routing import Route

    from flaxgpt.serve.metrics import ServeMetrics
    from flaxgpt.serve.middleware import Operations

    async def boom(request):
        raise RuntimeError("a bug in a handler (test)")

    async def gone(request):  # what request.body() raises when the client left mid-upload
        raise ClientDisconnect()

    metrics = ServeMetrics()
    ops = Middleware(Operations, metrics=metrics, routes=["/v1/completions", "/v1/chat/completions"])
    routes = [
        Route("/v1/completions", boom, methods=["POST"]),
        Route("/v1/chat/completions", gone, methods=["POST"]),
    ]
    app = Starlette(routes=routes, middleware=[ops])
    with caplog.at_level(logging.INFO, logger="flaxgpt.serve.access"), serving_in_thread(app) as url:
        r = httpx.post(f"{url}/v1/completions", json={}, timeout=60)  # a bug: OpenAI's error JSON,
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"  # not plain text
        httpx.post(f"{url}/v1/chat/completions", json={}, timeout=60)
    lines = [r.getMessage() for r in caplog.records if r.name == "flaxgpt.serve.access"]
    assert [x.split()[3] for x in lines] == ["500", "499"], lines
    counted = {s.labels["route"] + " " + s.labels["status"]: s.value for f in metrics.registry.collect()
               for s in f.samples if s.name == "flaxgpt_requests_total"}  # fmt: skip
    assert counted == {"/v1/completions 500": 1.0, "/v1/chat/completions 499": 1.0}, counted


def test_soak_small(served):
    """60 requests from 8 clients, some hanging up mid-stream, malformed or over the limits: no 5xx,
    every slot free afterwards, and the server still answers."""
    sched, url = served
    out = asyncio.run(soak(url, requests=60, clients=8, seed=0, api_key=KEY, max_tokens_limit=MAX_TOKENS,
                           max_body_bytes=MAX_BODY))  # fmt: skip
    assert not out["failures"], out
    assert out["kind"]["hangup"] >= 3 and out["kind"]["malformed"] + out["kind"]["too_big"] >= 2, out
    assert out["health"]["busy"] == 0 and out["after"] == 200, out
    assert not sched.active and not sched.prefilling and bool(sched.engine.state.done_B.all())
    assert not any(s.startswith("5") for s in out["status"]), out
