"""OpenAI's /v1/completions and /v1/chat/completions request and response shapes: validation and
JSON, no HTTP and no model.

    req = parse_completion(body, model="gpt2", tokenizer=tok, max_len=1024)   # or BadRequest
    req.prompts  # token ids per prompt; choice i*n + j is prompt i's j-th sample
    req = parse_chat(body, model=..., tokenizer=tok, ...)   # messages -> one prompt (the chat template)

A chat request's messages are rendered with the model's own template and generation prompt
(flaxgpt.data.chat, as transformers' apply_chat_template) into one token-id prompt, then checked
as a completion of those ids; the server stops each choice at the template's end-of-turn token
(and, as every reply, at the model's other end tokens: generation_config's eos_token_id list).

Every bad field is a BadRequest naming the field and the limit, which the server answers with
HTTP 400 and OpenAI's error JSON. Beyond OpenAI's fields, vLLM's: `top_k` (0 = off), `min_p`,
`repetition_penalty`, `stop_token_ids`, `structured_outputs` (choice / regex / json / grammar),
and `ignore_eos` (decode to max_tokens; for load tests). Sampling's definitions (decode/sampling.py
`Sampling`) are vLLM's.

What this file does not decide: a grammar's compilation (serve/grammar.py: `constraint` is only
its Spec here) and a tool call's format (serve/tools.py, per model family).
"""

from __future__ import annotations

import secrets
import time
import uuid
from dataclasses import dataclass
from typing import NamedTuple

from flaxgpt.data import chat
from flaxgpt.data.hf_tokenizer import HFTokenizer
from flaxgpt.decode.sampler import MAX_LOGPROBS
from flaxgpt.decode.sampling import MAX_LOGIT_BIAS, Sampling
from flaxgpt.serve.detokenize import TextOffsets

OPENAI_DEFAULT_MAX_TOKENS = 16
MAX_N = 16
MAX_STOP = 4
MAX_STOP_IDS = 16
CHAT_ONLY = ("messages", "logprobs", "top_logprobs", "tools", "tool_choice", "echo", "parallel_tool_calls")


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
    sampling: Sampling  # eos_id left None: the server knows the model's
    stop: list[str]
    seed: int
    n: int
    stream: bool
    include_usage: bool
    ignore_eos: bool
    logprobs: int | None = None  # each token's logprob and this many alternatives (None: none)
    echo: bool = False  # the prompt's tokens (and logprobs) before the completion
    stop_token_ids: tuple = ()
    constraint: object = None  # a serve.grammar Spec the output must match (None: free text)
    constraint_param: str | None = None  # the field it came from (errors name it)
    tools: list | None = None  # chat: checked OpenAI tools
    tool_choice: object = "none"  # "none" | "auto" | "required" | a function name
    parallel_tool_calls: bool = True  # False: a reply's first call only (OpenAI's, vLLM's)
    chat: bool = False

    # the settings as the sampler reads them (the old fields' names)
    temperature = property(lambda self: self.sampling.temperature)
    top_p = property(lambda self: self.sampling.top_p)
    top_k = property(lambda self: self.sampling.top_k)


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


