"""How the suite runs, as CI runs it: a crash in one pytest-xdist worker must end the run with the crashed test
named, never leave it waiting (tests/conftest.py sets `--max-worker-restart 0`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_a_crashed_xdist_worker_fails_the_run_instead_of_hanging(tmp_path: Path):
    """Under `--dist loadfile`, xdist's replacement of a crashed worker can wait forever (its scheduler; a CI floor
    leg segfaulted and then waited out CI's time limit). Two files, the first crashing its worker: the run must end
    with that test failed, within the timeout."""
    pytest.importorskip("xdist")
    (tmp_path / "test_crash.py").write_text("import os\n\ndef test_crash():\n    os._exit(1)\n\n"
                                            "def test_after():\n    pass\n")
    (tmp_path / "test_other.py").write_text("def test_other():\n    pass\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                                 "-n", "1", "--dist", "loadfile", "--rootdir", str(tmp_path), "-c", os.devnull,
                                 str(tmp_path)], capture_output=True, text=True, timeout=90, env=env, cwd=tmp_path)
    except subprocess.TimeoutExpired:
        pytest.fail("the run hung after its worker crashed: --max-worker-restart 0 is not in effect")
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "crashed while running 'test_crash.py::test_crash'" in result.stdout, result.stdout[-2000:]
