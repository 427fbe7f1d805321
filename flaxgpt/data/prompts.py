"""Prompts for GRPO: a jsonl of {prompt, ...fields the rewards read}, tokenized for sampling.

    flaxgpt prepare --dataset prompts --input prompts.jsonl --hf_dir MODEL --block_size 1024 --out_dir data/p
    flaxgpt prepare --dataset prompts --input prompts.jsonl --tokenizer char --out_dir data/p
    flaxgpt prepare --dataset prompts --input prompts.jsonl --tokenizer out/sft --out_dir data/p   # a run's
    data = PromptData("data/p")                       # the run's side: meta.json checked on opening
    rows = data.batch("train", step, n_prompts, seed)  # [{"prompt", "ids", "fields"}] of one step

A line is {"prompt": "Q: 2+3=", "answer": "5"} (text) or {"prompt": [{"role": "user", ...}], ...}
(chat messages; `messages` is accepted for `prompt`), rendered with the model's chat template and its
generation prompt (flaxgpt.data.chat), as TRL's GRPOTrainer renders a conversational prompt. Every
other key of the line is a field handed to the reward functions (flaxgpt.train.rewards) with the
prompt. A text prompt's ids are the tokenizer's own (a BOS first when the model's tokenizer adds one).

Files: {train,val}.prompts.jsonl, one {"prompt", "ids", "fields"} a line, and meta.json (kind
"prompts", the tokenizer, eos_id: the token that ends a completion, max_prompt_tokens). A character
vocabulary (--tokenizer char) is built from the prompts and the fields' text, plus "\\n", which has no
end-of-text token and so ends completions; `--tokenizer` a training run or a prepared dataset takes
its meta.json's tokenizer (GRPO from an SFT run: the vocabulary it was trained with). The last
val_fraction of the lines are the held-out prompts. Bad lines (no prompt, an empty one, bad
messages, a character the vocabulary lacks, a prompt that leaves no room for a completion in
--block_size) are a PrepareError naming the line; nothing is written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from flaxgpt.data import chat
from flaxgpt.data.dataset_files import PrepareError, document_end, jsonl_records, text_lines, writing
from flaxgpt.data.tokenizers import CharTokenizer

HINT = "prepare it with: flaxgpt prepare --dataset prompts --input PROMPTS.jsonl --out_dir DIR"
CHAR_EOS = "\n"  # a character vocabulary's end of a completion


def read_prompts(path) -> list[tuple[str, dict]]:
    """[(name, {"prompt", "fields"})] of a prompts jsonl; name = "PATH line N" for the errors."""
    out = []
    for name, record in jsonl_records(path, PrepareError, 'a .jsonl of {"prompt": ..., "answer": ...} lines'):
        if not isinstance(record, dict) or not ("prompt" in record or "messages" in record):
            raise PrepareError(f"{name} has no 'prompt' (text or chat messages; 'messages' also works)")
        fields = dict(record)
        prompt = fields.pop("prompt") if "prompt" in fields else fields.pop("messages")
        if isinstance(prompt, list):
            try:
                prompt = chat.check_messages(prompt, f"{name} prompt", need_assistant=False)
            except chat.ChatError as e:
                raise PrepareError(str(e)) from None
        elif not isinstance(prompt, str):
            raise PrepareError(f"{name}: the prompt must be text or a list of chat messages")
        elif not prompt.strip():
            raise PrepareError(
                f"{name}: the prompt is empty: nothing to complete (fill it in or drop the line)"
            )
        out.append((name, {"prompt": prompt, "fields": fields}))
    if not out:
        raise PrepareError(f"{path} holds no prompt")
    return out


def char_vocabulary(records) -> CharTokenizer:
    """Characters of every text prompt and every text field (what completions must be able to say)."""
    text = [CHAR_EOS]
    for _, r in records:
        if not isinstance(r["prompt"], str):
            raise PrepareError("chat prompts need the model's tokenizer: pass --hf_dir MODEL_DIR")
        text.append(r["prompt"])
        # a number too: the answer reward compares str(answer) with what a completion says
        text += [
            str(v)
            for v in r["fields"].values()
            if isinstance(v, (str, int, float)) and not isinstance(v, bool)
        ]
    return CharTokenizer.from_text("".join(text))


def tokenize_prompt(tokenizer, prompt, name: str) -> list[int]:
    if isinstance(prompt, list):
        try:
            return chat.render_ids(tokenizer, prompt, True, name)
        except chat.ChatError as e:
            raise PrepareError(str(e)) from None
    bos = [tokenizer.bos_id] if getattr(tokenizer, "add_bos", False) else []
    try:
        return bos + tokenizer.encode(prompt)
    except ValueError as e:  # a character vocabulary (--tokenizer RUN_DIR) that lacks one of its characters
        raise PrepareError(f"{name}: {e}") from None


def eos_of(tokenizer, name: str) -> int:
    """The id that ends a sampled completion: end-of-text, or a character vocabulary's newline."""
    if tokenizer.eot_id is None and isinstance(tokenizer, CharTokenizer):
        return tokenizer.stoi[CHAR_EOS]
    return document_end(tokenizer, name)


