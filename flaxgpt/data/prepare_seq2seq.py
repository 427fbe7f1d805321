"""Parallel text for the encoder-decoder -> token files (batches: data.batches.ParallelData / Batcher).

    flaxgpt prepare-seq2seq --task reverse --out_dir data/reverse
    flaxgpt prepare-seq2seq --task numbers --out_dir data/numbers
    flaxgpt prepare-seq2seq --task tsv --input pairs.tsv --out_dir data/mine  # src<TAB>tgt
    flaxgpt prepare-seq2seq --task files --input train.en --target train.de --out_dir data/mine
    flaxgpt prepare-seq2seq --task hf --hf_name wmt14 --hf_config de-en \
        --src_lang en --tgt_lang de --tokenizer gpt2 --out_dir data/wmt14_ende   # needs `datasets`, network

A prepared folder holds {train,val}.src.bin and .tgt.bin (the pairs' tokens end to end), {split}.idx.npy
(offsets [n + 1, 2]) and meta.json. Ids 0, 1, 2 are PAD, BOS, EOS; the base tokenizer's ids follow,
shared by source and target (flaxgpt.data.tokenizers.Seq2SeqTokenizer).
"""

from __future__ import annotations

import json
import os
import random
import sys
import warnings
from pathlib import Path

import numpy as np

from flaxgpt import errors
from flaxgpt.data.dataset_files import PrepareError, read_utf8, text_lines, token_dtype, writing
from flaxgpt.data.tokenizers import BOS_ID, EOS_ID, PAD_ID, CharTokenizer, Seq2SeqTokenizer, get_tokenizer

TASKS = ("reverse", "numbers", "tsv", "files", "hf")


# ---- synthetic tasks (no download) ----

ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen"
).split()
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
SCALES = ((10**9, "billion"), (10**6, "million"), (1000, "thousand"))


def number_to_words(n: int) -> str:
    """1234 -> 'one thousand two hundred thirty-four' (American English, no 'and')."""
    if n < 0:
        return "minus " + number_to_words(-n)
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("-" + ONES[n % 10] if n % 10 else "")
    if n < 1000:
        return ONES[n // 100] + " hundred" + (" " + number_to_words(n % 100) if n % 100 else "")
    for scale, name in SCALES:
        if n >= scale:
            rest = n % scale
            return number_to_words(n // scale) + " " + name + (" " + number_to_words(rest) if rest else "")
    raise AssertionError(n)


def reverse_pairs(n: int, seed: int, min_len: int = 1, max_len: int = 12, alphabet: str = "abcdefghij"):
    """n distinct random strings and their reversals."""
    letters = len(set(alphabet))
    capacity = sum(letters**length for length in range(min_len, max_len + 1))
    if n > capacity:  # the loop below would never end
        raise PrepareError(
            f"asked for {n} distinct strings, but {letters} letters make only {capacity} of up to "
            f"{max_len} characters; raise --max_chars or lower --n_train / --n_val"
        )
    rng = random.Random(seed)
    seen, pairs = set(), []
    while len(pairs) < n:
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(min_len, max_len)))
        if s not in seen:
            seen.add(s)
            pairs.append((s, s[::-1]))
    return pairs


def number_pairs(n: int, seed: int, max_value: int = 999_999):
    """n distinct numbers in [0, max_value] (digits) and their English words."""
    if n > max_value + 1:
        raise PrepareError(f"asked for {n} distinct numbers but max_value is {max_value}")
    values = np.random.default_rng(seed).choice(max_value + 1, size=n, replace=False)
    return [(str(int(v)), number_to_words(int(v))) for v in values]


def synthetic_split(task: str, n_train: int, n_val: int, seed: int, **kw):
    """Disjoint train and held-out val pairs of a synthetic task, and its fixed alphabet."""
    if task == "reverse":
        pairs = reverse_pairs(n_train + n_val, seed, **kw)
        alphabet = kw.get("alphabet", "abcdefghij")
    elif task == "numbers":
        pairs = number_pairs(n_train + n_val, seed, **kw)
        alphabet = "0123456789 -" + "".join(ONES + TENS[2:] + [name for _, name in SCALES]) + "hundred"
    else:
        raise PrepareError(f"unknown synthetic task {task!r}; choose reverse or numbers")
    return pairs[:n_train], pairs[n_train:], CharTokenizer(sorted(set(alphabet)))


# ---- reading parallel text ----


def read_tsv(path: str | Path) -> list[tuple[str, str, str]]:
    """(source, target, "file:line") of `source<TAB>target` lines (exactly one tab); blank lines are
    skipped."""
    pairs = []
    for lineno, line in enumerate(text_lines(read_utf8(path)), 1):
        if not line.strip():
            continue
        tabs = line.count("\t")
        if tabs != 1:
            raise PrepareError(
                f"{path}:{lineno} has {tabs or 'no'} tab{'s' if tabs != 1 else ''}; each line must be "
                "source<TAB>target with exactly one tab (a tab inside a sentence would be cut silently)"
            )
        src, tgt = line.split("\t")
        pairs.append((src, tgt, f"{path}:{lineno}"))
    return pairs


