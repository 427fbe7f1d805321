"""Tokenizers: one small interface, two kinds.

    tok = get_tokenizer("gpt2")            # GPT-2's BPE, offline (ranks shipped in the package)
    tok = CharTokenizer.from_text(text)    # characters seen in the data
    tok = Seq2SeqTokenizer(base)           # the encoder-decoder's: PAD, BOS, EOS, then base's ids
    ids = tok.encode("Hello"); text = tok.decode(ids)
    ids = encode_prompt(tok, text, block_size)   # a GPT prompt: never empty, cropped to the context

A tokenizer is described by a small JSON-able dict (`to_meta`) that `prepare`
writes into meta.json and `from_meta` reads back, so a run directory knows
how to turn its tokens into text.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.resources
import warnings
from typing import Protocol

R50K_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# GPT-2's pre-tokenizer split pattern (tiktoken's r50k_base / gpt2)
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
ENDOFTEXT = "<|endoftext|>"
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2  # the encoder-decoder's special ids, before the base vocabulary
N_SPECIAL = 3


class Tokenizer(Protocol):
    vocab_size: int
    eot_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids) -> str: ...

    def to_meta(self) -> dict: ...


class CharTokenizer:
    """One id per character, in sorted order of the characters seen in the data."""

    def __init__(self, chars: list[str]):
        self.chars = list(chars)
        self.stoi = {ch: i for i, ch in enumerate(self.chars)}
        self.vocab_size = len(self.chars)
        self.eot_id = None

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls(sorted(set(text)))

    def encode(self, text: str) -> list[int]:
        missing = sorted(set(text) - self.stoi.keys())
        if missing:
            raise ValueError(
                f"characters not in the vocabulary: {''.join(missing)!r} "
                f"({len(missing)} missing; the vocabulary has {self.vocab_size})"
            )
        return [self.stoi[ch] for ch in text]

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def to_meta(self) -> dict:
        return {"kind": "char", "chars": self.chars, "vocab_size": self.vocab_size}


class TiktokenTokenizer:
    """A tiktoken BPE; `gpt2` is built from the ranks file shipped with flaxgpt."""

    def __init__(self, name: str = "gpt2"):
        self.name = name
        self.enc = _tiktoken_encoding(name)
        self.vocab_size = self.enc.n_vocab
        self.eot_id = self.enc.eot_token

    def encode(self, text: str) -> list[int]:
        # <|endoftext|> written in text is the document separator, as in GPT-2's training data
        return self.enc.encode(text, allowed_special={ENDOFTEXT})

    def encode_batch(self, texts: list[str], num_threads: int = 8) -> list[list[int]]:
        return self.enc.encode_batch(texts, num_threads=num_threads, allowed_special={ENDOFTEXT})

    def decode(self, ids) -> str:
        return self.enc.decode([int(i) for i in ids])

    def to_meta(self) -> dict:
        return {"kind": "tiktoken", "name": self.name, "vocab_size": self.vocab_size}


def load_gpt2_ranks() -> dict[bytes, int]:
    """GPT-2's merge ranks from the package's data, checked against their sha256."""
    data = importlib.resources.files("flaxgpt").joinpath("assets/r50k_base.tiktoken").read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != R50K_SHA256:
        raise ValueError(
            f"flaxgpt/assets/r50k_base.tiktoken is corrupt: sha256 {digest}, "
            f"expected {R50K_SHA256}; reinstall flaxgpt"
        )
    ranks = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


@functools.cache
def _tiktoken_encoding(name: str):
    import tiktoken

    if name in ("gpt2", "r50k_base"):
        return tiktoken.Encoding(
            name=name,
            pat_str=GPT2_PATTERN,
            mergeable_ranks=load_gpt2_ranks(),
            special_tokens={ENDOFTEXT: 50256},
            explicit_n_vocab=50257,
        )
    try:  # other encodings come from tiktoken itself, which downloads them once
        return tiktoken.get_encoding(name)
    except ValueError as e:
        raise ValueError(f"unknown tiktoken encoding {name!r}: {e}") from None
    except Exception as e:  # network errors surface as many exception types
        raise RuntimeError(
            f"tiktoken encoding {name!r} needs the network to download "
            f"({type(e).__name__}); use 'gpt2', which works offline"
        ) from None


def get_tokenizer(name: str) -> Tokenizer:
    """`gpt2` (or another tiktoken encoding name)."""
    return TiktokenTokenizer(name)


def from_meta(meta: dict) -> Tokenizer:
    """The tokenizer described by a meta.json's `tokenizer` entry (see to_meta)."""
    kind = meta.get("kind")
    if kind == "char":
        return CharTokenizer(meta["chars"])
    if kind == "tiktoken":
        return TiktokenTokenizer(meta["name"])
    if kind == "seq2seq":
        return Seq2SeqTokenizer.from_meta(meta)
    if kind == "hf":  # a Hugging Face model's tokenizer.json (flaxgpt.data.prepare --tokenizer PATH)
        from flaxgpt.data.hf_tokenizer import HFTokenizer

        return HFTokenizer(meta["path"])
    raise ValueError(f"unknown tokenizer kind {kind!r} in meta.json; expected char, tiktoken, seq2seq or hf")


