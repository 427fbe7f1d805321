"""The serving API end to end, as an application sees it: the official `openai` client against serve.py
serving a tiny random Qwen2 (Hugging Face directory built here) with Qwen2.5's chat template.

The tokenizer is SentencePiece-style, as Llama 2's and Mistral's tokenizer.json files are (a "▁" for each
space, byte fallback, the decoder's Strip dropping the text's first space) with Qwen's control tokens and
<tool_call> / </tool_call> as plain added tokens. Checked: logprobs (chat, completions with echo,
streamed) against transformers' log-softmax of the same weights; structured outputs (random JSON
schemas, json_object, choice, regex) parse and validate, sharing batches with free text; the tool
agent loop (forced call, the tool's result, a JSON answer), a named call and a streamed call; seeds,
stop_token_ids and logit_bias; OpenAI's 400s for bad fields; the text that follows the prompt keeps
its leading space. One server process for the module; nothing is downloaded.
"""

import json
import os
import random
import re
import socket
import string
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from tests.procs import xla_flags
from tests.serve import tool_templates

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-4  # float32 logprobs (ours, JAX) against float64 log-softmax of transformers' float32 logits
BYTES = [f"<0x{b:02X}>" for b in range(256)]
WORDS = "the quick brown fox jumps over a lazy dog answer name value yes no maybe alpha beta red".split()
MULTIPLY = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "a times b",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 999},
                "b": {"type": "integer", "minimum": 0, "maximum": 999},
            },
            "required": ["a", "b"],
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
            "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["x"],
            "additionalProperties": False,
        },
    },
}


def corpus() -> str:
    rng = random.Random(0)
    lines = [string.printable, tool_templates.QWEN25, json.dumps([MULTIPLY, ADD])]  # the system prompt
    for _ in range(300):
        lines.append(" ".join(rng.choices(WORDS, k=rng.randint(3, 9))))
        obj = {rng.choice(WORDS): rng.choice([rng.randint(-99, 999), rng.choice(WORDS), [1, 2], True, None])}
        lines.append(json.dumps(obj))
    return "\n".join(lines)


