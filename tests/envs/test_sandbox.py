"""The Python executor's sandbox against hostile programs: each one ends as an observation, within its
limits, and leaves nothing behind outside its directory; the trainer's process is untouched."""

import os
import shutil
import tempfile
import time

import pytest

from flaxgpt.envs.sandbox import Limits, run_python

FAST = Limits(cpu_s=1, wall_s=3, memory_mb=512, file_mb=1, output_chars=1000)


def test_a_well_behaved_program_prints_and_writes_inside_its_directory():
    r = run_python("open('a.txt', 'w').write('hi')\nprint(open('a.txt').read(), 2 ** 10)", FAST)
    assert (r.stdout, r.exit_code, r.reason) == ("hi 1024\n", 0, None)
    assert r.observation() == "hi 1024"


@pytest.mark.parametrize("source", ["while True: pass", "import time\ntime.sleep(60)"])
def test_a_program_that_never_ends_is_stopped_by_its_limits(source):
    t0 = time.perf_counter()
    r = run_python(source, FAST)
    assert time.perf_counter() - t0 < FAST.wall_s + 2
    assert r.exit_code is None and r.reason in ("CPU limit", "wall-clock limit")
    assert "[stopped:" in r.observation()


@pytest.mark.parametrize(
    "source, said",
    [
        ("import os\nwhile True:\n    os.fork()", "does not allow os.fork"),  # a fork bomb
        ("import os\nos.system('echo hi')", "does not allow os.system"),
        ("import subprocess", "does not allow importing subprocess"),
        ("import multiprocessing", "does not allow importing multiprocessing"),
        ("import socket", "does not allow importing socket"),
        ("import ctypes", "does not allow importing ctypes"),
        ("import os\nos.kill(os.getppid(), 9)", "does not allow signals to other processes"),
        ("x = bytearray(10 * 2**30)", "MemoryError"),  # 10 GB
        ("import gc\ngc.get_objects()", "does not allow gc.get_objects"),
    ],
)
def test_hostile_programs_fail_inside_the_sandbox(source, said):
    r = run_python(source, FAST)
    assert r.exit_code == 1 and said in r.stderr, r


def test_writes_outside_its_directory_are_refused(tmp_path):
    target = tmp_path / "escaped.txt"
    for source in (
        f"open({str(target)!r}, 'w').write('x')",
        f"import os\nos.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
        f"import os\nos.chdir('/')\nopen({str(target)[1:]!r}, 'a')",  # relative, after a chdir
        "open('../../escaped.txt', 'w')",
        f"import os\nos.remove({__file__!r})",
        f"import os\nos.rename({__file__!r}, 'stolen.py')",
        "import os\nos.symlink('/', 'root')",
    ):
        r = run_python(source, FAST)
        assert r.exit_code == 1 and "PermissionError" in r.stderr, (source, r)
    assert not target.exists() and os.path.exists(__file__)
    assert run_python("import os\nprint(len(os.listdir('/')) > 0)", FAST).stdout == "True\n"  # reads stay


def test_no_handle_on_a_directory_outside_writes_through_dir_fd():
    """os.open(name, dir_fd=) and os.remove(name, dir_fd=) raise audit events with the relative name
    alone, which the path checks placed inside the sandbox: a handle on a directory outside was a way
    out. The directory here is one the sandbox's user can reach and write (under root it runs as
    nobody, so it sits in /tmp, world-writable): only the hook stands in the way."""
    outside = tempfile.mkdtemp(prefix="flaxgpt-sandbox-outside-")
    try:
        os.chmod(outside, 0o777)
        victim = os.path.join(outside, "victim.txt")
        for then in (
            "os.open('escaped.txt', os.O_WRONLY | os.O_CREAT, dir_fd=d)",
            "os.remove('victim.txt', dir_fd=d)",
            "open('escaped.txt', 'w', opener=lambda p, f: os.open(p, f, dir_fd=d))",
        ):
            with open(victim, "w") as f:
                f.write("keep")
            os.chmod(victim, 0o666)
            r = run_python(f"import os\nd = os.open({outside!r}, os.O_RDONLY)\n{then}", FAST)
            assert r.exit_code == 1 and "opens no directory outside its own" in r.stderr, (then, r)
            assert open(victim).read() == "keep" and sorted(os.listdir(outside)) == ["victim.txt"]
    finally:
        shutil.rmtree(outside)


def test_no_change_of_directory_no_process_no_fifo(tmp_path):
    """A handle on the sandbox's own directory, then a working directory below it: '../x' was checked
    as inside (from the working directory) and written outside (from the handle). Processes made past
    the audit hook (importlib's _gcd_import of _posixsubprocess, whose fork_exec raises no event) meet
    RLIMIT_NPROC 1; a FIFO (no audit event) could be made anywhere the user may write."""
    r = run_python(
        "import os\nd = os.open('.', os.O_RDONLY)\nos.mkdir('a')\nos.chdir('a')\n"
        "os.open('../escaped', os.O_WRONLY | os.O_CREAT, dir_fd=d)",
        FAST,
    )
    assert r.exit_code == 1 and "does not allow os.chdir" in r.stderr, r
    r = run_python("import resource\nprint(resource.getrlimit(resource.RLIMIT_NPROC))", FAST)
    assert r.stdout == "(1, 1)\n", r
    fifo = tmp_path / "fifo"
    os.chmod(tmp_path, 0o777)
    for call in ("os.mkfifo", "os.mknod", "__import__('posix').mkfifo"):
        r = run_python(f"import os\n{call}({str(fifo)!r})", FAST)
        assert r.exit_code == 1 and "AttributeError" in r.stderr and not fifo.exists(), (call, r)


def test_exit_output_and_errors_come_back_as_observations():
    assert run_python("import sys\nprint('bye')\nsys.exit(3)", FAST).observation() == "bye\n[exit code 3]"
    r = run_python("print('a' * 5000 + 'z')", Limits(output_chars=200))
    assert len(r.stdout) < 300 and "[... 4802 characters cut ...]" in r.stdout and r.stdout.endswith("az\n")
    r = run_python("print('x' * 10**7)", FAST)  # over the 1 MB file size limit
    assert r.exit_code != 0 or r.reason == "file size limit"
    r = run_python("1 / 0", FAST)
    assert r.stderr.startswith("Traceback") and "<tool>" in r.stderr and "ZeroDivisionError" in r.stderr
    assert '"<string>"' not in r.stderr.splitlines()[1]  # the trace starts at the tool's own code
