"""Operations around every HTTP request (an ASGI middleware): API key, body size limit, access log, metrics.

    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    app = Starlette(routes=..., middleware=[Middleware(Operations, api_key="sk-...", metrics=m)])

- API key: with one set, a request without `Authorization: Bearer <key>` gets 401 in OpenAI's
  error format (code "invalid_api_key"); the open paths (/health) never ask for it.
- Body size: a body over max_bytes gets 413 before any handler reads it (Content-Length is checked
  first; a chunked body is counted as it arrives).
- One access-log line per request on logger "flaxgpt.serve.access", written when the response ends
  (a stream's when its last byte is sent or the client hangs up):
      127.0.0.1 "POST /v1/completions" 200 1874B 0.412s
- flaxgpt_requests_total{route, status}: routes outside `routes` count as "other" (no label per
  scanned URL).

A pure ASGI middleware, not Starlette's BaseHTTPMiddleware: that one runs the app in a separate
task, which breaks a streaming response's cancellation when its client disconnects.
"""

from __future__ import annotations

import hmac
import json
import logging
import time

from starlette.requests import ClientDisconnect

from flaxgpt.serve import openai_api as api

access_log = logging.getLogger("flaxgpt.serve.access")
error_log = logging.getLogger("flaxgpt.serve")


def _error_response(status: int, message: str, kind: str, code: str | None = None):
    body = api.error_json(message, kind)
    body["error"]["code"] = code
    headers = [(b"content-type", b"application/json")]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    return status, json.dumps(body).encode(), headers


class Operations:
    def __init__(
        self, app, *, api_key=None, max_bytes: int = 1 << 20, metrics=None, routes=(), open_paths=("/health",)
    ):
        self.app, self.max_bytes, self.metrics = app, max_bytes, metrics
        self.api_key = api_key.encode() if api_key else None
        self.routes, self.open_paths = set(routes), set(open_paths)

    def _authorized(self, scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        # constant time: the comparison leaks nothing about how much of a guess was right
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, path = time.perf_counter(), scope["path"]
        sent = {"status": 0, "bytes": 0}

        async def send_counted(message):
            if message["type"] == "http.response.start":
                sent["status"] = message["status"]
            elif message["type"] == "http.response.body":
                sent["bytes"] += len(message.get("body", b""))
            await send(message)

        try:
            rejected = None
            if self.api_key and path not in self.open_paths and not self._authorized(scope):
                rejected = _error_response(
                    401,
                    "missing or incorrect API key: send the header 'Authorization: Bearer <key>'",
                    "invalid_request_error",
                    "invalid_api_key",
                )
            else:
                receive, rejected = await self._read_body(scope, receive)
            if rejected:
                status, body, headers = rejected
                await send_counted({"type": "http.response.start", "status": status, "headers": headers})
                await send_counted({"type": "http.response.body", "body": body})
            else:
                await self.app(scope, receive, send_counted)
        except ClientDisconnect:  # the client left while sending its body: a 499, as below
            raise
        except Exception:
            if sent["status"]:  # a response under way: Starlette's error middleware ends it
                raise
            # a bug: a 500 in OpenAI's error JSON (Starlette's is plain text, which clients cannot
            # read), the traceback in the server's log
            error_log.exception("%s %s failed", scope["method"], path)
            status, body, headers = _error_response(
                500, "the server failed on this request (a bug: see its log)", "server_error"
            )
            await send_counted({"type": "http.response.start", "status": status, "headers": headers})
            await send_counted({"type": "http.response.body", "body": body})
        finally:
            status = sent["status"] or 499  # nothing sent: the client went away first
            client = (scope.get("client") or ("-",))[0]
            access_log.info(
                '%s "%s %s" %d %dB %.3fs',
                client,
                scope["method"],
                path,
                status,
                sent["bytes"],
                time.perf_counter() - start,
            )
            if self.metrics is not None:
                route = path if path in self.routes else "other"
                self.metrics.requests.labels(route=route, status=str(status)).inc()

    async def _read_body(self, scope, receive):
        """Read the whole body (at most max_bytes) -> (a receive that replays it, None) or (_, a 413)."""
        too_large = _error_response(
            413,
            f"the request body is larger than this server's limit of {self.max_bytes} bytes",
            "invalid_request_error",
        )
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return receive, too_large
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # a disconnect: let the app see it
                chunks = None
                first = message
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return receive, too_large
            more = message.get("more_body", False)
        replay = [first] if chunks is None else [{"type": "http.request", "body": b"".join(chunks)}]

        async def replaying():
            return replay.pop() if replay else await receive()

        return replaying, None
