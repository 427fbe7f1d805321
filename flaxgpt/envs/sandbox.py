"""Running untrusted Python from a tool call: a fresh interpreter per call in a subprocess, with limits a
hostile program cannot lift and a result that is always an observation, never an exception.

    result = run_python("print(2 ** 10)", Limits(cpu_s=2, wall_s=5, memory_mb=512))
    result.stdout, result.stderr, result.exit_code, result.reason   # "1024\\n", "", 0, None

Layers, each stopping what the one before may miss:
- resource limits set in the child before the code runs (RLIMIT_CPU: an infinite loop; RLIMIT_AS: a
  10 GB allocation is a MemoryError; RLIMIT_FSIZE: output and each file capped; RLIMIT_NPROC 1: no
  process of its own, by whatever call; no core files), and a wall-clock limit after which the parent
  kills the child's whole process group (a program that sleeps or blocks uses no CPU time);
- an audit hook (sys.addaudithook: it cannot be removed) refusing new processes (fork, exec, spawn,
  subprocess, os.system), signals to other processes, sockets, ctypes, the garbage collector's object
  walks, any write, rename, link or removal outside the temporary directory, any handle on a directory
  outside it and any change of directory (the audit events of a `dir_fd=` call name a relative path,
  which the checks place from the working directory: a handle elsewhere, or another working directory,
  wrote outside); os.mkfifo and os.mknod, which raise no event, are removed;
- where the parent runs as root, the child drops to user `nobody` (the directory is made its own) and,
  where the kernel allows, enters a new network namespace: the file system's permissions and an empty
  network stand behind the hook.
The interpreter runs isolated (-I -S: no site-packages, no user site, no PYTHON* variables), with an
empty environment, in the temporary directory, removed afterwards. stdout and stderr go to files there
(a pipe cannot be capped without reading it) and come back cut to `output_chars` (head and tail).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile

NOBODY = 65534  # the uid / gid of `nobody` on Linux distributions


@dataclasses.dataclass(frozen=True)
class Limits:
    cpu_s: int = 5  # CPU seconds (RLIMIT_CPU): then SIGXCPU
    wall_s: float = 10.0  # wall-clock seconds: then the process group is killed
    memory_mb: int = 1024  # address space (RLIMIT_AS): beyond it allocations fail with MemoryError
    file_mb: int = 4  # largest file, stdout and stderr included (RLIMIT_FSIZE)
    output_chars: int = 4000  # of stdout and of stderr given back (the rest cut, said so)


@dataclasses.dataclass(frozen=True)
class Result:
    stdout: str
    stderr: str
    exit_code: int | None  # None: killed
    reason: str | None = None  # why it stopped early: "wall-clock limit", "CPU limit", "file size limit"

    def observation(self) -> str:
        """What a model sees: the output, and how it ended when it did not end well."""
        parts = [self.stdout.rstrip("\n")] if self.stdout.strip() else []
        if self.stderr.strip():
            parts.append(self.stderr.rstrip("\n"))
        if self.reason:
            parts.append(f"[stopped: {self.reason}]")
        elif self.exit_code:
            parts.append(f"[exit code {self.exit_code}]")
        return "\n".join(parts) if parts else "[no output]"


# The child's first code: trusted, it runs before the tool's and leaves a hook behind it. Names the hook
# needs are bound as default arguments (a frame reached from an exception's traceback sees no function
# object, so no __defaults__); paths are normalized with str methods only, which a program cannot patch.
_BOOT = r"""
import os, resource, sys
root, cpu_s, memory_mb, file_mb = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
source = sys.stdin.read()
# what tools usually need, imported while the interpreter's files are surely readable (a Python under
# /root is not, once the child is nobody); the tool may import any other module nobody can read
import bisect, collections, datetime, decimal, fractions, functools, heapq, itertools, json, math, random
import re, statistics, string, time, traceback
for limit, value in ((resource.RLIMIT_AS, memory_mb << 20), (resource.RLIMIT_FSIZE, file_mb << 20),
                     (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))  # SIGXCPU at the soft limit, SIGKILL a second on
if os.geteuid() == 0:
    try:
        os.unshare(os.CLONE_NEWNET)  # Python >= 3.12; an empty network namespace
    except (AttributeError, OSError):
        try:
            import ctypes
            ctypes.CDLL(None, use_errno=True).unshare(0x40000000)  # CLONE_NEWNET
        except Exception:
            pass
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
# no new process at all, whoever runs it (root alone is exempt, and it is nobody by now): fork_exec of
# _posixsubprocess, reached past the import check through importlib's internals, raises no audit event
resource.setrlimit(resource.RLIMIT_NPROC, (1, 1))
os.chdir(root)
for name in ("mkfifo", "mknod"):  # files made without an audit event, anywhere the user may write
    for module in (os, sys.modules["posix"]):
        if hasattr(module, name):
            delattr(module, name)

WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
DENY = frozenset(("os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                  "subprocess.Popen", "os.killpg", "signal.pthread_kill", "socket.__new__",
                  "socket.connect", "socket.bind", "socket.getaddrinfo", "ctypes.dlopen", "ctypes.dlsym",
                  "ctypes.cdata", "gc.get_objects", "gc.get_referrers", "gc.get_referents", "os.symlink",
                  "os.link", "os.chown", "os.setxattr", "os.removexattr", "os.chdir"))
PATHS = frozenset(("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.truncate",
                   "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.copymode", "shutil.copystat",
                   "shutil.copytree", "shutil.move", "shutil.make_archive"))
MODULES = frozenset(("ctypes", "_ctypes", "_posixsubprocess", "subprocess", "multiprocessing", "socket",
                     "_socket", "pty"))

def hook(event, args, _root=root + "/", _cwd=os.getcwd, _deny=DENY, _paths=PATHS, _modules=MODULES,
         _write=WRITE, _pid=os.getpid(), _str=str, _bytes=bytes, _int=int, _err=PermissionError,
         _isdir=os.path.isdir):
    def inside(path):
        if type(path) is _bytes:
            path = path.decode("utf-8", "replace")
        if type(path) is _int:  # an open file descriptor
            return True
        path = _str(path)
        if not path.startswith("/"):
            path = _cwd() + "/" + path
        parts = []
        for part in path.split("/"):
            if part == "..":
                parts = parts[:-1]
            elif part and part != ".":
                parts.append(part)
        path = "/" + "/".join(parts) + "/"
        return path.startswith(_root) or path == "/dev/null/"

    if event in _deny:
        raise _err(f"the sandbox does not allow {event}")
    if event == "import" and args[0].partition(".")[0] in _modules:
        raise _err(f"the sandbox does not allow importing {args[0]}")
    if event == "os.kill" and args[0] != _pid:
        raise _err("the sandbox does not allow signals to other processes")
    if event == "open":
        path, mode, flags = args
        writes = (mode is not None and any(c in mode for c in "wax+")) or (
            mode is None and flags is not None and flags & _write)
        if writes and not inside(path):
            raise _err(f"the sandbox writes only inside its directory, not to {path}")
        # no handle on a directory outside: the events of os.open(name, dir_fd=) and os.remove(name,
        # dir_fd=) carry a relative name the checks would place inside, written through that handle
        if type(path) is not _int and not inside(path) and _isdir(path):
            raise _err(f"the sandbox opens no directory outside its own, not {path}")
    elif event in _paths:
        for path in args[:2]:
            if isinstance(path, (str, bytes)) and not inside(path):
                raise _err(f"the sandbox changes only files inside its directory, not {path}")

for name in [m for m in sys.modules if m.partition(".")[0] in MODULES]:  # ctypes, after the unshare:
    del sys.modules[name]  # a module already imported is not imported again, and raises no event
sys.addaudithook(hook)
del hook, os, resource, root, cpu_s, memory_mb, file_mb
scope = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    exec(compile(source, "<tool>", "exec"), scope)
except SystemExit:
    raise
except BaseException as e:  # the traceback from the tool's own first frame, as python tool.py shows it
    import traceback
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    sys.exit(1)
"""


def run_python(source: str, limits: Limits = Limits()) -> Result:
    """Run `source` in a fresh isolated interpreter under `limits`; whatever it does, a Result."""
    root = tempfile.mkdtemp(prefix="flaxgpt_sandbox_")
    try:
        if os.geteuid() == 0:  # the child drops to nobody: the directory must be its own
            os.chown(root, NOBODY, NOBODY)
        out_path, err_path = os.path.join(root, ".stdout"), os.path.join(root, ".stderr")
        with open(out_path, "w+b") as out, open(err_path, "w+b") as err:
            args = [str(root), str(limits.cpu_s), str(limits.memory_mb), str(limits.file_mb)]
            child = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _BOOT, *args],
                stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=root, env={}, start_new_session=True,
            )  # fmt: skip
            reason = None
            try:
                child.communicate(source.encode(), timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                reason = "wall-clock limit"
            finally:
                try:  # the whole group: anything it managed to start goes too
                    os.killpg(child.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                child.wait()
            code = child.returncode
            if reason is None and code is not None and code < 0:
                reason = {signal.SIGXCPU: "CPU limit", signal.SIGXFSZ: "file size limit"}.get(-code)
                reason = reason or f"killed by signal {-code}"
            return Result(
                _read(out, limits.output_chars), _read(err, limits.output_chars),
                None if code is None or code < 0 else code, reason,
            )  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _read(f, n: int) -> str:
    f.seek(0)
    data = f.read().decode("utf-8", "replace")  # at most RLIMIT_FSIZE bytes
    if len(data) <= n:
        return data
    # the head and the tail: a traceback's last line says what went wrong
    return data[: n // 2] + f"\n[... {len(data) - n} characters cut ...]\n" + data[-(n - n // 2) :]