def _sampling(body, vocab_size: int) -> Sampling:
    """The sampling fields of a request (vLLM's ranges), as one Sampling (eos_id None)."""
    temperature = _number(body, "temperature", 1.0)
    if not 0 <= temperature <= 100:
        raise BadRequest(f"'temperature' must be in [0, 100] (0 = greedy), got {temperature}", "temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise BadRequest(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    top_k = _number(body, "top_k", 0, integer=True)
    if top_k < 0 and top_k != -1:  # vLLM's -1 is off too
        raise BadRequest(f"'top_k' must be >= 0 (0 or -1 = off), got {top_k}", "top_k")
    top_k = 0 if top_k >= vocab_size else top_k  # the whole vocabulary: off (and int32 on the device)
    min_p = _number(body, "min_p", 0.0)
    if not 0 <= min_p <= 1:
        raise BadRequest(f"'min_p' must be in [0, 1] (0 = off), got {min_p}", "min_p")
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        penalties[name] = _number(body, name, 0.0)
        if not -2 <= penalties[name] <= 2:
            raise BadRequest(f"'{name}' must be in [-2, 2], got {penalties[name]}", name)
    repetition = _number(body, "repetition_penalty", 1.0)
    if not 0 < repetition <= 100:
        raise BadRequest(
            f"'repetition_penalty' must be in (0, 100] (1 = off), got {repetition}", "repetition_penalty"
        )
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise BadRequest(
            "'logit_bias' must be an object mapping token ids to biases in [-100, 100]", "logit_bias"
        )
    if len(bias) > MAX_LOGIT_BIAS:
        raise BadRequest(f"'logit_bias' has {len(bias)} entries; at most {MAX_LOGIT_BIAS}", "logit_bias")
    pairs = []
    for k, v in bias.items():
        try:
            token = int(k)
        except (TypeError, ValueError):
            raise BadRequest(f"'logit_bias' keys must be token ids, got {k!r}"[:200], "logit_bias") from None
        if not 0 <= token < vocab_size:
            raise BadRequest(
                f"'logit_bias' names token {token}, outside the vocabulary [0, {vocab_size})", "logit_bias"
            )
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise BadRequest(
                f"'logit_bias' values must be numbers in [-100, 100], got {v!r}"[:200], "logit_bias"
            )
        pairs.append((token, float(v)))
    return Sampling(
        temperature=float(temperature), top_k=max(top_k, 0), top_p=float(top_p), min_p=float(min_p),
        presence_penalty=float(penalties["presence_penalty"]),
        frequency_penalty=float(penalties["frequency_penalty"]),
        repetition_penalty=float(repetition), logit_bias=tuple(pairs),
    )  # fmt: skip


def _constraint(body):
    """(Spec, field) from response_format / structured_outputs (vLLM's; its older name guided_json
    and friends are not read), or (None, None)."""
    from flaxgpt.serve import grammar

    rf, so = body.get("response_format"), body.get("structured_outputs")
    if rf is not None and so is not None:
        raise BadRequest(
            "send one of 'response_format' and 'structured_outputs', not both", "structured_outputs"
        )
    try:
        if so is not None:
            return grammar.spec_of_structured_outputs(so), "structured_outputs"
        if rf is not None:
            spec = grammar.spec_of_response_format(rf)
            return spec, "response_format" if spec is not None else None
    except grammar.GrammarError as e:
        raise BadRequest(str(e), e.param) from None
    return None, None


def parse_completion(body, *, model: str, tokenizer, vocab_size: int, max_len: int) -> CompletionRequest:
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    name = body.get("model", model)
    if not isinstance(name, str):
        raise BadRequest(
            f"'model' must be a string naming a served model, got {type(name).__name__}", "model"
        )
    if name != model:
        raise BadRequest(f"unknown model {name!r}; this server serves {model!r}", "model")
    if body.get("suffix") is not None:
        raise BadRequest("'suffix' is not supported", "suffix")
    logprobs = _number(body, "logprobs", None, integer=True)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise BadRequest(f"'logprobs' must be in [0, {MAX_LOGPROBS}], got {logprobs}", "logprobs")
    echo = _flag(body, "echo")
    prompts = _prompts(body, tokenizer, vocab_size)
    # chat's newer name wins, and errors say the name the request used
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, key, OPENAI_DEFAULT_MAX_TOKENS, integer=True)
    if max_tokens < 1:
        raise BadRequest(f"'{key}' must be >= 1, got {max_tokens}", key)
    longest = max(len(p) for p in prompts)
    if longest >= max_len:
        raise BadRequest(
            f"the prompt has {longest} tokens; the context window is {max_len} tokens "
            f"(prompt + max_tokens must fit)",
            "prompt",
        )
    if longest + max_tokens > max_len:
        raise BadRequest(
            f"prompt ({longest} tokens) + {key} ({max_tokens}) exceeds the context window of "
            f"{max_len} tokens; {key} can be at most {max_len - longest}",
            key,
        )
    sampling = _sampling(body, vocab_size)
    n = _number(body, "n", 1, integer=True)
    if not 1 <= n <= MAX_N:
        raise BadRequest(f"'n' must be in [1, {MAX_N}], got {n}", "n")
    best_of = _number(body, "best_of", n, integer=True)  # best_of == n: every sample returned
    if best_of < n:
        raise BadRequest(f"'best_of' must be >= n ({n}), got {best_of}", "best_of")
    if best_of > n:
        raise BadRequest(
            f"'best_of' > n is not supported; ask for n={best_of} and rank the choices by their logprobs",
            "best_of",
        )
    seed = _number(body, "seed", None, integer=True)
    if seed is None:
        seed = secrets.randbits(32)
    elif not 0 <= seed < 2**32:
        raise BadRequest(f"'seed' must be in [0, 2**32), got {seed}", "seed")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"'stop' must be a non-empty string or a list of at most {MAX_STOP} of them", "stop")
    stop_ids = body.get("stop_token_ids") or []
    if (
        not isinstance(stop_ids, list) or len(stop_ids) > MAX_STOP_IDS
        or not all(type(t) is int and 0 <= t < vocab_size for t in stop_ids)
    ):  # fmt: skip
        raise BadRequest(
            f"'stop_token_ids' must be a list of at most {MAX_STOP_IDS} token ids in [0, {vocab_size})",
            "stop_token_ids",
        )
    options = body.get("stream_options")
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    constraint, where = _constraint(body)
    return CompletionRequest(
        prompts=prompts,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=stop,
        seed=seed,
        n=n,
        stream=_flag(body, "stream"),
        include_usage=_flag(options, "include_usage"),
        ignore_eos=_flag(body, "ignore_eos"),
        logprobs=logprobs,
        echo=echo,
        stop_token_ids=tuple(stop_ids),
        constraint=constraint,
        constraint_param=where,
    )


