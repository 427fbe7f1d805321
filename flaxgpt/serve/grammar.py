"""Structured outputs, the host side: a request's constraint compiled for the tokenizer, and per running
sequence a matcher that writes the next token's allowed set into one row of an int32 bitmask.

    grammars = Grammars(tokenizer, vocab_size=50304)            # once per server
    spec = spec_of_response_format(body["response_format"])     # None, or a Spec: the cache key
    compiled = await asyncio.wrap_future(grammars.compile_async(spec, "response_format"))  # GrammarError: 400
    m = grammars.matcher(compiled)                              # one per sequence, engine thread only
    while not m.done():
        m.fill(bitmask_BW, row)                                 # rows without a constraint: allow_all
        token = sample(logits masked by bitmask_BW[row])
        m.accept(token)                                         # EOS ends the sequence as always

The engine is llguidance (benchmarks/grammar_engines.py, docs/structured_outputs.md): it compiles a
schema in 1-2 ms (13 ms with jsonschema's check first) and computes each mask on the fly in tens of
microseconds, where xgrammar spends over a second per schema precomputing. Bit j of word i of a row is
token 32*i + j, as both write. Thread-safety: a Compiled is shared read-only (each matcher() copies it);
a Matcher belongs to one thread; its fill drops the GIL while llguidance works.

EOS: the model's end-of-text id is allowed exactly when the text so far is complete. `done()` says that
nothing but EOS may follow; the engine stops there with finish_reason "stop" and need not sample EOS. A
vocabulary without EOS (characters) gets a virtual one past the model's ids that the mask never shows:
such a sequence ends by done() or by max_tokens.

Letters: B rows of the bitmask, W = ceil(V / 32) int32 words per row, V the model's vocabulary.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass

import jsonschema
import llguidance
import numpy as np

from flaxgpt.data.hf_tokenizer import HFTokenizer
from flaxgpt.data.tokenizers import CharTokenizer, TiktokenTokenizer

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# whitespace JSON may hold at each place it is allowed: pretty-printed output fits (a newline and 15 spaces
# of indent), but a model cannot spin on spaces forever (llguidance's default is unbounded)
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{1,16}"
JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE}  # "x-guidance" for %json blocks of tool-call grammars
FORMATS = "date-time, time, date, duration, email, hostname, ipv4, ipv6, uuid, uri"  # llguidance's
SO_KEYS = ("choice", "regex", "json", "grammar", "json_object")  # vLLM's structured_outputs constraints


class GrammarError(ValueError):
    """A constraint that cannot be used; `param` is the request field the HTTP 400 names."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Spec:
    """A constraint as data: `kind` in KINDS, `value` its canonical text. Hashable: the cache key."""

    kind: str
    value: str

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Spec kind {self.kind!r} is unknown; expected one of {', '.join(KINDS)}")


def json_schema_spec(schema, param: str, field: str | None = None) -> Spec:
    """A schema (a dict or its JSON text) as a Spec; errors name `field` (default: param). Key order is
    kept, not sorted: llguidance writes an object's properties in the order the schema lists them."""
    field = field or param
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"{field} is not valid JSON: {e}", param) from None
        except RecursionError:
            raise GrammarError(f"{field} is nested too deeply", param) from None
    if not isinstance(schema, dict):
        raise GrammarError(f"{field} must be a JSON schema object, got {type(schema).__name__}", param)
    return Spec("json_schema", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))


def spec_of_response_format(rf) -> Spec | None:
    """OpenAI's response_format: {"type": "text"} (None), "json_object", or "json_schema" with
    {"json_schema": {"name": ..., "schema": {...}, "strict": ...}} (strict or not, the schema is enforced)."""
    p = "response_format"
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise GrammarError(
            f'{p} must be an object such as {{"type": "json_object"}}, got {type(rf).__name__}', p
        )
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Spec("json_object", "")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise GrammarError(f'{p}.json_schema must be an object with a "schema" (the JSON schema)', p)
        return json_schema_spec(js["schema"], p, f"{p}.json_schema.schema")
    raise GrammarError(f"{p}.type {kind!r} is not supported; use text, json_object or json_schema", p)