def build_model_dir(directory: Path):
    """tokenizer.json (a BPE with byte fallback as Llama 2's: Prepend + Replace normalizer, Replace /
    ByteFallback / Fuse / Strip decoder), Qwen2.5's template, a tiny random Qwen2 -> (model, V)."""
    import transformers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace("▁", prepend_scheme="never")  # words apart, as SentencePiece
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>"] + BYTES, max_token_length=8)
    tok.train_from_iterator([corpus()], trainer)
    spec = json.loads(tok.to_str())  # the byte tokens belong to the vocabulary, not to the added tokens
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] not in BYTES]
    spec["pre_tokenizer"] = None  # Llama 2's tokenizer.json has none
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.add_special_tokens(tool_templates.CONTROL["hermes"])  # <|endoftext|> <|im_start|> <|im_end|>
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in tool_templates.PLAIN_ADDED["hermes"]]
    )
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    config["chat_template"] = tool_templates.QWEN25
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    V = tok.get_vocab_size(with_added_tokens=True)
    torch.manual_seed(0)
    hf_config = transformers.Qwen2Config(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
        eos_token_id=[tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")],  # Qwen2.5-Instruct's
    )  # fmt: skip
    model = transformers.Qwen2ForCausalLM(hf_config).eval()
    with torch.no_grad():
        for p in model.parameters():  # peaked logits: no near-ties among the greedy choices
            p.add_(0.15 * torch.randn_like(p))
    model.save_pretrained(directory)
    return model, V


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """SimpleNamespace(client, url, model (transformers), ref (its tokenizer), tok (tokenizers), V)."""
    import transformers

    directory = tmp_path_factory.mktemp("qwen2")
    model, V = build_model_dir(directory)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags()}
    cmd = [sys.executable, str(ROOT / "serve.py"), "--init_from", str(directory), "--port", str(port)]
    cmd += ["--slots", "4", "--max_queue", "32", "--max_len", "1024", "--model_name", "tiny"]
    cmd += ["--prefill_chunk", "32"]  # prompt buckets 16, 24, 32: few programs to compile at start
    log = open(directory / "server.log", "w")  # not a pipe: nobody reads it while tests run
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):  # compiling on a loaded 2-core machine: at most 5 minutes
        if proc.poll() is not None:
            pytest.fail(f"server exited {proc.returncode}:\n{(directory / 'server.log').read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("server not healthy after 300 s")
    # a connection per request: a pooled one may be closed by uvicorn's keep-alive timeout (5 s) just as
    # a request goes out on it, an error a client retries; without retries every error shows
    headers = {"Connection": "close"}
    client = openai.OpenAI(
        base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120, default_headers=headers
    )
    ref = transformers.PreTrainedTokenizerFast.from_pretrained(str(directory))
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    yield SimpleNamespace(client=client, url=url, model=model, ref=ref, tok=tok, V=V)
    proc.kill()
    proc.wait(timeout=30)
    log.close()


# ---- references


def ref_logprobs(api, ids) -> np.ndarray:
    """transformers' log-softmax (float64 of its float32 logits) at every position: [T, V]."""
    with torch.no_grad():
        logits = api.model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def token_bytes(api, i) -> bytes:
    """A token's own bytes, read here from the vocabulary's pieces: "▁" a space, <0xNN> its byte."""
    piece = api.tok.id_to_token(i)
    if re.fullmatch(r"<0x[0-9A-F]{2}>", piece):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("▁", " ").encode()


def texts(api) -> dict:
    """A token's text as logprobs report it (its bytes as text, U+FFFD for a partial character) -> its ids."""
    out = {}
    for i in range(api.V):
        out.setdefault(token_bytes(api, i).decode("utf-8", errors="replace"), []).append(i)
    return out


def follow(api, prompt_ids, content) -> list[int]:
    """The ids behind chat logprob entries, which name tokens by text only: at each step the id with
    that text whose transformers logprob is nearest. Asserts each logprob and its top alternatives."""
    by_text, ids = texts(api), list(prompt_ids)
    for k, e in enumerate(content):
        lp_V = ref_logprobs(api, ids)[-1]
        chosen = min(by_text[e.token], key=lambda i: abs(lp_V[i] - e.logprob))
        assert e.bytes == list(token_bytes(api, chosen)), e  # the token's own bytes, its space kept
        assert abs(lp_V[chosen] - e.logprob) < TOL, (k, e.token, lp_V[chosen], e.logprob)
        assert abs(e.logprob - lp_V.max()) < TOL  # greedy: the most likely token
        top = [t.logprob for t in e.top_logprobs]
        assert len(top) == 5 and top == sorted(top, reverse=True)
        np.testing.assert_allclose(top, np.sort(lp_V)[::-1][:5], atol=TOL, rtol=0)
        for t in e.top_logprobs:
            assert min(abs(lp_V[i] - t.logprob) for i in by_text[t.token]) < TOL, (k, t)
        ids.append(chosen)
    return ids[len(prompt_ids) :]


# ---- 1. logprobs


def test_chat_logprobs_equal_transformers_and_stream(api):
    messages = [{"role": "user", "content": "the quick brown fox"}]
    kw = dict(
        model="tiny", messages=messages, max_tokens=12, temperature=0, seed=3, logprobs=True, top_logprobs=5
    )
    r = api.client.chat.completions.create(**kw)
    prompt_ids = api.ref.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert r.usage.prompt_tokens == len(prompt_ids)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens - (r.choices[0].finish_reason == "stop")  # EOS: no entry
    ids = follow(api, prompt_ids, content)
    assert r.choices[0].message.content == api.tok.decode(prompt_ids + ids)[len(api.tok.decode(prompt_ids)) :]

    chunks = list(api.client.chat.completions.create(**kw, stream=True))
    streamed = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason


def test_completion_echo_prompt_logprobs_equal_transformers(api):
    prompt = api.tok.encode("the lazy dog jumps over a red fox", add_special_tokens=False).ids
    r = api.client.completions.create(
        model="tiny", prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(prompt) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    lp_TV = ref_logprobs(api, prompt)
    want = [lp_TV[t - 1, prompt[t]] for t in range(1, len(prompt))]
    np.testing.assert_allclose(lp.token_logprobs[1:-1], want, atol=TOL, rtol=0)
    assert abs(lp.token_logprobs[-1] - lp_TV[-1].max()) < TOL  # the greedy completion token
    for t in range(1, len(prompt) + 1):  # the top 3 (texts may coincide: a dict keeps one of them)
        assert len(lp.top_logprobs[t]) <= 3
        best = np.sort(lp_TV[t - 1])[::-1][:3]
        assert all(np.abs(best - v).min() < TOL for v in lp.top_logprobs[t].values())
        if len(lp.top_logprobs[t]) == 3:  # three texts: all three alternatives
            np.testing.assert_allclose(sorted(lp.top_logprobs[t].values(), reverse=True), best, atol=TOL)
    assert r.choices[0].text.startswith(api.tok.decode(prompt))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_logprob_tokens_are_the_tokens_bytes_and_offsets_point_into_the_text(api):
    # "▁ؿ" is "▁" then two byte-fallback tokens; alone, "▁quick" decodes as "quick" and <0xD8> as U+FFFD
    prompt = api.tok.encode("the ؿ quick brown", add_special_tokens=False).ids
    pieces = ["▁the", "▁", "<0xD8>", "<0xBF>", "▁quick", "▁brown"]
    assert [api.tok.id_to_token(i) for i in prompt] == pieces
    fox = {str(api.tok.token_to_id("▁fox")): 100}
    r = api.client.completions.create(
        model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=0, logit_bias=fox
    )
    text, lp = r.choices[0].text, r.choices[0].logprobs
    assert text == "the ؿ quick brown fox fox fox"  # the echo: the decoder drops the first space
    assert lp.tokens == [" the", " ", "\ufffd", "\ufffd", " quick", " brown"] + [" fox"] * 3
    assert lp.text_offset == [0, 3, 4, 4, 5, 11, 17, 21, 25]  # the two bytes: where their character is
    for token, offset in zip(lp.tokens[1:], lp.text_offset[1:]):
        assert "\ufffd" in token or text[offset:].startswith(token), (token, offset, text)
    # a special token inside the prompt: named in tokens, no characters of the text (decode skips it)
    start = api.tok.token_to_id("<|im_start|>")
    prompt = api.tok.encode("the quick", add_special_tokens=False).ids + [start]
    prompt += api.tok.encode("brown fox", add_special_tokens=False).ids
    r = api.client.completions.create(
        model="tiny", prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=0, logit_bias=fox
    )
    text, lp = r.choices[0].text, r.choices[0].logprobs
    assert text == "the quick brown fox fox" and lp.tokens[2] == "<|im_start|>"
    assert lp.text_offset == [0, 3, 9, 9, 15, 19]

    # chat: each entry's bytes are the token's own; together they are the reply's bytes
    # no end of turn (12 entries: it would have none) and no byte of a character cut in two
    specials = ["<|im_end|>", "<|im_start|>", "<|endoftext|>"]  # (their bytes are their names)
    bias = {str(api.tok.token_to_id(t)): -100 for t in [*specials, *BYTES[128:]]}
    r = chat(api, "the quick brown ؿ", max_tokens=12, temperature=0, logprobs=True, logit_bias=bias)
    content = r.choices[0].logprobs.content
    assert len(content) == 12 and r.choices[0].finish_reason == "length"
    assert bytes(b for e in content for b in e.bytes).decode() == r.choices[0].message.content


def test_byte_tokens_bytes_and_offsets_streamed_or_whole(api):
    # <0xFF>: its byte (llguidance, which reads tokens' bytes, keeps a leading 0xFF as its own marker:
    # it was reported with no bytes and an empty text)
    ff = str(api.tok.token_to_id("<0xFF>"))
    r = chat(api, "x", max_tokens=2, temperature=0, logprobs=True, logit_bias={ff: 100})
    assert [(e.token, e.bytes) for e in r.choices[0].logprobs.content] == [("\ufffd", [255])] * 2
    lp = complete(api, "x", max_tokens=2, temperature=0, logprobs=0, logit_bias={ff: 100}).choices[0].logprobs
    assert (lp.tokens, lp.text_offset) == (["\ufffd"] * 2, [0, 1])
    # a reply of byte tokens, valid and not: its stream's offsets are the whole reply's (each chunk
    # started a new decoder, and bytes held between chunks shifted every later offset)
    bias = {str(api.tok.token_to_id(f"<0x{b:02X}>")): 4 for b in range(0x80, 0x100)}
    for seed in range(3):
        kw = dict(max_tokens=24, temperature=1.0, seed=seed, logprobs=0, logit_bias=bias)
        whole = complete(api, "the quick brown", **kw).choices[0]
        chunks = [c.choices[0] for c in complete(api, "the quick brown", stream=True, **kw) if c.choices]
        streamed = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
        assert "".join(c.text for c in chunks) == whole.text and streamed == whole.logprobs.text_offset


def test_top_k_past_the_vocabulary_is_off(api):
    # top_k >= the vocabulary keeps every token: off (2**31 was a 500: the device's int32)
    kw = dict(max_tokens=6, temperature=1.0, seed=3)
    want = complete(api, "the quick brown", **kw).choices[0].text
    for k in (api.V, 2**31, 2**63):
        assert complete(api, "the quick brown", extra_body={"top_k": k}, **kw).choices[0].text == want


def test_usage_counts_a_prompt_once_whatever_n(api):
    kw = dict(max_tokens=2, temperature=1.0, seed=1, extra_body={"ignore_eos": True})
    one, three = complete(api, "the quick brown", **kw), complete(api, "the quick brown", n=3, **kw)
    assert one.usage.prompt_tokens == three.usage.prompt_tokens == 3  # as OpenAI counts: once
    assert (one.usage.completion_tokens, three.usage.completion_tokens) == (2, 6)


# ---- 2. structured outputs

SCALARS = ("string", "pattern", "integer", "number", "enum", "boolean")
KINDS = SCALARS + ("array", "object")


def value_schema(rng, kind, depth) -> dict:
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 8)}
    if kind == "pattern":
        pattern = rng.choice(
            [r"^[a-z]{2,5}$", r"^[0-9]{3}-[0-9]{2}$", r"^(red|green|blue)$", r"^[A-Z][a-z]{0,4}$"]
        )
        return {"type": "string", "pattern": pattern}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "number":
        return {"type": "number", "minimum": -1.5, "maximum": rng.choice([2.5, 100])}
    if kind == "enum":
        return {"enum": rng.sample(["alpha", "beta", "gamma", "delta", "yes no"], rng.randint(2, 4))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        low = rng.randint(0, 2)
        item = value_schema(rng, rng.choice(SCALARS), depth + 1)
        return {"type": "array", "items": item, "minItems": low, "maxItems": low + rng.randint(0, 2)}
    return object_schema(rng, depth + 1)


def object_schema(rng, depth=0, first=None) -> dict:
    """An object of 1-3 properties (`first` the first one's kind), some required, no others allowed."""
    kinds = [first or rng.choice(KINDS)] + [
        rng.choice(KINDS if depth < 1 else SCALARS) for _ in range(rng.randint(0, 2))
    ]
    props = {f"{kind[:3]}{i}": value_schema(rng, kind, depth) for i, kind in enumerate(kinds)}
    required = sorted(rng.sample(sorted(props), rng.randint(1, len(props))))
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def chat(api, content="Reply in JSON.", **kw):
    return api.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": content}], **kw
    )


