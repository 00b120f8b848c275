"""How the Slurm templates find their Python: scripts/slurm/lib.sh activates MEGALM_VENV, prefixes torchrun with
MEGALM_LAUNCH (a container), and stops with one line when neither gives it a torchrun. Sourced in plain bash (no
Slurm needed: lib.sh does this when sourced); the real-Slurm runs are tests/e2e/test_slurm.py."""

from __future__ import annotations

import importlib.util
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


def fake_tools(tmp_path: Path, getent: str, hostname: str) -> Path:
    """getent and hostname stand-ins printing what a cluster's would."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, output in (("getent", getent), ("hostname", hostname)):
        (bin_dir / name).write_text(f"#!/bin/sh\nprintf '{output}'\n")
        os.chmod(bin_dir / name, 0o755)
    return bin_dir


def rdzv_host(tmp_path: Path, getent: str, hostname: str, node: str = "") -> str:
    bin_dir = fake_tools(tmp_path, getent, hostname)
    script = f'source "{LIB}" && megalm_rdzv_host gpu-001'
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "MEGALM_ROOT": str(ROOT),
           "MEGALM_LAUNCH": "stand-in", "SLURMD_NODENAME": node}
    proc = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_the_head_node_lookup_skips_loopback_addresses(tmp_path):
    """train.sbatch's rendezvous host (the real-Slurm test forces MEGALM_RDZV_HOST, so it is tested here)."""
    hosts = "127.0.1.1 STREAM gpu-001\\n10.0.0.5 STREAM gpu-001\\n"
    assert rdzv_host(tmp_path, hosts, "10.9.9.9") == "10.0.0.5"
    # the name resolves to loopback only: on the head node, its own first address; elsewhere the name
    assert rdzv_host(tmp_path, "127.0.1.1 STREAM gpu-001\\n", "10.1.2.3 172.17.0.1\\n", node="gpu-001") == "10.1.2.3"
    assert rdzv_host(tmp_path, "127.0.1.1 STREAM gpu-001\\n", "10.1.2.3\\n", node="gpu-002") == "gpu-001"


def run_and_requeue(tmp_path: Path, markers: list[str], srun_exit: int) -> tuple[subprocess.CompletedProcess, bool]:
    """megalm_srun_and_requeue with a stand-in srun that leaves `markers` (as the job's processes would) and exits
    with `srun_exit`, and a scontrol that records a requeue."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    marker = tmp_path / "requeue-7"
    touches = "".join(f"touch {marker}.{m}\n" for m in markers)
    for name, body in (("srun", f"{touches}exit {srun_exit}\n"), ("scontrol", f"touch {tmp_path}/requeued\n"),
                       ("torchrun", "")):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}")
        os.chmod(bin_dir / name, 0o755)
    (tmp_path / "requeue-7.rank5-of-8").touch()  # markers left by an earlier attempt: cleared before srun
    (tmp_path / "requeue-7.failed-rank3").touch()
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "MEGALM_ROOT": str(ROOT), "SLURM_JOB_ID": "7",
           "MEGALM_REQUEUE_MARKER": str(marker)}
    proc = subprocess.run(["bash", "-c", f'source "{LIB}" && megalm_srun_and_requeue --nodes=2'], env=env,
                          capture_output=True, text=True, timeout=60)
    return proc, (tmp_path / "requeued").exists()


def test_a_job_is_requeued_when_its_processes_asked_and_none_failed_on_its_own(tmp_path):
    """A rank that failed on its own (a config error: exit 2) made srun SIGTERM the others; those still starting up
    exit 75 with their marker, and that one marker requeued the job, which then failed again (found in CI's Slurm
    test). The failing rank leaves a failure marker now, which vetoes the requeue; a preemption whose ranks stopped
    at different points (some asked, some died in a collective, none failed on its own) is still requeued, as is
    srun's own 75."""
    proc, requeued = run_and_requeue(tmp_path / "all", ["rank0-of-2", "rank1-of-2"], 1)
    assert (proc.returncode, requeued) == (0, True), proc.stderr
    proc, requeued = run_and_requeue(tmp_path / "some", ["rank1-of-2"], 143)
    assert (proc.returncode, requeued) == (0, True), proc.stderr
    proc, requeued = run_and_requeue(tmp_path / "failed", ["rank1-of-2", "failed-rank0"], 143)
    assert (proc.returncode, requeued) == (143, False), proc.stderr
    assert "1 process(es) asked to be requeued, but 1 failed on their own (failed-rank0): not requeued" in proc.stderr
    proc, requeued = run_and_requeue(tmp_path / "none", [], 1)
    assert (proc.returncode, requeued) == (1, False), proc.stderr
    proc, requeued = run_and_requeue(tmp_path / "single", [], 75)
    assert (proc.returncode, requeued) == (0, True), proc.stderr


