"""tools/gpu_check.sh and tools/gpu_wheels.sh, checked on any machine (no gpu marker: these run in the default
suite, so `pytest tests/gpu` is never empty): bash parses both, and without a visible CUDA device gpu_check.sh
refuses at once with one clear line and exit code 2, before it installs, runs or writes anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = [ROOT / "tools" / "gpu_check.sh", ROOT / "tools" / "gpu_wheels.sh"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses_and_is_executable(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert os.access(script, os.X_OK), f"{script.relative_to(ROOT)} is not executable (chmod +x)"


def test_gpu_check_refuses_without_cuda(tmp_path: Path) -> None:
    report = tmp_path / "report.md"
    # CUDA_VISIBLE_DEVICES="" hides every GPU, so this holds on a GPU machine too; WHEELS points at nothing.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable, "OUT": str(report),
           "WHEELS": str(tmp_path / "no-wheels")}
    proc = subprocess.run(["bash", str(SCRIPTS[0])], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "gpu_check: no CUDA device visible" in proc.stderr and "nothing was run" in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == [], "the refusal must not write a report or a log"
