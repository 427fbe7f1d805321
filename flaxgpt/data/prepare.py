"""Text -> token files: train.bin, val.bin (uint16 when the vocabulary fits, else uint32) and meta.json.

    flaxgpt prepare --dataset shakespeare_char --out_dir data/shakespeare_char  # offline
    flaxgpt prepare --dataset shakespeare --tokenizer gpt2 --out_dir data/shakespeare
    flaxgpt prepare --dataset text --input my_corpus/ --tokenizer gpt2 --out_dir data/mine
    flaxgpt prepare --dataset hf --hf_name openwebtext --out_dir data/owt  # needs datasets
    flaxgpt prepare --dataset fineweb --out_dir data/fineweb10B --num_proc 8  # speedrun shards
    flaxgpt prepare --dataset chat --input convs.jsonl --hf_dir path/to/Llama-3.2-1B-Instruct \
        --block_size 2048 --out_dir data/chat      # packed chat SFT rows (see docs/chat.md)
    flaxgpt prepare --dataset pairs --input pairs.jsonl --hf_dir path/to/model \
        --block_size 1024 --out_dir data/dpo       # DPO preference pairs (see docs/dpo.md)
    flaxgpt prepare --dataset prompts --input prompts.jsonl --hf_dir path/to/model \
        --block_size 1024 --out_dir data/grpo      # GRPO prompts and reward fields (see docs/grpo.md)
    flaxgpt prepare --dataset text --input docs/ --pack --block_size 1024 \
        --tokenizer gpt2 --out_dir data/docs       # one segment per file, packed

Tiny Shakespeare ships with the package (flaxgpt/assets), so the shakespeare datasets need no network;
--download fetches karpathy/char-rnn's input.txt instead.

The split is deterministic: the first (1 - val_fraction) of the tokens train, the rest validate
(for Hugging Face datasets, whole documents are assigned to val by a seeded shuffle).
Files are written to a temporary folder and renamed into place, so a failed run never damages
an existing dataset, and an existing dataset is only replaced with --overwrite.

`--dataset fineweb` streams a Hugging Face dataset (default FineWeb's sample-10BT) into the
speedrun's token shards instead (flaxgpt.data.fineweb): 100M tokens each, val first, resumable by
running the same command again.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
import sys
import urllib.request
from pathlib import Path

import numpy as np

from flaxgpt import errors
from flaxgpt.data.dataset_files import (
    TEXT_SUFFIXES,
    PrepareError,
    document_end,
    read_text,
    read_utf8,
    token_dtype,
    write_tokens,
    writing,
)
from flaxgpt.data.tokenizers import CharTokenizer, from_meta, get_tokenizer

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
# the same file ships as package data, so the quickstart needs no network (--download fetches it instead)
SHAKESPEARE_ASSET = "assets/tinyshakespeare.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
HF_DATASETS = {  # short name -> (load_dataset path, config name)
    "openwebtext": ("openwebtext", None),
    "fineweb-edu": ("HuggingFaceFW/fineweb-edu", "sample-10BT"),
}


def shipped_shakespeare() -> str:
    """Tiny Shakespeare from the package's assets (1.1 MB), checked against its sha256."""
    data = importlib.resources.files("flaxgpt").joinpath(SHAKESPEARE_ASSET).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHAKESPEARE_SHA256:
        raise PrepareError(
            f"flaxgpt/{SHAKESPEARE_ASSET} is corrupt: sha256 {digest}, expected {SHAKESPEARE_SHA256}; "
            "reinstall flaxgpt, or pass --download (or --input FILE with a copy of input.txt)"
        )
    return data.decode("utf-8")


def download_shakespeare(timeout: float = 20.0) -> str:
    try:
        with urllib.request.urlopen(SHAKESPEARE_URL, timeout=timeout) as response:
            return response.read().decode("utf-8")
    except OSError as e:  # URLError, timeouts and DNS failures are all OSErrors
        raise PrepareError(
            f"could not download Tiny Shakespeare ({e}); offline? pass --input FILE "
            "with a local copy of tinyshakespeare/input.txt"
        ) from None


