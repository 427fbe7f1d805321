"""The HTTP layer: OpenAI-compatible routes over the engine thread (Starlette + uvicorn).

    app = create_app(scheduler, tokenizer, model="gpt2", max_len=1024, vocab_size=50257)
    serve(app, scheduler, host="127.0.0.1", port=8000)     # SIGTERM drains, then exits 0

Routes: POST /v1/completions (text or token-id prompts; stream as server-sent events ending with `data:
[DONE]`), POST /v1/chat/completions (messages through the model's chat template, each choice stopped at
the template's end-of-turn token; streamed the same way), GET /v1/models, GET /health (503 while
compiling or draining), GET /metrics (Prometheus, flaxgpt/serve/metrics.py); with LoRA adapters
(serve/adapters.py) POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's; 403 unless the pool
has a runtime root, serve.py --allow_runtime_lora), a request's `model` naming the base or an adapter
(else 404 listing the models; not a string: 400). Every request goes through
flaxgpt/serve/middleware.py (API key, body size limit, access log, request counter). The handlers only
translate: parse and validate (flaxgpt/serve/openai_api.py), submit sequences to the Scheduler, and turn
its events into JSON. The event loop never runs XLA; the engine thread never touches HTTP. Bad input is
a 400 with OpenAI's error JSON; a full queue a 429 with Retry-After; a client that disconnects cancels
its sequences, freeing their slots.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import signal
import threading
import time

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from flaxgpt.data import chat
from flaxgpt.decode.sampling import Rows
from flaxgpt.serve import openai_api as api
from flaxgpt.serve import tools
from flaxgpt.serve.detokenize import TextOffsets
from flaxgpt.serve.grammar import GrammarError
from flaxgpt.serve.metrics import ServeMetrics
from flaxgpt.serve.middleware import Operations
from flaxgpt.serve.scheduler import (
    Delta,
    Draining,
    Failed,
    Finish,
    QueueFull,
    Scheduler,
    Sequence,
    TooManySequences,
)

log = logging.getLogger("flaxgpt.serve")


def _error(
    status: int, message: str, kind: str = "invalid_request_error", param=None, headers=None, code=None
):
    return JSONResponse(api.error_json(message, kind, param, code), status_code=status, headers=headers)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def create_app(
    sched: Scheduler,
    tokenizer,
    *,
    model: str,
    max_len: int,
    vocab_size: int,
    api_key: str | None = None,
    max_body_bytes: int = 1 << 20,
) -> Starlette:
    """api_key: required as `Authorization: Bearer` on every route but /health (None: open);
    max_body_bytes: larger bodies get 413. The scheduler reports to the app's /metrics."""
    metrics = ServeMetrics()
    metrics.watch(sched)
    sched.metrics = metrics
    eos_id = getattr(tokenizer, "eot_id", None)
    # the model's other end tokens stop a reply too (Llama 3.1: <|eom_id|> ends a tool call), unless
    # the request says ignore_eos; they are not part of the text
    eos_ids = frozenset(getattr(tokenizer, "eos_ids", ()))
    created = int(time.time())
    inflight: set[str] = set()  # ids of responses not fully sent

    async def health(request: Request):
        if not sched.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)
        if not sched.accepting:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok", "slots": sched.engine.slots, "busy": sched.busy, **sched.stats})

    pool = sched.adapters  # LoRA adapters (serve/adapters.py), None when the server has no slots for them

    def model_names() -> list[str]:
        return [model] + (pool.names() if pool is not None else [])

    async def models(request: Request):
        cards = [{"id": model, "object": "model", "created": created, "owned_by": "flaxgpt"}]
        for name in model_names()[1:]:
            cards.append(
                {"id": name, "object": "model", "created": created, "owned_by": "flaxgpt", "parent": model}
            )
        return JSONResponse({"object": "list", "data": cards})

    def runtime_lora_off():
        """403 unless serve.py --allow_runtime_lora: a client that may load adapters makes the server
        read files and hold them in memory, which the operator grants explicitly."""
        if pool is not None and pool.root is not None:
            return None
        return _error(
            403, "loading and unloading adapters at run time is off: start the server with "
            "--allow_runtime_lora --adapter_root DIR", "permission_error",
        )  # fmt: skip

    async def load_adapter(request: Request):
        """vLLM's POST /v1/load_lora_adapter {"lora_name", "lora_path"}: a path under the adapter root,
        read off the event loop."""
        if (refused := runtime_lora_off()) is not None:
            return refused
        try:
            body = json.loads(await request.body())
            name, path = body["lora_name"], body["lora_path"]
            if not (isinstance(name, str) and name and isinstance(path, str) and path):
                raise ValueError("lora_name and lora_path must be non-empty strings")
        except (ValueError, UnicodeDecodeError, KeyError, TypeError) as e:
            return _error(400, f"the body must be JSON with lora_name and lora_path: {e}")
        if name == model:
            return _error(400, f"{name!r} is the base model's name", param="lora_name")
        try:
            await asyncio.to_thread(pool.load_under_root, name, path)
        except Exception as e:  # outside the root, not an adapter, not one for this base: nothing loaded
            return _error(400, f"adapter {name!r} not loaded: {e}", param="lora_path")  # e: no server path
        log.info("loaded LoRA adapter %s from %s under the adapter root", name, path)
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    async def unload_adapter(request: Request):
        """vLLM's POST /v1/unload_lora_adapter {"lora_name"}: its running requests finish first."""
        if (refused := runtime_lora_off()) is not None:
            return refused
        try:
            name = json.loads(await request.body())["lora_name"]
        except (ValueError, UnicodeDecodeError, KeyError, TypeError) as e:
            return _error(400, f"the body must be JSON with lora_name: {e}")
        try:
            if not isinstance(name, str):
                raise KeyError(name)
            pool.unload(name)
        except KeyError:
            return _error(
                404, f"no adapter named {name!r} is loaded", param="lora_name", code="model_not_found"
            )
        log.info("unloaded LoRA adapter %s", name)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")

    end_of_turn: list = []  # the chat template's end-of-turn id, found at the first chat request

    async def completions(request: Request):
        return await _handle(request, api.parse_completion, eos_id, api.completion_json, api.completion_json)

    async def chat_completions(request: Request):
        if not end_of_turn and getattr(tokenizer, "chat_template", None):
            end_of_turn.append(chat.end_of_turn_id(tokenizer))
        eot = end_of_turn[0] if end_of_turn else eos_id
        parse = functools.partial(api.parse_chat, max_tokens_limit=sched.max_tokens)
        return await _handle(request, parse, eot, api.chat_json, api.chat_chunk_json)

    async def _handle(request: Request, parse, eos_id, whole_json, chunk_json):
        if not sched.accepting:
            return _error(503, "the server is shutting down", "service_unavailable")
        try:
            body = json.loads(await request.body())
            # a lone surrogate ("\ud800": a string cut inside an emoji) is valid JSON but no text: the
            # tokenizer, the grammar compiler and the JSON reply would each fail on it later
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except RecursionError:
            return _error(400, "the body is not valid JSON: it is nested too deeply")
        except UnicodeEncodeError as e:
            return _error(400, f"the body holds an unpaired UTF-16 surrogate ({e.reason}); send valid text")
        except (ValueError, UnicodeDecodeError) as e:
            return _error(400, f"the body is not valid JSON: {e}")
        name = body.get("model", model) if isinstance(body, dict) else model
        if not isinstance(name, str):
            return _error(
                400,
                f"'model' must be a string naming a served model, got {type(name).__name__}",
                param="model",
            )
        adapter = None if name == model or pool is None else pool.get(name)
        if adapter is None and name != model and name in model_names():  # evicted by --max_cpu_adapters
            try:
                adapter = await asyncio.to_thread(pool.reload, name)
            except Exception as e:  # its files changed or went away since it was loaded
                log.warning("LoRA adapter %s could not be read again: %s", name, e)
                return _error(
                    503, f"the adapter {name!r} could not be read again from its directory (see the "
                    "server log); unload it or restore its files", "service_unavailable", param="model",
                )  # fmt: skip
        if name != model and adapter is None:  # OpenAI's answer to a model it does not have
            available = ", ".join(model_names())
            return _error(
                404, f"the model {name!r} does not exist; this server serves {available}", param="model",
                code="model_not_found",
            )  # fmt: skip
        try:
            req = parse(body, model=name, tokenizer=tokenizer, vocab_size=vocab_size, max_len=max_len)
            compiled = None
            if req.constraint is not None:  # compiled on the grammar pool, cached by spec
                future = grammars().compile_async(req.constraint, req.constraint_param)
                compiled = await asyncio.wrap_future(future)
        except api.BadRequest as e:
            return _error(400, str(e), param=e.param)
        except RecursionError:  # a schema, a tool's parameters, JSON in a string: past Python's stack
            return _error(
                400, "a JSON value of the request (a schema, a tool, arguments) is nested too deeply"
            )
        except GrammarError as e:
            return _error(400, str(e), param=e.param or req.constraint_param)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        family = tools.family_of(getattr(tokenizer, "chat_template", None)) if req.tools else None
        calls = req.tools is not None and req.tool_choice != "none"
        seqs, replies = [], []
        for i, ids in enumerate(req.prompts):
            for j in range(req.n):
                eos = None if req.ignore_eos else eos_id
                sampling = req.sampling.replace(eos_id=eos)
                rows = Rows.of(
                    sampling, max_new_tokens=req.max_tokens, seed=req.seed, stream=j, logprobs=req.logprobs
                )
                index = i * req.n + j
                emit = lambda ev, index=index: loop.call_soon_threadsafe(events.put_nowait, (index, ev))  # noqa: E731
                seqs.append(Sequence(
                    ids, rows, stop=req.stop, emit=emit, adapter=adapter, logprobs=req.logprobs,
                    echo=req.echo, grammar=None if compiled is None else grammars().matcher(compiled),
                    stop_ids=frozenset(req.stop_token_ids) | (eos_ids - {eos} if eos is not None else set()),
                    special=calls,
                ))  # fmt: skip
                replies.append(_Reply(index, req, tokenizer, ids, family if calls else None))
        try:
            sched.submit(*seqs)
        except TooManySequences as e:  # or TooManyTokens (max_tokens over the server's limit)
            return _error(400, str(e), param=getattr(e, "param", "n"))
        except QueueFull as e:
            return _error(429, str(e), "rate_limit_error", headers={"Retry-After": str(e.retry_after)})
        except Draining as e:
            return _error(503, str(e), "service_unavailable")
        prompt_tokens = sum(len(ids) for ids in req.prompts)  # OpenAI counts a prompt once, whatever n
        cid = api.new_id()
        inflight.add(cid)  # a drain waits until every response is sent, not only generated
        if req.stream:
            stream = _stream(
                events, seqs, replies, cid, name, prompt_tokens, req.include_usage, inflight, chunk_json
            )
            return StreamingResponse(
                stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        try:
            return await _collect(request, events, seqs, replies, cid, name, prompt_tokens, whole_json)
        finally:
            inflight.discard(cid)

    grammar_pool: list = []  # the Grammars of this tokenizer, made at the first constrained request

    def grammars():
        if not grammar_pool:
            from flaxgpt.serve.grammar import Grammars

            grammar_pool.append(Grammars(tokenizer, vocab_size, threads=2))
        return grammar_pool[0]

    async def prometheus(request: Request):
        body, content_type = metrics.exposition()
        return Response(body, headers={"Content-Type": content_type})

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/load_lora_adapter", load_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_adapter, methods=["POST"]),
    ]

    async def not_found(request, exc):
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")

    ops = Middleware(
        Operations,
        api_key=api_key,
        max_bytes=max_body_bytes,
        metrics=metrics,
        routes=[r.path for r in routes],
    )
    app = Starlette(routes=routes, middleware=[ops], exception_handlers={404: not_found, 405: not_found})
    app.state.inflight = inflight
    return app