def test_structured_outputs_validate_while_sharing_batches(api):
    rng = random.Random(0)
    schemas = [object_schema(rng, first=KINDS[i % len(KINDS)]) for i in range(15)]
    max_tokens = 160

    def constrained(i, max_tokens=max_tokens):
        rf = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schemas[i]}}
        return chat(api, max_tokens=max_tokens, temperature=1.0, seed=1000 + i, response_format=rf)

    def free():
        return chat(api, "the quick brown fox", max_tokens=40, temperature=1.0, seed=7)

    with ThreadPoolExecutor(8) as pool:  # 4 slots: constrained and free rows share every batch
        futures = [pool.submit(constrained, i) for i in range(len(schemas))]
        free_together = pool.submit(free)
        cut = pool.submit(constrained, 0, max_tokens=3)  # no object of these schemas fits in 3 tokens
        replies = [f.result() for f in futures]
    assert cut.result().choices[0].finish_reason == "length" and cut.result().usage.completion_tokens == 3
    stops = 0
    for schema, r in zip(schemas, replies):
        c = r.choices[0]
        assert c.finish_reason in ("stop", "length"), c
        if c.finish_reason == "length":
            assert r.usage.completion_tokens == max_tokens
            continue
        stops += 1
        jsonschema.validate(json.loads(c.message.content), schema)
    assert stops >= 10, f"only {stops} of {len(schemas)} replies ended within {max_tokens} tokens"
    # the same requests alone: a row's mask and seed are its own
    assert free_together.result().choices[0].message.content == free().choices[0].message.content
    assert constrained(3).choices[0].message.content == replies[3].choices[0].message.content


