"""tools/gpu_check.sh and tools/gpu_wheels.sh, checked on any machine (no gpu marker: these run in the default
suite, so `pytest tests/gpu` is never empty): bash parses both; without a visible CUDA device gpu_check.sh refuses
at once with one clear line and exit code 2, before it installs, runs or writes anything; the GPU run it prints is
the one docs/benchmarks.md documents; a budget that is spent marks steps "not run", not failed; a step killed
mid-way leaves its lines in the report; and `--dry-run` runs the whole script on CPU (slow: about two minutes).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
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


def _dry_run(tmp_path: Path, *args: str, budget: int = 540, **env: str) -> subprocess.CompletedProcess:
    # without this pytest's own variables (a pytest-xdist worker's among them): the script's pytest is a run of its own
    outer = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env = {**outer, "PYTHON": sys.executable, "OUT": str(tmp_path), "GPU_CHECK_BUDGET_S": str(budget), **env}
    return subprocess.run(["bash", str(SCRIPTS[0]), "--dry-run", *args], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=540)


def test_the_documented_gpu_run_is_the_one_the_script_prints() -> None:
    printed = subprocess.run(["bash", str(SCRIPTS[0]), "--print-run"], capture_output=True, text=True,
                             check=True).stdout.strip()
    assert "OUT=DIR tools/gpu_check.sh setup compare_accumulated throughput\n" in printed
    assert "OUT=DIR tools/gpu_check.sh setup tests " in printed
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    assert printed in docs, "docs/benchmarks.md must quote `tools/gpu_check.sh --print-run` verbatim"


def test_a_spent_budget_means_not_run_never_failed(tmp_path: Path) -> None:
    """Also: the steps run in the order asked (the GPU run asks for the fast step's numbers before the tests), and
    `throughput` runs the 1.3B rows (fp8 compiled with and without its column-major copies apart: the A/B that
    decides that default; and through torchao's Float8Linear: the backend comparison), `bench` the other benchmarks,
    the attention kernels last: each row once (a later call's `bench` had re-run the 1.3B rows)."""
    proc = _dry_run(tmp_path, "throughput", "bench", "tests", budget=1)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = (tmp_path / "gpu_check_report.md").read_text()
    assert report.count(": not run (the 1 s budget was spent") >= 6, report
    assert "failed (exit" not in report and "**FAIL**" not in report and "**PASS**" in report
    sections = [line for line in report.splitlines() if line.startswith("### ") and line != "### setup"]
    # the rows that decide a default first (a budget cuts the last): compiled bf16, the base of the fp8 ratios, then
    # the fp8 A/Bs; eager bf16 after them
    assert sections[0].startswith("### training throughput, 1.3b/4096 bf16 compiled"), sections
    assert sections[1].startswith("### training throughput, 1.3b/4096 fp8 compiled ("), sections
    assert sections[2].startswith("### training throughput, 1.3b/4096 fp8 compiled, --fp8-columns-apart"), sections
    assert sections[3].startswith("### training throughput, 1.3b/4096 fp8 compiled, torchao's"), sections
    assert sections[4].startswith("### training throughput, 1.3b/4096 fp8_delayed compiled"), sections
    assert sections[5].startswith("### training throughput, 1.3b/4096 bf16 ("), sections
    assert sections[-2].startswith("### attention kernels, unequal documents, cuDNN ragged bucketed"), sections
    assert sections[-1].startswith("### tests"), sections
    rows = ("attention kernels, 1.3b/4096, one", "attention kernels, 1.3b/4096, unequal",
            "1.3b/4096 bf16 (", "1.3b/4096 bf16 compiled", "1.3b/4096 fp8 (",
            "1.3b/4096 fp8 compiled (", "fp8 compiled, --fp8-columns-apart", "torchao's Float8Linear",
            "1.3b/4096 fp8_delayed compiled",
            "AdamW kernels", "bf16 with fused weight gradients", "every speed option", "125m")
    assert [sum(row in line for line in sections) for row in rows] == [1] * len(rows), sections


BESIDE_OTHERS = """
import os

def test_alone():  # fails in a pytest-xdist worker only, as a test disturbed by its neighbours would
    assert "PYTEST_XDIST_WORKER" not in os.environ

def test_fine():
    pass
"""


@pytest.mark.parametrize("always", [False, True], ids=["passes alone", "fails alone too"])
def test_tests_that_fail_beside_others_run_again_alone(tmp_path: Path, always: bool) -> None:
    """The tests step's workers (GPU_CHECK_TEST_WORKERS; 4 on a GPU) share one GPU: a test that fails beside the others
    runs again in one process, and only a failure there fails the run."""
    tests = tmp_path / "tests" / "test_beside.py"
    tests.parent.mkdir()
    tests.write_text(BESIDE_OTHERS + ("\ndef test_broken():\n    assert False\n" if always else ""))
    proc = _dry_run(tmp_path, "tests", GPU_CHECK_TESTS=str(tests), GPU_CHECK_TEST_WORKERS="2")
    report = (tmp_path / "gpu_check_report.md").read_text()
    assert " -n 2 " in report and f"again in one process ({2 if always else 1})" in report, report
    if always:
        assert proc.returncode == 1 and "**FAIL**" in report and "1 passed, 1 failed" in report, report
    else:
        assert proc.returncode == 0 and "**PASS**" in report and "passed alone" in report, report


def test_a_worker_count_that_is_no_number_is_refused(tmp_path: Path) -> None:
    proc = _dry_run(tmp_path, "tests", GPU_CHECK_TEST_WORKERS="auto")
    assert proc.returncode == 2 and "GPU_CHECK_TEST_WORKERS=auto is not a count of workers" in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == [], "refused before writing anything"


def _kill_session(session: int) -> None:
    """SIGKILL every process of session `session` (/proc/PID/stat's sixth field)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(stat.parent.name), signal.SIGKILL)


def test_a_killed_step_leaves_its_lines(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    proc = subprocess.Popen(["bash", str(SCRIPTS[0]), "--dry-run", "tests"], env=env, cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    report = tmp_path / "gpu_check_report.md"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and "### tests" not in (report.read_text() if report.exists() else ""):
        time.sleep(0.2)
    _kill_session(proc.pid)  # as a device's time limit would: every process of the run (timeout has its own group)
    proc.wait(timeout=30)
    text = report.read_text()
    assert "# megalm GPU check (dry run)" in text and "### setup" in text and "### tests" in text, text
    assert "-m pytest" in text and "(started " in text, text


@pytest.mark.slow
def test_the_whole_script_dry_runs_on_cpu(tmp_path: Path) -> None:
    proc = _dry_run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (tmp_path / "gpu_check_report.md").read_text()
    for section in ("### setup", "### tests", "### training throughput, 125m bf16", "### HDP cost-model calibration",
                    "### megalm vs Megatron-Core vs TorchTitan", "**PASS**"):
        assert section in report, (section, report)
    assert "failed (exit" not in report and "**FAIL**" not in report, report  # ("0 failed" is the tests' count)
    assert (tmp_path / "hdp_cost_dry_run.yaml").exists() and (tmp_path / "compare_dry_run.json").exists()
    accumulated = json.loads((tmp_path / "compare_accumulated_dry_run.json").read_text())
    assert [(r["framework"], r["status"], r["micro_batches"]) for r in accumulated["rows"]] == [("megalm", "ok", 4)]
