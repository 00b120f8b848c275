"""tests/e2e/forked_python.py runs a command as a fresh interpreter would: the same argv, sys.path[0], working
directory, environment, thread count, exit status and output, a `__main__` of its own, shutdown work done (files left
open closed), and nothing imported but torch;
a command past its timeout is killed with what it started."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.e2e.forked_python import ForkedPython, forkable

PROBE = textwrap.dedent("""
    import atexit, os, sys, threading, time
    import torch
    print("argv", sys.argv[1:], os.path.basename(sys.argv[0]))
    print("path0", sys.path[0])
    print("cwd", os.getcwd(), "PROBE_VALUE", os.environ.get("PROBE_VALUE"))
    print("threads", torch.get_num_threads(), "name", __name__)
    print("imported", sorted(m for m in ("hydra", "omegaconf", "megalm", "transformers") if m in sys.modules))
    print("stdin", repr(sys.stdin.read()))
    print("main", sys.modules["__main__"].__dict__ is globals(), sorted(k for k in globals() if k[0] != "_"))
    LEFT_OPEN = open("left_open.txt", "w")  # closed by the interpreter's shutdown, not by the command
    LEFT_OPEN.write("written")
    def keeps_globals_alive():  # a function refers to its globals: a cycle only the interpreter's shutdown breaks
        return LEFT_OPEN
    atexit.register(lambda: print("atexit ran"))
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined"))).start()
    print("to stderr", file=sys.stderr)
    sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
""")


@pytest.fixture(scope="module")
def python():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with ForkedPython(env) as server:
        yield server, env


def fresh(argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("kind", ["script", "module"])
def test_a_forked_command_runs_as_a_fresh_interpreter_does(python, tmp_path, kind):
    server, env = python
    (tmp_path / "probe.py").write_text(PROBE)
    argv = [sys.executable, *(["-m", "probe"] if kind == "module" else [str(tmp_path / "probe.py")]), "a", "--b=c"]
    env = {**env, "PROBE_VALUE": "set", "PROBE_EXIT": "3"}
    expected = fresh(argv, tmp_path, env)
    (tmp_path / "left_open.txt").unlink()
    got = server.run(*forkable(argv), cwd=tmp_path, env=env, timeout=120)
    assert (got.returncode, got.stdout, got.stderr) == (expected.returncode, expected.stdout, expected.stderr)
    assert (tmp_path / "left_open.txt").read_text() == "written"
    assert got.returncode == 3 and "thread joined\natexit ran" in got.stdout and "imported []" in got.stdout


@pytest.mark.parametrize("ending, status, stderr", [("raise ValueError('bad')", 1, "ValueError: bad"),
                                                    ("sys.exit('a message')", 1, "a message"),
                                                    ("sys.exit()", 0, ""), ("pass", 0, "")])
def test_exit_status_and_output_of_a_failure(python, tmp_path, ending, status, stderr):
    server, env = python
    (tmp_path / "end.py").write_text(f"import sys\nprint('started')\n{ending}\n")
    argv = [sys.executable, str(tmp_path / "end.py")]
    expected, got = fresh(argv, tmp_path, env), server.run(*forkable(argv), cwd=tmp_path, env=env, timeout=60)
    assert (got.returncode, got.stdout) == (expected.returncode, expected.stdout) == (status, "started\n")
    assert stderr in got.stderr and got.stderr.strip().splitlines()[-1:] == expected.stderr.strip().splitlines()[-1:]


def test_a_command_past_its_timeout_is_killed_with_what_it_started(python, tmp_path):
    server, env = python
    (tmp_path / "hang.py").write_text(textwrap.dedent("""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open("child.pid", "w").write(str(child.pid))
        time.sleep(600)
    """))
    started = time.monotonic()
    got = server.run("script", str(tmp_path / "hang.py"), [], cwd=tmp_path, env=env, timeout=3)
    assert got.timed_out and got.returncode == -9 and time.monotonic() - started < 30
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and "Z" not in Path(f"/proc/{child}/stat").read_text().split()[2]:
        assert time.monotonic() < deadline, "the command's own child outlived its timeout"
        time.sleep(0.1)


def test_only_python_commands_other_than_torchrun_are_forked():
    assert forkable([sys.executable, "-m", "megalm.train", "x=1"]) == ("module", "megalm.train", ["x=1"])
    assert forkable([sys.executable, "tools/hdp_sim.py", "--ranks", "8"]) == ("script", "tools/hdp_sim.py",
                                                                             ["--ranks", "8"])
    for argv in ([sys.executable, "-m", "torch.distributed.run", "-m", "megalm.train"], ["bash", "-c", "true"],
                 [sys.executable, "-c", "print(1)"]):
        assert forkable(argv) is None, argv
