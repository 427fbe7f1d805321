"""The Detokenizer returns the text that follows the prompt, decode(prompt + reply)[len(decode(prompt)):],
a piece per add, for SentencePiece tokenizers with byte fallback (built here with the tokenizers library:
Llama 2's normalizer + Strip decoder, and the Metaspace pre-tokenizer + decoder of newer conversions),
GPT-2's byte-level BPE and characters; over random prompts and replies whose characters are split
across tokens (emoji, CJK, accents as byte tokens), with special tokens inside; each token decoding a
window of bounded length."""

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from flaxgpt.data.hf_tokenizer import HFTokenizer
from flaxgpt.data.tokenizers import CharTokenizer, get_tokenizer
from flaxgpt.serve.detokenize import Detokenizer

WORDS = ["the", "say", "you", "Rard", "now", "é", "naïve", "你好", "世界", "😀", "🎉", "\n", "ok,", " ", "x"]
CORPUS = "the quick brown fox. What say you? Rard now, there the thing: 你好 世界, naïve " * 20
BYTES = [f"<0x{b:02X}>" for b in range(256)]


def sentencepiece(directory, style: str) -> HFTokenizer:
    """A BPE over <unk> <s> </s> (ids 0 1 2, special), 256 byte tokens <0xNN> (byte fallback: emoji and
    most CJK become bytes) and merges of CORPUS up to 400 ids. llama2: Prepend + Replace normalizer, decoder
    Replace, ByteFallback, Fuse, Strip (Llama 2's tokenizer.json); metaspace: Metaspace pre-tokenizer
    and decoder (prepend_scheme "first": the first token's leading space is dropped)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    if style == "llama2":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        parts = [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
        tok.decoder = decoders.Sequence(parts)
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace("▁", "first")])
    tok.train_from_iterator(
        [CORPUS], trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"] + BYTES)
    )
    spec = json.loads(tok.to_str())  # the byte tokens belong to the model's vocabulary, not special ones
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] not in BYTES]
    spec["model"]["byte_fallback"] = True
    directory.mkdir()
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    return HFTokenizer(directory)


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    """name -> (tokenizer, byte_id(b) or None, special ids a reply may hold)."""
    root = tmp_path_factory.mktemp("detok")
    out = {}
    for style in ("llama2", "metaspace"):
        t = sentencepiece(root / style, style)
        out[style] = (t, lambda b, t=t: t.tok.token_to_id(BYTES[b]), [1, 2])
    gpt2 = get_tokenizer("gpt2")
    out["gpt2"] = (gpt2, lambda b: gpt2.enc.encode_single_token(bytes([b])), [gpt2.eot_id])
    out["char"] = (CharTokenizer(sorted(set("".join(WORDS) + CORPUS))), None, [])
    return out


def random_text(rng, n):
    return "".join(rng.choice(WORDS) + rng.choice(["", " "]) for _ in range(n))


def random_reply(rng, tok, byte_id, specials, n) -> list[int]:
    """Pieces of random text, each encoded on its own or (byte tokenizers) as its UTF-8 bytes one token
    each: characters split across tokens anywhere; sometimes a special token between pieces."""
    ids = []
    for _ in range(n):
        piece = random_text(rng, rng.randint(1, 3))
        if byte_id is not None and rng.random() < 0.3:
            ids += [byte_id(b) for b in piece.encode()]
        else:
            ids += tok.encode(piece)
        if specials and rng.random() < 0.1:
            ids.append(rng.choice(specials))
    return ids


def detokenize(tok, prompt, reply, rng) -> tuple[str, list[str]]:
    """(det.text after flush, every piece returned), the reply fed in chunks of 1..4 ids."""
    det, pieces, i = Detokenizer(tok, prompt), [], 0
    while i < len(reply):
        k = rng.randint(1, 4)
        pieces.append(det.add(reply[i : i + k]))
        i += k
    pieces.append(det.flush())
    assert "".join(pieces) == det.text
    return det.text, pieces


@pytest.mark.parametrize("name", ["llama2", "metaspace", "gpt2", "char"])
def test_the_text_that_follows_the_prompt(toks, name):
    tok, byte_id, specials = toks[name]
    rng = random.Random(name)
    for trial in range(200):
        prompt = tok.encode(random_text(rng, rng.randint(0, 6)))
        if byte_id is not None and rng.random() < 0.3:  # characters split across the prompt's tokens
            prompt += [byte_id(b) for b in random_text(rng, 2).encode()]
        if specials and rng.random() < 0.3:  # BOS first, or specials (EOS) last: skipped by decode
            prompt = [specials[0]] + prompt if trial % 2 else prompt + [specials[-1]] * rng.randint(1, 8)
        reply = random_reply(rng, tok, byte_id, specials, rng.randint(0, 8))
        want = tok.decode(prompt + reply)[len(tok.decode(prompt)) :]
        got, _ = detokenize(tok, prompt, reply, rng)
        assert got == want, (name, prompt, reply)


def test_sentencepiece_keeps_the_leading_space(toks):
    """The bug: the reply decoded alone drops its first space (Metaspace's first-token rule)."""
    tok = toks["metaspace"][0]
    prompt, reply = tok.encode("What say you"), tok.encode(" Rard now")
    assert tok.decode(reply) == "Rard now"
    det = Detokenizer(tok, prompt)
    pieces = [det.add([t]) for t in reply]
    assert pieces[0].startswith(" R") and "".join(pieces) == " Rard now" and det.flush() == ""
    llama = toks["llama2"][0]
    det = Detokenizer(llama, [1] + llama.encode("What say you"))
    assert det.add(llama.encode(" Rard now")) + det.flush() == "  Rard now"  # Prepend adds a ▁ per encode


def test_a_split_character_is_held_back_until_complete(toks):
    gpt2 = toks["gpt2"][0]
    det = Detokenizer(gpt2, gpt2.encode("hi"))
    emoji = [gpt2.enc.encode_single_token(bytes([b])) for b in "😀".encode()]  # 4 tokens, a byte each
    assert [det.add([t]) for t in emoji] == ["", "", "", "😀"]
    assert det.add(emoji[:2]) == "" and det.flush() == gpt2.decode(emoji[:2]) == "\ufffd"  # ended inside
    # a prompt that ends inside a character: the reply starts with it
    ids = gpt2.encode("hi 你")
    det = Detokenizer(gpt2, ids[:-1])
    assert gpt2.decode(ids[:-1]).endswith("\ufffd") and det.add(ids[-1:] + gpt2.encode(" ok")) == "你 ok"
    llama, byte_id, _ = toks["llama2"]
    det = Detokenizer(llama, llama.encode("say"))
    assert [det.add([byte_id(b)]) for b in "你".encode()] == ["", "", "你"]
    assert det.add([2]) == "" and det.add(llama.encode("x")) == " x"  # EOS skipped, as decode does


class Counting:
    """A tokenizer whose decode calls are counted, with the longest list of ids decoded."""

    def __init__(self, tok):
        self.tok, self.calls, self.longest = tok, 0, 0

    def decode(self, ids):
        self.calls, self.longest = self.calls + 1, max(self.longest, len(ids))
        return self.tok.decode(ids)


@pytest.mark.parametrize("name", ["llama2", "gpt2", "char"])
def test_each_token_decodes_a_bounded_window(toks, name):
    """2000 reply tokens, 300 EOS in a row among them: at most 2 decodes a token, none of more than a
    few ids (re-decoding the reply would be O(n) a token, O(n^2) in all)."""
    tok, byte_id, specials = toks[name]
    rng = random.Random(0)
    reply, more = [], []
    while len(reply) < 1000:
        reply += random_reply(rng, tok, byte_id, specials, 10)
    while len(more) < 700:
        more += random_reply(rng, tok, byte_id, specials, 10)
    reply += specials[-1:] * 300 + more  # a run of EOS must not grow the window
    counting, prompt = Counting(tok), tok.encode(random_text(rng, 20))
    det = Detokenizer(counting, prompt)
    for i in range(0, len(reply), 3):
        det.add(reply[i : i + 3])
    det.flush()
    assert counting.calls <= 2 * len(reply) + 40 and counting.longest <= 12, (
        counting.calls,
        counting.longest,
    )
    assert det.text == tok.decode(prompt + reply)[len(tok.decode(prompt)) :]


def test_text_offsets_of_valid_and_invalid_bytes():
    from flaxgpt.serve.detokenize import TextOffsets

    # "a", a lead byte "b" does not continue (its U+FFFD: that token's), é and € split across tokens
    # (the completing token starts where the character does), a lone 0xFF, "c"
    raws = [b"a", b"\xc3", b"b", b"\xc3", b"\xa9", b"\xe2\x82", b"\xac", b"\xff", b"c"]
    offsets = TextOffsets(10)
    assert [offsets.next(raw) for raw in raws] == [10, 11, 12, 13, 13, 14, 14, 15, 16]
    assert offsets.finish() == "a\ufffdbé€\ufffdc"
    offsets = TextOffsets()
    assert [offsets.next(raw) for raw in [b"\xe2", b"\x82", b"x"]] == [0, 0, 1]  # € cut short: one U+FFFD
    assert offsets.finish() == "\ufffdx"
