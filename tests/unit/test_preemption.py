"""Preemption: a signal stops the run after the current step with a checkpoint, the resumed run repeats the
uninterrupted losses, and `megalm-train` exits with the requeue code. Several ranks: tests/dist/test_preemption.py."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megalm.errors import ConfigError
from megalm.training.preemption import REQUEUE_EXIT_CODE, Preemption, _live, signal_numbers
from megalm.training.trainer import Trainer
from megalm.training.validation import validate_run
from tests.conftest import TINY, compose_config

STEPS = 8


def signal_during_step(trainer: Trainer, step: int, sig: signal.Signals) -> None:
    """Make `trainer` receive `sig` (a real signal, to this process) while it computes step `step` (0-based)."""
    train_step = trainer.train_step

    def wrapped(s: int):
        if s == step:
            os.kill(os.getpid(), sig)
        return train_step(s)

    trainer.train_step = wrapped


def live_handler(sig: signal.Signals) -> object:
    """The handler a run gives `sig` back when it ends: the installed one, or, if that is a retired run's (collected
    in another thread, where signal handlers cannot be set), the live one it forwards to."""
    return _live(signal.getsignal(sig))


def test_a_run_collected_in_another_thread_leaves_a_handler_the_next_run_passes_over():
    """A Preemption collected outside the main thread cannot uninstall its handler: it retires, forwarding to the
    one it replaced, and the next run gives the signal back that live handler, not the retired one. (An earlier
    test's trainer collected by a thread once made the tests here compare against the retired one.)"""
    import threading

    gc.collect()
    original = signal.getsignal(signal.SIGUSR1)
    holder = [Preemption(["SIGUSR1"], torch.device("cpu"), distributed=False)]
    collector = threading.Thread(target=lambda: (holder.clear(), gc.collect()))
    collector.start()
    collector.join()
    left = signal.getsignal(signal.SIGUSR1)
    assert left is not original and left.retired and live_handler(signal.SIGUSR1) == original
    with Preemption(["SIGUSR1"], torch.device("cpu"), distributed=False):
        pass
    assert signal.getsignal(signal.SIGUSR1) == original


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_saves_stops_and_the_resumed_run_repeats_the_losses(tmp_path, sig):
    straight = Trainer(compose_config(f"trainer.max_steps={STEPS}"), tmp_path / "straight").fit()

    before = live_handler(sig)
    first = Trainer(compose_config(f"trainer.max_steps={STEPS}"), tmp_path / "run")
    signal_during_step(first, 2, sig)
    summary = first.fit()
    assert summary.preempted and summary.steps == 3, "the step in progress finishes, then the run stops"
    assert summary.checkpoint is not None and summary.checkpoint.name == "step_00000003"
    assert signal.getsignal(sig) == before, "the signal's previous handler is back after fit()"

    resumed = Trainer(compose_config(f"trainer.max_steps={STEPS}"), tmp_path / "run")
    assert resumed.step == 3
    rest = resumed.fit()
    assert not rest.preempted
    assert summary.losses + rest.losses == straight.losses


def test_objects_collected_out_of_order_lose_no_signal():
    """Trainers built and never fitted keep their handlers until they are collected, in any order: collecting one
    must neither uninstall a live run's handler nor put back one whose owner is gone (the signal would be lost)."""
    sig, received = signal.SIGUSR1, []
    before = signal.signal(sig, lambda signum, frame: received.append(signum))
    try:
        first = Preemption(["SIGUSR1"], torch.device("cpu"), distributed=False)
        second = Preemption(["SIGUSR1"], torch.device("cpu"), distributed=False)
        del first
        gc.collect()
        os.kill(os.getpid(), sig)
        assert second.received == sig and not received, "the live object's handler stays installed"
        del second
        gc.collect()
        os.kill(os.getpid(), sig)
        assert received == [sig], "with both gone, the handler from before either is back"
    finally:
        signal.signal(sig, before)


def test_a_run_that_ended_catches_no_more_signals():
    """Two trainers built, both fitted and done: the handler from before is back, even though the first one's was
    what the second replaced (put back, it would catch for a run that has ended)."""
    sig, received = signal.SIGUSR1, []
    before = signal.signal(sig, lambda signum, frame: received.append(signum))
    try:
        first = Preemption(["SIGUSR1"], torch.device("cpu"), distributed=False)
        second = Preemption(["SIGUSR1"], torch.device("cpu"), distributed=False)
        with first:
            pass
        with second:
            pass
        os.kill(os.getpid(), sig)
        assert received == [sig] and first.received is None and second.received is None
    finally:
        signal.signal(sig, before)


def test_no_signal_no_preemption(tmp_path):
    summary = Trainer(compose_config("trainer.max_steps=2", "trainer.preempt_signals=[]"), tmp_path).fit()
    assert not summary.preempted and summary.steps == 2


def test_a_time_limit_stops_like_a_preemption_and_the_resumed_run_repeats_the_losses(tmp_path):
    """trainer.exit_duration_minutes (Megatron-LM's --exit-duration-in-mins): the step during which the limit passes
    finishes, the run saves and stops as a preempted one (exit 75 for a requeue), and the resumed run repeats the
    uninterrupted losses. The clock is moved past the limit during step 3 (the trainer's start, set back an hour)."""
    limit = ["trainer.exit_duration_minutes=30", f"trainer.max_steps={STEPS}"]
    straight = Trainer(compose_config(*limit), tmp_path / "straight").fit()
    assert not straight.preempted and straight.steps == STEPS  # an hour under the limit: no stop
    first = Trainer(compose_config(*limit), tmp_path / "run")
    train_step = first.train_step

    def late(step: int):
        if step == 2:
            first.preemption.started -= 3600
        return train_step(step)

    first.train_step = late
    summary = first.fit()
    assert summary.preempted and summary.steps == 3 and summary.checkpoint.name == "step_00000003"
    resumed = Trainer(compose_config(*limit), tmp_path / "run")
    assert resumed.step == 3
    rest = resumed.fit()
    assert not rest.preempted and summary.losses + rest.losses == straight.losses


def test_a_time_limit_that_passes_in_the_first_step_stops_after_it(tmp_path, caplog):
    """At a real clock: 6 ms pass in the first step of any model (and without signals to catch)."""
    overrides = ["trainer.exit_duration_minutes=0.0001", "trainer.preempt_signals=[]", f"trainer.max_steps={STEPS}"]
    with caplog.at_level("WARNING", logger="megalm"):
        summary = Trainer(compose_config(*overrides), tmp_path).fit()
    assert summary.preempted and summary.steps == 1 and summary.checkpoint.name == "step_00000001"
    assert "trainer.exit_duration_minutes=0.0001 reached" in caplog.text
    with pytest.raises(ConfigError, match=r"trainer.exit_duration_minutes=0.0 must be a finite number > 0"):
        validate_run(compose_config("trainer.exit_duration_minutes=0"), world_size=1)


def test_signal_names_are_checked():
    assert signal_numbers(["SIGTERM", "usr1"]) == [signal.SIGTERM, signal.SIGUSR1]
    for bad in (["SIGKILL"], ["SIGNOPE"]):
        with pytest.raises(ConfigError, match="trainer.preempt_signals"):
            signal_numbers(bad)


def _wait_for_steps(metrics: Path, proc: subprocess.Popen, steps: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run ended (code {proc.returncode}) before step {steps}"
        if metrics.is_file() and sum(1 for line in metrics.read_text().splitlines() if '"step"' in line) >= steps:
            return
        time.sleep(0.05)
    raise TimeoutError(f"no step {steps} in {metrics} after {timeout} s")


@pytest.mark.timeout(300)
def test_megalm_train_exits_with_the_requeue_code(tmp_path):
    """The CLI on SIGTERM: a checkpoint, exit code 75; the same command again finishes the run."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "megalm.train", *TINY, "trainer.max_steps=2000", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_steps(run_dir / "metrics.jsonl", proc, 2)
        proc.send_signal(signal.SIGTERM)
        err, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == REQUEUE_EXIT_CODE, err[-2000:]
    assert "preempted by SIGTERM" in err
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    stopped_at = int(latest.split("_")[1])
    assert 2 <= stopped_at < 2000
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if '"step"' in line]
    assert steps[-1] == stopped_at
    resumed = subprocess.run([*command[:-2], f"trainer.stop_at_step={stopped_at + 2}", command[-1]], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=200)
    assert resumed.returncode == 0, resumed.stdout[-2000:]
    assert f"resumed from {run_dir / 'checkpoints' / latest} at step {stopped_at}" in resumed.stdout


def test_a_signal_while_the_run_starts_up_stops_it_after_its_first_step(tmp_path):
    """The handlers are installed when the Trainer is built (data, model, resume can take minutes): a signal
    then is not lost, and the run stops after step 1 with a checkpoint. Collecting the Trainer gives the signal
    its previous handler back."""
    import gc

    # a trainer an earlier test left in a reference cycle gives its own previous handler back when the collector
    # finds it: collect those first, or one collected below would change the handler this test compares against
    gc.collect()
    before = live_handler(signal.SIGUSR1)
    trainer = Trainer(compose_config(f"trainer.max_steps={STEPS}"), tmp_path)
    assert signal.getsignal(signal.SIGUSR1) is not before
    os.kill(os.getpid(), signal.SIGUSR1)
    summary = trainer.fit()
    assert summary.preempted and summary.steps == 1 and summary.checkpoint.name == "step_00000001"
    assert signal.getsignal(signal.SIGUSR1) == before
    unused = Trainer(compose_config(f"trainer.max_steps={STEPS}"), tmp_path / "unused")
    assert signal.getsignal(signal.SIGUSR1) is not before
    del unused
    gc.collect()
    assert signal.getsignal(signal.SIGUSR1) == before


SIGNAL_AT = {  # a signal (SENT) sent to itself by megalm-train at a point of its start-up
    "imports": "import megalm.train as t; before = t.register_schema\n"
               "t.register_schema = lambda: (os.kill(os.getpid(), SENT), before())[1]",
    "checkpoint_load": "import megalm.training.trainer as tr; before = tr.Trainer.__init__\n"
                       "def init(self, *a, **k): os.kill(os.getpid(), SENT); before(self, *a, **k)\n"
                       "tr.Trainer.__init__ = init\nimport megalm.train as t",
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("at, signals, sent, code", [
    ("imports", None, signal.SIGTERM, REQUEUE_EXIT_CODE),
    ("checkpoint_load", None, signal.SIGTERM, REQUEUE_EXIT_CODE),
    ("checkpoint_load", "[]", signal.SIGTERM, -signal.SIGTERM),
    ("checkpoint_load", "[SIGUSR2]", signal.SIGUSR2, REQUEUE_EXIT_CODE),  # a signal the default list does not name
    ("checkpoint_load", "[SIGUSR2]", signal.SIGTERM, -signal.SIGTERM),  # and one the run's list leaves out
])
def test_a_signal_before_training_began_requeues_the_job(tmp_path, at, signals, sent, code):
    """Preempted during start-up (Slurm's SIGTERM while torch imports, or while a large checkpoint loads), the
    process died of the signal: torchrun reported a failure, no marker, and the job was not requeued. megalm-train
    catches trainer.preempt_signals from its first line: exit 75 and the marker (nothing to save yet); with
    trainer.preempt_signals=[] the signal keeps its default action."""
    marker = tmp_path / "requeue-marker"
    argv = [*TINY, "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'run'}"]
    if signals is not None:
        argv.append(f"trainer.preempt_signals={signals}")
    script = (f"import os, signal, sys\nSENT = {int(sent)}\nsys.argv = ['megalm-train', *{argv!r}]\n{SIGNAL_AT[at]}\n"
              "t.main()\n")
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, "MEGALM_REQUEUE_MARKER": str(marker)},
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert [m.name for m in tmp_path.glob("requeue-marker*")] == (["requeue-marker.rank0-of-1"]
                                                                    if code == REQUEUE_EXIT_CODE else [])
    assert (f"{sent.name} before training began" in proc.stderr) == (code == REQUEUE_EXIT_CODE), proc.stderr[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("during", ["shutdown_distributed", "mark_for_requeue"])
def test_a_second_signal_after_the_checkpoint_still_requeues(tmp_path, during):
    """Slurm's SIGTERM reaches every process of the job, and torchrun forwards its own: a worker can get a second one
    after its preempted run saved, while it shuts down. It exits 75 then, with the marker, where the signal's default
    action had ended it by the signal (-15), a failure to torchrun and the templates; and so while the marker is
    written, where the handlers had been between the trainer's and the shutdown's."""
    marker = tmp_path / "requeue-marker"
    argv = [*TINY, "trainer.max_steps=4", f"hydra.run.dir={tmp_path / 'run'}"]
    script = ("import os, signal, sys\n"
              f"sys.argv = ['megalm-train', *{argv!r}]\n"
              "import megalm.training.trainer as tr\nstep = tr.Trainer.train_step\n"
              "def first(self, *a, **k):\n    os.kill(os.getpid(), signal.SIGTERM)\n    return step(self, *a, **k)\n"
              "tr.Trainer.train_step = first\n"
              "import megalm.train as t\n"
              f"original, sent = t.{during}, []\n"  # the signal once (the handler marks too)
              "def second():\n    if not sent:\n        sent.append(True)\n"
              "        os.kill(os.getpid(), signal.SIGTERM)\n        time.sleep(5)\n    original()\n"
              f"t.{during} = second\n"
              "import time\nt.main()\n")
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, "MEGALM_REQUEUE_MARKER": str(marker)},
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == REQUEUE_EXIT_CODE, proc.stderr[-2000:]
    assert "SIGTERM again after the preempted run's checkpoint" in proc.stderr, proc.stderr[-2000:]
    assert [m.name for m in tmp_path.glob("requeue-marker*")] == ["requeue-marker.rank0-of-1"]
    assert list((tmp_path / "run" / "checkpoints").glob("step_*"))

def test_a_process_that_fails_on_its_own_leaves_a_failure_marker(tmp_path, monkeypatch):
    """The Slurm templates requeue no job in which a process failed on its own: a user error (fail) leaves
    `<marker>.failed-rank<RANK>`."""
    from megalm import train

    marker = tmp_path / "requeue-9"
    monkeypatch.setenv("MEGALM_REQUEUE_MARKER", str(marker))
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(SystemExit):
        train.fail("a config error")
    assert [p.name for p in tmp_path.iterdir()] == ["requeue-9.failed-rank3"]


@pytest.mark.parametrize("signalled", [False, True], ids=["own_failure", "stopped_by_a_preemption"])
def test_a_traceback_leaves_a_failure_marker_unless_a_preemption_signal_came_first(tmp_path, signalled):
    """An exception in training is this process's own failure (the marker vetoes a requeue), unless a preemption
    signal reached it first: then its collectives broke because the other ranks stopped to be requeued."""
    marker = tmp_path / "requeue-marker"
    argv = [*TINY, "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'run'}"]
    script = ("import signal, sys\nimport megalm.train as t\nfrom megalm.training.trainer import Trainer\n"
              "def fit(self):\n"
              f"    if {signalled}:\n        self.preemption.received = signal.SIGTERM\n"
              "    raise RuntimeError('a collective failed')\n"
              f"Trainer.fit = fit\nsys.argv = ['megalm-train', *{argv!r}]\nt.main()\n")
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, "MEGALM_REQUEUE_MARKER": str(marker),
                                                               "RANK": "0"}, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 1 and "a collective failed" in proc.stderr, proc.stderr[-2000:]
    assert [m.name for m in tmp_path.glob("requeue-marker*")] == ([] if signalled else ["requeue-marker.failed-rank0"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("run_dir_named", [True, False])
def test_ctrl_c_stops_with_one_line_that_names_the_checkpoint_to_resume(tmp_path, run_dir_named):
    """Ctrl-C (SIGINT, not a preemption signal by default) during a step printed a hundred lines of traceback ending
    in the GEMM it stopped: now one line naming the checkpoint the same command resumes from, exit 130 (the shell's
    code for SIGINT), and the failure marker (a user's stop is no requeue). The default run dir is a new
    outputs/DATE/TIME per run: the line then names the hydra.run.dir that resumes."""
    marker = tmp_path / "requeue-marker"
    argv = [*TINY, "trainer.max_steps=8", "trainer.save_interval=2"]
    argv += [f"hydra.run.dir={tmp_path / 'run'}"] if run_dir_named else []
    # Python's own SIGINT handler, whatever the harness left: a process started in the background by a shell without
    # job control inherits SIGINT ignored, and Python then installs no KeyboardInterrupt for it
    script = ("import os, signal, sys\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "import megalm.training.trainer as tr\nstep = tr.Trainer.train_step\n"
              "def interrupted(self, s, *a, **k):\n    if s == 3:\n        os.kill(os.getpid(), signal.SIGINT)\n"
              "    return step(self, s, *a, **k)\n"
              f"tr.Trainer.train_step = interrupted\nsys.argv = ['megalm-train', *{argv!r}]\n"
              "import megalm.train as t\nt.main()\n")
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, "MEGALM_REQUEUE_MARKER": str(marker),
                                                               "RANK": "0"}, capture_output=True, text=True,
                          timeout=240, cwd=tmp_path)
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    if run_dir_named:
        run_dir, command = tmp_path / "run", "the same command"
    else:
        [run_dir] = [p.parent for p in (tmp_path / "outputs").glob("*/*/config.yaml")]
        command = f"the same command with hydra.run.dir={run_dir}"
    assert last.startswith(f"megalm-train: interrupted (Ctrl-C); {command} resumes from "
                           f"{run_dir / 'checkpoints' / 'step_00000002'}."), proc.stderr[-2000:]
    assert [m.name for m in tmp_path.glob("requeue-marker*")] == ["requeue-marker.failed-rank0"]


@pytest.mark.parametrize("argv, said", [
    (["-m", "optim.lr=1e-3,2e-3"], "this sweep job's checkpoint is {ckpt}: run the job alone (without -m) with "
                                   "'hydra.run.dir={run}' to resume it"),  # the sweep again makes a new sweep dir
    (["optim.lr=1e-3"], "the same command with 'hydra.run.dir={run}' resumes from {ckpt}"),  # quoted: a space
])
def test_the_ctrl_c_line_names_a_command_that_resumes(tmp_path, argv, said):
    run = tmp_path / "my runs" / "run"
    ckpt = run / "checkpoints" / "step_00000002"
    script = ("import sys\nfrom pathlib import Path\nimport megalm.training.checkpoint as c\n"
              f"c.latest_checkpoint = lambda run_dir: Path(run_dir) / 'checkpoints' / 'step_00000002'\n"
              f"sys.argv = ['megalm-train', *{argv!r}]\nfrom megalm.train import stop_on_interrupt\n"
              f"stop_on_interrupt(Path({str(run)!r}), 0)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MEGALM_REQUEUE_MARKER": str(tmp_path / "marker")})
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert proc.stderr.strip() == ("megalm-train: interrupted (Ctrl-C); " + said.format(run=run, ckpt=ckpt) +
                                   ". To save on Ctrl-C first, add SIGINT to trainer.preempt_signals"), proc.stderr


def test_a_ctrl_c_inside_a_checkpoint_write_is_no_disk_to_free(tmp_path):
    """DCP catches what stops its write, a KeyboardInterrupt too, and hands it on wrapped in a CheckpointException:
    that was reported as a write failure ("free space on ..."); it is a KeyboardInterrupt again."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from megalm.errors import CheckpointError
    from megalm.training.checkpoint.tensors import write_failed

    stack = traceback.StackSummary.from_list([])
    assert isinstance(write_failed(tmp_path, CheckpointException("save", {0: (KeyboardInterrupt(), stack)})),
                      KeyboardInterrupt)
    full = write_failed(tmp_path, CheckpointException("save", {0: (OSError(28, "No space left on device"), stack)}))
    assert isinstance(full, CheckpointError) and "No space left on device" in str(full) and "free space" in str(full)
    # only a full disk is said to be one: a denied rename or a config that would not serialise names its own fix
    for other in (PermissionError(13, "Permission denied"), ValueError("cannot represent an object")):
        line = str(write_failed(tmp_path, other))
        assert str(other) in line and "free space" not in line and "fix what it names" in line, line


def test_a_torchrun_that_ignores_the_shutdown_timeout_is_said(monkeypatch):
    """The Slurm templates give torchrun's workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT=100 s to save after a preemption's
    SIGTERM; torch 2.11's torchrun (the Docker image's) does not read it and SIGKILLs them after 30 s, without a word
    (an audit, 2026-12-06). Said where it is set and not read; nothing where torchrun reads it or it is not set."""
    from torch.distributed.launcher.api import LaunchConfig

    from megalm.training.preemption import unread_shutdown_timeout

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "100")
    reads = "shutdown_timeout" in LaunchConfig.__annotations__
    assert (unread_shutdown_timeout() is None) == reads
    monkeypatch.setattr(LaunchConfig, "__annotations__", {k: v for k, v in LaunchConfig.__annotations__.items()
                                                          if k != "shutdown_timeout"})  # a torchrun before 2.12
    line = unread_shutdown_timeout()
    assert line is not None and line.startswith("TORCH_ELASTIC_SHUTDOWN_TIMEOUT=100 is not read by torch ")
    assert "SIGKILLs the workers in 30 s" in line
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    assert unread_shutdown_timeout() is None