def spec_of_structured_outputs(so) -> Spec:
    """vLLM's structured_outputs: exactly one of choice (strings), regex, json (a schema or its text),
    grammar (llguidance's Lark) or json_object (true); other keys must be null."""
    p = "structured_outputs"
    if not isinstance(so, dict):
        raise GrammarError(f'{p} must be an object such as {{"regex": "[0-9]+"}}, got {type(so).__name__}', p)
    given = [k for k, v in so.items() if v is not None and v is not False]
    unknown = [k for k in given if k not in SO_KEYS]
    if unknown:
        raise GrammarError(f"{p}.{unknown[0]} is not supported; give one of {', '.join(SO_KEYS)}", p)
    if len(given) != 1:
        raise GrammarError(f"{p} needs exactly one of {', '.join(SO_KEYS)}; got {len(given)}", p)
    key, value = given[0], so[given[0]]
    if key == "json":
        return json_schema_spec(value, p, f"{p}.json")
    if key == "json_object":
        return Spec("json_object", "")
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise GrammarError(f"{p}.choice must be a non-empty list of strings", p)
        return Spec("choice", json.dumps(value, ensure_ascii=False))
    if not isinstance(value, str) or not value:
        raise GrammarError(f"{p}.{key} must be a non-empty string", p)
    return Spec("regex" if key == "regex" else "grammar", value)


