"""Preference pairs for DPO: a jsonl of {prompt, chosen, rejected}, tokenized as TRL's DPOTrainer
tokenizes them, and packed, a pair's two sequences side by side in one row.

    flaxgpt prepare --dataset pairs --input pairs.jsonl --hf_dir MODEL --block_size 1024 --out_dir data/dpo
    pairs = read_pairs("pairs.jsonl")                                   # [(name, record)]
    prompt, chosen, rejected = tokenize_pair(tokenizer, record, max_len, name)
    rows = pack_pairs([(prompt, chosen, rejected), ...], block_size)    # packing.FIELDS, [R, T] each

A line is text ({"prompt": "Q: ...", "chosen": " yes", "rejected": " no"}) or conversational
({"prompt": [{"role": "user", ...}], "chosen": [{"role": "assistant", ...}], "rejected": [...]}),
rendered with the model's chat template (flaxgpt.data.chat). As TRL 1.16 (`_prepare_dataset`):
- text: the EOS token's text ends chosen and rejected (unless it already does); the ids are the
  tokenizer's own (a BOS first when the model's tokenizer adds one);
- chat: the prompt rendered with the generation prompt, prompt + chosen (rejected) rendered whole;
- either way the completion starts where the prompt's ids and the whole sequence's ids part (their
  common prefix), and each sequence is cut to max_len = block_size // 2 tokens (TRL's max_length,
  keep_start), so a pair always fits one row.

Packing: pair p of a row is two segments, chosen 2p + 1 then rejected 2p + 2 (attention and
positions restart in each, flaxgpt.data.packing); loss_mask marks the completion tokens, whose
log-probabilities DPO sums per segment (flaxgpt.train.dpo_task). Rows are filled best-fit
decreasing by pair length. Bad lines (no prompt, an empty or identical chosen / rejected, a prompt
that leaves no room for a response) are a PrepareError naming the line; nothing is written.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from flaxgpt.data import chat, packing
from flaxgpt.data.dataset_files import PrepareError, jsonl_records

KEYS = ("prompt", "chosen", "rejected")


def read_pairs(path: str | Path) -> list[tuple[str, dict]]:
    """[(name, record)] of a pairs jsonl; name = "PATH line N" for the errors."""
    out, what = [], 'a .jsonl of {"prompt", "chosen", "rejected"} lines'
    for name, record in jsonl_records(path, PrepareError, what):
        missing = [k for k in KEYS if not isinstance(record, dict) or k not in record]
        if missing:
            raise PrepareError(
                f"{name} has no {', '.join(map(repr, missing))}: a pair is prompt, chosen, rejected"
            )
        out.append((name, check_pair(record, name)))
    if not out:
        raise PrepareError(f"{path} holds no pair")
    return out


def check_pair(record: dict, name: str) -> dict:
    """The record with its messages checked; an empty or identical chosen / rejected is an error."""
    conversational = isinstance(record["prompt"], list)
    try:  # the functions the prompt offers, rendered as TRL's DPOTrainer renders them (tools=...)
        record["tools"] = chat.check_tools(record, name)
    except chat.ChatError as e:
        raise PrepareError(str(e)) from None
    if record["tools"] is not None and not conversational:
        raise PrepareError(
            f"{name}: tools are rendered by a chat template: give prompt, chosen and rejected as messages"
        )
    for k in KEYS:
        if conversational:
            try:
                record[k] = chat.check_messages(record[k], f"{name} {k}", need_assistant=False)
            except chat.ChatError as e:
                raise PrepareError(str(e)) from None
        elif not isinstance(record[k], str):
            raise PrepareError(f"{name}: {k} must be text like the prompt (or all three lists of messages)")
    for k in ("chosen", "rejected"):
        # a turn calling a tool has no content (check_messages drops a null one) and is not empty
        calls = conversational and any(m.get("tool_calls") for m in record[k])
        text = "".join(m.get("content", "") for m in record[k]) if conversational else record[k]
        if not text.strip() and not calls:
            raise PrepareError(f"{name}: {k} is empty: nothing to prefer (fill it in or drop the line)")
    if record["chosen"] == record["rejected"]:
        raise PrepareError(f"{name}: chosen and rejected are identical: nothing to prefer (drop the line)")
    return record


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def tokenize_pair(tokenizer, record: dict, max_len: int, name: str) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen ids, rejected ids) as TRL's DPOTrainer makes them, cut to max_len tokens
    a sequence; a prompt that leaves no response token is an error."""
    if isinstance(record["prompt"], list):
        try:
            tools = record.get("tools")
            prompt = chat.render_ids(tokenizer, record["prompt"], True, name, tools)
            whole = [
                chat.render_ids(tokenizer, record["prompt"] + record[k], False, name, tools) for k in KEYS[1:]
            ]
        except chat.ChatError as e:
            raise PrepareError(str(e)) from None
    else:
        bos = [tokenizer.bos_id] if getattr(tokenizer, "add_bos", False) else []
        eos = getattr(tokenizer, "special_tokens", {}).get("eos_token")
        if not eos:
            raise PrepareError(f"{name}: the tokenizer names no eos_token to end a text response with")
        ends = [record[k] if record[k].endswith(eos) else record[k] + eos for k in KEYS[1:]]
        prompt = bos + tokenizer.encode(record["prompt"])
        whole = [bos + tokenizer.encode(record["prompt"] + end) for end in ends]
    if whole[0] == whole[1]:  # e.g. " a" and " a<|eot_id|>": the same once the EOS is written
        raise PrepareError(
            f"{name}: chosen and rejected are the same tokens: nothing to prefer (drop the line)"
        )
    n = min(_common_prefix(prompt, w) for w in whole)
    if n >= max_len:
        raise PrepareError(
            f"{name}: the prompt has {n} tokens, leaving no room for a response in a sequence of "
            f"block_size // 2 = {max_len} (a pair's two sequences share a row); shorten the prompt "
            "or raise --block_size"
        )
    chosen, rejected = (w[n:max_len] for w in whole)
    return prompt[:n], chosen, rejected


