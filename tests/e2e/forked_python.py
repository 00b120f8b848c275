"""Run `python -m MODULE ...` and `python SCRIPT.py ...` commands as children forked from a server process that has
imported torch once, instead of as fresh interpreters.

Why: `import torch` costs 3-4 s of CPU on a CI core, and tests/e2e/test_docs_commands.py runs about 170 such
commands; forking from a process that imported it already skips that and nothing else. Only torch is imported ahead
(a fresh interpreter's state after its own `import torch`, which every command makes), with `torch._dynamo`, which
torch imports itself on first use (every optimizer's constructor and meta-device init do: 1.1 s of CPU), so a command
that forgets an import of its own still fails as it would when pasted. Each child gets the command's working
directory, environment, argv and sys.path[0] as `python` would set them, stdin from /dev/null, its stdout and stderr
in files, a session of its own (a timeout kills the command and whatever it started), and on exit what the
interpreter does at shutdown (joins non-daemon threads, runs atexit handlers) before its exit status is reported.
The server is POSIX-only (os.fork) and single-threaded: one command at a time per server.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Finished:
    """What subprocess.CompletedProcess gives a caller: the exit status (negative: killed by that signal) and output."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool = False


def forkable(argv: list[str]) -> tuple[str, str, list[str]] | None:
    """("module", name, args) for `python -m name args`, ("script", path, args) for `python path.py args`; None for
    what must start fresh: other executables, `python -c`, torchrun (its workers are fresh interpreters anyway)."""
    if len(argv) < 2 or argv[0] != sys.executable:
        return None
    if argv[1] == "-m" and len(argv) > 2 and argv[2] != "torch.distributed.run":
        return "module", argv[2], argv[3:]
    if argv[1].endswith(".py"):
        return "script", argv[1], argv[2:]
    return None


class ForkedPython:
    """A server process (this module run as a script) that imported torch, and the commands it forks; a context
    manager, one command at a time."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env  # the server's: what libraries read at import (OMP_NUM_THREADS) is read from it
        self.server: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self.outputs = tempfile.TemporaryDirectory(prefix="forked-python-")

    def __enter__(self) -> ForkedPython:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.stdin.close()
            self.server.wait(timeout=60)
        self.outputs.cleanup()

    def run(self, kind: str, target: str, args: list[str], cwd: Path, env: dict[str, str], timeout: float) -> Finished:
        with self.lock:
            if self.server is None:
                self.server = subprocess.Popen([sys.executable, __file__], env=self.env, stdin=subprocess.PIPE,
                                               stdout=subprocess.PIPE, text=True)
            out, err = Path(self.outputs.name, "stdout"), Path(self.outputs.name, "stderr")
            request = {"kind": kind, "target": target, "args": args, "cwd": str(cwd), "env": env,
                       "stdout": str(out), "stderr": str(err), "timeout": timeout}
            self.server.stdin.write(json.dumps(request) + "\n")
            self.server.stdin.flush()
            reply = self.server.stdout.readline()
            if not reply:
                raise RuntimeError(f"the forking server exited with {self.server.wait()}")
            status = json.loads(reply)
            return Finished(status["returncode"], out.read_text(errors="replace"), err.read_text(errors="replace"),
                            status["timed_out"])


_shared: ForkedPython | None = None


def run_one_thread(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """`cmd` as subprocess.run(capture_output=True, text=True) gives it, forked from this process's server where
    `forkable` (the server started at the first call, with its `env`: OMP_NUM_THREADS=1 is read at torch's import), a
    fresh process otherwise; a command past `timeout` raises subprocess.TimeoutExpired."""
    global _shared
    if (fork := forkable(cmd)) is None:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert env.get("OMP_NUM_THREADS") == "1", "forked commands share the server's one thread (set OMP_NUM_THREADS=1)"
    if _shared is None:
        _shared = ForkedPython(env)
        atexit.register(_shared.__exit__)
    done = _shared.run(*fork, cwd=cwd, env=env, timeout=timeout)
    if done.timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, done.stdout, done.stderr)
    return subprocess.CompletedProcess(cmd, done.returncode, done.stdout, done.stderr)


# ------------------------------------------------------------------------------------------------------ the server


def _child(request: dict[str, Any]) -> None:
    """Become the command in a fresh `__main__` module. Whatever it raises, SystemExit included, propagates out of the
    server's loop, so the interpreter exits this child as it exits a fresh one: the traceback printed, non-daemon
    threads joined, atexit handlers run, module globals cleared and collected (closing the files left open)."""
    import runpy
    import types

    os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own streams, for its lifetime
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
    main = sys.modules["__main__"] = types.ModuleType("__main__")  # not this server's namespace
    target, args = request["target"], request["args"]
    if request["kind"] == "module":
        sys.argv = ["-m", *args]  # argv[0] becomes the module's file, as `python -m` sets it
        sys.path[0] = os.getcwd()
        runpy._run_module_as_main(target)  # what `python -m` itself calls
    else:
        path = os.path.realpath(target)
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(path)
        main.__file__, main.__cached__, main.__spec__ = target, None, None
        code = compile(Path(path).read_bytes(), target, "exec")
        exec(code, main.__dict__)  # noqa: S102 - running the script is the point
    sys.exit(0)


def _wait(pid: int, timeout: float) -> tuple[int, bool]:
    """The child's exit status (negative: the signal that ended it), and whether it ran past `timeout` (then its
    whole session is killed)."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), False
        if time.monotonic() > deadline:
            os.killpg(pid, 9)
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), True
        time.sleep(0.02)


def serve() -> None:
    """Read one JSON request a line from stdin, fork the command, answer its status a line on stdout."""
    import gc

    import torch  # noqa: F401 - the point of the server
    import torch._dynamo  # noqa: F401 - torch loads it lazily in every optimizer's constructor: 1.1 s more a command

    # What these imports made goes to the collector's permanent generation: a command's full collections (megalm's
    # trainer runs them at step boundaries) walk only what the command made, where in a fresh interpreter they also
    # walk torch's objects (0.2-0.4 s each). Unfrozen at exit, the server's and each command's (which inherits this
    # handler, registered first so it runs last): the interpreter's last collection then frees them as a fresh one's
    # does (frozen, Triton's bindings report them leaked on stderr).
    atexit.register(gc.unfreeze)
    gc.collect()
    gc.freeze()

    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)  # exits this child; never returns
        returncode, timed_out = _wait(pid, request["timeout"])
        with contextlib.suppress(ProcessLookupError):  # what the command left running in its session
            os.killpg(pid, 9)
        sys.stdout.write(json.dumps({"returncode": returncode, "timed_out": timed_out}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
