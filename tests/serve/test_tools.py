"""OpenAI tool calls: rendering with tools equals transformers' apply_chat_template for the three
families' real templates (tests/serve/tool_templates.py), the request checks, the reply parsers
(whole and streamed in random pieces: the same content and calls), and grammar-forced calls (random
walks under llguidance's mask over GPT-2's vocabulary) that parse and validate against the schema.

Tokenizers are built here (a small byte-level BPE with each family's control tokens); nothing is
downloaded.
"""

import json
import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from flaxgpt.data import chat
from flaxgpt.data.hf_tokenizer import HFTokenizer
from flaxgpt.serve import tools as T
from tests.serve import tool_templates

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}, "b": {"type": "boolean"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
CORPUS = "".join(f"user {i}: weather in Paris? city unit celsius name arguments {i}\n" for i in range(100))


def call(id_, name, arguments: dict) -> dict:
    """An OpenAI client's tool call: arguments as a JSON string."""
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


CONVERSATIONS = {  # an agent's turn per family: the call, its result, the answer, a new question
    "hermes": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris and Rome? Add 2 and 3."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                call("call_1", "get_weather", {"city": "Paris"}),
                call("call_2", "get_weather", {"city": "Rome", "unit": "celsius"}),
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "call_2", "content": '{"temp": 25}'},
        {"role": "assistant", "content": "Paris 21, Rome 25.", "tool_calls": []},
        {"role": "user", "content": "And 2 plus 3?"},
    ],
    "llama3_json": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [call("call_1", "get_weather", {"city": "Paris"})]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "It is 21 in Paris."},
        {"role": "user", "content": "And 2 plus 3?"},
    ],
    "mistral": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call("a1b2c3d4e", "get_weather", {"city": "Paris"}), call("Z9y8x7w6v", "add", {})],
        },
        {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "Z9y8x7w6v", "content": "5"},
        {"role": "assistant", "content": "It is 21 in Paris."},
        {"role": "user", "content": "And 2 plus 3?"},
    ],
}