class _Reply:
    """One choice's events as OpenAI JSON: its text, logprobs (and an echoed prompt), its tool calls."""

    def __init__(self, index: int, req, tokenizer, prompt_ids, family: str | None):
        self.index, self.req, self.tokenizer, self.prompt_ids = index, req, tokenizer, prompt_ids
        self.family, self.text, self.entries, self.prompt, self.prompt_text = family, "", [], [], ""
        self.parser = tools.StreamParser(family, req.tools) if family else None
        self.any_call, self.offsets = False, None

    def _logprobs(self, entries, prompt=(), offsets=None):
        """offsets: the stream's TextOffsets (its chunks continue one another), else from the start."""
        if self.req.logprobs is None:
            return None
        if self.req.chat:
            return api.chat_logprobs(self.tokenizer, entries)
        out = api.completion_logprobs(self.tokenizer, entries, offsets or len(self.prompt_text))
        if not prompt:
            return out
        echoed = api.completion_logprobs(self.tokenizer, prompt, 0, text=self.prompt_text)
        return {k: echoed[k] + out[k] for k in out}

    def add(self, ev: Delta) -> list:
        """A delta -> the stream's choices for it (chunks of one choice)."""
        text = ev.text
        if ev.prompt is not None:  # echo: the prompt first, its tokens' logprobs with it
            self.prompt, self.prompt_text = ev.prompt, self.tokenizer.decode(self.prompt_ids)
            text = self.prompt_text + text
        if self.offsets is None:  # the first delta, after the echoed prompt's text is known
            self.offsets = TextOffsets(len(self.prompt_text))
        self.text += text
        self.entries += ev.logprobs
        lp = self._logprobs(ev.logprobs, self.prompt if ev.prompt is not None else (), self.offsets)
        if self.parser is None:
            return [api.Choice(self.index, text, None, lp)] if text or lp else []
        out = [c for c in map(self._delta, self.parser.feed(text)) if c is not None]
        if lp is not None:
            out = out or [api.Choice(self.index, "", None)]
            out[0] = out[0]._replace(logprobs=lp)
        return out

    def _delta(self, d: dict) -> api.Choice | None:
        calls = d.get("tool_calls")
        if calls and not self.req.parallel_tool_calls:  # the first call's pieces only
            calls = [c for c in calls if c["index"] == 0]
            if not calls and not d.get("content"):
                return None
        if calls:
            self.any_call = True
        return api.Choice(self.index, d.get("content", ""), None, tool_calls=calls or None)

    def finish(self, reason: str) -> list:
        """The stream's last choices: what the tool parser held back, then the finish reason."""
        held = self.parser.finish() if self.parser is not None else []
        out = [c for c in map(self._delta, held) if c is not None]
        if self.any_call and reason == "stop":
            reason = "tool_calls"
        return out + [api.Choice(self.index, "", reason)]

    def whole(self, reason: str) -> api.Choice:
        lp = self._logprobs(self.entries, self.prompt)
        if self.family is None:
            return api.Choice(self.index, self.text, reason, lp)
        content, calls = tools.parse(self.family, self.text, self.req.tools)
        calls = calls if self.req.parallel_tool_calls else calls[:1]
        if calls and reason == "stop":
            reason = "tool_calls"
        return api.Choice(self.index, content if calls else (content or ""), reason, lp, calls or None)


