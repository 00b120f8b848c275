"""`torchrun -m megalm.train` on CPU/gloo: the same losses as one process, and clean layout errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY
from tests.e2e.test_cli import run

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_torchrun_matches_single_process(tmp_path: Path, common: list[str], parallel: list[str]
                                          ) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """The losses of `common` in one process and under torchrun with `parallel`; returns both processes."""
    single = run([sys.executable, "-m", "megalm.train", *common, "hydra.run.dir=single"], tmp_path)
    assert single.returncode == 0, single.stderr
    multi = run([*TORCHRUN, "--nproc-per-node", "4", "-m", "megalm.train", *common, *parallel, "hydra.run.dir=multi"],
                tmp_path)
    assert multi.returncode == 0, multi.stderr[-3000:]
    a, b = losses(tmp_path / "single"), losses(tmp_path / "multi")
    assert len(a) == len(b) == 4
    for x, y in zip(b, a, strict=True):
        assert abs(x - y) <= 1e-5 * abs(y), (b, a)
    return single, multi


@pytest.mark.slow  # about 19 s: the default suite keeps the torchrun HDP run (4 ranks) and its shared run dir
def test_torchrun_tp2_dp2_matches_single_process(tmp_path):
    common = [*TINY, "trainer.max_steps=4", "precision=fp32", "trainer.micro_batch_size=2"]
    assert_torchrun_matches_single_process(tmp_path, common, ["parallel.tp=2", "parallel.dp=2",
                                                              "parallel.sequence_parallel=true"])
    assert not any(p.name != "multi" and p.name != "single" for p in tmp_path.iterdir() if p.is_dir()), \
        "all ranks must share rank 0's run dir"


@pytest.mark.parametrize("args, message", [
    (["parallel.tp=3"], "world size 2 is not divisible by tp*pp*cp = 3"),
    (["parallel.tp=2", "model.num_heads=2", "model.num_kv_heads=1", "model.hidden_size=64",
      "model.ffn_hidden_size=63"], "model.ffn_hidden_size=63 is not divisible by parallel.tp=2"),
], ids=["world_not_divisible", "ffn_not_divisible"])
# the layout's other refusal, dp != world / (tp*pp*cp), is raised beside the first (tests/unit/test_dims.py)
def test_bad_layout_fails_on_every_rank_without_hanging(tmp_path, args, message):
    # torchrun stops the other workers once one has failed: a 2 s monitor interval gives the slower rank (on a
    # loaded machine) the time to print its own line first.
    proc = run([*TORCHRUN, "--monitor-interval", "2", "--nproc-per-node", "2", "-m", "megalm.train", *TINY, *args],
               tmp_path, timeout=120)
    assert proc.returncode != 0
    ours = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(ours) == 2 and all(message in ln for ln in ours), proc.stderr[-2000:]
    assert "megalm/" not in proc.stderr, "no traceback from megalm's code (torchrun adds its own report)"


def test_torchrun_hdp_matches_single_process(tmp_path):
    """HDP from the command line: dp2 x cp2 as one domain of 4, rings of up to 3 ranks, a token budget. A warning of
    the config (a warmup as long as the run) is said once: not by every rank, nor again by megalm-train's check
    before Hydra starts the run."""
    common = [*TINY, "trainer.max_steps=4", "optim.warmup_steps=4", "precision=fp32", "data.varlen=true",
              "model.seq_length=48", "trainer.tokens_per_step=300"]
    single, multi = assert_torchrun_matches_single_process(
        tmp_path, common, ["parallel.hdp=true", "parallel.dp=2", "parallel.cp=2", "parallel.hdp_capacity=16"])
    for proc, run_dir in ((single, "single"), (multi, "multi")):
        said = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "the learning rate warms up" in ln]
        assert len(said) == 1, said
        assert (tmp_path / run_dir / "train.log").read_text().count("the learning rate warms up") == 1
    assert not any(p.name != "multi" and p.name != "single" for p in tmp_path.iterdir() if p.is_dir()), \
        "all ranks must share rank 0's run dir"
