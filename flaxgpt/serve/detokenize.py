"""A reply's text as its tokens arrive: the text that follows the prompt, in O(1) work a token.

    det = Detokenizer(tokenizer, prompt_ids)  # any flaxgpt tokenizer: decode(ids) -> str
    new_text = det.add(new_ids)               # what the new tokens add ("" while a character is incomplete)
    det.text                                  # the whole reply so far: every add's result, concatenated
    det.flush()                               # at the end: what was held back (incomplete: U+FFFD)

A reply decoded on its own is not the text that follows the prompt: SentencePiece decoders (Llama 2's
Strip, the Metaspace decoder of Mistral's and newer conversions) drop the first token's leading
space, so "What say you" + [▁Rard, ▁now] reads "Rard now" where the text in context is " Rard now";
and decoding the whole reply at every step costs O(n) a token. So, as vLLM's incremental detokenizer
does, each step decodes a short window of ids with and without the new ones (vLLM's ids[prefix:] and
ids[prefix:read]) and returns the difference. The window holds the ids of the last text returned (the
prompt's last few at first) and those held back since; it opens on a token that has text, so the
first-token rules hit that token in both decodes and cancel out, and the new tokens decode as they do
in context. Work a token: one decode of the window, two when text is returned.

Held back: a trailing "\ufffd" is a UTF-8 character whose bytes have not all come (byte-level BPE
and SentencePiece byte fallback split characters across tokens); it is returned once complete, or as
U+FFFD by flush, or once MAX_PENDING tokens in a row have ended inside one (no character spans more:
those bytes are invalid and stay U+FFFD). A prompt that ends inside a character: the reply's text
starts with that character.
Tokens that add no text to a window that has some (special tokens the tokenizer skips, e.g. EOS) are
left out of the window: they change no later text, and a run of them must not grow it.

Limits: text already returned is never taken back, so invalid UTF-8 (a broken model's bytes, or a
reply cut inside a character) may read differently from decode(prompt + reply): tokenizers'
ByteFallback turns a whole run of byte tokens into U+FFFDs when the run holds an invalid byte, the
characters returned before it in that run included, and a U+FFFD returned after MAX_PENDING tokens
may be repeated when later bytes regroup. Valid text is never lost; for valid UTF-8 the result is
exactly decode(prompt + reply)[len(decode(prompt)):] (tests/serve/test_detokenize.py).

`TextOffsets`: where each token's text starts (completions' logprobs `text_offset`), token after token,
one per reply across a stream's chunks.

Also the scheduler's other text rules: `WithSpecial` (a tokenizer whose decode keeps special tokens, for
requests that ask for them) and `held_back` (the end of a reply not to emit yet: a partial character
or the start of a stop string).
"""

from __future__ import annotations

import codecs
import os