async def _stream(events, seqs, replies, cid, model, prompt_tokens, include_usage, inflight, chunk_json):
    completion_tokens, left = 0, len(seqs)
    try:
        if chunk_json is api.chat_chunk_json:  # chat: each choice's role first, as OpenAI streams
            yield _sse(chunk_json(cid, model, [(i, None, None) for i in range(len(seqs))]))
        while left:
            index, ev = await events.get()
            if isinstance(ev, Delta):
                for choice in replies[index].add(ev):
                    yield _sse(chunk_json(cid, model, [choice]))
            elif isinstance(ev, Finish):
                left -= 1
                completion_tokens += ev.completion_tokens
                for choice in replies[index].finish(ev.reason):
                    yield _sse(chunk_json(cid, model, [choice]))
            elif isinstance(ev, Failed):
                left -= 1
                yield _sse(api.error_json(f"choice {index} failed: {ev.message}", "server_error"))
        if include_usage:
            usage = api.usage_json(prompt_tokens, completion_tokens)
            yield _sse(chunk_json(cid, model, [], usage=usage))
        yield "data: [DONE]\n\n"
    finally:  # also when the client went away (Starlette cancels us): free the slots
        inflight.discard(cid)
        for s in seqs:
            s.cancel()


async def _collect(request, events, seqs, replies, cid, model, prompt_tokens, whole_json):
    reasons, completion_tokens, failed = [None] * len(seqs), 0, []
    left = len(seqs)
    checked = time.monotonic()
    try:
        while left:
            try:
                index, ev = await asyncio.wait_for(events.get(), timeout=0.5)
            except TimeoutError:
                ev = None
            # every half second, events or not: a decoding request has an event every step, and a
            # client that hung up (a timeout, then a retry) must not keep its slots decoding
            if time.monotonic() - checked >= 0.5:
                checked = time.monotonic()
                if await request.is_disconnected():
                    return _error(499, "client disconnected")
            if ev is None:
                continue
            if isinstance(ev, Delta):
                replies[index].add(ev)
            elif isinstance(ev, Finish):
                left -= 1
                reasons[index] = ev.reason
                completion_tokens += ev.completion_tokens
            elif isinstance(ev, Failed):
                left -= 1
                failed.append(f"choice {index}: {ev.message}")
    finally:
        for s in seqs:
            s.cancel()
    if failed:
        return _error(500, "; ".join(failed), "server_error")
    usage = api.usage_json(prompt_tokens, completion_tokens)
    choices = [r.whole(reason) for r, reason in zip(replies, reasons, strict=True)]
    return JSONResponse(whole_json(cid, model, choices, usage))


