"""OpenAI's /v1/completions and /v1/chat/completions request and response shapes: validation and
JSON, no HTTP and no model.

    req = parse_completion(body, model="gpt2", tokenizer=tok, max_len=1024)   # or BadRequest
    req.prompts  # token ids per prompt; choice i*n + j is prompt i's j-th sample
    req = parse_chat(body, model=..., tokenizer=tok, ...)   # messages -> one prompt (the chat template)

A chat request's messages are rendered with the model's own template and generation prompt
(flaxgpt.data.chat, as transformers' apply_chat_template) into one token-id prompt, then checked
as a completion of those ids; the server stops each choice at the template's end-of-turn token.

Every bad field is a BadRequest naming the field and the limit, which the server answers with
HTTP 400 and OpenAI's error JSON. Extensions beyond OpenAI's fields: `top_k` (0 = off) and
`ignore_eos` (decode to max_tokens; for load tests).
"""

from __future__ import annotations

import secrets
import time
import uuid
from dataclasses import dataclass

from flaxgpt.data import chat

OPENAI_DEFAULT_MAX_TOKENS = 16
MAX_N = 16
MAX_STOP = 4


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error_json(
    message: str, kind: str = "invalid_request_error", param: str | None = None, code=None
) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class CompletionRequest:
    prompts: list[list[int]]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop: list[str]
    seed: int
    n: int
    stream: bool
    include_usage: bool
    ignore_eos: bool


def _number(body, name, default, *, integer=False):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        kind = "an integer" if integer else "a number"
        raise BadRequest(f"'{name}' must be {kind}, got {type(v).__name__} {v!r}"[:200], name)
    return v


def _flag(body, name, default=False):
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"'{name}' must be a boolean, got {type(v).__name__}", name)
    return v


def _prompts(body, tokenizer, vocab_size: int) -> list[list[int]]:
    """str | [str] | [int] | [[int]] -> token ids per prompt."""
    p = body.get("prompt")
    if p is None:
        raise BadRequest("'prompt' is required: a string, a list of strings, or token ids", "prompt")
    is_ids = lambda x: isinstance(x, list) and x and all(type(t) is int for t in x)  # noqa: E731
    if isinstance(p, str):
        texts_or_ids = [p]
    elif is_ids(p):
        texts_or_ids = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) or is_ids(x) for x in p):
        texts_or_ids = p
    else:
        raise BadRequest(
            "'prompt' must be a string, a list of strings, a list of token ids, or a list of those"
        )
    out = []
    for x in texts_or_ids:
        if isinstance(x, str):
            # a tokenizer that starts sequences with BOS (Llama's tokenizer.json) gets it, as in transformers
            bos = [tokenizer.bos_id] if getattr(tokenizer, "add_bos", False) else []
            try:
                ids = bos + tokenizer.encode(x)
            except ValueError as e:
                raise BadRequest(f"prompt cannot be tokenized: {e}", "prompt") from None
            eot = getattr(tokenizer, "eot_id", None)
            if not ids and eot is not None:
                ids = [eot]  # an empty prompt starts a new document, as GPT-2 was trained
        else:
            ids = x
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise BadRequest(f"token ids must be in [0, {vocab_size}), got {bad[0]}", "prompt")
        if not ids:
            raise BadRequest("the prompt is empty and this tokenizer has no end-of-text token", "prompt")
        out.append(list(ids))
    return out


