"""One training run per run directory: out_dir/train.lock, naming its holder (host and pid).

    with run_lock.hold(out_dir):      # trainer.train, before anything in out_dir is deleted or written
        ...                           # a second train.py on out_dir stops at once with RunLocked

The lock is an flock on out_dir/train.lock, whose text says who holds it: {"host", "pid", "start",
"since"}. The kernel drops an flock when its process dies (kill -9 included), so a file left by a dead
process is taken over; so is one naming a pid of this host that is gone (or was reused: "start" is
the process's start time), which covers file systems without flock. A file naming another host is
never taken over: the message says to delete it if that run is gone. The file is removed on release
(normal exit, exception, or SIGTERM, which the training loop turns into a normal exit).

Several processes (multi-host): only process 0 takes the lock, then tells the others whether it
got it (one small broadcast), so every process of a second job refuses. Process 0 is the one that
writes config.json and metrics.jsonl, and out_dir must be on a file system all hosts share anyway
(orbax writes every process's shards there), so one lock per run is enough; per-process locks would
only add files.

A Trainer built by hand (tests, notebooks) takes no lock: `train()` does.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
from pathlib import Path

LOCK_FILE = "train.lock"


class RunLocked(ValueError):
    """out_dir is held by another training run; the message is one line naming it."""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]  # field 22, counted after "pid (comm)"
    except (OSError, IndexError):
        return None


def _alive(holder: dict) -> bool:
    """Whether the holder, a process of this host, still runs."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    start = holder.get("start")
    return start is None or _start_time(pid) in (None, start)


def _describe(holder: dict) -> str:
    since = f", since {holder['since']}" if holder.get("since") else ""
    return f"pid {holder.get('pid')} on host {holder.get('host')}{since}"


class Lock:
    """A held lock; `release()` removes the file and drops the flock."""

    def __init__(self, path: Path, fd: int, created_dir: Path | None):
        self.path, self._fd, self._created_dir = path, fd, created_dir

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:  # still our file
                os.unlink(self.path)
        os.close(self._fd)  # drops the flock
        self._fd = None
        if self._created_dir is not None:  # a run refused before writing anything leaves no empty dir
            with contextlib.suppress(OSError):
                self._created_dir.rmdir()


def _read(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    try:
        holder = json.loads(os.read(fd, 4096).decode() or "{}")
    except (ValueError, UnicodeDecodeError):
        return {}
    return holder if isinstance(holder, dict) else {}


def acquire(out_dir) -> Lock:
    """Takes out_dir's lock, creating out_dir if needed; RunLocked (one line) when a live run holds it."""
    out_dir = Path(out_dir)
    created = None if out_dir.exists() else out_dir
    if out_dir.exists() and not out_dir.is_dir():  # (mkdir's own error said only "File exists")
        raise ValueError(
            f"out_dir {out_dir} is a file; point out_dir at a directory (a new one for a new run)"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / LOCK_FILE
    host, pid = socket.gethostname(), os.getpid()
    for _ in range(10):  # retried only when the file is replaced between open and flock
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                holder = _read(fd)
                os.close(fd)
                raise RunLocked(
                    f"{out_dir} is in use by another training run ({_describe(holder)}); wait for "
                    "it to finish or stop it, or pass another out_dir"
                ) from None
            # a file system without flock: the file's text alone decides
        try:
            if os.stat(path).st_ino != os.fstat(fd).st_ino:  # released and removed meanwhile: again
                os.close(fd)
                continue
        except FileNotFoundError:
            os.close(fd)
            continue
        holder = _read(fd)
        if holder.get("pid") not in (None, pid) or holder.get("host") not in (None, host):
            if holder.get("host") != host:
                os.close(fd)
                raise RunLocked(
                    f"{out_dir} is in use by another training run ({_describe(holder)}); if that "
                    f"run is gone, delete {path}"
                )
            if _alive(holder):
                os.close(fd)
                raise RunLocked(
                    f"{out_dir} is in use by another training run ({_describe(holder)}); wait for "
                    "it to finish or stop it, or pass another out_dir"
                )
        since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        me = {"host": host, "pid": pid, "start": _start_time(pid), "since": since}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, (json.dumps(me) + "\n").encode())
        os.fsync(fd)
        return Lock(path, fd, created)
    raise RunLocked(f"{path} keeps changing; is another training run starting on {out_dir}?")


@contextlib.contextmanager
def hold(out_dir):
    """acquire/release around a training run; with several processes only process 0 takes it."""
    import jax

    lock, refused = None, None
    if jax.process_index() == 0:
        try:
            lock = acquire(out_dir)
        except RunLocked as e:
            refused = e
    if jax.process_count() > 1:  # every process of a refused job stops, not only process 0
        import numpy as np
        from jax.experimental import multihost_utils

        if multihost_utils.broadcast_one_to_all(np.int32(refused is not None)) and refused is None:
            refused = RunLocked(f"{out_dir} is in use by another training run (process 0 names it)")
    if refused is not None:
        raise refused
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()
