"""The demo a new user runs first: the stdlib corpus, the tiny model, the loss clearly falling."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.e2e.test_cli import ROOT, run


@pytest.mark.slow
@pytest.mark.timeout(1000)  # the subprocess has its own 900 s limit; the suite-wide 600 s would cut it first
def test_default_megalm_train(tmp_path):
    """`megalm-train` with no arguments: the acceptance run (2 to 5 min on 2 cores, loss ≤ 0.6 × first)."""
    start = time.time()
    proc = run([sys.executable, "-m", "megalm.train"], tmp_path, timeout=900, threads=2)  # as the README times it
    seconds = time.time() - start
    assert proc.returncode == 0, proc.stderr
    run_dirs = list((tmp_path / "outputs").glob("*/*"))
    assert len(run_dirs) == 1
    records = [json.loads(line) for line in (run_dirs[0] / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 300
    assert records[-1]["loss"] <= 0.6 * records[0]["loss"]
    out = proc.stdout + proc.stderr
    assert "checkpoint:" in out and "finished at step 300/300" in out
    print(f"default demo: {seconds:.0f}s wall, loss {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f}")
    sample = subprocess.run(["megalm-generate", str(tmp_path / "outputs"), "--prompt", "import ",
                             "--max-new-tokens", "40"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert sample.returncode == 0 and sample.stdout.startswith("import "), sample.stderr