def prepare_prompts(args, make_tokenizer) -> dict:
    """--dataset prompts: tokenized prompts and their fields into args.out_dir (meta.json last)."""
    out_dir = Path(args.out_dir)
    if not args.input:
        raise PrepareError("--dataset prompts needs --input PROMPTS.jsonl")
    if (out_dir / "meta.json").exists() and not args.overwrite:
        raise PrepareError(f"{out_dir} already holds a prepared dataset; pass --overwrite to replace it")
    records = read_prompts(args.input)
    name = args.hf_dir or args.tokenizer or "gpt2"
    tokenizer = char_vocabulary(records) if name == "char" else make_tokenizer(name)
    if any(isinstance(r["prompt"], list) for _, r in records):
        try:
            chat.template_of(tokenizer)
        except chat.ChatError as e:
            raise PrepareError(str(e)) from None
    rows = []
    for line, r in records:
        ids = tokenize_prompt(tokenizer, r["prompt"], line)
        if args.block_size and len(ids) >= args.block_size:
            raise PrepareError(
                f"{line}: the prompt has {len(ids)} tokens, leaving no room for a completion in "
                f"--block_size {args.block_size}; shorten it or raise --block_size"
            )
        rows.append({"prompt": r["prompt"], "ids": ids, "fields": r["fields"]})
    n_val = max(1, round(len(rows) * args.val_fraction))
    if len(rows) - n_val < 1:
        raise PrepareError(f"{len(rows)} prompts: too few to split with val_fraction={args.val_fraction}")
    splits = {"train": rows[:-n_val], "val": rows[-n_val:]}
    meta = {"kind": "prompts", "tokenizer": tokenizer.to_meta(), "vocab_size": tokenizer.vocab_size}
    meta.update(eos_id=eos_of(tokenizer, name), max_prompt_tokens=max(len(r["ids"]) for r in rows))
    meta.update(source=str(args.input), fields=sorted({k for r in rows for k in r["fields"]}))
    meta.update({f"{s}_examples": len(v) for s, v in splits.items()})
    with writing(out_dir) as tmp:
        for split, part in splits.items():
            lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part)
            (tmp / f"{split}.prompts.jsonl").write_text(lines, encoding="utf-8")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        out_dir.mkdir(exist_ok=True)
        for split in splits:
            os.replace(tmp / f"{split}.prompts.jsonl", out_dir / f"{split}.prompts.jsonl")
        os.replace(tmp / "meta.json", out_dir / "meta.json")  # last: it marks completeness
    print(
        f"wrote {out_dir}: {meta['train_examples']} train and {meta['val_examples']} val prompts, "
        f"at most {meta['max_prompt_tokens']} tokens, vocab {meta['vocab_size']:,}"
    )
    return meta


class PromptData:
    """A prompts dataset's splits, read whole (prompts are few and small) and checked on opening."""

    def __init__(self, data_dir, hint: str | None = None):
        """hint: 'prepare it with: COMMAND', the recipe's (flaxgpt.data.hints)."""
        self.dir = Path(data_dir)
        hint = hint or HINT
        try:
            self.meta = json.loads((self.dir / "meta.json").read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{self.dir}/meta.json cannot be read ({type(e).__name__}); {hint}") from None
        if self.meta.get("kind") != "prompts":
            raise ValueError(
                f"{self.dir} holds a {self.meta.get('kind', 'token')} dataset, not prompts; "
                f"{hint} --overwrite"
            )
        self.splits = {}
        for split in ("train", "val"):
            path = self.dir / f"{split}.prompts.jsonl"
            try:
                self.splits[split] = [json.loads(x) for x in text_lines(path.read_text(encoding="utf-8"))]
            except (OSError, ValueError) as e:
                raise ValueError(f"{path} cannot be read ({type(e).__name__}); {hint} --overwrite") from None
        self.eos_id = int(self.meta["eos_id"])
        self.max_prompt_tokens = int(self.meta["max_prompt_tokens"])

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def check(self, block_size: int, model_vocab_size: int, max_completion: int) -> None:
        if self.max_prompt_tokens + max_completion > block_size:
            raise ValueError(
                f"{self.dir}: a prompt of {self.max_prompt_tokens} tokens + grpo.max_completion_length "
                f"{max_completion} > block_size {block_size}; shorten the prompts or the completions"
            )
        if self.vocab_size > model_vocab_size:
            raise ValueError(
                f"the dataset's vocabulary ({self.vocab_size}) is larger than the model's "
                f"({model_vocab_size}); prepare it with the model's own tokenizer (--hf_dir)"
            )

    def batch(self, split: str, step: int, n_prompts: int, seed: int) -> list[dict]:
        """n_prompts rows of a split for a step: a fresh shuffle each pass over it, the same for a
        (seed, step) whatever came before (a resumed run samples the prompts it would have)."""
        rows = self.splits[split]
        first = step * n_prompts
        out = []
        for i in range(first, first + n_prompts):
            order = np.random.default_rng([seed, i // len(rows)]).permutation(len(rows))
            out.append(rows[order[i % len(rows)]])
        return out
