"""Tokenizers: GPT-2's BPE offline, characters, and their meta.json round trip."""

import hashlib

import pytest

from flaxgpt import tokenizers
from flaxgpt.tokenizers import CharTokenizer, from_meta, get_tokenizer


def test_gpt2_known_ids():
    tok = get_tokenizer("gpt2")
    assert tok.encode("Hello, I am") == [15496, 11, 314, 716]
    assert tok.encode(" the") == [262]
    assert tok.encode("<|endoftext|>") == [50256]
    assert (tok.vocab_size, tok.eot_id) == (50257, 50256)


def test_gpt2_round_trip_unicode():
    tok = get_tokenizer("gpt2")
    text = "Ünïcödé, émojis 🙂 and\n\nnewlines\t tabs  spaces'll don't 1234"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode_batch([text, "x"]) == [tok.encode(text), tok.encode("x")]


def test_shipped_ranks_are_gpt2s():
    ranks = tokenizers.load_gpt2_ranks()
    assert len(ranks) == 50256
    assert ranks[b"!"] == 0 and ranks[b"Hello"] == 15496


def test_corrupt_ranks_refused(monkeypatch):
    real = hashlib.sha256
    monkeypatch.setattr(tokenizers.hashlib, "sha256", lambda data: real(data + b"x"))
    with pytest.raises(ValueError, match="r50k_base.tiktoken is corrupt"):
        tokenizers.load_gpt2_ranks()


def test_char_tokenizer():
    tok = CharTokenizer.from_text("hello world")
    assert tok.vocab_size == 8 and tok.eot_id is None
    assert tok.decode(tok.encode("hold")) == "hold"
    with pytest.raises(ValueError, match=r"characters not in the vocabulary: 'QZ'"):
        tok.encode("hello QZ")


def test_meta_round_trip():
    char = CharTokenizer.from_text("abc\n")
    assert from_meta(char.to_meta()).encode("cab\n") == char.encode("cab\n")
    bpe = get_tokenizer("gpt2")
    assert from_meta(bpe.to_meta()).encode("Hello") == [15496]
    with pytest.raises(ValueError, match="unknown tokenizer kind 'word'"):
        from_meta({"kind": "word"})