def pack_pairs(pairs, block_size: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """[(prompt, chosen, rejected) ids] -> {inputs, targets, loss_mask, segment_ids} [R, T]: pair p
    of a row is segments 2p + 1 (chosen) and 2p + 2 (rejected), next-token pairs of each sequence."""
    examples = []
    for prompt, chosen, rejected in pairs:
        c, r = ([0] * len(prompt) + [1] * len(x) for x in (chosen, rejected))
        examples.append((packing.example(prompt + chosen, c), packing.example(prompt + rejected, r)))
    return packing.pack_groups(examples, block_size, pad_id)


def prepare_pairs(args, tokenizer) -> tuple[dict[str, dict], dict]:
    """--dataset pairs (prepare.prepare_packed has checked --input and --hf_dir): ({split: packed rows},
    meta fields); the last val_fraction of the pairs validate."""
    T = args.block_size
    if T < 4:
        raise PrepareError(f"--block_size must be >= 4, got {T}; a row holds a pair's two sequences")
    records = read_pairs(args.input)
    if isinstance(records[0][1]["prompt"], list):
        try:
            chat.template_of(tokenizer)
        except chat.ChatError as e:
            raise PrepareError(str(e)) from None
    pairs = [tokenize_pair(tokenizer, record, T // 2, name) for name, record in records]
    n_val = max(1, round(len(pairs) * args.val_fraction))
    if len(pairs) - n_val < 1:
        raise PrepareError(f"{len(pairs)} pairs: too few to split with val_fraction={args.val_fraction}")
    splits = {"train": pairs[:-n_val], "val": pairs[-n_val:]}
    pad = tokenizer.eot_id if tokenizer.eot_id is not None else 0
    rows = {name: pack_pairs(ps, T, pad_id=pad) for name, ps in splits.items()}
    meta = {f"{split}_examples": len(ps) for split, ps in splits.items()}
    return rows, meta