def read_aligned(src_path: str | Path, tgt_path: str | Path) -> list[tuple[str, str, str]]:
    """Two files, line i of one translating line i of the other."""
    src = text_lines(read_utf8(src_path))
    tgt = text_lines(read_utf8(tgt_path))
    if len(src) != len(tgt):
        raise PrepareError(
            f"{src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}; the files must be line-aligned"
        )
    return [(s, t, f"{src_path}:{i}") for i, (s, t) in enumerate(zip(src, tgt), 1)]


def encode_pairs(pairs, tokenizer: Seq2SeqTokenizer, max_len: int, truncate: bool):
    """Token lists per side. Sources get EOS, targets BOS/EOS at batch time: each side must fit
    max_len - 1 tokens; longer ones are an error, or cut with a warning when `truncate`."""
    src_ids, tgt_ids, n_cut = [], [], 0
    for i, pair in enumerate(pairs):
        src, tgt = pair[0], pair[1]
        where = pair[2] if len(pair) > 2 else f"pair {i}"
        if not src.strip():
            raise PrepareError(f"{where}: empty source; remove the line or give it a source")
        s, t = tokenizer.encode(src), tokenizer.encode(tgt)
        if max(len(s), len(t)) > max_len - 1:
            if not truncate:
                raise PrepareError(
                    f"{where}: {max(len(s), len(t))} tokens, more than max_len - 1 = "
                    f"{max_len - 1}; raise --max_len or pass --truncate"
                )
            s, t, n_cut = s[: max_len - 1], t[: max_len - 1], n_cut + 1
        src_ids.append(s)
        tgt_ids.append(t)
    if n_cut:
        warnings.warn(
            f"truncated {n_cut} of {len(pairs)} pairs to max_len - 1 = {max_len - 1} tokens", stacklevel=2
        )
    return src_ids, tgt_ids


def write_parallel(
    out_dir, splits: dict, tokenizer: Seq2SeqTokenizer, source: str, overwrite: bool = False
) -> dict:
    """splits: {"train": (src_ids, tgt_ids), "val": ...} -> token files + meta.json, atomically."""
    out_dir = Path(out_dir)
    if (out_dir / "meta.json").exists() and not overwrite:
        raise PrepareError(f"{out_dir} already holds a prepared dataset; pass --overwrite to replace it")
    dtype = token_dtype(tokenizer.vocab_size)
    meta = {
        "kind": "seq2seq",
        "tokenizer": tokenizer.to_meta(),
        "vocab_size": tokenizer.vocab_size,
        "dtype": np.dtype(dtype).name,
        "pad_id": PAD_ID,
        "bos_id": BOS_ID,
        "eos_id": EOS_ID,
        "source": source,
        "max_src_len": 0,
        "max_tgt_len": 0,
    }
    names = []
    with writing(out_dir) as tmp:
        for split, (src_ids, tgt_ids) in splits.items():
            if not src_ids:
                raise PrepareError(f"the {split} split is empty; give more pairs")
            offsets = np.zeros((len(src_ids) + 1, 2), np.int64)
            offsets[1:, 0] = np.cumsum([len(s) for s in src_ids])
            offsets[1:, 1] = np.cumsum([len(t) for t in tgt_ids])
            for side, ids in (("src", src_ids), ("tgt", tgt_ids)):
                np.fromiter((i for s in ids for i in s), np.int64).astype(dtype).tofile(
                    tmp / f"{split}.{side}.bin"
                )
            np.save(tmp / f"{split}.idx.npy", offsets)
            names += [f"{split}.src.bin", f"{split}.tgt.bin", f"{split}.idx.npy"]
            meta[f"{split}_pairs"] = len(src_ids)
            # +1: the source's EOS; the target's BOS (inputs) or EOS (targets)
            meta["max_src_len"] = max(meta["max_src_len"], 1 + int(np.diff(offsets[:, 0]).max()))
            meta["max_tgt_len"] = max(meta["max_tgt_len"], 1 + int(np.diff(offsets[:, 1]).max()))
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        out_dir.mkdir(exist_ok=True)
        for name in names + ["meta.json"]:  # meta.json last: it marks completeness
            os.replace(tmp / name, out_dir / name)
    return meta


# ---- command line ----


def check_args(args) -> None:
    """Nonsense numbers are refused before anything is read or written."""
    lowest = {"n_train": 1, "n_val": 1, "max_len": 2, "max_chars": 1, "max_value": 0}
    for name, low in lowest.items():
        if getattr(args, name) < low:
            raise PrepareError(f"--{name} must be >= {low}, got {getattr(args, name)}")
    if args.max_value >= SCALES[0][0] * 1000:  # number_to_words names billions at most
        raise PrepareError(f"--max_value must be below 10**12 (words up to billions), got {args.max_value}")
    if not 0.0 < args.val_fraction < 1.0:
        raise PrepareError(f"--val_fraction must be in (0, 1), got {args.val_fraction}")