def test_json_object_choice_and_regex(api):
    stops = 0
    for seed in range(3):
        r = chat(api, max_tokens=200, temperature=1.0, seed=seed, response_format={"type": "json_object"})
        if r.choices[0].finish_reason == "stop":
            stops += 1
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        else:
            assert r.usage.completion_tokens == 200
    assert stops
    choices, regex = ["yes", "no", "maybe so"], r"[0-9]{3}-[a-z]{2,4}"
    for seed in range(3):
        so = {"structured_outputs": {"choice": choices}}
        r = chat(api, max_tokens=20, temperature=1.0, seed=seed, extra_body=so)
        assert r.choices[0].message.content in choices and r.choices[0].finish_reason == "stop"
        so = {"structured_outputs": {"regex": regex}}
        r = chat(api, max_tokens=20, temperature=1.0, seed=seed, extra_body=so)
        assert re.fullmatch(regex, r.choices[0].message.content) and r.choices[0].finish_reason == "stop"


# ---- 3. tools


def multiply(a: int, b: int) -> int:
    return a * b


def check_call(call, tool) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


def test_tool_agent_loop(api):
    messages = [{"role": "user", "content": "What is 6 times 7?"}]
    kw = dict(model="tiny", tools=[MULTIPLY], max_tokens=80, temperature=1.0, seed=5)
    r = api.client.chat.completions.create(messages=messages, tool_choice="required", **kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    result = multiply(**check_call(call, MULTIPLY))
    messages.append(c.message.model_dump(exclude_none=True))  # the assistant turn with its tool_calls
    messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
    schema = {"type": "object", "properties": {"answer": {"const": result}}, "required": ["answer"]}
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    r = api.client.chat.completions.create(messages=messages, tool_choice="none", response_format=rf, **kw)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    assert json.loads(r.choices[0].message.content) == {"answer": result}


def test_named_tool_choice_forces_that_function(api):
    for seed in range(3):
        r = chat(api, "Add or multiply?", tools=[MULTIPLY, ADD], max_tokens=60, temperature=1.0, seed=seed,
                 tool_choice={"type": "function", "function": {"name": "add"}})  # fmt: skip
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        check_call(c.message.tool_calls[0], ADD)


def test_streamed_tool_call_reassembles_to_the_whole_reply(api):
    kw = dict(tools=[MULTIPLY, ADD], tool_choice="required", max_tokens=80, temperature=1.0, seed=11)
    whole = chat(api, "What is 6 times 7?", **kw).choices[0]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 1
    calls, content, finish = {}, "", None
    for chunk in chat(api, "What is 6 times 7?", stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        for piece in delta.tool_calls or []:
            if piece.index not in calls:  # OpenAI's first piece: index, id, type, name, "" arguments
                assert piece.id.startswith("call_") and piece.type == "function" and piece.function.name
                calls[piece.index] = {
                    "name": piece.function.name,
                    "arguments": piece.function.arguments or "",
                }
            else:
                assert piece.id is None and piece.function.name is None
                calls[piece.index]["arguments"] += piece.function.arguments
    assert finish == "tool_calls" and content == "" and list(calls) == [0]
    want = whole.message.tool_calls[0].function
    assert calls[0] == {"name": want.name, "arguments": want.arguments}


def test_every_end_token_of_the_model_ends_a_reply_and_a_tool_call(api):
    """generation_config's eos_token_id list (Qwen2.5's <|im_end|>, <|endoftext|>; Llama 3.1's
    <|eom_id|>, which ends a tool call) stops a reply as transformers' generate and vLLM stop, out of
    the text; ignore_eos decodes through them."""
    end = api.tok.token_to_id("<|endoftext|>")
    kw = dict(max_tokens=6, temperature=0, logit_bias={str(end): 100})
    r = complete(api, "the quick brown", **kw)
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == ("", "stop", 1)
    r = complete(api, "the quick brown", **kw, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    r = chat(api, "Hi", **kw)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("", "stop")
    call = json.dumps('\n{"name": "add", "arguments": {"x": 4}}\n')  # between the markers, ids here
    opening, closing = (api.tok.token_to_id(t) for t in ("<tool_call>", "</tool_call>"))
    grammar = f"start: <[{opening}]> {call} <[{closing}]> <[{end}]>"
    so = {"structured_outputs": {"grammar": grammar}}
    r = chat(api, "Add 4.", tools=[ADD], max_tokens=60, extra_body=so)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None, c
    assert check_call(c.message.tool_calls[0], ADD) == {"x": 4}


def test_parallel_tool_calls_false_keeps_the_first_call(api):
    """Two calls in a reply (forced here by a grammar); parallel_tool_calls false returns the first,
    whole and streamed, as OpenAI and vLLM do."""
    opening, closing = (api.tok.token_to_id(t) for t in ("<tool_call>", "</tool_call>"))
    one, two = (json.dumps(f'\n{{"name": "add", "arguments": {{"x": {x}}}}}\n') for x in (1, 2))
    grammar = f'start: <[{opening}]> {one} <[{closing}]> "\\n" <[{opening}]> {two} <[{closing}]>'
    kw = dict(tools=[ADD], max_tokens=80, extra_body={"structured_outputs": {"grammar": grammar}})
    arguments = lambda c: [json.loads(call.function.arguments) for call in c.message.tool_calls]  # noqa: E731
    assert arguments(chat(api, "Add.", **kw).choices[0]) == [{"x": 1}, {"x": 2}]
    first = chat(api, "Add.", parallel_tool_calls=False, **kw).choices[0]
    assert first.finish_reason == "tool_calls" and arguments(first) == [{"x": 1}]
    pieces = [
        piece
        for chunk in chat(api, "Add.", parallel_tool_calls=False, stream=True, **kw)
        for choice in chunk.choices
        for piece in choice.delta.tool_calls or []
    ]
    assert {p.index for p in pieces} == {0}
    assert json.loads("".join(p.function.arguments or "" for p in pieces)) == {"x": 1}


def test_a_function_without_parameters_is_called_with_none(api):
    """OpenAI: a function declared without `parameters` takes an empty parameter list; a forced call's
    arguments are {} (they were any object: random keys, or no call at all by max_tokens)."""
    now = {"type": "function", "function": {"name": "now", "description": "the time"}}
    for seed in range(3):
        c = chat(api, "Time?", tools=[now], tool_choice="required", max_tokens=40, temperature=1.0, seed=seed)
        call = c.choices[0].message.tool_calls[0].function
        assert (call.name, call.arguments) == ("now", "{}")


# ---- 4. sampling controls


def complete(api, prompt, **kw):
    return api.client.completions.create(model="tiny", prompt=prompt, **kw)


def test_seed_is_the_same_alone_and_in_a_batch(api):
    prompts = ["the quick brown", "a lazy dog", "yes no maybe", "red fox"]
    kw = dict(max_tokens=24, temperature=1.0)
    alone = [complete(api, p, seed=i, **kw).choices[0].text for i, p in enumerate(prompts)]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda i: complete(api, prompts[i], seed=i, **kw).choices[0].text, range(4)))
    assert together == alone
    assert complete(api, prompts[0], seed=99, **kw).choices[0].text != alone[0]


def test_stop_token_ids_and_logit_bias(api):
    by_text = texts(api)
    kw = dict(max_tokens=16, temperature=1.0, seed=1, logprobs=0)  # seeded: the same tokens until the stop
    r = complete(api, "the quick brown", **kw)
    tokens = r.choices[0].logprobs.tokens
    # a token whose text names one id, first seen at position k >= 1
    k = next((k for k, t in enumerate(tokens) if k and len(by_text[t]) == 1 and t not in tokens[:k]), None)
    assert k is not None, tokens
    s = complete(api, "the quick brown", **kw, extra_body={"stop_token_ids": [by_text[tokens[k]][0]]})
    assert s.choices[0].finish_reason == "stop" and s.usage.completion_tokens == k + 1
    assert s.choices[0].logprobs.tokens == tokens[:k]  # the stop token is not part of the reply
    assert r.choices[0].text.startswith(s.choices[0].text)

    fox = api.tok.token_to_id("▁fox")
    b = complete(api, "the quick brown", max_tokens=8, temperature=0, logprobs=0, logit_bias={str(fox): 100})
    assert b.choices[0].logprobs.tokens == [" fox"] * 8 and b.choices[0].finish_reason == "length"
    assert b.choices[0].logprobs.text_offset == list(range(0, 32, 4))  # where each " fox" starts
    assert b.choices[0].text == " fox" * 8  # the text that follows the prompt: its first space kept
    assert max(b.choices[0].logprobs.token_logprobs) < -0.1  # logprobs of the raw logits, before the bias


# ---- 5. bad input


def schema_format(schema) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def tool(parameters) -> list:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


DEEP = {"type": "object", "properties": {}}
for _ in range(400):  # a valid schema, 400 objects deep (a 100 kB body: under the server's limit)
    DEEP = {"type": "object", "properties": {"a": DEEP}}

DEEP_CALL = [  # a tool call whose arguments string nests 5000 lists
    {"role": "user", "content": "x"},
    {
        "role": "assistant",
        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}],
    },
    {"role": "tool", "tool_call_id": "c", "content": "1"},
]