def parse_chat(
    body, *, model: str, tokenizer, vocab_size: int, max_len: int, max_tokens_limit: int | None = None
) -> CompletionRequest:
    """A chat completion: `messages` (and `tools`) through the chat template, the other fields as a
    completion's; `logprobs` (bool) + `top_logprobs` (0..20) as chat has them. Without `max_tokens`
    a reply may take the rest of the context (OpenAI's chat has no 16-token default), at most
    max_tokens_limit (the server's --max_tokens)."""
    from flaxgpt.serve import tools as tool_calls

    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    if "prompt" in body:
        raise BadRequest("'prompt' belongs to /v1/completions; a chat request sends 'messages'", "prompt")
    if _flag(body, "echo"):
        raise BadRequest("'echo' belongs to /v1/completions; chat has no echo", "echo")
    want = _flag(body, "logprobs")
    top = _number(body, "top_logprobs", None, integer=True)
    if top is not None and not want:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise BadRequest(f"'top_logprobs' must be in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs")
    try:
        chat.template_of(tokenizer)
        tools = tool_calls.check_tools(body.get("tools"))  # [] when absent
        family = tool_calls.family_of(tokenizer.chat_template)
        if tools and family is None:
            raise BadRequest(
                "this model's chat template does not render tools; use a model whose template does "
                "(Qwen2.5/Qwen3, Hermes, Llama 3.1+, Mistral)", "tools",
            )  # fmt: skip
        choice = tool_calls.check_tool_choice(body.get("tool_choice"), tools)
        messages = chat.check_messages(body.get("messages"), "'messages'", need_assistant=False)
        tool_calls.check_tool_messages(messages)
        parallel = tool_calls.check_parallel(body.get("parallel_tool_calls"))
        messages = tool_calls.mistral_ids(messages) if family == "mistral" else messages
        ids = chat.render_ids(
            tokenizer, messages, add_generation_prompt=True, name="'messages'", tools=tools or None
        )
    except tool_calls.ToolError as e:
        raise BadRequest(str(e), e.param) from None
    except chat.ChatError as e:
        raise BadRequest(str(e), "messages") from None
    rest = {k: v for k, v in body.items() if k not in CHAT_ONLY}
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        # the rest of the window (a prompt too long is refused below)
        rest["max_tokens"] = max(1, min(max_len - len(ids), max_tokens_limit or max_len))
    if want:
        rest["logprobs"] = top or 0
    req = parse_completion(
        {**rest, "prompt": ids}, model=model, tokenizer=tokenizer, vocab_size=vocab_size, max_len=max_len
    )
    req.chat, req.tools, req.tool_choice, req.parallel_tool_calls = True, tools or None, choice, parallel
    forced = tool_calls.forced_call(family, tools, choice, tokenizer)
    if forced is not None:  # `required` or a named function: the mask makes the reply that call
        if req.constraint is not None:
            raise BadRequest(
                f"'tool_choice' {choice!r} forces a tool call; it cannot be combined with "
                f"'{req.constraint_param}'", "tool_choice",
            )  # fmt: skip
        from flaxgpt.serve import grammar  # what may fail to compile: a tool's parameters (`tools`)

        req.constraint, req.constraint_param = grammar.Spec("grammar", forced), "tools"
    return req


def new_id() -> str:
    return f"cmpl-{uuid.uuid4().hex[:24]}"


class Choice(NamedTuple):
    """One choice of a reply or of a streamed chunk. text None: a chat stream's first (role) delta;
    logprobs: the choice's logprobs object (completion_logprobs / chat_logprobs); tool_calls: chat
    `tool_calls` (whole, or a stream's deltas)."""

    index: int
    text: str | None
    finish_reason: str | None
    logprobs: dict | None = None
    tool_calls: list | None = None


def chat_json(cid, model, choices, usage=None, created=None) -> dict:
    """A whole chat completion; choices: Choice (or (index, text, finish_reason))."""
    out = completion_json(cid, model, [], usage, created)
    out["object"], out["id"] = "chat.completion", cid.replace("cmpl-", "chatcmpl-")
    out["choices"] = []
    for c in map(_choice, choices):
        message = {"role": "assistant", "content": c.text}
        if c.tool_calls:
            message["tool_calls"] = c.tool_calls
        out["choices"].append(
            {"index": c.index, "message": message, "logprobs": c.logprobs, "finish_reason": c.finish_reason}
        )
    return out


