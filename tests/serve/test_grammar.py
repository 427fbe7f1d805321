"""Structured outputs' host side (flaxgpt.serve.grammar): whatever a sampler picks among the tokens a mask
allows, the text that ends is valid. Random walks over many generated JSON schemas, regexes, choices and
Lark grammars on GPT-2's vocabulary (padded to 50304 as the model is), a character vocabulary and two
tiny tokenizer.json vocabularies (byte-level BPE and SentencePiece-style); then one-line errors with the
request field to name, and the cache."""

import concurrent.futures
import functools
import json
import re
import string
import time

import jsonschema
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from flaxgpt.data.hf_tokenizer import HFTokenizer
from flaxgpt.data.tokenizers import CharTokenizer, Seq2SeqTokenizer, TiktokenTokenizer, get_tokenizer
from flaxgpt.serve import grammar
from flaxgpt.serve.grammar import GrammarError, Grammars, Spec

STEPS = 400  # a walk's bound; walks cut by it count as unfinished
P_EOS = 0.05  # EOS when allowed: rarely, so walks go on past the first point where the text may end
CHARS = sorted(set(' \n\t{}[]":,.-+=eE0123456789abcdefghijklmnopqrstuvwxyzABCXYZ_@/\\é'))
TEXT = "".join(
    f'line {i}: {{"fox": {i}, "dog": [true, null, -1.5e3]}} the quick brown fox\n' for i in range(60)
)


@pytest.fixture(scope="module")
def gpt2():
    return Grammars(get_tokenizer("gpt2"), 50304)  # the model's padded vocabulary: ids past 50257 never


@pytest.fixture(scope="module")
def chars():
    return Grammars(CharTokenizer(CHARS), len(CHARS))  # no EOS: a virtual one the mask never shows