def make_tool_dir(directory, family: str) -> str:
    """tokenizer.json (byte-level BPE, the family's control tokens first) + tokenizer_config.json."""
    directory = str(directory)
    os.makedirs(directory, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=tool_templates.CONTROL[family],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([CORPUS], trainer)
    tok.add_tokens([AddedToken(t, special=False) for t in tool_templates.PLAIN_ADDED[family]])
    tok.save(os.path.join(directory, "tokenizer.json"))
    bos, eos = tool_templates.BOS_EOS[family]
    config = {"eos_token": eos, "tokenizer_class": "PreTrainedTokenizerFast"}
    config |= {"bos_token": bos} if bos else {}
    config["chat_template"] = tool_templates.TEMPLATES[family]
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return directory


@pytest.mark.parametrize("family", T.FAMILIES)
def test_render_with_tools_equals_apply_chat_template(tmp_path, family):
    import transformers

    directory = make_tool_dir(tmp_path, family)
    ours, ref = HFTokenizer(directory), transformers.PreTrainedTokenizerFast.from_pretrained(directory)
    assert T.family_of(ours.chat_template) == family
    raw = CONVERSATIONS[family]
    checked = chat.check_messages(raw, need_assistant=False)
    T.check_tool_messages(checked)
    # as given (a JSON-string or a dict argument alike), with and without tools, any prefix
    for messages in (raw, checked, checked[:2]):
        for tools in (TOOLS, None):
            for gen in (True, False):
                want = ref.apply_chat_template(
                    messages, tools=tools, add_generation_prompt=gen, tokenize=True, return_dict=False
                )
                assert chat.render_ids(ours, messages, gen, tools=tools) == list(want)
    # check_messages hands templates the arguments as objects (what `| tojson` was trained on)
    text, _ = chat.render(ours, checked, True, tools=TOOLS)
    written = {
        "hermes": '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}',
    }[family]
    assert written in text and '"{\\"city' not in text
    assert '"name": "add"' in text and "celsius" in text  # the tools themselves are in the prompt


def test_mistral_takes_an_openai_conversations_call_ids(tmp_path):
    """Mistral's template refuses any id but 9 letters and digits; a conversation replayed from
    another server (call_...) renders with ids of its own, a call and its answer still matching."""
    from flaxgpt.serve import openai_api

    tok = HFTokenizer(make_tool_dir(tmp_path, "mistral"))
    asked = {"role": "assistant", "content": None, "tool_calls": [call("call_abc123XYZ789", "add", {"a": 1})]}
    messages = [{"role": "user", "content": "2 + 3?"}, asked]
    messages.append({"role": "tool", "tool_call_id": "call_abc123XYZ789", "content": "5"})
    mapped = T.mistral_ids(messages)
    short = mapped[1]["tool_calls"][0]["id"]
    assert len(short) == 9 and short.isalnum() and mapped[2]["tool_call_id"] == short
    assert asked["tool_calls"][0]["id"] == "call_abc123XYZ789"  # the caller's messages as they were
    assert T.mistral_ids(CONVERSATIONS["mistral"]) == CONVERSATIONS["mistral"]  # 9 alphanumerics: kept
    body = {"messages": messages, "tools": TOOLS}
    req = openai_api.parse_chat(body, model="m", tokenizer=tok, vocab_size=tok.vocab_size, max_len=4096)
    assert short in tok.tok.decode(req.prompts[0], skip_special_tokens=False)


def test_family_of_plain_templates_is_none():
    from tests.data.test_chat import TEMPLATES

    assert [T.family_of(t) for t in TEMPLATES.values()] == [None, None, None]
    assert T.family_of(None) is None


def test_check_messages_tool_turns():
    raw = CONVERSATIONS["hermes"]
    checked = chat.check_messages(raw, need_assistant=False)
    assert checked[2]["tool_calls"][1]["function"]["arguments"] == {"city": "Rome", "unit": "celsius"}
    assert "content" not in checked[2] and "tool_calls" not in checked[5]  # null and [] dropped
    assert raw[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # the input untouched
    assert checked[3] == {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}
    bad = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call("c", "f", {})]}]
    bad[1]["tool_calls"][0]["function"]["arguments"] = "{city: Paris}"
    with pytest.raises(chat.ChatError, match="message 1: tool call 0 'arguments' is not JSON"):
        chat.check_messages(bad)
    bad[1]["tool_calls"][0]["function"]["arguments"] = "[1, 2]"
    with pytest.raises(chat.ChatError, match="'arguments' is not a JSON object"):
        chat.check_messages(bad)
    with pytest.raises(chat.ChatError, match="message 1 \\(assistant\\) has no string 'content'"):
        chat.check_messages([bad[0], {"role": "assistant", "content": None, "tool_calls": []}])
    with pytest.raises(chat.ChatError, match="message 0 \\(user\\) has 'tool_calls'"):
        chat.check_messages([{"role": "user", "tool_calls": [call("c", "f", {})]}], need_assistant=False)
    with pytest.raises(chat.ChatError, match="tool call 0 has no 'function' with a string 'name'"):
        chat.check_messages([{"role": "assistant", "tool_calls": [{"id": "c"}]}])


