"""flaxgpt.data.prepare on generated text: files, dtype, split, refusal to overwrite, offline error."""

import json
import urllib.request

import numpy as np
import pytest

from flaxgpt.data import prepare
from flaxgpt.data.tokenizers import from_meta

TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(200))


def _write(tmp_path, text=TEXT, name="input.txt"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_char_dataset_roundtrip(tmp_path):
    src = _write(tmp_path)
    meta = prepare.main(
        ["--dataset", "shakespeare_char", "--input", str(src), "--out_dir", str(tmp_path / "d")]
    )
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == len(set(TEXT))
    train = np.fromfile(tmp_path / "d/train.bin", dtype=np.uint16)
    val = np.fromfile(tmp_path / "d/val.bin", dtype=np.uint16)
    assert len(train) == int(len(TEXT) * 0.9) and len(train) + len(val) == len(TEXT)
    saved = json.loads((tmp_path / "d/meta.json").read_text())
    tok = from_meta(saved["tokenizer"])
    assert tok.decode(np.concatenate([train, val])) == TEXT  # split is a cut, nothing lost or shuffled
    assert saved["train_tokens"] == len(train) and saved["val_tokens"] == len(val)


def test_text_outside_a_prepared_vocabulary_is_one_line(tmp_path):
    """--tokenizer DIR (a run's or a dataset's character vocabulary, as docs/checkpoints.md prepares
    new text for a run) on text with characters it lacks: a PrepareError naming them, not a traceback."""
    src = _write(tmp_path)
    prepare.main(
        ["--dataset", "text", "--input", str(src), "--tokenizer", "char", "--out_dir", str(tmp_path / "d")]
    )
    other = tmp_path / "other.txt"
    other.write_text(TEXT + " £ ~\n")
    with pytest.raises(
        prepare.PrepareError, match="does not encode with this tokenizer: characters not in the"
    ):
        prepare.main(["--dataset", "text", "--input", str(other), "--tokenizer", str(tmp_path / "d"),
                      "--out_dir", str(tmp_path / "e")])  # fmt: skip
    assert not (tmp_path / "e").exists()
    (tmp_path / "f").write_text("notes")
    with pytest.raises(prepare.PrepareError, match="--out_dir .*f is a file; choose a directory"):
        prepare.main(["--dataset", "text", "--input", str(src), "--out_dir", str(tmp_path / "f")])
    assert (tmp_path / "f").read_text() == "notes"


def test_gpt2_tokens_from_a_folder(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text(TEXT[:3000])
    (folder / "b.md").write_text(TEXT[3000:6000])
    (folder / "skip.bin").write_bytes(b"\x00\x01")
    meta = prepare.main(
        [
            "--dataset",
            "text",
            "--input",
            str(folder),
            "--tokenizer",
            "gpt2",
            "--out_dir",
            str(tmp_path / "d"),
            "--val_fraction",
            "0.2",
        ]
    )
    assert meta["vocab_size"] == 50257 and meta["dtype"] == "uint16"
    ids = np.concatenate([np.fromfile(tmp_path / f"d/{s}.bin", dtype=np.uint16) for s in ("train", "val")])
    assert from_meta(meta["tokenizer"]).decode(ids) == TEXT[:3000] + "\n\n" + TEXT[3000:6000]


def test_wide_vocab_uses_uint32():
    assert prepare.token_dtype(65) == np.uint16 and prepare.token_dtype(70000) == np.uint32


def test_refuses_to_overwrite_and_keeps_old_files(tmp_path):
    src = _write(tmp_path)
    out = tmp_path / "d"
    prepare.main(["--dataset", "text", "--tokenizer", "char", "--input", str(src), "--out_dir", str(out)])
    before = (out / "train.bin").read_bytes()
    other = _write(tmp_path, "abc" * 500, "other.txt")
    with pytest.raises(prepare.PrepareError, match="--overwrite"):
        prepare.main(
            ["--dataset", "text", "--tokenizer", "char", "--input", str(other), "--out_dir", str(out)]
        )
    assert (out / "train.bin").read_bytes() == before
    # a failure half way (text too short) leaves the old dataset whole, even with --overwrite
    tiny = _write(tmp_path, "ab", "tiny.txt")
    with pytest.raises(prepare.PrepareError, match="too short"):
        prepare.main(
            [
                "--dataset",
                "text",
                "--tokenizer",
                "char",
                "--input",
                str(tiny),
                "--out_dir",
                str(out),
                "--overwrite",
            ]
        )
    assert (out / "train.bin").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp left
    prepare.main(
        [
            "--dataset",
            "text",
            "--tokenizer",
            "char",
            "--input",
            str(other),
            "--out_dir",
            str(out),
            "--overwrite",
        ]
    )
    assert (out / "train.bin").read_bytes() != before


def _offline(monkeypatch):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(urllib.request, "urlopen", offline)


def test_shakespeare_char_offline_uses_the_shipped_copy(tmp_path, monkeypatch):
    _offline(monkeypatch)  # the quickstart's prepare step must not touch the network
    meta = prepare.main(["--dataset", "shakespeare_char", "--out_dir", str(tmp_path / "d")])
    # nanoGPT's figures for this file: 65 characters, 1,003,854 train and 111,540 val tokens
    assert (meta["vocab_size"], meta["train_tokens"], meta["val_tokens"]) == (65, 1_003_854, 111_540)
    text = from_meta(meta["tokenizer"]).decode(np.fromfile(tmp_path / "d/train.bin", dtype=np.uint16)[:14])
    assert text == "First Citizen:"
    assert "tinyshakespeare.txt" in meta["source"]


def test_shipped_copy_is_checked(monkeypatch):
    monkeypatch.setattr(prepare, "SHAKESPEARE_SHA256", "0" * 64)
    with pytest.raises(prepare.PrepareError, match="corrupt.*--download"):
        prepare.shipped_shakespeare()


def test_offline_download_says_use_input(tmp_path, monkeypatch):
    _offline(monkeypatch)
    with pytest.raises(prepare.PrepareError, match="--input FILE") as e:
        prepare.main(["--dataset", "shakespeare_char", "--download", "--out_dir", str(tmp_path / "d")])
    assert "\n" not in str(e.value)
    assert not (tmp_path / "d").exists()


def test_missing_input_and_hf_without_network(tmp_path):
    with pytest.raises(prepare.PrepareError, match="does not exist"):
        prepare.main(
            ["--dataset", "text", "--input", str(tmp_path / "nope.txt"), "--out_dir", str(tmp_path / "d")]
        )
    with pytest.raises(prepare.PrepareError, match="datasets|could not load"):
        prepare.prepare_hf("definitely/not-a-dataset-xyz", tmp_path / "h", "gpt2", 0.1, False, 1)


def test_non_utf8_input_names_the_file_and_byte(tmp_path):
    src = tmp_path / "latin1.txt"
    src.write_bytes("first line\ncaf\u00e9 au lait\n".encode("latin-1"))
    with pytest.raises(prepare.PrepareError) as e:
        prepare.main(
            [
                "--dataset",
                "text",
                "--input",
                str(src),
                "--tokenizer",
                "char",
                "--out_dir",
                str(tmp_path / "d"),
            ]
        )
    assert f"{src} is not UTF-8 text: byte 14 (line 2) is 0xe9" in str(e.value)
    assert "\n" not in str(e.value) and not (tmp_path / "d").exists()


def test_val_fraction_zero_is_refused_up_front(tmp_path):
    src = _write(tmp_path)
    for bad in ("0", "1", "-0.1", "nan"):
        with pytest.raises(prepare.PrepareError, match="--val_fraction must be in"):
            prepare.main(
                [
                    "--dataset",
                    "text",
                    "--input",
                    str(src),
                    "--val_fraction",
                    bad,
                    "--out_dir",
                    str(tmp_path / "d"),
                ]
            )
    assert not (tmp_path / "d").exists()


def run_with_file_limit(args, cwd, max_bytes):
    """A subprocess whose writes past `max_bytes` per file fail (EFBIG), as on a disk that fills up
    (set in the child by a small trampoline: no fork of this threaded process)."""
    import os
    import subprocess
    import sys

    limited = (
        "import os, resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), "
        "resource.RLIM_INFINITY)); os.execv(sys.executable, [sys.executable, *sys.argv[2:]])"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-c", limited, str(max_bytes), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_failed_write_is_one_line_and_keeps_the_old_dataset(tmp_path):
    out = tmp_path / "d"
    prepare.main(
        ["--dataset", "text", "--tokenizer", "char", "--input", str(_write(tmp_path)), "--out_dir", str(out)]
    )
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    big = _write(tmp_path, TEXT * 4, "big.txt")
    r = run_with_file_limit(
        ["-m", "flaxgpt.data.prepare", "--dataset", "text", "--tokenizer", "char", "--input", str(big)]
        + ["--out_dir", str(out), "--overwrite"],
        tmp_path,
        max_bytes=8192,
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith(f"error: writing {out} failed: ") and "nothing was changed there" in lines[0]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp folder left
