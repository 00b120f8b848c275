"""tools/bench/host_overhead.py times the step's host work; with `--cuda-paths` the FP8 recipe runs its CUDA code on
the CPU (its GEMMs through torch._scaled_mm, timed apart) and bf16 never calls it. In a process of its own: the
compiled casts import inductor, after which the Triton interpreter of the MX kernel tests fails."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cuda_paths_send_fp8_gemms_through_scaled_mm():
    """fp8 on both backends (`fp8+torchao`: precision.backend=torchao, when torchao is importable)."""
    from megalm.precision.torchao_fp8 import torchao_problem

    precisions = ["bf16", "fp8"] + ["fp8+torchao"] * (torchao_problem() is None)
    proc = subprocess.run([sys.executable, str(ROOT / "tools/bench/host_overhead.py"), "model=tiny",
                           "model.num_layers=2", "--precisions", *precisions, "--cuda-paths", "--steps", "2",
                           "--warmup", "1", "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {row["precision"]: row for row in json.loads(proc.stdout.strip().splitlines()[-1])}
    assert rows.keys() == set(precisions), rows
    assert rows["bf16"]["scaled_mm_ms"] == 0.0 and all(rows[p]["scaled_mm_ms"] > 0.0 for p in precisions[1:]), rows
    assert all(row["layers"] == 2 and row["host_ms"] > 0 for row in rows.values()), rows