def test_request_checks_are_one_line_errors_naming_the_field():
    assert T.check_tools(None) == [] and T.check_tools(TOOLS) == TOOLS
    fn = WEATHER["function"]
    cases = [
        ([], "'tools' must be a non-empty list"),
        ([{"type": "retrieval"}], "tools\\[0\\] must be {type: 'function'"),
        ([{"type": "function", "function": {"name": "get weather"}}], "tools\\[0\\] has name 'get weather'"),
        ([{"type": "function", "function": {"name": "x" * 65}}], "a name is 1-64 letters"),
        ([WEATHER, WEATHER], "tool 'get_weather' is declared twice"),
        ([{"type": "function", "function": {**fn, "parameters": {"type": "string"}}}], "must be an object"),
        (
            [
                {
                    "type": "function",
                    "function": {**fn, "parameters": {"properties": {"city": {"type": "strin"}}}},
                }
            ],
            "tool 'get_weather': 'parameters' is not a valid JSON schema at properties/city/type",
        ),
    ]
    for tools, message in cases:
        with pytest.raises(T.ToolError, match=message) as e:
            T.check_tools(tools)
        assert e.value.param == "tools" and "\n" not in str(e.value)
    assert T.check_tools([{"type": "function", "function": {"name": "now"}}])  # no parameters: fine

    assert [T.check_tool_choice(c, TOOLS) for c in (None, "auto", "none", "required")] == [
        "auto",
        "auto",
        "none",
        "required",
    ]
    assert T.check_tool_choice(None, []) == T.check_tool_choice("auto", []) == "none"
    assert T.request_family(tool_templates.QWEN25, TOOLS) == "hermes"
    assert T.request_family(tool_templates.QWEN25, []) is None
    with pytest.raises(T.ToolError, match="this model's chat template has no tool support") as e:
        T.request_family("{{ messages[0].content }}", TOOLS)
    assert e.value.param == "tools"
    named = {"type": "function", "function": {"name": "add"}}
    assert T.check_tool_choice(named, TOOLS) == named
    for choice, message in [
        ({"type": "function", "function": {"name": "mul"}}, "names 'mul', which is not among 'tools'"),
        ("always", "'tool_choice' must be 'none', 'auto', 'required'"),
        ({"type": "function"}, "'tool_choice' must be"),
    ]:
        with pytest.raises(T.ToolError, match=message) as e:
            T.check_tool_choice(choice, TOOLS)
        assert e.value.param == "tool_choice"
    with pytest.raises(T.ToolError, match="the request has no 'tools'"):
        T.check_tool_choice("required", [])

    user = {"role": "user", "content": "hi"}
    asked = {"role": "assistant", "tool_calls": [call("call_1", "add", {})]}
    for messages, message in [
        (
            [user, {"role": "tool", "tool_call_id": "call_1", "content": "5"}],
            "message 1 \\(tool\\) answers no call",
        ),
        (
            [user, asked, {"role": "tool", "tool_call_id": "call_9", "content": "5"}],
            "has tool_call_id 'call_9'",
        ),
        (
            [user, asked, {"role": "tool", "content": "5"}],
            "has tool_call_id None; send the id of the call it answers \\(call_1\\)",
        ),
    ]:
        with pytest.raises(T.ToolError, match=message) as e:
            T.check_tool_messages(chat.check_messages(messages, need_assistant=False))
        assert e.value.param == "messages"


def calls_of(calls) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


PARIS = ("get_weather", {"city": "Paris"})
SUM = ("add", {"a": 2, "b": True})
# (family, reply, content, calls) as parse must read them
REPLIES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
     '\n</tool_call>', "Let me check.", [PARIS]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": true}}\n</tool_call>', None, [PARIS, SUM]),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": true}\n</tool_call> then '
     '<tool_call>{"name": "add", "arguments": "{\\"a\\": 2, \\"b\\": true}"}</tool_call>',
     '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": true}\n</tool_call> then', [SUM]),
    ("hermes", 'x <tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
     'x <tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', []),
    ("hermes", 'Sure <tool_call>\n{"name": "add", "arguments": {"a": 2, "b": true}}\n', "Sure", [SUM]),
    ("hermes", "Plain: a < b, and <tool is not a call.  ", "Plain: a < b, and <tool is not a call.", []),
    ("hermes", "  \n ", None, []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "add", "arguments": {"a": 2, "b": true}}', None, [PARIS, SUM]),
    ("llama3_json", ' {"name": "get_weather", "parameters": {"city": "Paris"} and more',
     '{"name": "get_weather", "parameters": {"city": "Paris"} and more', []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}} trailing',
     '{"name": "get_weather", "parameters": {"city": "Paris"}} trailing', []),
    ("llama3_json", '{"name": "unknown", "parameters": {}}', '{"name": "unknown", "parameters": {}}', []),
    ("llama3_json", "The answer is 5 {not a call}.", "The answer is 5 {not a call}.", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "add", "arguments": {"a": 2, "b": true}}]', None, [PARIS, SUM]),
    ("mistral", 'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}] done',
     "Checking.  done", [PARIS]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, oops]',
     '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, oops]', []),
    ("mistral", "Lists look like [1, 2]; [TOOL_CALLS] alone is text.",
     "Lists look like [1, 2]; [TOOL_CALLS] alone is text.", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "nope"}]',
     '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "nope"}]', []),
]  # fmt: skip