@dataclass(frozen=True)
class Vocabulary:
    """llguidance's view of a tokenizer: `tok` has n >= V ids (never-allowed padding past the tokenizer's,
    a virtual EOS last when the tokenizer has none), `eos` is the model's EOS id or None."""

    tok: llguidance.LLTokenizer
    vocab_size: int  # V: the model's
    n: int
    eos: int | None
    eos_is_text: bool  # a tokenizer.json that does not mark EOS special: llguidance would allow it as text

    @property
    def words(self) -> int:
        return -(-self.vocab_size // 32)

    @property
    def spills(self) -> bool:
        """llguidance's n ids take more words than the model's V (a virtual EOS, a larger tokenizer)."""
        return -(-self.n // 32) > self.words

    @property
    def tail(self) -> int | None:
        """The last word's bits below V, when llguidance could set bits at or past V; else None."""
        return (
            (1 << (self.vocab_size % 32)) - 1 if self.n > self.vocab_size and self.vocab_size % 32 else None
        )


class _Tokens:
    """The token bytes of a tokenizer without a tokenizer.json, as llguidance.TokenizerWrapper reads them."""

    def __init__(self, tokens: list[bytes], eos: int, special: list[int], encode):
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, eos, None
        self.special_token_ids, self._encode = special, encode

    def __call__(self, text: str | bytes) -> list[int]:
        # llguidance tokenizes with it (bytes when a call with bytes does not raise): a wrong answer here
        # silently drops tokens from the masks
        return self._encode(text.decode("utf-8", "replace") if isinstance(text, bytes) else text)


_vocabularies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_vocabularies_lock = threading.Lock()


def vocabulary(tokenizer, vocab_size: int) -> Vocabulary:
    """llguidance's tokenizer for a flaxgpt tokenizer and a model of `vocab_size` ids (cached: building it
    takes about a second for GPT-2's 50257 tokens)."""
    with _vocabularies_lock:
        by_size = _vocabularies.setdefault(tokenizer, {})
        if vocab_size not in by_size:
            by_size[vocab_size] = _build_vocabulary(tokenizer, vocab_size)
        return by_size[vocab_size]


def token_bytes(tokenizer, token: int) -> bytes:
    """A tokenizer.json token's own bytes, as llguidance reads them from the vocabulary (logprobs'
    `bytes`): byte-level BPE's characters as their bytes, SentencePiece's ▁ as a space and <0xNN> as
    that byte, an added token as its text. Any cached vocabulary of the tokenizer serves (the model's
    padded size only adds empty ids)."""
    if token in getattr(tokenizer, "added_ids", ()):  # its text (llguidance may hold no bytes for it)
        return tokenizer.tok.id_to_token(token).encode("utf-8")
    with _vocabularies_lock:
        vocab = next(iter(_vocabularies.get(tokenizer, {}).values()), None)
    if vocab is None:
        vocab = vocabulary(tokenizer, tokenizer.vocab_size)
    raw = vocab.tok.decode_bytes([token]) if 0 <= token < vocab.n else b""
    if not raw and (byte := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", tokenizer.tok.id_to_token(token) or "")):
        return bytes([int(byte[1], 16)])  # <0xFF>: llguidance reads a leading 0xFF as its own marker
    return raw


def _llguidance_json(tokenizer: HFTokenizer, eos: int | None) -> str:
    """The tokenizer.json llguidance reads, with two rewrites; every token keeps its bytes.

    A Metaspace decoder (recent SentencePiece conversions) is written as the Replace("▁", " ") +
    ByteFallback + Fuse that llguidance recognises: it reads a token's bytes from the decoder, and under
    Metaspace it took "▁" for text (a mask offering '▁"' where ' "' is forced, then refusing it). Only the
    first token's leading-space rule differs, which a mask over a reply's tokens never meets.

    Added tokens that are not special (Qwen's <tool_call>, Gemma's <table>) leave the added list:
    llguidance takes every added token for a control token, yet spelled forced text with them, so a
    grammar forcing "<tool_call>" offered that id alone, then refused it (a 500). Out of the list,
    forced text is spelled in ordinary pieces, an in-vocabulary one is text, one outside an id never
    offered but as <[id]> (the tool-call grammars). Kept: EOS, and one the decoder reads otherwise."""
    spec = json.loads(tokenizer.tok.to_str())
    pieces = {i: piece for piece, i in tokenizer.tok.get_vocab(with_added_tokens=False).items()}
    hf_decoder = tokenizer.tok.decoder

    def text_alike(added: dict) -> bool:
        if added["special"] or added["id"] == eos:
            return False
        piece = pieces.get(added["id"])
        return piece is None or (hf_decoder is not None and hf_decoder.decode([piece]) == added["content"])

    spec["added_tokens"] = [a for a in spec.get("added_tokens", []) if not text_alike(a)]
    decoder = spec.get("decoder") or {}
    parts = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    if any(d.get("type") == "Metaspace" for d in parts):
        spec["decoder"] = {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
            ],
        }
    return json.dumps(spec)


def _build_vocabulary(tokenizer, vocab_size: int) -> Vocabulary:
    eos = tokenizer.eot_id
    if eos is not None and eos >= vocab_size:
        raise ValueError(f"the tokenizer's EOS id {eos} is outside the model's vocabulary of {vocab_size}")
    n = max(vocab_size, tokenizer.vocab_size) + (eos is None)  # room for a virtual EOS past both
    llg_eos = n - 1 if eos is None else eos
    if isinstance(tokenizer, HFTokenizer):  # llguidance reads byte-level and SentencePiece (▁, <0xNN>) alike
        tok = llguidance.LLTokenizer(_llguidance_json(tokenizer, eos), n_vocab=n, eos_token=llg_eos)
    elif isinstance(tokenizer, TiktokenTokenizer):
        enc = tokenizer.enc
        tokens = [enc.decode_single_token_bytes(i) for i in range(enc.n_vocab)]
        special = sorted(enc.encode_single_token(s) for s in enc.special_tokens_set)
        tok = _wrapped(tokens, n, llg_eos, special, enc.encode_ordinary)
    elif isinstance(tokenizer, CharTokenizer):
        tokens, stoi = [c.encode() for c in tokenizer.chars], tokenizer.stoi  # not the tokenizer: a weak key
        # a character outside the vocabulary cannot be written: an error, not a silent drop (dropped,
        # a forced '{' read as nothing, and the mask offered what the grammar then refused: a 500)
        encode = lambda text: [stoi[c] for c in text]  # KeyError: llguidance finds no tokens for it
        tok = _wrapped(tokens, n, llg_eos, [] if eos is None else [eos], encode)
    else:
        raise ValueError(
            f"structured outputs need a tiktoken, tokenizer.json or character vocabulary; "
            f"got {type(tokenizer).__name__}"
        )
    return Vocabulary(tok, vocab_size, n, eos, eos is not None and not tok.is_special_token(eos))


def _wrapped(tokens: list[bytes], n: int, eos: int, special: list[int], encode) -> llguidance.LLTokenizer:
    tokens = tokens + [b""] * (n - len(tokens))  # padding ids: empty bytes, never allowed
    if not tokens[eos]:
        tokens[eos], special = b"<|virtual eos|>", [*special, eos]
    wrapper = llguidance.TokenizerWrapper(_Tokens(tokens, eos, special, encode))
    return llguidance.LLTokenizer(wrapper, n_vocab=n)


@dataclass(frozen=True, eq=False)
class Compiled:
    """A compiled constraint: a matcher at the start, already past its first mask, never advanced; each
    sequence gets a copy. Shared read-only by any thread."""

    spec: Spec
    start: llguidance.LLMatcher


class Grammars:
    """Specs compiled for one tokenizer and model vocabulary, LRU-cached (errors too), on a small pool."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        *,
        compile_timeout: float = 10.0,
        cache_size: int = 256,
        threads: int = 1,
    ):
        self.tokenizer, self.vocab = tokenizer, vocabulary(tokenizer, vocab_size)
        self.words = self.vocab.words
        self.compile_timeout, self.cache_size = compile_timeout, cache_size
        self._cache: OrderedDict[Spec, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")

    def compile(self, spec: Spec, param: str) -> Compiled:
        """Blocking compile (cached); GrammarError(message, param) when the spec cannot be used."""
        return self.compile_async(spec, param).result()

    def compile_async(self, spec: Spec, param: str) -> Future:
        """A Future of compile(spec, param): the event loop awaits it, never compiles."""
        with self._lock:
            shared = self._cache.pop(spec, None)
            if shared is None:  # one compile per spec, however many requests wait for it
                shared = Future()
                self._pool.submit(self._build, spec, shared)
            self._cache[spec] = shared  # the most recently used last
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        mine = Future()

        def relay(f: Future):  # the shared Future's outcome, its GrammarError naming this request's field
            e = f.exception()
            if e is None:
                mine.set_result(f.result())
            else:
                mine.set_exception(GrammarError(str(e), param) if isinstance(e, GrammarError) else e)

        shared.add_done_callback(relay)
        return mine

    def _build(self, spec: Spec, shared: Future) -> None:
        # llguidance's compile cannot be interrupted: past the timeout the request fails, and the cache keeps
        # that failure so the same spec does not occupy the pool again; the thread finishes in the background
        late = GrammarError(
            f"the grammar took longer than {self.compile_timeout:g} s to compile; simplify it"
        )
        timer = threading.Timer(self.compile_timeout, _settle, (shared, None, late))
        timer.daemon = True
        timer.start()
        try:
            _settle(shared, self._compile_now(spec), None)
        except Exception as e:  # a bug too reaches the waiting request, not the pool's silence
            _settle(shared, None, e)
        finally:
            timer.cancel()

    def _compile_now(self, spec: Spec) -> Compiled:
        start = llguidance.LLMatcher(self.vocab.tok, _grammar_text(spec), log_level=0)
        if start.is_error():
            raise GrammarError(_message(spec.kind, start.get_error()))
        # the first mask builds the lexer's first states: paid here, on the pool, not in the engine's step
        allowed_W = np.zeros(self.words, np.int32)
        _fill(start, self.vocab, allowed_W, allowed_W.ctypes.data)
        if self.vocab.eos is not None:
            _clear(allowed_W, self.vocab.eos)
        if not allowed_W.any() and not start.is_accepting():  # llguidance: an error, "NoExtension"
            raise GrammarError(f"the {_name(spec.kind)} allows no text in this model's vocabulary")
        if start.is_error():
            raise GrammarError(_message(spec.kind, start.get_error()))
        # a first token it forces must go through (tried on a copy): forced text that never ends
        # ('foo: "a" foo': llguidance's limit) failed the first step, a 500 for the grammar's fault
        allowed = np.flatnonzero(np.unpackbits(allowed_W.view(np.uint8), bitorder="little"))
        if len(allowed) == 1 and not (probe := start.deep_copy()).consume_token(int(allowed[0])):
            raise GrammarError(_message(spec.kind, probe.get_error()))
        return Compiled(spec, start)

    def matcher(self, compiled: Compiled) -> Matcher:
        return Matcher(compiled.start.deep_copy(), self.vocab)

    def close(self) -> None:
        """Stop the pool; a compile under way finishes in the background."""
        self._pool.shutdown(wait=False, cancel_futures=True)


class Matcher:
    """One sequence's place in its grammar. Used only from the engine thread."""

    def __init__(self, m: llguidance.LLMatcher, vocab: Vocabulary):
        self._m, self._vocab = m, vocab
        self._bitmask_BW, self._address = None, 0

    def fill(self, bitmask_BW: np.ndarray, row: int) -> None:
        """Row `row` := the tokens allowed next (EOS when the text may end; only EOS once done())."""
        if (
            bitmask_BW is not self._bitmask_BW
        ):  # the engine reuses one buffer: checked, its address read, once
            _check_bitmask(bitmask_BW, self._vocab.words)
            self._bitmask_BW, self._address = bitmask_BW, bitmask_BW.ctypes.data  # .ctypes costs ~5 us
        if not 0 <= row < bitmask_BW.shape[0]:  # llguidance writes through a raw pointer: never past the end
            raise IndexError(f"row {row} is outside the bitmask's {bitmask_BW.shape[0]} rows")
        row_W = bitmask_BW[row]
        _fill(self._m, self._vocab, row_W, self._address + row * bitmask_BW.strides[0])
        if self._vocab.eos_is_text and not self._m.is_accepting():
            _clear(row_W, self._vocab.eos)

    def accept(self, token: int) -> None:
        """Advance past `token`; GrammarError if it was not allowed (the mask makes that a bug)."""
        if not 0 <= token < self._vocab.vocab_size or not self._m.consume_token(token):
            reason = self._m.get_error().split("\n")[0] or f"id {token} is outside the vocabulary"
            raise GrammarError(f"token {token} does not fit the grammar: {reason}")

    def done(self) -> bool:
        """Nothing but EOS may follow (or the grammar failed): the sequence must stop."""
        return self._m.is_stopped()


def allow_all(bitmask_BW: np.ndarray, row: int) -> None:
    """Row `row` := every token allowed (a sequence without a constraint)."""
    bitmask_BW[row] = -1


def _check_bitmask(bitmask_BW: np.ndarray, words: int) -> None:
    ok = bitmask_BW.dtype == np.int32 and bitmask_BW.ndim == 2 and bitmask_BW.flags["C_CONTIGUOUS"]
    if not ok or bitmask_BW.shape[1] != words:
        raise ValueError(
            f"bitmask must be a C-contiguous int32 [B, {words}] array, got {bitmask_BW.dtype} "
            f"{bitmask_BW.shape}; allocate it as np.zeros((B, grammars.words), np.int32)"
        )


def _fill(m: llguidance.LLMatcher, vocab: Vocabulary, row_W: np.ndarray, address: int) -> None:
    """llguidance's mask over its n ids into `row_W` (W words at `address`): ids at or past V never."""
    if vocab.spills:
        full_W = np.empty(-(-vocab.n // 32), np.int32)
        m.unsafe_compute_mask_ptr(full_W.ctypes.data, full_W.nbytes)
        row_W[:] = full_W[: vocab.words]
    else:
        m.unsafe_compute_mask_ptr(address, row_W.nbytes)  # drops the GIL while it works
    if vocab.tail is not None:
        row_W.view(np.uint32)[-1] &= np.uint32(vocab.tail)


def _clear(row_W: np.ndarray, token: int) -> None:
    row_W.view(np.uint32)[token // 32] &= ~np.uint32(1 << (token % 32))


def _settle(f: Future, result, error) -> None:
    """Set `f` once: the compile and its timer race, the first one wins."""
    try:
        f.set_result(result) if error is None else f.set_exception(error)
    except InvalidStateError:
        pass


def _name(kind: str) -> str:
    return {"json_object": "JSON schema", "json_schema": "JSON schema"}.get(kind, kind)


def _grammar_text(spec: Spec) -> str:
    """llguidance's grammar for a spec; a JSON schema is checked against JSON Schema 2020-12 first."""
    if spec.kind in ("json_object", "json_schema"):
        schema = {"type": "object"} if spec.kind == "json_object" else json.loads(spec.value)
        _check_schema(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":  # a JSON string is a Lark string literal
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(map(json.dumps, json.loads(spec.value)))
        )
    return llguidance.LLMatcher.grammar_from_lark(spec.value)


def _check_schema(schema: dict) -> None:
    try:  # ~13 ms for a 20-property schema (pure Python): once per new schema, on the pool
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(map(str, e.absolute_path)) or "the top level"
        raise GrammarError(f"invalid JSON schema at {where}: {_one_line(e.message)}") from None
    except RecursionError:  # jsonschema walks it recursively
        raise GrammarError("the JSON schema is nested too deeply to check; flatten it") from None


def _message(kind: str, error: str) -> str:
    """llguidance's error (several lines, a source excerpt) as one line that says what to change."""
    if m := re.search(r"Unimplemented keys: \[(.*?)\]", error):
        keys = [k.strip().strip('"') for k in m.group(1).split(",")]
        s = "s" if len(keys) > 1 else ""
        return (
            f"unsupported JSON schema keyword{s} {', '.join(map(repr, keys))}; remove {'them' if s else 'it'}"
        )
    if m := re.search(r"Unknown format: (\S+)", error):
        return f"unsupported string format {m.group(1)!r}; supported: {FORMATS}"
    line = _one_line(error)
    if kind == "regex":
        return f"regex does not compile: {line.rpartition('error: ')[2] or line}"
    return f"the {_name(kind)} does not compile: {line}"


def _one_line(text: str) -> str:
    """The lines that carry words: no caret markers, no numbered source excerpts, no state dump."""
    text = text.split("\n<state>")[0]
    keep = [s.strip() for s in text.splitlines() if s.strip() and not re.match(r"^\s*(\^+|\d+ \|.*)$", s)]
    return " ".join(keep)