def byte_level_json(path):
    """Byte-level BPE (Qwen, Llama 3) of ~400 ids trained on TEXT; <s> </s> are 1 2."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT], trainer)
    tok.save(str(path))


def sentencepiece_json(path, mark_special: bool = True):
    """SentencePiece-style BPE (Llama 2, Mistral, Gemma): ▁ for a space, <0xNN> for bytes it lacks.
    Unmarked, <s> and </s> are plain text to llguidance, EOS included: the mask must still hide it."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for c in "▁" + "".join(CHARS).replace(" ", "").replace("é", ""):
        vocab.setdefault(c, len(vocab))
    merges = [
        ("▁", "t"),
        ("h", "e"),
        ("▁t", "he"),
        ("{", '"'),
        ('"', ":"),
        ("t", "r"),
        ("tr", "u"),
        ("n", "u"),
    ]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    if mark_special:  # control tokens, as Llama's file marks them
        tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(path))


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece", "sentencepiece_unmarked"])
def hf(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "byte_level":
        byte_level_json(directory / "tokenizer.json")
    else:
        sentencepiece_json(directory / "tokenizer.json", mark_special=request.param == "sentencepiece")
    (directory / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    tok = HFTokenizer(directory)
    assert tok.eos_id == 2
    return Grammars(tok, tok.vocab_size + 13)  # a padded model vocabulary again


def allowed(bitmask_BW, row: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(bitmask_BW[row].view(np.uint8), bitorder="little"))


@functools.cache
def punctuation(v: grammar.Vocabulary) -> np.ndarray:
    """[n] bool: the ids whose text is ASCII punctuation and whitespace only (llguidance's view)."""
    marks = set((string.punctuation + string.whitespace).encode())
    return np.array([(b := v.tok.decode_bytes([i])) != b"" and set(b) <= marks for i in range(v.n)])


def walk(grammars: Grammars, compiled, rng) -> tuple[list[int], bool]:
    """(ids, finished): at each step a token drawn from those the mask allows, until done() or EOS.

    Half the steps draw uniformly from all allowed tokens, half from the allowed tokens of punctuation
    and whitespace only (when there are any): a uniform draw alone inside a free string closes it with a
    chance of ~1 in 1000 per GPT-2 token, and numbers take digits for as long, so walks through free
    strings and numbers would rarely end within the bound.
    """
    v = grammars.vocab
    m = grammars.matcher(compiled)
    bitmask_BW = np.zeros((3, grammars.words), np.int32)
    ids = []
    for _ in range(STEPS):
        if m.done():
            return ids, True
        m.fill(bitmask_BW, 1)  # a middle row: neighbours untouched
        assert not bitmask_BW[0].any() and not bitmask_BW[2].any()
        ok = allowed(bitmask_BW, 1)
        assert ok.size and ok[-1] < v.vocab_size, ok[-3:]  # never a padding id, never the virtual EOS
        if v.eos in ok and rng.random() < P_EOS:
            return ids, True
        ok = ok[ok != v.eos]
        if not ok.size:
            return ids, True
        short = ok[punctuation(v)[ok]]
        token = int(rng.choice(short if short.size and rng.random() < 0.5 else ok))
        m.accept(token)
        ids.append(token)
    return ids, False


def text_of(grammars: Grammars, tokenizer, ids: list[int]) -> str:
    if isinstance(tokenizer, TiktokenTokenizer):  # strict: a walk must not split a UTF-8 character
        return b"".join(tokenizer.enc.decode_single_token_bytes(i) for i in ids).decode("utf-8")
    return tokenizer.decode(ids)  # what the server returns


def random_schema(rng, depth: int = 0) -> dict:
    """A schema with the features structured outputs meet: nested objects, bounded arrays, enums, required
    fields, patterns and formats, bounded numbers, booleans, nulls, unions. An object at the top, as
    response_format asks (a walk on a vocabulary without EOS could not end a bare number)."""
    kinds = ["string", "integer", "number", "boolean", "null", "enum", "const", "pattern", "format", "union"]
    if depth < 2:
        kinds += ["array", "object", "object"]
    kind = "object" if depth == 0 else str(rng.choice(kinds))
    if kind == "string":
        lo = int(rng.integers(0, 4))
        return {"type": "string", "minLength": lo, "maxLength": lo + int(rng.integers(0, 10))}
    if kind == "integer":
        lo = int(rng.integers(-1000, 1000))
        return {"type": "integer", "minimum": lo, "maximum": lo + int(rng.integers(0, 5000))}
    if kind == "number":
        lo = float(rng.integers(-50, 50)) / 4
        return {"type": "number", "minimum": lo, "maximum": lo + float(rng.integers(1, 400)) / 8}
    if kind in ("boolean", "null"):
        return {"type": kind}
    if kind == "enum":
        return {"enum": ["red", "green", "blue", 7, None, 'a "quoted" é'][: int(rng.integers(1, 7))]}
    if kind == "const":
        return {"const": str(rng.choice(["v1", "ok", "x y"]))}
    if kind == "pattern":
        return {"type": "string", "pattern": str(rng.choice(["^[a-z]{2,5}-[0-9]{1,3}$", "^(ab|cd)+x?$"]))}
    if kind == "format":
        return {"type": "string", "format": str(rng.choice(["date", "uuid", "time"]))}
    if kind == "union":
        return {"anyOf": [random_schema(rng, depth + 1), {"type": "null"}]}
    if kind == "array":
        lo = int(rng.integers(0, 3))
        items = random_schema(rng, depth + 1)
        return {"type": "array", "items": items, "minItems": lo, "maxItems": lo + int(rng.integers(0, 3))}
    n = int(rng.integers(1, 5))
    props = {f"k{i}_{rng.integers(100)}": random_schema(rng, depth + 1) for i in range(n)}
    required = [k for k in props if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def check_walks(grammars: Grammars, specs_and_checks, rng, walks: int = 2, min_finished: float = 0.9):
    """Walk each spec `walks` times; every finished text passes its check; most walks finish."""
    tokenizer = grammars.tokenizer
    finished = total = 0
    for spec, check in specs_and_checks:
        compiled = grammars.compile(spec, "structured_outputs")
        for _ in range(walks):
            ids, done = walk(grammars, compiled, rng)
            total += 1
            if done:
                finished += 1
                text = text_of(grammars, tokenizer, ids)
                try:
                    check(text)
                except Exception as e:
                    raise AssertionError(f"{spec.kind} {spec.value[:300]} produced {text!r}: {e}") from e
    assert finished >= min_finished * total, f"{finished} of {total} walks finished within {STEPS} steps"
    return finished, total


def schema_check(schema: dict):
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    return lambda text: validator.validate(json.loads(text))


def schema_cases(rng, n: int):
    out = []
    for _ in range(n):
        schema = random_schema(rng)
        out.append((grammar.json_schema_spec(schema, "response_format"), schema_check(schema)))
    return out


def test_random_walks_through_json_schemas_end_valid_gpt2(gpt2):
    rng = np.random.default_rng(0)
    check_walks(gpt2, schema_cases(rng, 100), rng)


def test_random_walks_through_json_schemas_end_valid_chars_and_tokenizer_json(chars, hf):
    rng = np.random.default_rng(1)
    for g in (chars, hf):
        check_walks(g, schema_cases(rng, 40), rng)


def test_json_object_regex_choice_and_lark(gpt2, chars):
    """Bounded constraints on every vocabulary (a character one has no EOS: only done() ends a walk),
    open-ended ones where EOS may end them."""
    rng = np.random.default_rng(2)
    choices = ["yes", "no", "maybe so", "né", ""]
    pairs = 'start: pair ("," pair){0,3}\npair: NAME "=" value\nvalue: NUMBER | "true" | "null" | STRING\n'
    pairs += 'NAME: /[a-z]{1,6}/\nNUMBER: /-?[0-9]{1,3}/\nSTRING: /"[a-z ]{0,8}"/'
    pairs_re = r'[a-z]{1,6}=(-?[0-9]{1,3}|true|null|"[a-z ]{0,8}")'
    call = (
        'start: "call " %json {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}'
    )

    def is_call(text):
        assert text.startswith("call ") and isinstance(json.loads(text[5:])["x"], int), text

    def fullmatch(regex):
        return lambda text: re.fullmatch(regex, text) or pytest.fail(f"{text!r} does not match {regex}")

    bounded = [
        r"[a-c]{2,6}-(x|yy)[0-9]{1,3}",
        r"(\+|-)?[0-9]{1,4}(\.[0-9]{1,2})?",
        r"[a-z]{1,5}(,[a-z]{1,5}){0,3}",
    ]
    cases = [(Spec("regex", r), fullmatch(r)) for r in bounded]
    cases += [(Spec("choice", json.dumps(choices)), lambda t: t in choices or pytest.fail(t))]
    cases += [(Spec("grammar", pairs), fullmatch(f"{pairs_re}(,{pairs_re}){{0,3}}"))]
    cases += [(Spec("grammar", call), is_call), (Spec("json_object", ""), lambda t: json.loads(t).keys())]
    open_ended = [(Spec("regex", r"[a-z]+( [a-z]+)*\."), fullmatch(r"[a-z]+( [a-z]+)*\."))]
    open_ended += [(Spec("grammar", 'start: /[0-9]+/ ("+" /[0-9]+/)*'), fullmatch(r"[0-9]+(\+[0-9]+)*"))]
    check_walks(chars, cases, rng, walks=3, min_finished=0.8)  # json_object: free keys, values
    check_walks(gpt2, cases + open_ended, rng, walks=3, min_finished=0.8)


def test_done_then_only_eos_and_padding_never(gpt2):
    tok = get_tokenizer("gpt2")
    m = gpt2.matcher(gpt2.compile(Spec("choice", '["yes", "no"]'), "structured_outputs"))
    bitmask_BW = np.zeros((1, gpt2.words), np.int32)
    m.fill(bitmask_BW, 0)
    assert tok.enc.decode_single_token_bytes(int(allowed(bitmask_BW, 0)[0])) in (
        b"n",
        b"no",
        b"y",
        b"ye",
        b"yes",
    )
    for t in tok.encode("yes"):
        m.accept(t)
    assert m.done()
    m.fill(bitmask_BW, 0)
    assert allowed(bitmask_BW, 0).tolist() == [tok.eot_id]
    with pytest.raises(GrammarError, match="does not fit the grammar"):
        m.accept(tok.encode("!")[0])
    grammar.allow_all(bitmask_BW, 0)
    assert (bitmask_BW == -1).all()
    with pytest.raises(ValueError, match=r"int32 \[B, 1572\]"):
        m.fill(np.zeros((1, 1571), np.int32), 0)
    with pytest.raises(IndexError, match="row 1 is outside the bitmask's 1 rows"):
        m.fill(bitmask_BW, 1)  # llguidance writes through a raw pointer: checked first


def test_bad_specs_are_one_line_errors_naming_the_field(gpt2):
    def error(spec_fn, param="structured_outputs"):
        with pytest.raises(GrammarError) as e:
            gpt2.compile(spec_fn(), param)
        assert e.value.param == param and "\n" not in str(e.value), (e.value.param, str(e.value))
        return str(e.value)

    so, rf = grammar.spec_of_structured_outputs, grammar.spec_of_response_format
    schema = lambda s: lambda: rf({"type": "json_schema", "json_schema": {"name": "r", "schema": s}})
    assert "invalid JSON schema at type" in error(schema({"type": "strin"}), "response_format")
    assert "invalid JSON schema at properties/a/minimum" in error(
        schema({"type": "object", "properties": {"a": {"minimum": "0"}}}), "response_format"
    )
    msg = error(schema({"type": "object", "unevaluatedProperties": False}), "response_format")
    assert msg == "unsupported JSON schema keyword 'unevaluatedProperties'; remove it"
    assert "'contains', 'uniqueItems'" in error(
        lambda: so({"json": {"type": "array", "uniqueItems": True, "contains": {}}})
    )
    assert "unsupported string format 'phone'" in error(
        lambda: so({"json": {"type": "string", "format": "phone"}})
    )
    assert error(lambda: so({"regex": "a(b"})) == "regex does not compile: unclosed group"
    assert "look-around" in error(lambda: so({"regex": "(?=a)b"}))
    assert 'unknown name: "foo"' in error(lambda: so({"grammar": "start: foo"}))
    assert "the grammar does not compile" in error(lambda: so({"grammar": "start: ("}))
    # text forced forever: past llguidance's limit at the first token (it was a 500 there)
    assert "Too many items" in error(lambda: so({"grammar": 'start: foo\nfoo: "a" foo'}))
    assert "allows no text" in grammar_error_chars(Spec("regex", "[QW]+"))
    # text forced from the start that the vocabulary cannot write (Tiny Shakespeare has no '{'): it
    # compiled, the characters dropped, and the first step refused the token the mask offered (a 500)
    assert "allows no text" in grammar_error_chars(Spec("json_object", ""))
    assert "allows no text" in grammar_error_chars(Spec("regex", "\\{[a-c]+"))
    for bad, words in [
        ({"choice": []}, "choice must be a non-empty list of strings"),
        ({"choice": ["a", 1]}, "choice must be a non-empty list of strings"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"regex": "a", "grammar": "start: x"}, "needs exactly one of"),
        ({}, "needs exactly one of"),
        ({"regex": "a", "whitespace_pattern": " "}, "whitespace_pattern is not supported"),
        ({"json": "{bad"}, "structured_outputs.json is not valid JSON"),
        ({"json": [1]}, "structured_outputs.json must be a JSON schema object"),
        ("regex", "structured_outputs must be an object"),
    ]:
        assert words in error(lambda bad=bad: so(bad)), bad
    for bad, words in [
        ({"type": "yaml"}, "response_format.type 'yaml' is not supported"),
        ({"type": "json_schema"}, 'response_format.json_schema must be an object with a "schema"'),
        (
            {"type": "json_schema", "json_schema": {"schema": "{"}},
            "response_format.json_schema.schema is not",
        ),
        ([1], "response_format must be an object"),
    ]:
        assert words in error(lambda bad=bad: rf(bad), "response_format"), bad


def grammar_error_chars(spec: Spec) -> str:
    g = Grammars(CharTokenizer(list("abc")), 3)
    with pytest.raises(GrammarError) as e:
        g.compile(spec, "structured_outputs")
    return str(e.value)


def test_spec_builders():
    rf, so = grammar.spec_of_response_format, grammar.spec_of_structured_outputs
    assert rf(None) is None and rf({"type": "text"}) is None
    assert rf({"type": "json_object"}) == Spec("json_object", "") == so({"json_object": True, "regex": None})
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    spec = rf({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert spec == so({"json": schema}) == so({"json": json.dumps(schema, indent=2)})
    assert list(json.loads(spec.value)["properties"]) == ["b", "a"]  # declared order: the order written
    assert so({"choice": ["a", "é"]}) == Spec("choice", '["a", "é"]')
    assert so({"grammar": "start: /x/"}) == Spec("grammar", "start: /x/")
    with pytest.raises(ValueError, match="kind 'yaml' is unknown"):
        Spec("yaml", "")


def test_cache_async_and_timeout(gpt2):
    spec = Spec("regex", "[0-9]{3}")
    compiled = gpt2.compile(spec, "structured_outputs")
    assert gpt2.compile(spec, "structured_outputs") is compiled
    future = gpt2.compile_async(spec, "structured_outputs")
    assert isinstance(future, concurrent.futures.Future) and future.result(timeout=10) is compiled
    other = gpt2.compile_async(Spec("regex", "[a-f]{3}"), "structured_outputs").result(timeout=10)
    assert other is not compiled
    bad = Spec("regex", "(")  # a cached failure still names each request's own field
    for param in ("structured_outputs", "response_format"):
        with pytest.raises(GrammarError) as e:
            gpt2.compile(bad, param)
        assert e.value.param == param

    small = Grammars(gpt2.tokenizer, 50257, cache_size=2)  # the same tokenizer: its vocabulary reused
    assert small.vocab is grammar.vocabulary(gpt2.tokenizer, 50257) is not gpt2.vocab
    first = small.compile(Spec("regex", "a"), "p")
    small.compile(Spec("regex", "b"), "p")
    small.compile(Spec("regex", "c"), "p")  # evicts "a", the least recently used
    assert small.compile(Spec("regex", "a"), "p") is not first

    slow = Grammars(gpt2.tokenizer, 50257, compile_timeout=0.05)
    real = slow._compile_now
    slow._compile_now = lambda spec: time.sleep(0.5) or real(spec)
    with pytest.raises(GrammarError, match=r"took longer than 0\.05 s to compile") as e:
        slow.compile(Spec("regex", "z"), "structured_outputs")
    assert e.value.param == "structured_outputs"
    slow.close()


def test_unsupported_tokenizer_and_eos_outside_the_model():
    with pytest.raises(ValueError, match="got Seq2SeqTokenizer"):
        grammar.vocabulary(Seq2SeqTokenizer(CharTokenizer(list("ab"))), 5)
    with pytest.raises(ValueError, match="EOS id 50256 is outside the model's vocabulary of 50000"):
        grammar.vocabulary(get_tokenizer("gpt2"), 50000)