def encode_prompt(tokenizer, text: str, max_tokens: int) -> list[int]:
    """A GPT prompt's ids, never empty and at most the last `max_tokens` (with a warning if cut).

    A tokenizer whose model starts sequences with BOS (`add_bos`: Llama's tokenizer.json) gets it
    first. An empty prompt starts from BOS, from end-of-text, or from a newline (else the first
    character) for a character vocabulary, which has no end-of-text token; that too is a warning.
    """
    bos = [tokenizer.bos_id] if getattr(tokenizer, "add_bos", False) else []
    ids = tokenizer.encode(text)
    if not ids:
        if bos:
            return bos
        if tokenizer.eot_id is not None:
            return [tokenizer.eot_id]
        start = "\n" if "\n" in tokenizer.stoi else tokenizer.chars[0]  # nanoGPT starts from "\n"
        warnings.warn(
            f"empty prompt: starting from {start!r} (this character vocabulary has no end-of-text token)",
            stacklevel=2,
        )
        return tokenizer.encode(start)
    if len(bos) + len(ids) > max_tokens:
        warnings.warn(
            f"prompt of {len(bos) + len(ids)} tokens is longer than the context ({max_tokens}); "
            f"keeping its last {max_tokens} tokens",
            stacklevel=2,
        )
        ids = ids[len(bos) + len(ids) - max_tokens :]  # BOS stays first
    return bos + ids


class TextStream:
    """The new text of a growing list of ids, for printing as they are decoded.

    `add(ids)` returns the text the new ids complete: all of it but a half-decoded UTF-8 character at
    its end (a BPE token can end inside one), held back until the ids that finish it arrive;
    `flush()` returns what is held at the end (as transformers' TextStreamer.end does).
    """

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.shown = tokenizer, [], 0

    def add(self, ids) -> str:
        self.ids.extend(int(i) for i in ids)
        # only the trailing replacement characters wait: a chunk of 16 tokens cut inside a character
        # once showed nothing of its other 15, and nothing showed them later
        text = self.tokenizer.decode(self.ids)
        return self._upto(text, len(text.rstrip("\ufffd")))

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids)
        return self._upto(text, len(text))

    def _upto(self, text: str, end: int) -> str:
        new, self.shown = text[self.shown : end], max(self.shown, end)
        return new


class Seq2SeqTokenizer:
    """A base tokenizer (characters or tiktoken BPE) behind three special ids: id = base id + 3."""

    pad_id, bos_id, eos_id = PAD_ID, BOS_ID, EOS_ID

    def __init__(self, base):
        self.base = base
        self.vocab_size = base.vocab_size + N_SPECIAL
        self.eot_id = EOS_ID

    def encode(self, text: str) -> list[int]:
        return [i + N_SPECIAL for i in self.base.encode(text)]

    def decode(self, ids) -> str:
        """Text of the ids up to the first EOS; PAD and BOS are dropped."""
        out = []
        for i in ids:
            i = int(i)
            if i == EOS_ID:
                break
            if i >= N_SPECIAL:
                out.append(i - N_SPECIAL)
        return self.base.decode(out)

    def to_meta(self) -> dict:
        return {
            "kind": "seq2seq",
            "base": self.base.to_meta(),
            "vocab_size": self.vocab_size,
            "pad_id": PAD_ID,
            "bos_id": BOS_ID,
            "eos_id": EOS_ID,
        }

    @classmethod
    def from_meta(cls, meta: dict) -> Seq2SeqTokenizer:
        if meta.get("kind") != "seq2seq":
            raise ValueError(
                f"tokenizer kind {meta.get('kind')!r} is not a seq2seq vocabulary; "
                "prepare the data with flaxgpt prepare-seq2seq"
            )
        return cls(from_meta(meta["base"]))