CONTEXT = 5  # prompt tokens decoded before the reply (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)
MAX_CONTEXT = 32  # at most this many: more only for a prompt tail of special tokens or split characters
MAX_PENDING = 4  # a UTF-8 character is at most 4 bytes, and a token that ends inside one holds at least one
INCOMPLETE = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer, prompt_ids):
        self.tokenizer = tokenizer
        prompt = [int(i) for i in prompt_ids]
        start = max(0, len(prompt) - CONTEXT)
        # the window opens on text, at a character's first byte, when the prompt has one
        while start > 0 and len(prompt) - start < MAX_CONTEXT and _no_start(self._decode(prompt[start:])):
            start -= 1
        self.ids = prompt[start:]  # the window: ids[:read] were returned (or are the prompt's), the rest
        self.read = len(self.ids)  # are held back; older ids are never decoded again
        if self._decode(self.ids).endswith(INCOMPLETE):  # the prompt ends inside a character: the reply
            for read in range(len(self.ids) - 1, max(-1, len(self.ids) - MAX_PENDING), -1):  # starts with it
                if not self._decode(self.ids[:read]).endswith(INCOMPLETE):
                    self.read = read
                    break
        self.prefix_text = self._decode(self.ids[: self.read])  # what the window's returned ids read
        self.tail = self._decode(self.ids)  # what the whole window reads
        self.text = ""
        self.waiting = 0  # the last tokens whose window's text ended inside a character

    def add(self, new_ids) -> str:
        """The text the new ids add to the reply ("" while a character is incomplete)."""
        new = "".join([self._add_one(int(t)) for t in new_ids])  # a token at a time: a character
        self.text += new  # split by the last of several new ids holds back only that character
        return new

    def flush(self) -> str:
        """What is held back, as decode gives it (an incomplete character as U+FFFD); then nothing is."""
        new = self._advance(self.tail) if self.read < len(self.ids) else ""
        self.text += new
        return new

    def _add_one(self, t: int) -> str:
        self.ids.append(t)
        text = self._decode(self.ids)
        if text == self.tail and self.tail and not self.tail.endswith(INCOMPLETE):
            self.ids.pop()  # adds nothing after text (a special token decode skips): out of the window
            return ""
        self.tail = text
        self.waiting = self.waiting + 1 if text.endswith(INCOMPLETE) else 0  # tokens in a row ending so
        if 0 < self.waiting < MAX_PENDING or text == self.prefix_text:  # or no text yet at all
            return ""
        return self._advance(text)

    def _advance(self, text: str) -> str:
        """What `text` (the window's) adds; the ids it came from open the next window."""
        if text.startswith(self.prefix_text):
            new = text[len(self.prefix_text) :]
        else:  # invalid bytes read differently once more came: repeat a U+FFFD rather than lose text
            new = text[len(os.path.commonprefix([text, self.prefix_text])) :]
        self.ids = self.ids[self.read :]
        self.read, self.waiting = len(self.ids), 0
        self.prefix_text = self.tail = self._decode(self.ids)
        return new

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids) if ids else ""


def _no_start(text: str) -> bool:
    """A window that opens on no text or inside a character (its first bytes decode to U+FFFD)."""
    return not text or text.startswith(INCOMPLETE)


class WithSpecial:
    """A tokenizer whose decode keeps special tokens (a Hugging Face tokenizer's skip them)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids) -> str:
        inner = getattr(self.tokenizer, "tok", None)
        if inner is None:  # tiktoken and characters: no token is skipped
            return self.tokenizer.decode(ids)
        return inner.decode([int(i) for i in ids], skip_special_tokens=False)


def held_back(text: str, stop: list[str]) -> int:
    """Characters at the end of `text` not to emit yet: a partial UTF-8 character or stop string."""
    n = len(text) - len(text.rstrip("\ufffd"))
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                n = max(n, k)
                break
    return n


class TextOffsets:
    """Where each token's text starts, from `start`, in the text its bytes decode to (U+FFFD for invalid
    bytes). A token ending inside a valid character gets no characters, so the token that completes it
    starts where the character does; bytes that prove invalid (a lead byte the next token does not
    continue) are that earlier token's U+FFFD, and the next token starts after it. One object a reply,
    across its stream's chunks: a fresh decoder a chunk lost the bytes held between them."""

    def __init__(self, start: int = 0):
        self.chars = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.count, self.text = start, ""

    def next(self, raw: bytes) -> int:
        """The next token's start, given its bytes (b"" for a token the text skips)."""
        held = self.chars.getstate()[0]
        piece = self.chars.decode(raw)
        lead = 0  # the held bytes' own U+FFFDs when this token did not complete them: the earlier token's
        if held:
            alone = held.decode("utf-8", errors="replace")
            fresh = codecs.getincrementaldecoder("utf-8")(errors="replace")
            lead = len(alone) if piece == alone + fresh.decode(raw) else 0
        start = self.count + lead
        self.count, self.text = self.count + len(piece), self.text + piece
        return start

    def finish(self) -> str:
        """All the text (what was held back decoded as U+FFFD)."""
        self.text += self.chars.decode(b"", final=True)
        return self.text
