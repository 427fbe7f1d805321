"""OpenAI tool calling: the request's `tools` and `tool_choice` checked, the model's reply turned
into `tool_calls` (whole or streamed), and the grammar that forces a call.

    tools = check_tools(body.get("tools"))                  # [] when absent
    choice = check_tool_choice(body.get("tool_choice"), tools)  # "none" | "auto" | "required" | {function}
    check_tool_messages(messages)                           # each tool turn answers an earlier call
    family = request_family(tok.chat_template, tools)       # how this model writes a call
    content, calls = parse(family, reply, tools)            # a whole reply
    stream = StreamParser(family, tools)                    # a streamed one: OpenAI's deltas
    deltas = stream.feed(piece) ... + stream.finish()
    lark = call_grammar(family, tools, choice, marker_token(family, tok))  # Lark, or None

Families, told apart by the text of the model's chat template:
- "hermes": `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any number of them,
  text around them (Hermes 2 Pro, Qwen2.5, Qwen3: the template writes "<tool_call>");
- "mistral": `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` after any text (Mistral 7B
  v0.3, Nemo: the template writes "[TOOL_CALLS]");
- "llama3_json": the whole reply is `{"name": ..., "parameters": {...}}`, maybe after
  `<|python_tag|>`, several joined by ";" (Llama 3.1-3.3: a Llama 3 template writing '"parameters": ').

What is a call and what stays text: a block in the family's format whose JSON parses, whose name is
one of the request's tools and whose arguments are an object becomes a call (`arguments` re-dumped
as JSON, unvalidated against the schema, as OpenAI's non-strict calls); anything else, a block
with malformed JSON or an undeclared name included, stays in `content` as the model wrote it. An
undeclared name is text, not a call, because the client cannot run a function it never declared,
and a reply that shows what the model tried is more useful than an error. `content` is the text
outside the calls, stripped (templates strip turns anyway), None when empty.

Streaming sends text as it comes, less the tail that could begin a marker ("<tool" may become
"<tool_call>"), and sends a call once it is whole: a call sent piece by piece could not be taken
back when its JSON turned out malformed, and then the stream would disagree with `parse`.
"""

from __future__ import annotations

import json
import re
import secrets
import string

FAMILIES = ("hermes", "llama3_json", "mistral")
NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"
OPENERS = {"hermes": HERMES_OPEN, "mistral": MISTRAL_MARK, "llama3_json": PYTHON_TAG}  # a call starts here
CLOSERS = {"hermes": HERMES_CLOSE}  # ... and, in these families, ends here
# the JSON the templates write with `tojson` (json.dumps' separators): a forced call keeps to it;
# lenient: a schema keyword llguidance lacks is left unenforced rather than failing the request
JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False, "lenient": True}
_DECODER = json.JSONDecoder()
_NOT_JSON = (json.JSONDecodeError, RecursionError)  # text nested past Python's stack is no call either
_ALPHANUMERIC = string.ascii_letters + string.digits


class ToolError(ValueError):
    """A bad `tools`, `tool_choice` or tool turn in `messages`: `.param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


# ---- the request


def check_tools(tools) -> list[dict]:
    """The request's OpenAI `tools`, checked ([] when absent); each is passed to the template as given."""
    if tools is None:
        return []
    if not isinstance(tools, list) or not tools:
        raise ToolError(
            "'tools' must be a non-empty list of {type: 'function', function: {name, parameters}} objects",
            "tools",
        )
    from jsonschema import Draft202012Validator, SchemaError

    seen = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function":
            raise ToolError(
                f"tools[{i}] must be {{type: 'function', function: {{name, parameters}}}}", "tools"
            )
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ToolError(
                f"tools[{i}] has name {name!r}; a name is 1-64 letters, digits, '_' or '-'", "tools"
            )
        if name in seen:
            raise ToolError(f"tool {name!r} is declared twice; give each tool its own name", "tools")
        seen.add(name)
        if not isinstance(function.get("description", ""), str):
            raise ToolError(f"tool {name!r} has a non-string 'description'", "tools")
        params = function.get("parameters", {})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ToolError(
                f"tool {name!r}: 'parameters' must be an object schema, "
                f'e.g. {{"type": "object", "properties": {{...}}}}',
                "tools",
            )
        try:
            Draft202012Validator.check_schema(params)
        except SchemaError as e:
            where = "/".join(map(str, e.path)) or "the top level"
            raise ToolError(
                f"tool {name!r}: 'parameters' is not a valid JSON schema at {where}: {e.message}", "tools"
            ) from None
        except RecursionError:  # jsonschema walks it recursively
            raise ToolError(f"tool {name!r}: 'parameters' is nested too deeply to check", "tools") from None
    return list(tools)


