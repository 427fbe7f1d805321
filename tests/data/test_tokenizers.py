"""Tokenizers: GPT-2's BPE offline, characters, the encoder-decoder's, meta.json round trips, prompts."""

import hashlib

import pytest

from flaxgpt.data import tokenizers
from flaxgpt.data.tokenizers import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    CharTokenizer,
    Seq2SeqTokenizer,
    TextStream,
    encode_prompt,
    from_meta,
    get_tokenizer,
)


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


def test_tokenizer_reserves_pad_bos_eos_and_decodes_up_to_eos():
    tok = Seq2SeqTokenizer(CharTokenizer(list("abc")))
    assert tok.vocab_size == 6 and tok.encode("cab") == [5, 3, 4]
    assert tok.decode([BOS_ID, 5, 3, EOS_ID, 4, 4]) == "ca"
    assert tok.decode([5, PAD_ID, 4]) == "cb"
    assert Seq2SeqTokenizer.from_meta(tok.to_meta()).decode([3, 4]) == "ab"
    assert from_meta(tok.to_meta()).decode([3, 4]) == "ab"
    with pytest.raises(ValueError, match="not a seq2seq vocabulary"):
        Seq2SeqTokenizer.from_meta({"kind": "char", "chars": ["a"]})


def test_encode_prompt_is_never_empty_and_fits_the_context():
    gpt2 = get_tokenizer("gpt2")
    assert encode_prompt(gpt2, "", 8) == [gpt2.eot_id]
    chars = CharTokenizer(list("\nab"))
    with pytest.warns(UserWarning, match="empty prompt: starting from '\\\\n'"):
        assert encode_prompt(chars, "", 8) == chars.encode("\n")
    with pytest.warns(UserWarning, match="empty prompt: starting from 'a'"):
        assert encode_prompt(CharTokenizer(list("ab")), "", 8) == [0]
    with pytest.warns(UserWarning, match=r"prompt of 5 tokens is longer than the context \(3\)"):
        assert encode_prompt(chars, "abbab", 3) == chars.encode("bab")


def test_text_stream_holds_back_half_characters():
    gpt2 = get_tokenizer("gpt2")
    ids = gpt2.encode("héllo 🦜 wörld")
    stream = TextStream(gpt2)
    pieces = [stream.add([i]) for i in ids]
    assert "".join(pieces) == "héllo 🦜 wörld" and "\ufffd" not in "".join(pieces)
    assert "" in pieces  # the parrot is three tokens: the first two wait for the third
    # a chunk that ends inside a character shows all but that character; the end shows the rest
    cut = gpt2.encode("Tokyo is the capital of Japan, written 東京")[:-1]
    stream = TextStream(gpt2)
    shown = stream.add(cut)
    assert shown == "Tokyo is the capital of Japan, written 東" and shown + stream.flush() == gpt2.decode(cut)