@pytest.mark.parametrize("family,reply,content,calls", REPLIES)
def test_parse(family, reply, content, calls):
    got_content, got_calls = T.parse(family, reply, TOOLS)
    assert got_content == content and calls_of(got_calls) == calls
    for c in got_calls:
        assert c["type"] == "function" and set(c) == {"id", "type", "function"}
        assert len(c["id"]) == 9 and c["id"].isalnum() if family == "mistral" else c["id"].startswith("call_")
    assert len({c["id"] for c in got_calls}) == len(got_calls)


def join_stream(deltas) -> tuple[str | None, list[dict]]:
    """A client's reassembly of OpenAI streaming deltas: content appended, calls by index."""
    content, calls = "", {}
    for d in deltas:
        assert set(d) <= {"content", "tool_calls"} and d
        content += d.get("content", "")
        for piece in d.get("tool_calls", []):
            if piece["index"] not in calls:
                assert piece["type"] == "function" and piece["id"] and piece["function"]["arguments"] == ""
                calls[piece["index"]] = {
                    "id": piece["id"],
                    "type": "function",
                    "function": dict(piece["function"]),
                }
            else:
                assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}
                calls[piece["index"]]["function"]["arguments"] += piece["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content or None, [calls[i] for i in range(len(calls))]


@pytest.mark.parametrize("family,reply,content,calls", REPLIES)
def test_stream_equals_parse_for_any_split(family, reply, content, calls):
    rng = random.Random(reply)
    splits = [list(reply)]  # a character at a time, then random pieces
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(reply)), min(len(reply) - 1, rng.randint(1, 8))))
        splits.append([reply[a:b] for a, b in zip([0] + cuts, cuts + [len(reply)])])
    for pieces in splits:
        stream = T.StreamParser(family, TOOLS)
        deltas = [d for p in pieces for d in stream.feed(p)] + stream.finish()
        got_content, got_calls = join_stream(deltas)
        assert got_content == content and calls_of(got_calls) == calls


def test_stream_holds_back_what_could_begin_a_marker():
    stream = T.StreamParser("hermes", TOOLS)
    assert stream.feed("Let me check. <tool") == [{"content": "Let me check."}]
    assert stream.feed("_call>\n{") == []
    out = stream.feed('"name": "add", "arguments": {"a": 1, "b": false}}\n</tool_call>')
    assert [list(d) for d in out] == [["tool_calls"], ["tool_calls"]]
    assert out[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": ""}
    assert out[1]["tool_calls"][0] == {"index": 0, "function": {"arguments": '{"a": 1, "b": false}'}}
    assert stream.feed(" <b>ok</b>") == [{"content": "  <b>ok</b>"}] and stream.finish() == []
    mistral = T.StreamParser("mistral", TOOLS)
    assert mistral.feed("see [TOOL") == [{"content": "see"}]
    assert mistral.feed("S]") == [{"content": " [TOOLS]"}] and mistral.finish() == []
    llama = T.StreamParser("llama3_json", TOOLS)
    assert llama.feed(" <|python") == [] and llama.feed("_tag|>{") == []
    assert [list(d) for d in llama.feed('"name": "add"}') + llama.finish()] == [
        ["tool_calls"],
        ["tool_calls"],
    ]
    assert T.StreamParser("llama3_json", TOOLS).feed("Hello {") == [{"content": "Hello {"}]


@pytest.fixture(scope="module")
def gpt2_matcher():
    """(tokenizer, a function from a Lark grammar to a fresh llguidance matcher) over GPT-2's vocabulary."""
    import llguidance
    from llguidance.tiktoken import lltokenizer_from_encoding

    from flaxgpt.data.tokenizers import get_tokenizer

    tok = get_tokenizer("gpt2")
    ll = lltokenizer_from_encoding(tok.enc)

    def matcher(lark: str):
        m = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(lark), log_level=1)
        assert not m.is_error(), m.get_error()
        return m

    return tok, matcher


