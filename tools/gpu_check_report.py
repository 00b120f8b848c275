"""The pieces of tools/gpu_check.sh's report that need Python: the header (device, versions) and a test summary.

    python tools/gpu_check_report.py header REPORT [--dry-run]   # appends the header: date, device, versions, commit
    python tools/gpu_check_report.py junit JUNIT_XML RC SECONDS  # prints the tests' lines (counts, failures, skips)
    python tools/gpu_check_report.py failed JUNIT_XML            # prints how many tests failed or errored
    python tools/gpu_check_report.py device                      # prints "CAPABILITY GPUS NAME", e.g. "90 1 h100"

Why separate: the shell script appends each step's lines to the report as it goes (a step killed by a time limit
leaves what it wrote); these two parts are structured data, easier read in Python than in bash.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception:
        return "not installed"


def _sh(*cmd: str) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:
        return ""


def header(dry_run: bool) -> list[str]:
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        driver = _sh("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader").splitlines()[:1]
        device = (f"{torch.cuda.get_device_name(0)} (sm{props.major}{props.minor}, {props.total_memory / 2**30:.1f} "
                  f"GiB), {torch.cuda.device_count()} visible" + (f"; driver {driver[0]}" if driver else ""))
    else:
        device = "no CUDA device (dry run: CPU stand-ins for the GPU steps)" if dry_run else "no CUDA device"
    # a copy without .git (the device tool's) is named by its caller: GPU_CHECK_COMMIT
    commit = (_sh("git", "describe", "--always", "--dirty") or os.environ.get("GPU_CHECK_COMMIT")
              or "unknown (no git checkout; GPU_CHECK_COMMIT names it)")
    return [
        "# megalm GPU check" + (" (dry run)" if dry_run else ""), "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- device: {device}",
        f"- torch {torch.__version__} (CUDA {torch.version.cuda}), triton {_version('triton')}, "
        f"flash-attn {_version('flash_attn')}, Python {platform.python_version()}",
        f"- commit: {commit}",
    ]


def junit(path: Path, rc: int, seconds: str) -> tuple[list[str], bool]:
    """The tests' lines and whether they passed: pytest exit 0, at least one test passed, none failed."""
    counts, failed, skips = Counter(), [], Counter()
    if path.exists():
        for case in ET.parse(path).getroot().iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
            counts[outcome] += 1
            if outcome in ("failure", "error"):
                failed.append(f"{name} ({outcome})")
            elif outcome == "skipped":
                skips[next(c for c in case if c.tag == "skipped").get("message", "")[:160]] += 1
    cut = rc in (124, 137)
    lines = [f"{counts['passed']} passed, {counts['failure']} failed, {counts['error']} errors, {counts['skipped']} "
             f"skipped in {seconds} s (pytest exit code {rc}" + (", cut by its time limit" if cut else "") + ")"]
    if failed:
        lines += ["", "Failed:", *[f"- `{name}`" for name in failed]]
    if skips:
        lines += ["", "Skipped:", *[f"- {n} × {reason}" for reason, n in skips.most_common()]]
    return lines, rc == 0 and counts["passed"] > 0 and not failed


def failed(path: Path) -> int:
    """How many tests of the junit file failed or errored (a test can carry both a failure and a teardown error)."""
    cases = ET.parse(path).getroot().iter("testcase") if path.exists() else ()
    return sum(any(child.tag in ("failure", "error") for child in case) for case in cases)


def device() -> str:
    """The device's compute capability (e.g. 90), GPU count and short name (h100: NVIDIA's "H100 80GB HBM3" reads
    as its model, not as its memory), or "0 0 cpu"."""
    import re

    import torch

    if not torch.cuda.is_available():
        return "0 0 cpu"
    name = torch.cuda.get_device_name(0)
    model = re.search(r"\b[A-Z]\d{2,3}\b", name)
    short = re.sub(r"[^a-z0-9]", "_", (model.group(0) if model else name.split()[-1]).lower())
    major, minor = torch.cuda.get_device_capability()
    return f"{major}{minor} {torch.cuda.device_count()} {short}"


def main(argv: list[str]) -> int:
    if argv[:1] == ["header"]:
        report = Path(argv[1])
        with report.open("a") as out:
            out.write("\n".join(header("--dry-run" in argv)) + "\n")
        return 0
    if argv[:1] == ["device"]:
        print(device())
        return 0
    if argv[:1] == ["junit"]:
        lines, ok = junit(Path(argv[1]), int(argv[2]), argv[3])
        print("\n".join(lines))
        return 0 if ok else 1
    if argv[:1] == ["failed"]:
        print(failed(Path(argv[1])))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
