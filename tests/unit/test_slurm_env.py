"""How the Slurm templates find their Python: scripts/slurm/lib.sh activates MEGALM_VENV, prefixes torchrun with
MEGALM_LAUNCH (a container), and stops with one line when neither gives it a torchrun. Sourced in plain bash (no
Slurm needed: lib.sh does this when sourced); the real-Slurm runs are tests/e2e/test_slurm.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIB = ROOT / "scripts" / "slurm" / "lib.sh"


def source_lib(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    script = f'source "{LIB}" && echo "torchrun=$(command -v torchrun)" && echo "launch=${{MEGALM_LAUNCH_WORDS[*]}}"' \
             ' && echo "marker=${VENV_MARKER:-}"'
    clean = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MEGALM_ROOT": str(ROOT), **env}
    return subprocess.run(["bash", "-c", script], env=clean, capture_output=True, text=True, timeout=60)


def fake_venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "torchrun").write_text("#!/bin/sh\n")
    os.chmod(venv / "bin" / "torchrun", 0o755)
    (venv / "bin" / "activate").write_text(f'export PATH="{venv}/bin:$PATH"\nexport VENV_MARKER=activated\n')
    return venv


def test_megalm_venv_is_activated(tmp_path):
    venv = fake_venv(tmp_path)
    proc = source_lib(tmp_path, MEGALM_VENV=str(venv))
    assert proc.returncode == 0, proc.stderr
    assert f"torchrun={venv}/bin/torchrun" in proc.stdout and "marker=activated" in proc.stdout


def test_a_container_launcher_prefixes_torchrun(tmp_path):
    proc = source_lib(tmp_path, MEGALM_LAUNCH="apptainer exec --nv /images/train.sif")
    assert proc.returncode == 0, proc.stderr
    assert "launch=apptainer exec --nv /images/train.sif" in proc.stdout


def test_no_python_environment_is_one_line(tmp_path):
    proc = source_lib(tmp_path)  # PATH without a torchrun, no MEGALM_VENV, no MEGALM_LAUNCH
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "torchrun is not on PATH" in proc.stderr and "MEGALM_VENV" in proc.stderr
    proc = source_lib(tmp_path, MEGALM_VENV=str(tmp_path / "missing"))
    assert proc.returncode == 2 and "has no bin/activate" in proc.stderr and proc.stderr.count("\n") == 1
