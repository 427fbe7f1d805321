"""No file of the repository names a place on one machine: a path under a home or work folder (/work,
/home, /Users, /root), a scratch or mount point (/tmp, /mnt, /scratch, /data) or a Windows user folder.
Commands and defaults say out/..., data/..., ../other_checkout, $HOME or tempfile.gettempdir() instead.
System paths any Linux has (/proc, /usr, /etc, /dev) are not one machine's."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MACHINE_PATH = re.compile(
    r"(?<![\w.~$/-])/(?:work|home|Users|root|tmp|mnt|scratch|data|nfs|gpfs|lustre)/[\w.-]"
    r"|\b[A-Z]:\\(?:Users|Documents and Settings)\\",
)
# A path that is a fact about another program, not a place on a machine of ours.
ALLOWED = {"/tmp/libtpu_lockfile"}  # libtpu's own lock file (docs/aot.md, aot/targets.py: why it is bypassed)
# .gitignore's leading slash anchors a pattern at the repository root (/data/, /out/): not an absolute path.
SKIPPED_FILES = {".gitignore"}


def tracked_files() -> list[Path]:
    r = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        pytest.skip("not a git checkout")
    return [ROOT / name for name in r.stdout.split("\0") if name and Path(name).name not in SKIPPED_FILES]


def machine_paths(text: str) -> list[str]:
    return [word for _, word in where(text)]


def where(text: str) -> list[tuple[int, str]]:
    """(offset, path) of each machine path in `text`."""
    found = []
    for m in MACHINE_PATH.finditer(text):
        word = re.match(r"[^\s'\"`)\],;:]+", text[m.start() :]).group(0)
        if word in ALLOWED or re.search(r"\$\w+'$", text[max(0, m.start() - 40) : m.start()]):
            continue  # gs://'$BUCKET'/data/...: a URL with a shell variable spliced in
        found.append((m.start(), word))
    return found


def test_the_pattern():
    home, work = "/" + "home/ada/run", "/" + "work/venv/bin/python"  # split: this file is scanned too
    assert machine_paths(f"python {work} --out {home}") == [work, home]
    assert machine_paths("--against " + "/" + "tmp/old") and machine_paths("cd C:" + "\\Users\\ada")
    assert machine_paths("out = Path('" + "/" + "mnt/ckpt')") == ["/" + "mnt/ckpt"]
    for fine in ("/proc/self/status", "/usr/bin/time", "~/.cache/flaxgpt", "$HOME/x", "data/x/meta.json"):
        assert machine_paths(fine) == [], fine
    assert machine_paths("gs://bucket/data/openwebtext, https://host/home/page, ../old, out/run") == []
    assert machine_paths("gcloud storage cp -r gs://'$BUCKET'/data/openwebtext flaxgpt/data/") == []
    assert machine_paths("libtpu takes " + "/" + "tmp/libtpu_lockfile") == []


def test_no_file_names_a_machine_path():
    found = []
    for path in tracked_files():
        if not path.is_file():  # deleted in the working tree, not yet committed
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue  # binary
        text = data.decode("utf-8", errors="replace")
        for offset, word in where(text):
            line = text[:offset].count("\n") + 1
            found.append(f"{path.relative_to(ROOT)}:{line}: {word}")
    assert not found, "absolute machine paths (use out/, data/, ../x, $HOME or tempfile):\n" + "\n".join(
        found
    )