def parse_completion(body, *, model: str, tokenizer, vocab_size: int, max_len: int) -> CompletionRequest:
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    name = body.get("model", model)
    if name != model:
        raise BadRequest(f"unknown model {name!r}; this server serves {model!r}", "model")
    for field in ("logprobs", "suffix", "best_of"):
        if body.get(field) not in (None, 1 if field == "best_of" else None):
            raise BadRequest(f"'{field}' is not supported", field)
    if body.get("echo"):
        raise BadRequest("'echo' is not supported", "echo")
    for field in ("presence_penalty", "frequency_penalty"):
        if _number(body, field, 0) != 0:
            raise BadRequest(f"'{field}' is not supported (only 0)", field)
    prompts = _prompts(body, tokenizer, vocab_size)
    max_tokens = _number(body, "max_tokens", OPENAI_DEFAULT_MAX_TOKENS, integer=True)
    if max_tokens < 1:
        raise BadRequest(f"'max_tokens' must be >= 1, got {max_tokens}", "max_tokens")
    longest = max(len(p) for p in prompts)
    if longest >= max_len:
        raise BadRequest(
            f"the prompt has {longest} tokens; the context window is {max_len} tokens "
            f"(prompt + max_tokens must fit)",
            "prompt",
        )
    if longest + max_tokens > max_len:
        raise BadRequest(
            f"prompt ({longest} tokens) + max_tokens ({max_tokens}) exceeds the context window of "
            f"{max_len} tokens; max_tokens can be at most {max_len - longest}",
            "max_tokens",
        )
    temperature = _number(body, "temperature", 1.0)
    if not 0 <= temperature <= 100:
        raise BadRequest(f"'temperature' must be in [0, 100] (0 = greedy), got {temperature}", "temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise BadRequest(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    top_k = _number(body, "top_k", 0, integer=True)
    if top_k < 0:
        raise BadRequest(f"'top_k' must be >= 0 (0 = off), got {top_k}", "top_k")
    n = _number(body, "n", 1, integer=True)
    if not 1 <= n <= MAX_N:
        raise BadRequest(f"'n' must be in [1, {MAX_N}], got {n}", "n")
    seed = _number(body, "seed", None, integer=True)
    if seed is None:
        seed = secrets.randbits(32)
    elif not 0 <= seed < 2**32:
        raise BadRequest(f"'seed' must be in [0, 2**32), got {seed}", "seed")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"'stop' must be a non-empty string or a list of at most {MAX_STOP} of them", "stop")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    return CompletionRequest(
        prompts=prompts,
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=top_k,
        stop=stop,
        seed=seed,
        n=n,
        stream=_flag(body, "stream"),
        include_usage=_flag(options, "include_usage"),
        ignore_eos=_flag(body, "ignore_eos"),
    )


def parse_chat(body, *, model: str, tokenizer, vocab_size: int, max_len: int) -> CompletionRequest:
    """A chat completion: `messages` through the chat template, the other fields as a completion's."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    if "prompt" in body:
        raise BadRequest("'prompt' belongs to /v1/completions; a chat request sends 'messages'", "prompt")
    for field in ("tools", "tool_choice", "response_format"):
        if body.get(field) is not None:
            raise BadRequest(f"'{field}' is not supported", field)
    try:
        chat.template_of(tokenizer)
        messages = chat.check_messages(body.get("messages"), "'messages'", need_assistant=False)
        ids = chat.render_ids(tokenizer, messages, add_generation_prompt=True, name="'messages'")
    except chat.ChatError as e:
        raise BadRequest(str(e), "messages") from None
    rest = {k: v for k, v in body.items() if k not in ("messages", "max_completion_tokens", "logprobs")}
    if body.get("logprobs"):
        raise BadRequest("'logprobs' is not supported", "logprobs")
    if body.get("max_completion_tokens") is not None:  # the newer name of max_tokens
        rest["max_tokens"] = body["max_completion_tokens"]
    return parse_completion(
        {**rest, "prompt": ids}, model=model, tokenizer=tokenizer, vocab_size=vocab_size, max_len=max_len
    )


def new_id() -> str:
    return f"cmpl-{uuid.uuid4().hex[:24]}"


def chat_json(cid, model, choices, usage=None, created=None) -> dict:
    """A whole chat completion; choices: [(index, text, finish_reason)]."""
    out = completion_json(cid, model, [], usage, created)
    out["object"], out["id"] = "chat.completion", cid.replace("cmpl-", "chatcmpl-")
    out["choices"] = [
        {"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None, "finish_reason": r}
        for i, t, r in choices
    ]
    return out


def chat_chunk_json(cid, model, choices, usage=None, created=None) -> dict:
    """One streamed chunk; the role comes with each choice's first (empty) delta."""
    out = completion_json(cid, model, [], usage, created)
    out["object"], out["id"] = "chat.completion.chunk", cid.replace("cmpl-", "chatcmpl-")
    deltas = [
        {"role": "assistant", "content": ""} if t is None else {"content": t} if t else {}
        for _, t, _ in choices
    ]
    out["choices"] = [
        {"index": i, "delta": d, "logprobs": None, "finish_reason": r}
        for (i, _, r), d in zip(choices, deltas)
    ]
    return out


def completion_json(cid, model, choices, usage=None, created=None) -> dict:
    """choices: [(index, text, finish_reason)]."""
    out = {
        "id": cid,
        "object": "text_completion",
        "created": created or int(time.time()),
        "model": model,
        "choices": [{"index": i, "text": t, "logprobs": None, "finish_reason": r} for i, t, r in choices],
    }
    if usage is not None:
        out["usage"] = usage
    return out


def usage_json(prompt_tokens: int, completion_tokens: int) -> dict:
    total = prompt_tokens + completion_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total}