def test_a_job_s_run_dir_reaches_hydra_whatever_its_name_holds(tmp_path):
    """The templates' hydra.run.dir=... of a job named `7b,lr=3e-4(v2)` (a comma is a sweep to Hydra, parentheses and
    '=' do not parse unquoted: the job trained nothing and exited 1), or holding a '${' (an interpolation to OmegaConf,
    which Hydra's config resolves: the job failed to start), reads back as the dir, and megalm-train's pre-check reads
    the value as Hydra and OmegaConf do (here a file where the dir should be: refused with its one line)."""
    import sys

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from megalm.train import override_value

    parser = OverridesParser.create()
    for name in ("7b,lr=3e-4(v2)", "it's [a] #1", "back\\slash", "ends\\", "q\\'x", "a${b}", "c\\${d}", "e\\\\${f}'"):
        script = f'source "{LIB}" >/dev/null && megalm_run_dir_override "$1"'
        env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MEGALM_ROOT": str(ROOT), "MEGALM_LAUNCH": "stand-in"}
        proc = subprocess.run(["bash", "-c", script, "_", f"/runs/{name}-42"], env=env, capture_output=True, text=True,
                              timeout=60)
        # as Hydra's config holds it: the override's value, resolved by OmegaConf
        resolved = OmegaConf.create({"dir": parser.parse_override(proc.stdout).value()}).dir
        assert resolved == override_value(proc.stdout) == f"/runs/{name}-42", proc.stdout
        # the run dir the job's own lines use (its logs, the requeue marker) is the one Hydra reads from it
        script = f'source "{LIB}" >/dev/null && megalm_run_dir "$1"'
        found = subprocess.run(["bash", "-c", script, "_", proc.stdout], env={**env, "SLURM_JOB_ID": "42"},
                               capture_output=True, text=True, timeout=60)
        assert found.stdout == f"/runs/{name}-42\n", (proc.stdout, found.stdout, found.stderr)
    taken = tmp_path / "7b,lr=3e-4(v2)-42"
    taken.write_text("")
    proc = subprocess.run([sys.executable, "-m", "megalm.train", f"hydra.run.dir='{taken}'"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and f"hydra.run.dir={taken} is a file" in proc.stderr, proc.stderr


def test_a_prefixed_run_dir_override_is_the_job_s_run_dir(tmp_path):
    """++hydra.run.dir= sets the run dir in Hydra as hydra.run.dir= does: the templates added their own beside it, so
    the job's logs and requeue marker went to outputs/ while it trained elsewhere (an audit, 2026-12-06).
    (+hydra.run.dir= Hydra refuses in one line, the key existing: its job's lines go to the dir it named.)"""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MEGALM_ROOT": str(ROOT), "MEGALM_LAUNCH": "stand-in",
           "SLURM_JOB_ID": "42", "SLURM_SUBMIT_DIR": "/submit"}
    for override, sets in (("hydra.run.dir=/runs/a", True), ("+hydra.run.dir=/runs/a", True),
                           ("++hydra.run.dir=/runs/a", True), ("model.hydra.run.dir=/runs/a", False)):
        script = f'source "{LIB}" >/dev/null && megalm_run_dir "$1" && (megalm_sets_run_dir "$1" && echo sets || :)'
        proc = subprocess.run(["bash", "-c", script, "_", override], env=env, capture_output=True, text=True,
                              timeout=60)
        expected = "/runs/a\nsets\n" if sets else "/submit/outputs/megalm-42\n"
        assert proc.stdout == expected, (override, proc.stdout, proc.stderr)


def test_a_job_submitted_outside_the_checkout_is_one_line(tmp_path):
    """sbatch runs a copy of the template, which finds lib.sh in the submit dir: submitted elsewhere it failed with
    bash's "lib.sh: No such file or directory" (an audit on a real Slurm, 2026-12-06)."""
    for template in ("train.sbatch", "train_single_node.sbatch"):
        env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SLURM_SUBMIT_DIR": str(tmp_path)}
        proc = subprocess.run(["bash", str(ROOT / "scripts" / "slurm" / template)], env=env, capture_output=True,
                              text=True, timeout=60, cwd=tmp_path)
        assert proc.returncode == 2 and proc.stderr == (f"error: {tmp_path} is not a megalm checkout; submit from it "
                                                        "or set MEGALM_ROOT=/path/to/megalm\n"), proc.stderr


def test_a_second_loopback_cluster_start_on_a_running_dir_is_refused(tmp_path):
    """`cluster.py start DIR` twice started a second set of daemons and overwrote DIR/pids.json, so `stop` left the
    first set running (an audit, 2026-12-06); a pids.json whose pids are gone (or reused) does not refuse."""
    import json
    import sys

    daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(tmp_path)])
    try:
        (tmp_path / "pids.json").write_text(json.dumps({"slurmctld": daemon.pid}))
        cluster = [sys.executable, str(ROOT / "tools" / "slurm_local" / "cluster.py"), "start", str(tmp_path)]
        proc = subprocess.run(cluster, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1 and proc.stderr.startswith(f"error: {tmp_path} already runs a cluster "
                                                               "(slurmctld); stop it first"), proc.stderr
    finally:
        daemon.kill()
        daemon.wait()
    spec = importlib.util.spec_from_file_location("slurm_local_cluster", ROOT / "tools" / "slurm_local" / "cluster.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.LoopbackCluster.running_recorded(tmp_path) == {}
