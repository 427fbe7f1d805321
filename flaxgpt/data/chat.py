"""Conversations through a model's own chat template: token ids and the assistant-only loss mask.

    tok = hf_tokenizer.HFTokenizer("path/to/llama_dir")  # its chat_template and special token strings
    ids = render_ids(tok, messages, add_generation_prompt=True)     # a prompt for generation
    ids = render_ids(tok, messages, True, tools=tools)   # with OpenAI tools (flaxgpt.serve.tools)
    ids, mask = assistant_mask(tok, messages)        # training: mask[i] = 1 on assistant tokens
    examples = read_conversations("convs.jsonl")     # {"messages": [...], "tools": [...]} a line

Rendering is transformers' apply_chat_template: the same Jinja environment (a sandbox with
trim_blocks and lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that
keeps non-ASCII, the `{% generation %}` block), the same variables (messages,
add_generation_prompt, tools, documents=None and the special token strings), then the text
encoded with no special token added: the ids equal `apply_chat_template`'s. Messages may carry
OpenAI tool calls; `check_messages` parses their JSON-string arguments into the dicts templates
expect (as vLLM does), so a conversation an OpenAI client sends renders as the model was trained.

The loss counts assistant tokens only, found one of two ways:
- a template that marks `{% generation %}...{% endgeneration %}` (TRL's, SmolLM3's, ...): the tokens
  of the marked characters, as transformers' `return_assistant_tokens_mask` (char_to_token of each
  span's first and last character);
- any other template (Llama 3's, Qwen2's ChatML, ...): prefix by prefix. For assistant turn i, the
  ids of messages[:i] with the generation prompt must be a prefix of the ids of messages[:i+1],
  which must be a prefix of the whole conversation's; the tokens between are the turn (its text and
  the template's end-of-turn tokens). A template for which that does not hold is an error that
  asks for `{% generation %}` marks.
Either way the generation prompt (`<|start_header_id|>assistant<|end_header_id|>\\n\\n`) is never
trained on: it is what the user's side supplies at inference.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

import numpy as np

from flaxgpt.data.dataset_files import jsonl_records

ROLES = ("system", "user", "assistant", "tool")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# private-use characters around each {% generation %} block's output, removed after rendering
OPEN, CLOSE = "\U000f0000", "\U000f0001"


class ChatError(ValueError):
    """Bad conversation or template: the message says which and how to fix it."""


_COMPILED: dict[str, object] = {}


def compile_template(source: str):
    """A chat template compiled in transformers' Jinja environment (cached per source)."""
    if source in _COMPILED:
        return _COMPILED[source]
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %}: its output, wrapped in OPEN ... CLOSE."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            return OPEN + caller() + CLOSE

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; templates expect plain JSON
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    _COMPILED[source] = env.from_string(source)
    return _COMPILED[source]


