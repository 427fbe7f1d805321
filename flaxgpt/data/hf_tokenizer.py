"""A Hugging Face model's own tokenizer: its tokenizer.json through the `tokenizers` library.

    tok = HFTokenizer("path/to/llama_dir")      # or the tokenizer.json itself
    ids = tok.encode("Hello")                   # the text's ids, no special token (as tiktoken's)
    text = tok.decode(ids)                      # special tokens (BOS, EOS) left out
    tok.add_bos, tok.bos_id, tok.eos_id         # True, 128000, 128001 for Llama 3

`add_bos` says whether the model's own post-processor starts a sequence with BOS (Llama's
does, Qwen2's does not); prompts (tokenizers.encode_prompt) and prepared documents
(flaxgpt.data.prepare) then start with it. `encode` itself adds nothing, so a context and its
continuation encode apart as lm-evaluation-harness does. BOS and EOS ids come from the model's
files, first found wins: generation_config.json, config.json, then tokenizer_config.json's token
strings. EOS is what sampling stops at and what `prepare` appends to each document.

The chat side (rendered by flaxgpt.data.chat): `tok.chat_template` is the model's Jinja template,
chat_template.jinja beside tokenizer.json, else tokenizer_config.json's `chat_template` (a string,
or a list of named templates: "default"), else None; `tok.special_tokens` the strings templates
read (bos_token, eos_token, ...: transformers' special_tokens_map); `tok.encoding(text)` the
tokenizers Encoding (offsets for char_to_token).
"""

from __future__ import annotations

import json
from pathlib import Path

TOKENIZER_FILE = "tokenizer.json"
ID_FILES = ("generation_config.json", "config.json")
# transformers' SPECIAL_TOKENS_ATTRIBUTES: the token strings a chat template sees
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class HFTokenizer:
    def __init__(self, path: str | Path):
        path = Path(path).expanduser()
        file = path / TOKENIZER_FILE if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no {TOKENIZER_FILE} at {path}; pass a model directory that holds one")
        try:
            import tokenizers
        except ImportError as e:
            raise ImportError(f"{file} needs the tokenizers library: pip install tokenizers") from e
        self.file = file.resolve()
        self.tok = tokenizers.Tokenizer.from_file(str(self.file))
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        # eos_ids: every id generation stops at (Llama 3.1's <|end_of_text|>, <|eom_id|>, <|eot_id|>), as
        # transformers' generate and vLLM stop: the server's default stop tokens
        strings = token_strings(self.file.parent)  # read once: the ids' fallback and the templates' variables
        self.bos_id, self.eos_id, self.eos_ids = special_ids(self.file.parent, self.tok, strings)
        self.eot_id = self.eos_id  # the Tokenizer protocol's end of text
        with_special = self.tok.encode("a").ids
        self.add_bos = self.bos_id is not None and with_special[:1] == [self.bos_id] != self.encode("a")[:1]
        self.chat_template, self.special_tokens = chat_template(self.file.parent), strings
        self.added_ids = frozenset(self.tok.get_added_tokens_decoder())  # control tokens (<|eot_id|>, ...)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encoding(self, text: str):
        """The tokenizers Encoding of `text` (ids and character offsets), no special token added."""
        return self.tok.encode(text, add_special_tokens=False)

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def to_meta(self) -> dict:
        return {"kind": "hf", "path": str(self.file), "vocab_size": self.vocab_size}


def special_ids(
    directory: Path, tok, strings: dict[str, str]
) -> tuple[int | None, int | None, frozenset[int]]:
    """(bos_id, eos_id, every EOS id) from the model's files, each from the first of generation_config.json
    and config.json that gives it (the file transformers' generate reads), else from the token
    `strings` (token_strings'); a list of EOS ids (Llama 3 chat) gives the first as eos_id."""
    found: dict = {}
    every: frozenset[int] = frozenset()
    for name in ID_FILES:
        file = directory / name
        if file.is_file():
            data = json.loads(file.read_text())
            for key in ("bos_token_id", "eos_token_id"):
                value = data.get(key)
                values = value if isinstance(value, list) else [value]
                value = values[0] if values else None
                if key not in found and value is not None:
                    found[key] = int(value)
                    if key == "eos_token_id":
                        every = frozenset(
                            int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)
                        )
    for key in ("bos_token", "eos_token"):
        token = strings.get(key)
        if f"{key}_id" not in found and token is not None and tok.token_to_id(token) is not None:
            found[f"{key}_id"] = tok.token_to_id(token)
    eos = found.get("eos_token_id")
    return found.get("bos_token_id"), eos, every | ({eos} if eos is not None else set())


def chat_template(directory: Path) -> str | None:
    """The chat template from chat_template.jinja / tokenizer_config.json, or None."""
    config_file, template = directory / "tokenizer_config.json", None
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():  # transformers v5 saves the template here; it wins over the config's copy
        template = jinja.read_text(encoding="utf-8")
    elif isinstance(config.get("chat_template"), list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in config["chat_template"] if isinstance(t, dict)}
        template = named.get("default")
    elif isinstance(config.get("chat_template"), str):
        template = config["chat_template"]
    return template


def token_strings(directory: Path) -> dict[str, str]:
    """The special token strings (bos_token, eos_token, ...): tokenizer_config.json's, else
    special_tokens_map.json's (where older saves keep them; transformers reads both)."""
    special = {}
    for file in ("special_tokens_map.json", "tokenizer_config.json"):  # the later one wins
        path = directory / file
        data = json.loads(path.read_text()) if path.is_file() else {}
        for name in SPECIAL_TOKEN_NAMES:
            token = data.get(name)
            token = token.get("content") if isinstance(token, dict) else token
            if isinstance(token, str):
                special[name] = token
    return special
