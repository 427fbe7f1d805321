"""The files of a prepared dataset: reading the input text (UTF-8 checked, a file or a folder) and
writing token files atomically beside out_dir. Bad input is a PrepareError whose message says what is
wrong and how to fix it; `flaxgpt prepare` prints it as one line."""

from __future__ import annotations

import contextlib
import errno
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

TEXT_SUFFIXES = (".txt", ".md", ".text")


class PrepareError(Exception):
    """Bad input: the message says what is wrong and how to fix it."""


def jsonl_records(path: str | Path, error=PrepareError, what: str = "a .jsonl file") -> list[tuple]:
    """[(name, record)] of a jsonl file, blank lines skipped; name = "PATH line N" for the caller's errors.
    A missing file or a line that is not JSON is `error`, naming it (`what`: the lines expected)."""
    path = Path(path)
    if not path.is_file():
        raise error(f"--input {path} does not exist ({what})")
    out = []
    for n, line in enumerate(text_lines(read_utf8(path, error)), start=1):
        if not line.strip():
            continue
        name = f"{path} line {n}"
        try:
            out.append((name, json.loads(line)))
        except ValueError as e:
            raise error(f"{name} is not JSON ({e})") from None
    return out


def document_end(tokenizer, name: str) -> int:
    """The id each document ends with (end-of-text): a one-line PrepareError when there is none,
    rather than a None that numpy writes as id 0."""
    if getattr(tokenizer, "eot_id", None) is not None:
        return int(tokenizer.eot_id)
    if hasattr(tokenizer, "stoi"):  # a character vocabulary
        raise PrepareError(
            "a character vocabulary has no end-of-text token to end each document with; "
            "use --tokenizer gpt2 or a model directory"
        )
    raise PrepareError(
        f"--tokenizer {name} names no end-of-text token (eos_token in tokenizer_config.json or "
        "special_tokens_map.json, or eos_token_id in config.json); add one: each document ends with it"
    )


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def text_lines(text: str) -> list[str]:
    """`text`'s lines, split at "\\n" alone (a "\\r" before it dropped), as `wc -l` counts them:
    str.splitlines also splits at U+2028, U+2029, U+0085 and form feeds, which a JSON string or a
    sentence may hold (a line cut there would shift every pair after it, or not parse)."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def read_utf8(path: str | Path, error=PrepareError) -> str:
    """A file's text, a leading byte-order mark dropped; bytes that are not UTF-8 are an `error`
    naming the file, byte offset and line."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise error(f"cannot read {path}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise error(
            f"{path} is not UTF-8 text: byte {e.start} (line {line}) is 0x{data[e.start]:02x} ({e.reason}); "
            "convert it, e.g. iconv -f latin1 -t utf-8"
        ) from None


def read_text(path: str | Path) -> str:
    """A text file, or every text file under a folder (sorted, joined by blank lines)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise PrepareError(f"no {'/'.join(TEXT_SUFFIXES)} files under {path}")
        return "\n\n".join(read_utf8(p) for p in files)
    if not path.is_file():
        raise PrepareError(f"--input {path} does not exist")
    return read_utf8(path)


@contextlib.contextmanager
def writing(out_dir: Path):
    """A temporary folder beside out_dir for the files (renamed into place by the caller, meta.json
    last); removed whatever happens. A write that fails (a full disk) is a one-line PrepareError and
    leaves any existing dataset in out_dir as it was."""
    if out_dir.exists() and not out_dir.is_dir():
        raise PrepareError(f"--out_dir {out_dir} is a file; choose a directory (a new one, or a dataset's)")
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    except OSError as e:
        raise PrepareError(f"cannot write to {out_dir.parent}: {e.strerror or e}") from None
    try:
        yield tmp
    except OSError as e:
        why = "no space left on device" if e.errno == errno.ENOSPC else (e.strerror or str(e))
        if e.errno is None:  # numpy's tofile: "N requested and M written"
            why = f"a short write ({e}): is the disk full?"
        raise PrepareError(
            f"writing {out_dir} failed: {why}; nothing was changed there (free space and run again)"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_tokens(path: Path, ids, dtype) -> None:
    ids = np.asarray(ids)
    if ids.size and ids.max() >= np.iinfo(dtype).max + 1:
        raise PrepareError(f"token id {ids.max()} does not fit {np.dtype(dtype).name}")
    ids.astype(dtype).tofile(path)