def prepare(args) -> dict:
    if args.task in ("reverse", "numbers"):
        kw = {"max_value": args.max_value} if args.task == "numbers" else {"max_len": args.max_chars}
        train, val, base = synthetic_split(args.task, args.n_train, args.n_val, args.seed, **kw)
        source = f"synthetic:{args.task}"
    else:
        if args.task == "hf":
            train, val = load_hf_pairs(args)
        else:
            if not args.input or (args.task == "files" and not args.target):
                raise PrepareError(
                    f"--task {args.task} needs --input" + (" and --target" if args.task == "files" else "")
                )
            pairs = read_tsv(args.input) if args.task == "tsv" else read_aligned(args.input, args.target)
            n_val = max(1, int(len(pairs) * args.val_fraction))
            if len(pairs) < 2:
                raise PrepareError(f"{args.input} has {len(pairs)} pairs; need at least 2 (train and val)")
            train, val = pairs[:-n_val], pairs[-n_val:]
        source = args.input or f"hf:{args.hf_name}"
        text = "".join(p[0] + p[1] for p in train + val) if args.tokenizer == "char" else None
        base = CharTokenizer.from_text(text) if text is not None else get_tokenizer(args.tokenizer)
    tok = Seq2SeqTokenizer(base)
    splits = {
        name: encode_pairs(pairs, tok, args.max_len, args.truncate)
        for name, pairs in (("train", train), ("val", val))
    }
    return write_parallel(args.out_dir, splits, tok, source, args.overwrite)


def load_hf_pairs(args):
    """A Hugging Face translation dataset (wmt14 de-en: train, validation = newstest2013)."""
    try:
        import datasets
    except ImportError:
        raise PrepareError("--task hf needs the `datasets` package: pip install -e '.[data]'") from None
    try:
        ds = datasets.load_dataset(args.hf_name, args.hf_config)
    except Exception as e:  # offline, unknown name: both mean "cannot get it"
        raise PrepareError(
            f"could not load Hugging Face dataset {args.hf_name!r}/{args.hf_config!r} "
            f"({type(e).__name__}); it needs the network, or prepare local files with "
            "--task tsv / --task files"
        ) from None
    out = []
    for split in ("train", "validation"):
        rows = ds[split]["translation"]
        out.append([(r[args.src_lang], r[args.tgt_lang], f"{split}:{i}") for i, r in enumerate(rows)])
    return out


def main(argv=None) -> dict:
    p = errors.parser(
        prog="flaxgpt prepare-seq2seq", description=__doc__.split("\n")[0]
    )  # one-line usage errors
    p.add_argument(
        "--task", required=True, choices=TASKS, help="reverse | numbers (synthetic), tsv, files, hf"
    )
    p.add_argument("--out_dir", required=True, help="where the token files and meta.json go")
    p.add_argument("--input", help="tsv: the source<TAB>target file; files: the source-side file")
    p.add_argument("--target", help="files: the target-side file, line-aligned with --input")
    p.add_argument("--tokenizer", choices=["char", "gpt2"], default="char", help="shared vocabulary")
    p.add_argument("--max_len", type=int, default=256, help="longest side in tokens, EOS/BOS included")
    p.add_argument(
        "--truncate", action="store_true", help="cut longer pairs (with a warning) instead of failing"
    )
    p.add_argument("--val_fraction", type=float, default=0.05, help="tsv/files: last share of pairs for val")
    p.add_argument("--n_train", type=int, default=50_000, help="synthetic: training pairs")
    p.add_argument("--n_val", type=int, default=1000, help="synthetic: held-out pairs (never in train)")
    p.add_argument("--max_chars", type=int, default=12, help="reverse: longest string")
    p.add_argument("--max_value", type=int, default=999_999, help="numbers: largest number")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf_name", default="wmt14")
    p.add_argument("--hf_config", default="de-en")
    p.add_argument("--src_lang", default="en")
    p.add_argument("--tgt_lang", default="de")
    p.add_argument("--overwrite", action="store_true", help="replace an existing prepared dataset")
    args = p.parse_args(argv)
    check_args(args)
    meta = prepare(args)
    print(
        f"wrote {args.out_dir}: {meta['train_pairs']:,} train and {meta['val_pairs']:,} val pairs, "
        f"vocab {meta['vocab_size']:,}, longest source {meta['max_src_len']} / target "
        f"{meta['max_tgt_len']} tokens"
    )
    return meta


def cli(argv=None) -> int:
    """`flaxgpt prepare-seq2seq`."""
    return errors.run_cli(main, argv, errors=(PrepareError,))


if __name__ == "__main__":
    sys.exit(cli())