BAD = [  # (the field the error names, a word of its message, the request)
    ("response_format", "strng", schema_format({"type": "object", "properties": {"a": {"type": "strng"}}})),
    ("structured_outputs", "look-around", {"extra_body": {"structured_outputs": {"regex": "(?<=a)b"}}}),
    ("structured_outputs", "character class", {"extra_body": {"structured_outputs": {"regex": "[a-"}}}),
    ("tools", "'parameters'", {"tools": tool({"type": "object", "properties": {"a": {"type": 12}}})}),
    (
        "tool_choice",
        "'f'",
        {"tools": [MULTIPLY], "tool_choice": {"type": "function", "function": {"name": "f"}}},
    ),
    ("parallel_tool_calls", "true or false", {"tools": [MULTIPLY], "parallel_tool_calls": "no"}),
    # a forced call's schema that cannot be enforced: the tools are at fault, not tool_choice
    (
        "tools",
        "$defs/x",
        {"tools": tool({"properties": {"a": {"$ref": "#/$defs/x"}}}), "tool_choice": "required"},
    ),
    ("top_logprobs", "'logprobs'", {"top_logprobs": 3}),
    ("top_logprobs", "21", {"logprobs": True, "top_logprobs": 21}),
    ("logit_bias", "100000", {"logit_bias": {"100000": 5}}),
    # JSON nested past Python's stack (jsonschema's check, json.loads of a string): 400s, not 500s
    ("response_format", "nested too deeply", schema_format(DEEP)),
    ("tools", "nested too deeply", {"tools": tool(DEEP)}),
    ("response_format", "nested too deeply", schema_format(json.dumps(DEEP))),  # the schema as a string
    ("messages", "nested too deeply", {"extra_body": {"messages": DEEP_CALL}}),
]


