"""The `flaxgpt prepare` command that writes a recipe's data, for the one-line missing-data errors.

    prepare_command(config, "gpt2")  # flaxgpt prepare --dataset shakespeare --tokenizer gpt2 --out_dir ...

Built from the recipe's data.dir and data.format and the tokenizer its model reads (the caller's:
loader.data_tokenizer(init_from) says it: gpt2 for a GPT-2 name, the directory for a Hugging Face
model or a flaxgpt run, None for a fresh model), and the dataset the one the folder's name says
(shakespeare_char, shakespeare, openwebtext, fineweb, reverse, numbers, wmt14), else your own text
(`--dataset text --input FILE`).
"""

from __future__ import annotations

import shlex
from pathlib import Path

DATASETS = (  # a folder name's start -> its dataset: the recipes' own folders (configs/*.py)
    ("shakespeare_char", "--dataset shakespeare_char"),
    ("shakespeare", "--dataset shakespeare"),
    ("openwebtext", "--dataset hf --hf_name openwebtext"),
    ("fineweb", "--dataset fineweb"),
)
TASKS = (  # encoder-decoder recipes: flaxgpt prepare-seq2seq
    ("reverse", "--task reverse"),
    ("numbers", "--task numbers"),
    (
        "wmt14_ende",
        "--task hf --hf_name wmt14 --hf_config de-en --src_lang en --tgt_lang de --max_len 128 --truncate",
    ),
)


def prepare_command(config, tok: str | None) -> str:
    """The command that prepares config.data.dir for this recipe, whose model reads tokenizer `tok`
    (loader.data_tokenizer's: "gpt2", a directory, or None for a fresh model)."""
    fmt, name = config.data.get("format", "tokens"), Path(str(config.data.dir)).name
    out = shlex.quote(str(config.data.dir))  # a command to paste: a path with spaces stays one word
    hf = tok is not None and is_hf_dir(tok)
    tok = shlex.quote(str(tok)) if tok is not None else None
    model = tok if tok not in (None, "gpt2") else "MODEL_DIR"
    block = config.get("model", {}).get("block_size", 0)
    if fmt == "packed":
        args = f"--dataset chat --input convs.jsonl --hf_dir {model} --block_size {block}"
    elif fmt == "pairs":
        args = f"--dataset pairs --input pairs.jsonl --hf_dir {model} --block_size {block}"
    elif fmt == "prompts":  # a fresh model: a character vocabulary of the prompts
        args = "--dataset prompts --input PROMPTS.jsonl " + (
            "--tokenizer char" if tok is None else f"--hf_dir {tok}" if hf else f"--tokenizer {tok}"
        )
    elif fmt == "shards":
        args = "--dataset fineweb"
    elif "seq2seq" in config:
        task = next((a for start, a in TASKS if name.startswith(start)), "--task tsv --input PAIRS.tsv")
        tok = "gpt2" if task.startswith("--task hf") else tok
        return (
            f"flaxgpt prepare-seq2seq {task}" + (f" --tokenizer {tok}" if tok else "") + f" --out_dir {out}"
        )
    else:
        args = next((a for start, a in DATASETS if name.startswith(start)), "--dataset text --input FILE")
        if tok is None and args.endswith("--input FILE"):
            tok = "char"  # a fresh model on your own text: characters (or --tokenizer gpt2)
        elif tok is None and "shakespeare_char" not in args:
            tok = "gpt2"
        if tok and "shakespeare_char" not in args:
            args += f" --tokenizer {tok}"
    return f"flaxgpt prepare {args} --out_dir {out}"


def is_hf_dir(path: str) -> bool:
    """A Hugging Face model directory rather than a flaxgpt run (which holds checkpoints/); a path not
    there yet counts as a model unless it is under out/, where runs go."""
    p = Path(path)
    if p.is_dir():
        return not (p / "checkpoints").is_dir()
    return p.parts[:1] != ("out",)


def prepare_hint(config, tok: str | None, overwrite: bool = False) -> str:
    """'prepare it with: COMMAND' (with --overwrite where a part of the dataset is there already)."""
    return "prepare it with: " + prepare_command(config, tok) + (" --overwrite" if overwrite else "")