def template_of(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        where = getattr(getattr(tokenizer, "file", None), "parent", "the tokenizer")
        raise ChatError(
            f"{where} has no chat template (no chat_template.jinja, no tokenizer_config.json "
            "'chat_template'); use a chat (instruct) model's directory, or add its template there"
        )
    return template


def check_messages(messages, name: str = "the conversation", need_assistant: bool = True) -> list[dict]:
    """The messages as plain dicts; a bad one is a ChatError naming `name`.

    Besides {role, content}, an agent conversation holds assistant turns with OpenAI `tool_calls`
    (content null or absent) and `tool` turns answering them (`tool_call_id`, string content).
    A content may be a list of OpenAI text parts (joined); the `developer` role is `system`.
    """
    if not isinstance(messages, list) or not messages:
        raise ChatError(f"{name}: 'messages' must be a non-empty list of {{role, content}} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ChatError(f"{name}: message {i} is not a {{role, content}} object")
        # OpenAI's newer name for the system role (o1 and later models); templates know only "system"
        role = "system" if m["role"] == "developer" else m["role"]
        if role not in ROLES:
            raise ChatError(
                f"{name}: message {i} has role {m['role']!r}; roles are {', '.join(ROLES)} (and developer)"
            )
        # null keys dropped: templates test presence ('tool_calls' in message, content is defined)
        clean = {k: v for k, v in m.items() if v is not None}
        clean["role"] = role
        if isinstance(clean.get("content"), list):
            clean["content"] = _text_parts(clean["content"], f"{name}: message {i}")
        calls = _tool_calls(clean.pop("tool_calls", None), f"{name}: message {i}")
        if calls and m["role"] != "assistant":
            raise ChatError(f"{name}: message {i} ({m['role']}) has 'tool_calls'; only assistants call tools")
        if calls:
            clean["tool_calls"] = calls
        elif not isinstance(clean.get("content"), str):
            raise ChatError(f"{name}: message {i} ({m['role']}) has no string 'content'")
        if "weight" in clean and (role != "assistant" or clean["weight"] not in (0, 1)):
            raise ChatError(  # OpenAI's fine-tuning format: 0 leaves an assistant turn untrained
                f"{name}: message {i} has weight {clean['weight']!r}; a weight is 0 or 1, on assistant turns"
            )
        if not isinstance(clean.get("tool_call_id", ""), str):
            raise ChatError(f"{name}: message {i} has a non-string 'tool_call_id'; send the call's id string")
        if isinstance(clean.get("content"), str):
            clean["content"] = clean["content"].replace(OPEN, "").replace(CLOSE, "")
        out.append(clean)
    if need_assistant and not any(m["role"] == "assistant" for m in out):
        raise ChatError(f"{name} has no assistant turn: nothing to train on (add one, or drop the line)")
    return out


def _text_parts(parts: list, where: str) -> str:
    """OpenAI's content parts ([{"type": "text", "text": ...}, ...], what SDKs and agent frameworks
    send) as the one string a template renders: the text parts joined, as vLLM joins them for a text
    model. Any other part (an image, audio, a file) is an error: these models read text only."""
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            what = f"type {kind!r}" if kind is not None else "no 'type'"
            raise ChatError(
                f"{where}: content part {j} has {what}; this model reads text only: send "
                '{"type": "text", "text": "..."} parts or a string'
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _tool_calls(calls, where: str) -> list[dict]:
    """OpenAI tool_calls with each `arguments` JSON string parsed into a dict.

    Templates write the arguments with `| tojson` (Qwen2.5, Llama 3.1, Mistral), so a string there
    would be written as a quoted string, not the object the model was trained on; vLLM parses them
    the same way before rendering. An empty list is no call (the turn renders as plain text).
    """
    if calls is None or calls == []:
        return []
    if not isinstance(calls, list):
        raise ChatError(f"{where}: 'tool_calls' must be a list of {{id, type, function}} objects")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ChatError(f"{where}: tool call {j} has no 'function' with a string 'name'")
        if call.get("type", "function") != "function":
            raise ChatError(f"{where}: tool call {j} has type {call['type']!r}; the only type is 'function'")
        arguments = function.get("arguments") or {}  # null or "" is a call without arguments
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                raise ChatError(
                    f"{where}: tool call {j} 'arguments' is not JSON ({e}); send an object"
                ) from None
            except RecursionError:
                raise ChatError(f"{where}: tool call {j} 'arguments' is nested too deeply") from None
        if not isinstance(arguments, dict):
            raise ChatError(
                f'{where}: tool call {j} \'arguments\' is not a JSON object, e.g. {{"city": "Paris"}}'
            )
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


PROBE = "\u2063probe\u2063"  # text no template changes: where a message's text lands in a rendering


def render(tokenizer, messages, add_generation_prompt: bool, name: str = "the conversation", tools=None):
    """(text, [(start, end) character spans of {% generation %} blocks]).

    `tools`: OpenAI tool dicts ({"type": "function", "function": {...}}), handed to the template as
    transformers' `apply_chat_template(messages, tools=tools)` does; None renders without tools.
    """
    import jinja2

    template = compile_template(template_of(tokenizer))
    variables = dict(getattr(tokenizer, "special_tokens", {}))
    try:
        marked = template.render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.exceptions.TemplateError as e:
        raise ChatError(f"{name}: the chat template refused it: {e}") from None
    text, spans, start = [], [], None
    for piece in re.split(f"([{OPEN}{CLOSE}])", marked):
        if piece == OPEN:
            start = sum(map(len, text))
        elif piece == CLOSE:
            spans.append((start, sum(map(len, text))))
        else:
            text.append(piece)
    return "".join(text), spans


def render_ids(
    tokenizer, messages, add_generation_prompt: bool, name: str = "the conversation", tools=None
) -> list[int]:
    """apply_chat_template's ids: the rendered text, no special token added."""
    return tokenizer.encode(render(tokenizer, messages, add_generation_prompt, name, tools)[0])


def assistant_mask(
    tokenizer, messages, name: str = "the conversation", tools=None
) -> tuple[np.ndarray, np.ndarray]:
    """(ids [N] int64, mask [N] uint8: 1 on the tokens of assistant turns) of a whole conversation."""
    text, spans = render(tokenizer, messages, False, name, tools)
    encoding = tokenizer.encoding(text)
    ids = np.asarray(encoding.ids, np.int64)
    mask = np.zeros(len(ids), np.uint8)
    # OpenAI's per-turn weight: 0 keeps an assistant turn as context, untrained
    trained = [m.get("weight", 1) == 1 for m in messages if m["role"] == "assistant"]
    if GENERATION_TAG.search(template_of(tokenizer)):
        if not all(trained) and len(spans) != len(trained):
            raise ChatError(
                f"{name}: the template marks {len(spans)} {{% generation %}} blocks for {len(trained)} "
                "assistant turns, so a turn's weight 0 cannot be told apart; drop the weights"
            )
        spans = [span for span, keep in zip(spans, trained) if keep] if not all(trained) else spans
        for start, end in spans:  # transformers' rule: first to last token touching the span
            first, last = encoding.char_to_token(start), encoding.char_to_token(end - 1)
            if first is None:
                break
            mask[first : len(ids) if last is None else last + 1] = 1
        return ids, mask
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or m.get("weight", 1) == 0:
            continue
        if i:
            before = render_ids(tokenizer, messages[:i], True, name, tools)
        else:  # an opening assistant turn: what the template writes before its text is prompt too
            before = _before_text(tokenizer, m, name, tools)  # (BOS, a default system block, its header)
        through = render_ids(tokenizer, messages[: i + 1], False, name, tools)
        if before is None or through[: len(before)] != before or list(ids[: len(through)]) != through:
            raise ChatError(
                f"{name}: the chat template does not render turn {i} as a prefix of the conversation, "
                "so its assistant tokens cannot be found; mark them with {% generation %} in the template"
            )
        mask[len(before) : len(through)] = 1
    return ids, mask


def _before_text(tokenizer, message, name, tools) -> list[int] | None:
    """The ids a template writes before a conversation's first message's text (a template may add
    BOS or a default system block only before a first message, so rendering none does not show them);
    None when the text is not written as given."""
    text, _ = render(tokenizer, [{**message, "content": PROBE}], False, name, tools)
    return tokenizer.encode(text[: text.index(PROBE)]) if PROBE in text else None


def end_of_turn_id(tokenizer) -> int | None:
    """The control token the template writes right after an assistant's text (<|eot_id|>, <|im_end|>):
    where a chat reply stops. The tokenizer's EOS when the template writes none."""
    text, _ = render(
        tokenizer, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": PROBE}], False
    )
    after = text[text.index(PROBE) + len(PROBE) :] if PROBE in text else ""
    added = getattr(tokenizer, "added_ids", frozenset())
    return next((t for t in tokenizer.encode(after) if t in added), tokenizer.eos_id)


def check_tools(record: dict, name: str) -> list | None:
    """A jsonl line's `tools` (OpenAI's fine-tuning format: the functions its assistant may call), or None."""
    tools = record.get("tools") or None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ChatError(f'{name}: "tools" must be a list of {{"type": "function", "function": ...}} objects')
    return tools


def read_conversations(path: str | Path) -> list[tuple[str, list[dict], list | None]]:
    """[(name, messages, tools)] of an OpenAI-style jsonl file (its fine-tuning format: a line's `tools`,
    the functions its assistant may call, rendered by the template as serving renders a request's);
    name = "PATH line N" for the errors."""
    out = []
    for name, record in jsonl_records(path, ChatError, 'a .jsonl file of {"messages": [...]} lines'):
        if not isinstance(record, dict) or "messages" not in record:
            raise ChatError(f'{name} has no "messages" list')
        out.append((name, check_messages(record["messages"], name), check_tools(record, name)))
    if not out:
        raise ChatError(f"{path} holds no conversation")
    return out