@pytest.mark.parametrize("field,needle,kw", BAD, ids=[f"{f}-{i}" for i, (f, *_) in enumerate(BAD)])
def test_bad_input_is_openai_400_naming_the_field(api, field, needle, kw):
    with pytest.raises(openai.BadRequestError) as e:
        chat(api, max_tokens=8, **kw)
    assert e.value.status_code == 400 and e.value.param == field and e.value.type == "invalid_request_error"
    message = e.value.body["message"]
    assert needle in message and "\n" not in message, message
    r = chat(api, max_tokens=8, temperature=0)  # and the server goes on serving
    assert r.choices[0].finish_reason in ("stop", "length")


# ---- 6. the text that follows the prompt


def test_text_follows_the_prompt_streamed_or_whole(api):
    kw = dict(max_tokens=24, temperature=0)
    whole = complete(api, "the quick brown", **kw).choices[0].text
    pieces = [c.choices[0].text for c in complete(api, "the quick brown", stream=True, **kw) if c.choices]
    assert "".join(pieces) == whole
    ids = api.tok.encode("the quick brown", add_special_tokens=False).ids
    assert complete(api, ids, **kw).choices[0].text == whole  # a token-id prompt: the same text
    # a first token that carries "▁": the reply starts with its space (decoded alone, "▁fox" is "fox")
    fox = {str(api.tok.token_to_id("▁fox")): 100}
    whole = complete(api, "the quick brown", max_tokens=3, temperature=0, logit_bias=fox).choices[0].text
    stream = complete(api, "the quick brown", max_tokens=3, temperature=0, logit_bias=fox, stream=True)
    pieces = [c.choices[0].text for c in stream if c.choices and c.choices[0].text]
    assert whole == "".join(pieces) == " fox fox fox" and pieces[0].startswith(" ")
