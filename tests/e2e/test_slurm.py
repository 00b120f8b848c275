"""The Slurm templates on a real Slurm: a loopback cluster of two nodes on this host (munged, slurmctld and two
slurmd from Debian's packages, tools/slurm_local/cluster.py), `sbatch scripts/slurm/train.sbatch` on CPU/gloo
(2 nodes x 1 process = dp2) with the losses of one process; then a job preempted twice (the `--signal=B:USR1`
path and a SIGTERM to the job step) that requeues itself, resumes in its run dir and ends with the losses of an
uninterrupted one-process run. Slow (about 2-3 minutes); installs slurm-wlm and munge with apt-get when missing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import TINY

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ROOT / "scripts" / "slurm"
_spec = importlib.util.spec_from_file_location("slurm_local_cluster", ROOT / "tools" / "slurm_local" / "cluster.py")
cluster_lib = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cluster_lib)

pytestmark = pytest.mark.slow

COMMON = [*TINY, "trainer.device=cpu", "precision=fp32"]
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("the loopback Slurm cluster runs munged, slurmctld and slurmd as root; not root here")
    why = cluster_lib.ensure_installed()
    if why:
        pytest.skip(why)
    cluster = cluster_lib.LoopbackCluster(tmp_path_factory.mktemp("slurm"), nodes=2)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def base_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def one_process_losses(overrides: list[str], cwd: Path) -> dict[int, float]:
    proc = subprocess.run([sys.executable, "-m", "megalm.train", *overrides, "hydra.run.dir=single"], cwd=cwd,
                          env=base_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["step"]: r["loss"] for r in records(cwd / "single")}


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Job:
    """One `sbatch` of a template, submitted from `cwd`: it runs in the template's own run dir."""

    def __init__(self, cluster, cwd: Path, name: str, overrides: list[str], template: str = "train.sbatch",
                 nodes: int = 2, env: dict[str, str] | None = None):
        self.cluster, self.cwd, self.name = cluster, cwd, name
        # Both "nodes" are this host: the rendezvous is 127.0.0.1 on a port free now (the template's override).
        env = {**self.cluster.env(), **base_env(), "MEGALM_ROOT": str(ROOT), "MEGALM_RDZV_HOST": "127.0.0.1",
               "MEGALM_RDZV_PORT": str(cluster_lib.free_port()), "SLURM_CONF": str(cluster.conf), **(env or {})}
        proc = subprocess.run(["sbatch", "--parsable", f"--nodes={nodes}", "--gpus-per-node=0", "--time=20",
                               f"--job-name={name}", str(TEMPLATES / template), *overrides],
                              cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        self.id = proc.stdout.strip().split(";")[0]
        self.run_dir = cwd / "outputs" / f"{name}-{self.id}"  # the template's default: job name and id

    def info(self) -> dict[str, str]:
        out = subprocess.run(["scontrol", "show", "job", "-o", self.id], env=self.cluster.env(),
                             capture_output=True, text=True, timeout=30).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def scancel(self, *args: str) -> None:
        subprocess.run(["scancel", *args, self.id], env=self.cluster.env(), check=True, timeout=30)

    def wait(self, ready, timeout: float, what: str) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.info()
            if ready(info) or info.get("JobState") in FINAL:
                return info
            time.sleep(0.2)
        pytest.fail(f"job {self.id}: {what} not within {timeout:.0f} s\n{self.logs()}")

    def finish(self, timeout: float = 600) -> dict[str, str]:
        return self.wait(lambda i: False, timeout, "no final state")

    def steps(self) -> list[int]:
        return [r["step"] for r in records(self.run_dir)]

    def logs(self, tail: int = 2500) -> str:
        """The batch shell's log and every per-node log (their tails: failure messages; tail=0: all)."""
        paths = [self.cwd / f"slurm-{self.name}-{self.id}.out", *sorted((self.run_dir / "slurm").glob("*.log"))]
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}" for p in paths if p.exists())


def assert_same_losses(got: list[dict], want: dict[int, float]) -> None:
    assert sorted(r["step"] for r in got) == sorted(want), [r["step"] for r in got]
    for r in got:
        assert abs(r["loss"] - want[r["step"]]) <= 1e-5 * abs(want[r["step"]]), (r, want[r["step"]])