def check_tool_choice(tool_choice, tools: list[dict]):
    """The request's choice: "none", "auto", "required" or {"type": "function", "function": {"name"}}.

    Absent means "auto" with tools and "none" without (OpenAI's defaults); "auto" without tools
    is "none" too, since there is nothing to call."""
    names = [t["function"]["name"] for t in tools]
    if tool_choice is None or tool_choice in ("none", "auto"):
        return (tool_choice or "auto") if tools else "none"
    if tool_choice == "required" or isinstance(tool_choice, dict):
        if not tools:
            raise ToolError(
                "'tool_choice' asks for a call but the request has no 'tools'; add them", "tool_choice"
            )
        if tool_choice == "required":
            return "required"
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if tool_choice.get("type") == "function" and isinstance(name, str):
            if name not in names:
                raise ToolError(
                    f"'tool_choice' names {name!r}, which is not among 'tools' ({', '.join(names)})",
                    "tool_choice",
                )
            return {"type": "function", "function": {"name": name}}
    raise ToolError(
        "'tool_choice' must be 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def check_parallel(value) -> bool:
    """OpenAI's `parallel_tool_calls`: true (or absent), or false: a reply's first call only."""
    if value is None or isinstance(value, bool):
        return value is not False
    raise ToolError(f"'parallel_tool_calls' must be true or false, got {value!r}", "parallel_tool_calls")


def check_tool_messages(messages: list[dict]) -> None:
    """OpenAI's rule for a conversation (after chat.check_messages): each `tool` turn carries the
    `tool_call_id` of a call in the assistant turn just before it (other tool turns between)."""
    ids = None  # the open calls' ids; None outside a run of tool turns
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            ids = [c["id"] for c in m.get("tool_calls", []) if isinstance(c.get("id"), str)] or None
        elif m["role"] != "tool":
            ids = None
        elif ids is None:
            raise ToolError(
                f"message {i} (tool) answers no call: it must follow an assistant turn whose "
                "'tool_calls' have ids (or other tool turns after one)",
                "messages",
            )
        elif m.get("tool_call_id") not in ids:
            raise ToolError(
                f"message {i} (tool) has tool_call_id {m.get('tool_call_id')!r}; send the id of "
                f"the call it answers ({', '.join(ids)})",
                "messages",
            )


def mistral_ids(messages: list[dict]) -> list[dict]:
    """The conversation with every tool-call id Mistral's template refuses (any but 9 letters and
    digits: an OpenAI conversation's call_...) replaced by 9 of its own, a hash of the id, so a call
    and its answer still match (vLLM shortens them likewise); the caller's messages are not changed."""
    import hashlib

    def short(id_):
        if not isinstance(id_, str) or re.fullmatch(r"[a-zA-Z0-9]{9}", id_):
            return id_
        n = int.from_bytes(hashlib.sha256(id_.encode()).digest()[:8], "big")
        return "".join(_ALPHANUMERIC[(n // len(_ALPHANUMERIC) ** k) % len(_ALPHANUMERIC)] for k in range(9))

    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "id": short(c.get("id"))} for c in m["tool_calls"]]}
        if "tool_call_id" in m:
            m = {**m, "tool_call_id": short(m["tool_call_id"])}
        out.append(m)
    return out


def request_family(chat_template: str | None, tools: list[dict]) -> str | None:
    """The family a request with `tools` is parsed in (None without tools); a template that
    renders no tools cannot take them."""
    family = family_of(chat_template)
    if tools and family is None:
        raise ToolError(
            "this model's chat template has no tool support (no <tool_call>, [TOOL_CALLS] or "
            "Llama 3 JSON calls); send the request without 'tools', or serve a model whose template has them",
            "tools",
        )
    return family if tools else None


def family_of(chat_template: str | None) -> str | None:
    """How the template's model writes a call (see the module docstring); None: it renders no tools."""
    t = chat_template or ""
    if HERMES_OPEN in t:
        return "hermes"
    if MISTRAL_MARK in t:
        return "mistral"
    if '"parameters": ' in t and "<|start_header_id|>" in t and "tool" in t:
        return "llama3_json"
    return None


# ---- the reply: pieces of text and calls


def _call(obj, names: frozenset, keys=("arguments",)) -> dict | None:
    """{"name", "arguments": dict} when `obj` is a call to one of `names`, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    arguments = next((obj[k] for k in keys if k in obj), None)
    if arguments is None:
        arguments = {}  # a function of no parameters, called without any
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except _NOT_JSON:
            return None
    return {"name": obj["name"], "arguments": arguments} if isinstance(arguments, dict) else None


def _json(text: str):
    try:
        return json.loads(text)
    except _NOT_JSON:
        return None


def _held(text: str, start: int, marker: str) -> int:
    """Length of the longest tail of text[start:] that begins `marker` (not yet text, not yet a call)."""
    for n in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _scan(family: str, text: str, start: int, names: frozenset, final: bool) -> tuple[list, int]:
    """(pieces of text[start:settled]: strings and calls, settled). `start` is a settled point;
    pieces up to `settled` stay what they are however the text goes on; final: the text is whole."""
    scan = {"hermes": _scan_hermes, "mistral": _scan_mistral, "llama3_json": _scan_llama3}[family]
    return scan(text, start, names, final)


def _scan_hermes(text, i, names, final):
    pieces = []
    while True:
        j = text.find(HERMES_OPEN, i)
        if j < 0:
            end = len(text) if final else len(text) - _held(text, i, HERMES_OPEN)
            return pieces + [text[i:end]], end
        pieces.append(text[i:j])
        k = text.find(HERMES_CLOSE, j)
        if k < 0 and not final:
            return pieces, j
        # an unclosed block at the end (max_tokens, or a model that stops at the '}') still counts
        inner_end, end = (len(text), len(text)) if k < 0 else (k, k + len(HERMES_CLOSE))
        call = _call(_json(text[j + len(HERMES_OPEN) : inner_end]), names)
        pieces.append(call or text[j:end])
        i = end


def _scan_mistral(text, i, names, final):
    pieces = []
    while True:
        j = text.find(MISTRAL_MARK, i)
        if j < 0:
            end = len(text) if final else len(text) - _held(text, i, MISTRAL_MARK)
            return pieces + [text[i:end]], end
        pieces.append(text[i:j])
        k = j + len(MISTRAL_MARK)
        while k < len(text) and text[k] in " \t\r\n":
            k += 1
        if k == len(text) and not final:
            return pieces, j
        if k == len(text) or text[k] != "[":  # no list: the marker is text
            pieces.append(text[j:k])
            i = k
            continue
        try:  # a list ends at its own ']', so a prefix that decodes decodes the same in the whole text
            value, end = _DECODER.raw_decode(text, k)
        except _NOT_JSON:
            if not final:
                return pieces, j  # unfinished (or malformed: known at the end)
            return pieces + [text[j:]], len(text)
        calls = [_call(v, names) for v in value] if isinstance(value, list) and value else [None]
        pieces += calls if all(calls) else [text[j:end]]
        i = end


def _scan_llama3(text, i, names, final):
    if i > 0:  # settled past the start only once the reply is known to be text
        return [text[i:]], len(text)
    lead = text.lstrip()
    if not (lead.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(lead)):
        return [text], len(text)
    if not final:
        return [], 0
    body = lead.removeprefix(PYTHON_TAG)
    calls, k = [], 0
    while True:
        k = len(body) - len(body[k:].lstrip())
        try:
            obj, k = _DECODER.raw_decode(body, k)
        except _NOT_JSON:
            return [text], len(text)
        calls.append(_call(obj, names, ("parameters", "arguments")))
        rest = body[k:].lstrip()
        if not calls[-1] or (rest and not rest.startswith(";")):
            return [text], len(text)
        if not rest:
            return calls, len(text)
        k = len(body) - len(rest) + 1


def _names(tools) -> frozenset:
    return frozenset(t["function"]["name"] for t in tools or [])


def call_id(family: str | None) -> str:
    """A fresh tool-call id: 9 alphanumerics for Mistral (its template refuses any other id), else
    OpenAI's call_ + 24."""
    n = 9 if family == "mistral" else 24
    random = "".join(secrets.choice(_ALPHANUMERIC) for _ in range(n))
    return random if family == "mistral" else f"call_{random}"


def _arguments(call: dict) -> str:
    return json.dumps(call["arguments"], ensure_ascii=False)


def parse(family: str, text: str, tools: list[dict]) -> tuple[str | None, list[dict]]:
    """(content, OpenAI tool_calls) of a whole reply; see the module docstring for the rules."""
    pieces, _ = _scan(family, text, 0, _names(tools), final=True)
    content = "".join(p for p in pieces if isinstance(p, str)).strip() or None
    calls = [
        {
            "id": call_id(family),
            "type": "function",
            "function": {"name": p["name"], "arguments": _arguments(p)},
        }
        for p in pieces
        if isinstance(p, dict)
    ]
    return content, calls


class StreamParser:
    """A reply's text pieces in, OpenAI chat.completion.chunk deltas out; what it sends, joined,
    is `parse` of the whole text (content stripped the same way, calls in the same order).

    A call's first delta carries index, id, type, name and "arguments": "", the next its arguments.
    """

    def __init__(self, family: str, tools: list[dict]):
        self.family, self.names = family, _names(tools)
        self.text, self.settled, self.n_calls = "", 0, 0
        self.started, self.space = False, ""  # content seen yet; whitespace held until text follows

    def feed(self, delta_text: str) -> list[dict]:
        self.text += delta_text
        return self._advance(final=False)

    def finish(self) -> list[dict]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> list[dict]:
        pieces, self.settled = _scan(self.family, self.text, self.settled, self.names, final)
        deltas = []
        for piece in pieces:
            if isinstance(piece, dict):
                deltas += self._call(piece)
            elif text := self._content(piece):
                if deltas and "content" in deltas[-1]:
                    deltas[-1]["content"] += text
                else:
                    deltas.append({"content": text})
        return deltas

    def _content(self, piece: str) -> str:
        """The piece less leading whitespace of the reply and its own trailing whitespace, which is
        sent with the next text: what is sent, joined, is the content stripped."""
        if not self.started:
            piece = piece.lstrip()
            self.started = bool(piece)
        body = piece.rstrip()
        if not body:
            self.space += piece
            return ""
        out, self.space = self.space + body, piece[len(body) :]
        return out

    def _call(self, call: dict) -> list[dict]:
        index, self.n_calls = self.n_calls, self.n_calls + 1
        function = {"name": call["name"], "arguments": ""}
        head = {"index": index, "id": call_id(self.family), "type": "function", "function": function}
        body = {"index": index, "function": {"arguments": _arguments(call)}}
        return [{"tool_calls": [head]}, {"tool_calls": [body]}]


# ---- forcing a call


def marker_token(family: str, tokenizer) -> int | None:
    """The id of the family's opening marker when the tokenizer has it as one added token (Qwen's
    <tool_call>, Mistral's control token [TOOL_CALLS]), for call_grammar; else None. Llama 3's
    forced call is bare JSON (its templates write no <|python_tag|> before a JSON call)."""
    return _added_id(OPENERS.get(family) if family != "llama3_json" else None, tokenizer)


def close_token(family: str, tokenizer) -> int | None:
    """The id of the family's closing marker when it is one added token (Qwen's </tool_call>); else None."""
    return _added_id(CLOSERS.get(family), tokenizer)


def _added_id(marker: str | None, tokenizer) -> int | None:
    ids = tokenizer.encode(marker) if marker else []
    return ids[0] if len(ids) == 1 and ids[0] in getattr(tokenizer, "added_ids", ()) else None


def forced_call(family: str | None, tools: list[dict], tool_choice, tokenizer) -> str | None:
    """call_grammar for a request (None without tools), the family's markers forced by id where they
    are added tokens (they never match text)."""
    if not tools:
        return None
    marker, close = marker_token(family, tokenizer), close_token(family, tokenizer)
    return call_grammar(family, tools, tool_choice, marker, close)


# a function declared without `parameters` takes none (OpenAI's reading): its arguments are {}
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def call_grammar(
    family: str, tools: list[dict], tool_choice, marker_id: int | None = None, close_id: int | None = None
) -> str | None:
    """llguidance Lark grammar for exactly one call in the family's format: to any of the tools
    ("required") or to the named one; None for "auto" and "none" (nothing to force).

    The arguments follow the tool's `parameters` schema (`%json`), written as the templates write
    JSON (", " and ": "). `marker_id` (marker_token's answer): the opening marker's token id, forced
    as that one token, since a special token (Mistral's [TOOL_CALLS]) never matches text; without
    it the marker is forced as text. `close_id` (close_token's): the closing marker's, likewise (Qwen2.5's
    </tool_call> is an added token: llguidance offers it where the text is forced, then refuses it).
    """
    if tool_choice in ("none", "auto"):
        return None
    assert tools, "call_grammar needs the request's tools (check_tool_choice refuses a call without them)"
    chosen = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    params = {t["function"]["name"]: t["function"].get("parameters", NO_PARAMETERS) for t in tools}
    key = "parameters" if family == "llama3_json" else "arguments"
    rules, alternatives = [], []
    for k, (name, schema) in enumerate(params.items()):
        if chosen is not None and name != chosen:
            continue
        schema = {"type": "object", **schema, "x-guidance": JSON_STYLE}
        head = json.dumps(f'{{"name": "{name}", "{key}": ')
        rules += [f'call_{k}: {head} args_{k} "}}"', f"args_{k}: %json {json.dumps(schema)}"]
        alternatives.append(f"call_{k}")
    call = " | ".join(alternatives)
    opening = f"<[{marker_id}]>" if marker_id is not None else None
    start = {
        "hermes": f'{opening or json.dumps(HERMES_OPEN)} "\\n" ({call}) "\\n" '
        + (f"<[{close_id}]>" if close_id is not None else json.dumps(HERMES_CLOSE)),
        "mistral": f'{opening or json.dumps(MISTRAL_MARK)} " [" ({call}) "]"',
        "llama3_json": f"{opening or ''} ({call})".strip(),
    }[family]
    return "\n".join([f"start: {start}"] + rules) + "\n"