def walk(tok, m, rng, limit=400) -> str:
    """A random token walk under the matcher's mask until the grammar is done; the text."""
    import llguidance.numpy as lln

    mask, ids = lln.allocate_token_bitmask(1, tok.vocab_size), []
    while not m.is_stopped():
        assert len(ids) < limit, tok.decode(ids)
        lln.fill_next_token_bitmask(m, mask)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[: tok.vocab_size])
        allowed = allowed[allowed != tok.eot_id]
        ids.append(int(rng.choice(allowed)))
        assert m.consume_token(ids[-1]), m.get_error()
    return b"".join(tok.enc.decode_single_token_bytes(i) for i in ids).decode("utf-8")


@pytest.mark.parametrize("family", T.FAMILIES)
def test_grammar_forced_calls_parse_and_validate(gpt2_matcher, family):
    from jsonschema import Draft202012Validator

    tok, matcher = gpt2_matcher
    assert T.marker_token(family, tok) is None  # GPT-2 spells <tool_call> and [TOOL_CALLS] as text
    rng = np.random.default_rng(0)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert T.call_grammar(family, TOOLS, "auto") is None and T.call_grammar(family, TOOLS, "none") is None
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        names = set()
        for _ in range(8):
            text = walk(tok, matcher(T.call_grammar(family, TOOLS, choice)), rng)
            content, calls = T.parse(family, text, TOOLS)
            assert content is None and len(calls) == 1, text
            stream = T.StreamParser(family, TOOLS)
            streamed = join_stream([d for ch in text for d in stream.feed(ch)] + stream.finish())
            assert streamed[0] is None and calls_of(streamed[1]) == calls_of(calls)
            name, arguments = calls_of(calls)[0]
            Draft202012Validator(schemas[name]).validate(arguments)
            names.add(name)
        assert names == ({"get_weather", "add"} if choice == "required" else {"get_weather"})


def test_grammar_forces_the_marker_token_when_given_its_id(tmp_path):
    import llguidance

    directory = make_tool_dir(tmp_path, "mistral")
    ours = HFTokenizer(directory)
    ll = llguidance.LLTokenizer((tmp_path / "tokenizer.json").read_text(), eos_token=ours.eos_id)
    marker = ours.tok.token_to_id("[TOOL_CALLS]")
    assert T.marker_token("mistral", ours) == marker and T.marker_token("llama3_json", ours) is None
    lark = T.call_grammar("mistral", TOOLS, "required", marker_id=marker)
    m = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(lark), log_level=1)
    assert not m.is_error(), m.get_error()
    assert m.compute_ff_tokens()[:1] == [marker]  # the control token itself, not its spelling


def test_an_added_tokens_text_in_a_grammar_is_spelled_in_pieces(tmp_path):
    """Qwen's <tool_call> (an added token, not special) written as text: llguidance offered that id
    alone where the text was forced, then refused it (a 500 at that step, wherever it came); the
    forced text is now spelled in ordinary pieces, and the id itself is still forced as <[id]>."""
    from flaxgpt.serve.grammar import Grammars, Spec, token_bytes

    ours = HFTokenizer(make_tool_dir(tmp_path, "hermes"))
    opening = ours.tok.token_to_id("<tool_call>")
    grammars = Grammars(ours, ours.vocab_size)
    bitmask = np.zeros((1, grammars.words), np.int32)

    def greedy(text: str) -> list[int]:  # the lowest allowed id each step, until only EOS may follow
        m, ids = grammars.matcher(grammars.compile(Spec("grammar", text), "structured_outputs")), []
        for _ in range(40):
            m.fill(bitmask, 0)
            allowed = np.flatnonzero(np.unpackbits(bitmask[0].view(np.uint8), bitorder="little"))
            if m.done():
                return ids
            ids.append(int(allowed[allowed != ours.eos_id][0]))
            m.accept(ids[-1])
        raise AssertionError(f"{text} did not end")

    for text in ('start: "<tool_call>" "x"', 'start: "x" "<tool_call>" "y"'):
        ids = greedy(text)
        assert opening not in ids and ours.decode(ids) == text.split(":")[1].replace('"', "").replace(" ", "")
    assert greedy(f'start: "x" <[{opening}]> "y"') == [*ours.encode("x"), opening, *ours.encode("y")]
    assert token_bytes(ours, opening) == b"<tool_call>"  # logprobs' bytes: its text, as before