def serve(
    app,
    sched: Scheduler,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    drain_timeout: float = 600,
    ready_line: str | None = None,
):
    """Run uvicorn until SIGINT or SIGTERM. SIGTERM drains: new requests get 503 while the
    in-flight ones finish (at most drain_timeout s), then the server exits; a second signal quits.
    ready_line: printed once the engine is compiled and the socket listens (serve.py's `ready on`)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if sig != signal.SIGTERM or not sched.accepting:
                return super().handle_exit(sig, frame)
            log.warning("SIGTERM: draining %d sequences; new requests get 503", sched.busy)
            sched.accepting = False

            def wait():
                deadline = time.monotonic() + drain_timeout
                sched.drain(timeout=drain_timeout)
                while app.state.inflight and time.monotonic() < deadline:
                    time.sleep(0.05)  # the last bytes of streams being sent
                self.should_exit = True

            threading.Thread(target=wait, daemon=True).start()

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=30)
    srv = Server(config)

    def say_ready():
        while not sched.ready.wait(0.1) or not srv.started:
            if srv.should_exit or not sched.thread.is_alive():
                return
            time.sleep(0.05)
        print(ready_line, flush=True)

    if ready_line:
        threading.Thread(target=say_ready, daemon=True).start()
    srv.run()
    sched.close()
