"""The tools a user meets beside megalm-train answer a bad override or flag as megalm-train does: one `error:` line
and exit code 2, not Hydra's or argparse's traceback, and no run starts."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.e2e.forked_python import run_one_thread

ROOT = Path(__file__).resolve().parents[2]


def test_a_mistyped_flag_of_the_save_benchmark_is_an_error_not_an_override(tmp_path):
    """checkpoint_save.py read unknown arguments as Hydra overrides (parse_known_args): `--iters 1` (other tools' flag)
    went to Hydra."""
    proc = run_one_thread([sys.executable, str(ROOT / "tools/bench/checkpoint_save.py"), "--iters", "1"], tmp_path,
                          {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 2 and "unrecognized arguments: --iters 1" in proc.stderr, proc.stderr[-2000:]
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv, fragment", [
    (["tools/bench/throughput.py", "--steps", "1", "model.hiden=3"], "unknown config key 'model.hiden'"),
    (["tools/hdp_plan.py", "--step", "1", "model.hiden=4"], "unknown config key 'model.hiden'"),
    (["tools/hdp_plan.py", "--step", "1", "parallel.hdp=true"], "set parallel.hdp=true and parallel.dp"),
    (["tools/bench/moe_balance.py", "--steps", "1", "model.hiden=2"], "unknown config key 'model.hiden'"),
    (["tools/bench/comm_volume.py", "--nproc", "2", "model.hiden=2"], "unknown config key 'model.hiden'"),
    (["tools/bench/python_gc.py", "--steps", "1", "model.hiden=2"], "unknown config key 'model.hiden'"),
    (["tools/bench/context_parallel.py", "--nproc", "2", "model.hiden=2"], "unknown config key 'model.hiden'"),
    (["-m", "megalm.train", "--cfg", "job", "model.hiden=3"], "unknown config key 'model.hiden'"),
    (["tools/bench/throughput.py", "--steps", "0"], "--steps 0 must be >= 1"),
    (["tools/hdp_plan.py", "--step", "-1"], "--step -1 must be >= 0"),
    # scanned step boundaries for minutes (an audit, 2026-12-06)
    (["tools/hdp_plan.py", "--step", "10000000000", "parallel.hdp=true", "parallel.dp=2", "data.varlen=true"],
     "--step 10000000000 is past the run's last step, 299 (trainer.max_steps=300)"),
    (["tools/bench/amax_histories.py", "--reps", "0"], "--reps 0 must be >= 1"),
    # a traceback each, or (--systems) a table without the misspelt row (an audit, 2026-12-04)
    (["tools/bench/step_cost.py", "model=nonexistent"], "Could not find 'model/nonexistent'"),
    (["tools/bench/step_cost.py", "--systems", "megalm_compile", "model=tiny"], "--systems megalm_compile: not one"),
    (["tools/bench/activation_memory.py", "--recompute", "bogus"], "parallel.recompute='bogus'"),
    (["tools/bench/estimate_vs_formula.py", "--models", "nope"], "--models nope: not one of 8b, 70b"),
    (["tools/bench/hdp_plan_time.py", "--reps", "0"], "--reps 0 must be >= 1"),
    (["tools/bench/hdp_plan_time.py", "--ranks", "2"], "raise --ranks or --capacity"),  # a planner's traceback
    (["tools/bench/checkpoint_save.py", "--reps", "0"], "--reps 0 must be >= 1"),
    (["tools/bench/adamw_kernels.py", "--iters", "0"], "--iters 0 must be >= 1"),
])
def test_a_bad_override_is_one_line(argv, fragment, tmp_path):
    # forked from a server that imported torch (tests/e2e/forked_python.py): 3 s of CPU less a case
    proc = run_one_thread([sys.executable, *[str(ROOT / a) if a.endswith(".py") else a for a in argv]], tmp_path,
                          {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    assert fragment in lines[0] and "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir()), "a refused command wrote nothing"