def chat_chunk_json(cid, model, choices, usage=None, created=None) -> dict:
    """One streamed chunk; the role comes with each choice's first (empty) delta."""
    out = completion_json(cid, model, [], usage, created)
    out["object"], out["id"] = "chat.completion.chunk", cid.replace("cmpl-", "chatcmpl-")
    out["choices"] = []
    for c in map(_choice, choices):
        delta = (
            {"role": "assistant", "content": ""} if c.text is None else {"content": c.text} if c.text else {}
        )
        delta |= {"tool_calls": c.tool_calls} if c.tool_calls else {}
        out["choices"].append(
            {"index": c.index, "delta": delta, "logprobs": c.logprobs, "finish_reason": c.finish_reason}
        )
    return out


def completion_json(cid, model, choices, usage=None, created=None) -> dict:
    """choices: Choice (or (index, text, finish_reason))."""
    out = {
        "id": cid,
        "object": "text_completion",
        "created": created or int(time.time()),
        "model": model,
        "choices": [
            {"index": c.index, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish_reason}
            for c in map(_choice, choices)
        ],
    }
    if usage is not None:
        out["usage"] = usage
    return out


def _choice(c) -> Choice:
    return c if isinstance(c, Choice) else Choice(*c)


def token_text(tokenizer, token: int) -> tuple[str, bytes]:
    """A token as logprobs report it: its own bytes (a SentencePiece token's leading space kept, a
    byte-fallback token's one byte), and their text (U+FFFD where it holds part of a character).
    Decoding the id alone would drop that space and turn a partial character's bytes into U+FFFD's."""
    enc = getattr(tokenizer, "enc", None)
    if enc is not None:  # tiktoken: a token is a byte string
        raw = enc.decode_single_token_bytes(int(token))
    elif isinstance(tokenizer, HFTokenizer):  # tokenizer.json: llguidance reads each token's bytes
        from flaxgpt.serve import grammar

        raw = grammar.token_bytes(tokenizer, int(token))
    else:
        raw = tokenizer.decode([int(token)]).encode("utf-8")
    return raw.decode("utf-8", errors="replace"), raw


def _skipped(tokenizer, token: int) -> bool:
    """A special token the reply's text leaves out (decode skips it: BOS, <|im_start|>): it is reported
    by name but takes no characters of the text."""
    return token in getattr(tokenizer, "added_ids", ()) and tokenizer.decode([token]) == ""


def completion_logprobs(tokenizer, entries, offset: int = 0, text: str | None = None) -> dict:
    """The legacy completions `logprobs` object of TokenLogprob entries (serve/scheduler.py): tokens,
    token_logprobs (None for an echoed prompt's first), top_logprobs ({token: logprob}; None there too),
    text_offset (where each token's text starts in the reply, from `offset`, an int or a reply's
    detokenize.TextOffsets that a stream's chunks share: characters of the tokens' bytes before it).
    text: the entries' own decoded text (an echoed prompt), which may lack what the tokens' bytes hold
    at its start (special tokens, a SentencePiece first space): offsets are aligned to its end."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offsets = TextOffsets(offset) if isinstance(offset, int) else offset  # a stream's: its chunks go on
    for e in entries:
        token, raw = token_text(tokenizer, e.id)
        out["tokens"].append(token)
        out["token_logprobs"].append(e.logprob)
        out["top_logprobs"].append(
            None if e.logprob is None else {token_text(tokenizer, i)[0]: lp for i, lp in e.top}
        )
        out["text_offset"].append(offsets.next(b"" if _skipped(tokenizer, e.id) else raw))
    if text is not None:  # an echoed prompt (offset an int): aligned to its text's end
        whole = offsets.finish()
        shift = len(whole) - len(text) if whole.endswith(text) else 0
        out["text_offset"] = [offset + max(0, s - offset - shift) for s in out["text_offset"]]
    return out


def chat_logprobs(tokenizer, entries) -> dict:
    """Chat's `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""

    def one(token, lp):
        text, raw = token_text(tokenizer, token)
        return {"token": text, "logprob": lp, "bytes": list(raw)}

    return {
        "content": [
            {**one(e.id, e.logprob), "top_logprobs": [one(i, lp) for i, lp in e.top]} for e in entries
        ]
    }


def usage_json(prompt_tokens: int, completion_tokens: int) -> dict:
    total = prompt_tokens + completion_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total}
