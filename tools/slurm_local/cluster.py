"""A throwaway Slurm cluster on this one host: munged, slurmctld and N slurmd ("nodes" n1..nN), all as root.

Every file it writes (munge key, slurm.conf, state, spool, logs, pid files) lives under one directory that the
caller owns; the daemons run in the foreground as children of this process, so `stop()` ends exactly the
processes it started, by pid (from the command line, `start` records them in DIR/pids.json for `stop`). Nothing
under /etc or /run is touched: clients find the cluster through the SLURM_CONF variable of `env()`.

    python tools/slurm_local/cluster.py start /tmp/slurm-lab   # prints `export SLURM_CONF=...`; daemons stay up
    python tools/slurm_local/cluster.py stop /tmp/slurm-lab    # ends them, by the pids `start` recorded

Used by tests/e2e/test_slurm.py. Needs the Debian packages slurm-wlm (or slurmctld, slurmd, slurm-client) and
munge; `ensure_installed()` installs them with apt-get when they are missing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo")


def missing_binaries() -> list[str]:
    return [name for name in DAEMONS if shutil.which(name) is None and not Path(f"/usr/sbin/{name}").exists()]


def ensure_installed() -> str | None:
    """Install Slurm and munge from the distribution when missing; returns why not possible, or None."""
    if not missing_binaries():
        return None
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        return "Slurm is not installed and apt-get (as root) is not available to install slurm-wlm and munge"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "slurm-wlm", "munge"]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            return f"`{' '.join(cmd)}` failed: {proc.stderr[-500:]}"
    return None if not missing_binaries() else f"still missing after apt-get: {missing_binaries()}"


def free_port() -> int:
    """A TCP port nobody listens on now (the kernel's pick; another process could take it, but rarely does)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cancel_jobs(env: dict[str, str], timeout: float = 30) -> None:
    """Cancel every job of the cluster `env` points at and wait for their processes (slurmstepd's children, not
    ours) to end; quiet when slurmctld does not answer."""
    def queue(*states: str) -> str:
        argv = ["squeue", "-h", "-o", "%i", *(["-t", ",".join(states)] if states else [])]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    if not queue():
        return
    subprocess.run(["scancel", "--full", "--user", "root"], env=env, capture_output=True, timeout=30)
    deadline = time.monotonic() + timeout
    while queue("running", "completing") and time.monotonic() < deadline:
        time.sleep(0.5)


def sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class LoopbackCluster:
    """`nodes` slurmd on 127.0.0.1 with distinct names and ports, one partition `debug` holding all of them."""

    def __init__(self, root: Path | str, nodes: int = 2, cpus_per_node: int = 1):
        self.root = Path(root).resolve()
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.cpus = cpus_per_node
        self.procs: dict[str, subprocess.Popen] = {}
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"

    def env(self) -> dict[str, str]:
        """The environment for Slurm clients (sbatch, squeue, scontrol) talking to this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    # ------------------------------------------------------------------ files

    def write_files(self) -> None:
        for sub in ("munge", "state", "spool", "log", "run"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        ctld_port = free_port()
        node_lines = [f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={free_port()} "
                      f"CPUs={self.cpus} RealMemory=1000 State=UNKNOWN" for name in self.nodes]
        r = self.root
        self.conf.write_text("\n".join([
            "# A loopback test cluster written by tools/slurm_local/cluster.py: every node is this host.",
            "ClusterName=megalmtest",
            "SlurmctldHost=localhost",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire: also how long a requeued job waits before it may start again (default 120 s)
            f"AuthInfo=socket={self.munge_socket},cred_expire=10",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/run/slurmctld.pid",
            f"SlurmdPidFile={r}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            f"PlugStackConfig={r}/plugstack.conf",
            "ProctrackType=proctrack/linuxproc",  # no cgroups: the test host may have none writable
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=2",  # start a requeued job as soon as it may start
            "MpiDefault=none",
            "SwitchType=switch/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "ReturnToService=2",
            "JobRequeue=1",
            "MinJobAge=3600",  # no slurmdbd, hence no sacct: finished jobs stay visible to scontrol
            "KillWait=30",
            "SlurmdTimeout=60",
            "SlurmdParameters=config_overrides",  # trust the CPUs here, not the host's count
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            *node_lines,
            f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))
        (r / "plugstack.conf").write_text("")

    # ------------------------------------------------------------------ daemons

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 - the child holds it
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=self.env(), start_new_session=True)
        log.close()

    def start(self, timeout: float = 60) -> None:
        self.write_files()
        m = self.root / "munge"
        self._spawn("munged", [sbin("munged"), "-F", "--force", f"--socket={self.munge_socket}",
                               f"--key-file={m / 'munge.key'}", f"--pid-file={m / 'munged.pid'}",
                               f"--log-file={m / 'munged.log'}", f"--seed-file={m / 'munged.seed'}"])
        self._wait(lambda: self.munge_socket.exists(), timeout, "munged did not create its socket")
        self._spawn("slurmctld", [sbin("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._wait(lambda: self._ok(["scontrol", "ping"], "UP"), timeout, "slurmctld did not answer scontrol ping")
        for node in self.nodes:
            (self.root / "spool" / node).mkdir(exist_ok=True)
            self._spawn(f"slurmd-{node}", [sbin("slurmd"), "-D", "-N", node, "-f", str(self.conf)])
        self._wait(self.all_idle, timeout, "the nodes did not become idle")

    def all_idle(self) -> bool:
        out = self._run(["sinfo", "-h", "-N", "-o", "%N %t"])
        states = dict(line.split() for line in out.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in self.nodes)

    def stop(self) -> None:
        """Cancel this cluster's jobs (their processes belong to slurmstepd, not to us), then end the daemons this
        object started (slurmd first, munged last), by pid; SIGKILL stragglers."""
        ctld = self.procs.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            cancel_jobs(self.env())
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        self.procs.clear()

    def _run(self, argv: list[str]) -> str:
        proc = subprocess.run(argv, env=self.env(), capture_output=True, text=True, timeout=30)
        return proc.stdout if proc.returncode == 0 else ""

    def _ok(self, argv: list[str], needle: str) -> bool:
        return needle in self._run(argv)

    def _wait(self, ready, timeout: float, message: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{message}: {dead} exited; logs under {self.root / 'log'}\n{self.logs_tail()}")
            if ready():
                return
            time.sleep(0.5)
        raise RuntimeError(f"{message} within {timeout:.0f} s; logs under {self.root / 'log'}\n{self.logs_tail()}")

    def logs_tail(self, chars: int = 1500) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")) + [self.root / "munge" / "munged.log"]:
            if path.is_file():
                parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)


    # ------------------------------------------------------------------ across processes (the command line)

    def save_pids(self) -> None:
        (self.root / "pids.json").write_text(json.dumps({n: p.pid for n, p in self.procs.items()}))

    @staticmethod
    def running_recorded(root: Path | str) -> dict[str, int]:
        """{name: pid} of the daemons a `start` command recorded under `root` that still run: pids whose command line
        still names `root` (a pid reused by another process since is not one)."""
        root = Path(root).resolve()
        if not (root / "pids.json").exists():
            return {}
        running = {}
        for name, pid in json.loads((root / "pids.json").read_text()).items():
            try:
                if str(root) in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode():
                    running[name] = pid
            except (FileNotFoundError, ProcessLookupError):
                continue
        return running

    @staticmethod
    def stop_recorded(root: Path | str) -> list[str]:
        """End the daemons a `start` command recorded under `root` (`running_recorded`). Returns the names it
        stopped."""
        root = Path(root).resolve()
        if not (root / "pids.json").exists():
            return []
        pids = LoopbackCluster.running_recorded(root)
        cancel_jobs({**os.environ, "SLURM_CONF": str(root / "slurm.conf")})
        stopped = []
        for name, pid in reversed(list(pids.items())):
            try:
                os.kill(pid, signal.SIGTERM)
            except (FileNotFoundError, ProcessLookupError):
                continue
            deadline = time.monotonic() + 15
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            if Path(f"/proc/{pid}").exists():
                os.kill(pid, signal.SIGKILL)
            stopped.append(name)
        (root / "pids.json").unlink()
        return stopped


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] not in ("start", "stop"):
        sys.exit(__doc__)
    if sys.argv[1] == "stop":
        print("stopped:", ", ".join(LoopbackCluster.stop_recorded(sys.argv[2])) or "nothing")
        return
    if running := LoopbackCluster.running_recorded(sys.argv[2]):  # a second start lost the first one's pids
        sys.exit(f"error: {sys.argv[2]} already runs a cluster ({', '.join(running)}); stop it first: python "
                 f"{sys.argv[0]} stop {sys.argv[2]}")
    why = ensure_installed()
    if why:
        sys.exit(f"error: {why}")
    cluster = LoopbackCluster(sys.argv[2])
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    cluster.save_pids()  # the daemons run in their own sessions and outlive this command
    print(f"export SLURM_CONF={cluster.conf}  # nodes {', '.join(cluster.nodes)}, partition debug; "
          f"stop: python {sys.argv[0]} stop {cluster.root}")


if __name__ == "__main__":
    main()