@pytest.mark.timeout(600)
def test_sbatch_two_nodes_matches_one_process(slurm, tmp_path):
    overrides = [*COMMON, "trainer.max_steps=6"]
    job = Job(slurm, tmp_path, "megalm-2n", overrides)
    info = job.finish(timeout=300)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), job.logs()
    node_logs = sorted(p.name for p in (job.run_dir / "slurm").glob("*.log"))
    assert node_logs == [f"megalm-2n-{job.id}-node{n}-{host}-restart0.log" for n, host in
                         ((0, os.uname().nodename), (1, os.uname().nodename))], node_logs
    assert "2 rank(s): tp=1 pp=1 dp=2" in job.logs(tail=0), job.logs()  # both nodes joined one rendezvous
    assert_same_losses(records(job.run_dir), one_process_losses(overrides, tmp_path))


@pytest.mark.timeout(900)
def test_preempted_job_requeues_itself_and_resumes_exactly(slurm, tmp_path):
    # Long enough that both signals land while it trains (~50 ms a step on 2 cores, 120 steps, ~2 s per attempt to
    # start); every signal goes out as soon as the attempt has logged a step.
    overrides = [*COMMON, "trainer.max_steps=120", "trainer.global_batch_size=64"]
    job = Job(slurm, tmp_path, "megalm-pre", overrides)

    # 1. The time-limit warning of `#SBATCH --signal=B:USR1@120`: USR1 to the batch shell only.
    job.wait(lambda i: len(job.steps()) >= 1, 300, "a logged step")
    job.scancel("--batch", "--signal=USR1")
    info = job.wait(lambda i: i.get("Restarts") == "1", 120, "the requeue after USR1")
    assert info["Restarts"] == "1", f"the run ended before the signal took effect: {info}\n{job.logs()}"
    first_stop = max(job.steps())
    assert first_stop < 120, job.logs()

    # 2. A SIGTERM to the job step (what `scancel --signal=TERM` or `#SBATCH --signal=TERM@T` sends).
    job.wait(lambda i: max(job.steps()) > first_stop, 300, "a step after the resume")
    job.scancel("--signal=TERM")
    info = job.wait(lambda i: i.get("Restarts") == "2", 120, "the requeue after SIGTERM")
    assert info["Restarts"] == "2", f"the run ended before the signal took effect: {info}\n{job.logs()}"
    second_stop = max(job.steps())
    assert first_stop < second_stop < 120, job.logs()

    info = job.finish()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "2"), job.logs()
    logs = job.logs(tail=0)
    assert logs.count("asked to be requeued") == 2, logs
    assert f"resumed from {job.run_dir}/checkpoints/step_{first_stop:08d}" in logs, logs
    assert f"resumed from {job.run_dir}/checkpoints/step_{second_stop:08d}" in logs, logs
    for restart in range(3):  # one log per node and attempt
        assert len(list((job.run_dir / "slurm").glob(f"*-restart{restart}.log"))) == 2, logs
    assert_same_losses(records(job.run_dir), one_process_losses(overrides, tmp_path))


@pytest.mark.timeout(600)
def test_single_node_template_matches_one_process(slurm, tmp_path):
    """torchrun --standalone in one srun step, NPROC_PER_NODE=2 workers (no GPUs): dp2 = one process."""
    overrides = [*COMMON, "trainer.max_steps=4"]
    job = Job(slurm, tmp_path, "megalm-1n", overrides, template="train_single_node.sbatch", nodes=1,
              env={"NPROC_PER_NODE": "2"})
    info = job.finish(timeout=300)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), job.logs()
    assert "2 rank(s): tp=1 pp=1 dp=2" in job.logs(tail=0), job.logs()
    assert_same_losses(records(job.run_dir), one_process_losses(overrides, tmp_path))


@pytest.mark.timeout(300)
def test_failing_run_fails_the_job_without_requeue(slurm, tmp_path):
    """Any exit but 75 is the job's own: a layout error (exit 2 on every rank) fails the job, not requeued."""
    job = Job(slurm, tmp_path, "megalm-bad", [*COMMON, "trainer.max_steps=2", "parallel.tp=3"])
    info = job.finish(timeout=240)
    # srun's status: torchrun's 1, or 143 for the node --kill-on-bad-exit stopped (srun reports the highest)
    assert (info["JobState"], info["Restarts"]) == ("FAILED", "0") and info["ExitCode"] in ("1:0", "143:0"), \
        f"{info}\n{job.logs()}"
    assert "world size 2 is not divisible by tp*pp*cp = 3" in job.logs(tail=0), job.logs()
    # each rank that reached the check failed on its own and said so (a rank that srun's SIGTERM stopped while it
    # started may have asked to be requeued: the failure vetoes it)
    assert list((job.run_dir / "slurm").glob(f"requeue-{job.id}.failed-rank*")), job.logs()
