"""serve.py in a process of its own, for the serving benchmarks: started on a free port, ready when
/health answers 200, terminated on the way out.

    with serve_process.running(["--init_from", "gpt2", "--random_init", "--slots", "8"]) as (url, proc):
        httpx.post(f"{url}/v1/completions", json={...})

Its stderr (the access log: a line per request) goes to a temporary file, not a pipe nobody reads
(a full pipe would stall the server); a server that exits before it is ready is an error carrying the
end of that file.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(args, *, env: dict | None = None, poll_s: float = 0.5, timeout_s: float = 1800, root=ROOT):
    """serve.py `args` (no --port: a free one is added) -> yields (url, process) once /health is 200.
    `env`: extra environment variables (PYTHONPATH is `root`, this checkout by default, so the server
    runs that checkout's flaxgpt: another commit's worktree for old-vs-new comparisons)."""
    import httpx

    port = free_port()
    cmd = [sys.executable, str(Path(root) / "serve.py"), *args, "--port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(root), **(env or {})}
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.perf_counter() + timeout_s
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"serve.py exited {proc.returncode}: {log.read()[-2000:]}")
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"serve.py did not answer {url}/health within {timeout_s:.0f} s")
                time.sleep(poll_s)
            yield url, proc
        finally:
            proc.terminate()
            proc.wait(timeout=120)