def encode_split(text: str, tokenizer, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    bos = [tokenizer.bos_id] if getattr(tokenizer, "add_bos", False) else []  # a Llama-family model's BOS
    try:
        ids = np.asarray(bos + tokenizer.encode(text), dtype=np.int64)
    except ValueError as e:  # a character vocabulary (a run's, --tokenizer RUN) without some of the text's
        raise PrepareError(
            f"the text does not encode with this tokenizer: {e}; remove those characters, or prepare with "
            "--tokenizer char to build a vocabulary from this text"
        ) from None
    n_train = int(len(ids) * (1.0 - val_fraction))  # nanoGPT's split point
    n_val = len(ids) - n_train
    if n_train < 2 or (val_fraction > 0 and n_val < 2):
        raise PrepareError(
            f"the text has only {len(ids)} tokens: too short to split with "
            f"val_fraction={val_fraction}; give more text"
        )
    return ids[:n_train], ids[n_train:]


def write_dataset(out_dir: str | Path, train_ids, val_ids, tokenizer, source: str, overwrite: bool) -> dict:
    """Write train.bin, val.bin and meta.json atomically (temp folder, then rename)."""
    out_dir = Path(out_dir)
    if (out_dir / "meta.json").exists() and not overwrite:
        raise PrepareError(f"{out_dir} already holds a prepared dataset; pass --overwrite to replace it")
    dtype = token_dtype(tokenizer.vocab_size)
    with writing(out_dir) as tmp:
        for name, ids in (("train", train_ids), ("val", val_ids)):
            write_tokens(tmp / f"{name}.bin", ids, dtype)
        meta = {
            "tokenizer": tokenizer.to_meta(),
            "vocab_size": tokenizer.vocab_size,
            "dtype": np.dtype(dtype).name,
            "train_tokens": int(len(train_ids)),
            "val_tokens": int(len(val_ids)),
            "source": source,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        out_dir.mkdir(exist_ok=True)
        for name in ("train.bin", "val.bin", "meta.json"):  # meta.json last: it marks completeness
            os.replace(tmp / name, out_dir / name)
    return meta


def make_tokenizer(name: str, text: str | None = None):
    if name == "char":
        if text is None:
            raise PrepareError("--tokenizer char needs the whole text; use --tokenizer gpt2 for --dataset hf")
        return CharTokenizer.from_text(text)
    if name == "gpt2":
        return get_tokenizer(name)
    meta = Path(name) / "meta.json"  # a prepared dataset's or a training run's: the model's tokenizer
    if meta.is_file():
        try:
            return from_meta(json.loads(meta.read_text())["tokenizer"])
        except (KeyError, TypeError, ValueError) as e:
            raise PrepareError(f"--tokenizer {name}: {meta} names no usable tokenizer ({e})") from None
    from flaxgpt.data.hf_tokenizer import HFTokenizer  # a model directory or its tokenizer.json

    try:
        return HFTokenizer(name)
    except (OSError, ImportError) as e:
        raise PrepareError(f"--tokenizer {name}: {e}; use char, gpt2 or a path to a tokenizer.json") from None
    except Exception as e:  # a file that is not JSON (a git-lfs pointer): tokenizers' or json's error
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PrepareError(
            f"--tokenizer {name}: its files cannot be read ({why}); a git-lfs pointer? fetch the real files"
        ) from None


def prepare_text(
    text: str, out_dir, tokenizer_name: str, val_fraction: float, source: str, overwrite: bool = False
) -> dict:
    tokenizer = make_tokenizer(tokenizer_name, text)
    train_ids, val_ids = encode_split(text, tokenizer, val_fraction)
    return write_dataset(out_dir, train_ids, val_ids, tokenizer, source, overwrite)


def prepare_hf(
    name: str,
    out_dir,
    tokenizer_name: str,
    val_fraction: float,
    overwrite: bool,
    num_proc: int,
    seed: int = 2357,
) -> dict:
    """A Hugging Face text dataset, tokenized in parallel (datasets.map shows a progress bar)."""
    out_dir = Path(out_dir)
    if (out_dir / "meta.json").exists() and not overwrite:
        raise PrepareError(f"{out_dir} already holds a prepared dataset; pass --overwrite to replace it")
    try:
        import datasets
    except ImportError:
        raise PrepareError("--dataset hf needs the `datasets` package: pip install -e '.[data]'") from None
    path, config = HF_DATASETS.get(name, (name, None))
    tokenizer = make_tokenizer(tokenizer_name)
    try:
        ds = datasets.load_dataset(path, config, split="train", num_proc=num_proc)
    except Exception as e:  # offline, unknown name, gated dataset: all mean "cannot get it"
        raise PrepareError(
            f"could not load Hugging Face dataset {path!r} ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); check the name and the network, "
            "or prepare local files with --dataset text --input PATH"
        ) from None
    if "text" not in ds.column_names:
        raise PrepareError(
            f"Hugging Face dataset {path!r} has no 'text' column (it has {', '.join(ds.column_names)}); "
            "--dataset hf tokenizes a 'text' column"
        )
    if len(ds) < 2:
        raise PrepareError(
            f"Hugging Face dataset {path!r} has {len(ds)} document(s); a train and a val split need 2"
        )
    split = ds.train_test_split(test_size=val_fraction, seed=seed, shuffle=True)
    eot = document_end(tokenizer, tokenizer_name)
    bos = [tokenizer.bos_id] if getattr(tokenizer, "add_bos", False) else []  # a Llama-family model's BOS

    def tokenize(batch):  # each document ends with <|endoftext|> (EOS), as GPT-2 was trained
        ids = [bos + x for x in tokenizer.encode_batch(batch["text"], num_threads=1)]
        return {"ids": [x + [eot] for x in ids], "len": [len(x) + 1 for x in ids]}

    splits = {}
    for key, part in (("train", split["train"]), ("val", split["test"])):
        tok = part.map(
            tokenize,
            batched=True,
            remove_columns=part.column_names,
            num_proc=num_proc,
            desc=f"tokenizing {key}",
        )
        splits[key] = tok
    return _write_hf(out_dir, splits, tokenizer, f"hf:{path}", overwrite)


def _write_hf(out_dir: Path, splits, tokenizer, source: str, overwrite: bool) -> dict:
    """Stream tokenized shards into the .bin files (they may be far larger than memory)."""
    dtype = token_dtype(tokenizer.vocab_size)
    counts = {}
    with writing(out_dir) as tmp:
        for key, tok in splits.items():
            total = int(np.sum(tok["len"], dtype=np.int64))
            arr = np.memmap(tmp / f"{key}.bin", dtype=dtype, mode="w+", shape=(total,))
            n_shards, pos = max(1, min(1024, len(tok) // 1000)), 0
            for i in range(n_shards):
                shard = tok.shard(num_shards=n_shards, index=i, contiguous=True).with_format("numpy")
                ids = np.concatenate(shard["ids"]) if len(shard) else np.zeros(0, dtype)
                arr[pos : pos + len(ids)] = ids
                pos += len(ids)
            arr.flush()
            counts[key] = total
        meta = {
            "tokenizer": tokenizer.to_meta(),
            "vocab_size": tokenizer.vocab_size,
            "dtype": np.dtype(dtype).name,
            "train_tokens": counts["train"],
            "val_tokens": counts["val"],
            "source": source,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        out_dir.mkdir(exist_ok=True)
        for name in ("train.bin", "val.bin", "meta.json"):
            os.replace(tmp / name, out_dir / name)
    return meta


def _sequences(args, T: int):
    """--dataset chat | text --pack: (tokenizer, {split: packed rows}, {split_examples: n}, cut)."""
    from flaxgpt.data import chat, packing

    sequences = []  # (name, ids, mask): mask 1 on the tokens to predict
    if args.dataset == "chat":
        if not args.input or not args.hf_dir:
            raise PrepareError(
                "--dataset chat needs --input CONVS.jsonl and --hf_dir MODEL_DIR (its chat template)"
            )
        tokenizer = make_tokenizer(args.hf_dir)
        try:
            chat.template_of(tokenizer)
            for name, messages, tools in chat.read_conversations(args.input):
                sequences.append((name, *chat.assistant_mask(tokenizer, messages, name, tools)))
        except chat.ChatError as e:
            raise PrepareError(str(e)) from None
    else:
        if not args.input:
            raise PrepareError("--dataset text --pack needs --input FILE_OR_FOLDER")
        path = Path(args.input)
        files = [path]
        if path.is_dir():  # read_text's files
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        tokenizer = make_tokenizer(args.tokenizer or "gpt2", read_text(path))
        bos = [tokenizer.bos_id] if getattr(tokenizer, "add_bos", False) else []
        eot = document_end(tokenizer, args.tokenizer or "gpt2")
        for f in files:  # a document longer than a row is cut into rows' worth
            ids = bos + tokenizer.encode(read_utf8(f)) + [eot]
            sequences += [(str(f), ids[i : i + T + 1], None) for i in range(0, max(1, len(ids) - 1), T)]
    examples, cut = [], 0
    for name, ids, mask in sequences:
        if len(ids) > T + 1:
            if not args.truncate:
                raise PrepareError(
                    f"{name}: the conversation has {len(ids)} tokens, more than --block_size + 1 = {T + 1}; "
                    "pass --truncate to cut it, or a larger --block_size"
                )
            ids, mask, cut = ids[: T + 1], mask[: T + 1], cut + 1
        ex = packing.example(ids, mask)
        if ex[2].any():  # a conversation cut before its first assistant token has nothing to train
            examples.append(ex)
    n_val = max(1, round(len(examples) * args.val_fraction))
    if len(examples) - n_val < 1:
        raise PrepareError(
            f"{len(examples)} usable examples: too few to split with val_fraction={args.val_fraction}"
        )
    splits = {"train": examples[:-n_val], "val": examples[-n_val:]}
    pad = tokenizer.eot_id if tokenizer.eot_id is not None else 0
    rows = {name: packing.pack(exs, T, pad_id=pad) for name, exs in splits.items()}
    return tokenizer, rows, {f"{k}_examples": len(v) for k, v in splits.items()}, cut


def prepare_packed(args) -> dict:
    """--dataset chat (conversations, assistant tokens trained), text --pack (documents, every token
    trained) or pairs (DPO's preference pairs, flaxgpt.data.preference) -> packed rows
    (flaxgpt.data.packing). The last val_fraction of the examples validate."""
    from flaxgpt.data import packing

    out_dir, T = Path(args.out_dir), args.block_size
    if T < 2:
        raise PrepareError(f"--block_size must be >= 2, got {T}; packing needs the model's block_size")
    if (out_dir / "meta.json").exists() and not args.overwrite:
        raise PrepareError(f"{out_dir} already holds a prepared dataset; pass --overwrite to replace it")
    kind, cut = "packed", 0
    if args.dataset == "pairs":  # DPO: a pair's chosen and rejected side by side in a row
        from flaxgpt.data import preference

        if not args.input or not args.hf_dir:
            raise PrepareError("--dataset pairs needs --input PAIRS.jsonl and --hf_dir MODEL_DIR")
        kind, tokenizer = "pairs", make_tokenizer(args.hf_dir)
        rows, counts = preference.prepare_pairs(args, tokenizer)
    else:
        tokenizer, rows, counts, cut = _sequences(args, T)
    dtype = token_dtype(tokenizer.vocab_size)
    with writing(out_dir) as tmp:
        meta = {"kind": kind, "tokenizer": tokenizer.to_meta(), "vocab_size": tokenizer.vocab_size}
        meta.update(dtype=np.dtype(dtype).name, block_size=T, source=str(args.input), truncated=cut)
        for split, arrays in rows.items():
            for field, a in arrays.items():
                np.save(
                    tmp / f"{split}.{field}.npy",
                    a.astype(dtype if field in ("inputs", "targets") else a.dtype),
                )
            meta[f"{split}_rows"] = len(arrays["inputs"])
            meta[f"{split}_examples"] = counts[f"{split}_examples"]
            meta[f"{split}_padding"] = round(packing.padding_fraction(arrays["segment_ids"]), 4)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        out_dir.mkdir(exist_ok=True)
        for split in rows:
            for field in packing.FIELDS:
                os.replace(tmp / f"{split}.{field}.npy", out_dir / f"{split}.{field}.npy")
        os.replace(tmp / "meta.json", out_dir / "meta.json")  # last: it marks completeness
    print(
        f"wrote {out_dir}: {meta['train_examples']} train examples in {meta['train_rows']} rows of {T} "
        f"({meta['train_padding']:.1%} padding), {meta['val_examples']} val in {meta['val_rows']}"
        + (f"; {cut} cut to {T + 1} tokens" if cut else "")
    )
    return meta


def main(argv=None) -> dict:
    p = errors.parser(prog="flaxgpt prepare", description=__doc__.split("\n")[0])  # one-line usage errors
    p.add_argument(
        "--dataset",
        required=True,
        choices=["shakespeare_char", "shakespeare", "text", "hf", "fineweb", "chat", "pairs", "prompts"],
        help="shakespeare_char (char tokens), shakespeare (default gpt2 BPE), text, hf, "
        "fineweb (speedrun token shards), chat (OpenAI-style jsonl conversations, packed), "
        "pairs (DPO: jsonl of prompt, chosen, rejected), prompts (GRPO: jsonl of prompt and reward fields)",
    )
    p.add_argument(
        "--hf_dir", help="chat, pairs, prompts: the model directory (tokenizer.json, chat template)"
    )
    p.add_argument(
        "--block_size",
        type=int,
        default=0,
        help="chat, pairs / --pack: the row length (the model's); prompts: refuse longer prompts",
    )
    p.add_argument("--pack", action="store_true", help="--dataset text: one segment per file, packed rows")
    p.add_argument("--truncate", action="store_true", help="chat: cut a conversation longer than a row")
    p.add_argument("--input", help="a text file or a folder of text files (shakespeare*: a local copy)")
    p.add_argument("--out_dir", required=True, help="where train.bin, val.bin and meta.json go")
    p.add_argument(
        "--tokenizer",
        help="char | gpt2 | PATH (a model directory or tokenizer.json: the model's own tokenizer; a training "
        "run or a prepared dataset: its meta.json's); default: char for shakespeare_char, else gpt2",
    )
    p.add_argument("--val_fraction", type=float, default=0.1, help="share of tokens for validation")
    p.add_argument(
        "--hf_name",
        default=None,
        help=f"--dataset hf: {', '.join(HF_DATASETS)} (default openwebtext) or any Hugging Face dataset "
        "with a 'text' column; --dataset fineweb: default HuggingFaceFW/fineweb, also a local "
        "save_to_disk folder or 'json' with --hf_data_files",
    )
    p.add_argument("--hf_config", default=None, help="--dataset fineweb: the dataset's config (sample-10BT)")
    p.add_argument("--hf_data_files", default=None, help="--dataset fineweb: data files (e.g. with json)")
    p.add_argument(
        "--shard_tokens", type=int, default=100_000_000, help="--dataset fineweb: tokens per shard"
    )
    p.add_argument(
        "--max_shards", type=int, default=0, help="--dataset fineweb: stop after N shards (0 = all)"
    )
    p.add_argument(
        "--num_proc",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="tokenizer processes for --dataset hf",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing prepared dataset")
    p.add_argument(
        "--download",
        action="store_true",
        help="shakespeare*: fetch input.txt from karpathy/char-rnn instead of the copy shipped with flaxgpt",
    )
    args = p.parse_args(argv)
    if not 0.0 < args.val_fraction < 1.0:  # (0 too: training evaluates on val.bin)
        raise PrepareError(
            f"--val_fraction must be in (0, 1), got {args.val_fraction}; training needs a val split "
            "(the default 0.1 holds out the last 10% of the tokens)"
        )
    if args.num_proc < 1:
        raise PrepareError(f"--num_proc must be >= 1, got {args.num_proc}")
    if args.hf_dir and args.dataset not in ("chat", "pairs", "prompts"):  # it was ignored: GPT-2 ids
        raise PrepareError(
            f"--hf_dir is read by --dataset chat, pairs and prompts; --dataset {args.dataset} takes the "
            f"model's tokenizer as --tokenizer {args.hf_dir}"
        )
    if args.pack and args.dataset != "text":
        what = "packed already" if args.dataset in ("chat", "pairs") else "one token stream"
        raise PrepareError(f"--pack packs --dataset text's documents; --dataset {args.dataset} is {what}")
    tok = args.tokenizer or ("char" if args.dataset == "shakespeare_char" else "gpt2")
    if args.dataset == "prompts":  # GRPO: prompts to sample from, fields the rewards read
        from flaxgpt.data import prompts

        return prompts.prepare_prompts(args, make_tokenizer)
    if args.dataset in ("chat", "pairs") or (args.dataset == "text" and args.pack):
        return prepare_packed(args)
    if args.dataset == "fineweb":
        from flaxgpt.data import fineweb

        name, config = (args.hf_name, args.hf_config) if args.hf_name else fineweb.FINEWEB
        try:
            done = fineweb.prepare_fineweb(
                args.out_dir,
                name,
                config,
                data_files=args.hf_data_files,
                shard_tokens=args.shard_tokens,
                num_proc=args.num_proc,
                max_shards=args.max_shards,
            )
        except fineweb.ShardError as e:
            raise PrepareError(str(e)) from None
        print(f"{args.out_dir}: {done['shards']} shards, {done['tokens']:,} tokens")
        return done
    if args.dataset == "hf":
        name = args.hf_name or "openwebtext"
        meta = prepare_hf(name, args.out_dir, tok, args.val_fraction, args.overwrite, args.num_proc)
    else:
        if args.dataset == "text" and not args.input:
            raise PrepareError("--dataset text needs --input FILE_OR_FOLDER")
        if (Path(args.out_dir) / "meta.json").exists() and not args.overwrite:  # before any download
            raise PrepareError(
                f"{args.out_dir} already holds a prepared dataset; pass --overwrite to replace it"
            )
        if args.input:
            text, source = read_text(args.input), str(args.input)
        elif args.download:
            text, source = download_shakespeare(), SHAKESPEARE_URL
        else:
            text, source = shipped_shakespeare(), f"flaxgpt/{SHAKESPEARE_ASSET} ({SHAKESPEARE_URL})"
        meta = prepare_text(text, args.out_dir, tok, args.val_fraction, source, args.overwrite)
    print(
        f"wrote {args.out_dir}: {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens, "
        f"vocab {meta['vocab_size']:,} ({meta['dtype']})"
    )
    return meta


def cli(argv=None) -> int:
    """`flaxgpt prepare`."""
    return errors.run_cli(main, argv, errors=(PrepareError,))


if __name__ == "__main__":
    sys.exit(cli())
