"""Preemption: a signal asks the run to stop at the next step boundary, with a checkpoint, and to be requeued.

Schedulers warn before they take nodes back: Slurm sends SIGTERM to every process of a job (or the signal of
`#SBATCH --signal`) and SIGKILLs it `KillWait` seconds later; torchrun forwards SIGTERM to its workers. The
handler only sets a flag, because a checkpoint written from inside a signal handler could interrupt a collective
half-way. Ranks see the signal at different moments, so the flag is max-reduced over all ranks on the device
within each step and read with the step's totals (`reduced_flag`, no host sync of its own), and again at a step
that evaluated or saved (`agreed_now`: a signal during a save is not left for the next step); every rank stops
after the same step. The run then saves and the process exits with `REQUEUE_EXIT_CODE` (EX_TEMPFAIL, "try
again"): the Slurm templates (scripts/slurm/) requeue the job on it, and the next launch resumes from that
checkpoint with `trainer.resume=auto`, exactly.

A time limit stops the run the same way (`trainer.exit_duration_minutes`, Megatron-LM's --exit-duration-in-mins):
once that many minutes have passed since the trainer started, on any rank's clock, every rank stops after the same
step, saves and exits for a requeue, which suits a scheduler that kills a job at its time limit and sends no signal
first (or one whose save would not fit between the signal and the kill). It rides on the same flag, so it adds no
collective and no host sync to a step.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from types import FrameType

import torch
import torch.distributed as dist

from megalm.errors import REQUEUE_EXIT_CODE as REQUEUE_EXIT_CODE  # re-exported: its users read it here
from megalm.errors import ConfigError

log = logging.getLogger("megalm")


def signal_numbers(names: list[str]) -> list[signal.Signals]:
    """`trainer.preempt_signals` names (SIGTERM, USR1, ...) as signals; a one-line ConfigError for a bad name."""
    found = []
    for name in names:
        key = name.upper() if name.upper().startswith("SIG") else f"SIG{name.upper()}"
        if key in ("SIGKILL", "SIGSTOP") or not hasattr(signal.Signals, key):
            raise ConfigError(f"trainer.preempt_signals has {name!r}, not a signal a process can catch; use names "
                              "such as SIGTERM, SIGUSR1 (or [] to turn preemption handling off)")
        found.append(signal.Signals[key])
    return found


def _retired(handler: object) -> bool:
    """Whether `handler` is a `Preemption`'s that no longer catches: its owner was collected, or left its `with`."""
    return getattr(handler, "owner", None) is not None and (handler.owner() is None or handler.retired)


def _live(handler: object) -> object:
    """`handler`, or, if it is a retired `Preemption` handler, the first live one it replaced."""
    while _retired(handler):
        handler = handler.previous
    return handler


def _forward(handler: object, signum: int, frame: FrameType | None) -> None:
    """Do what `handler` (the handler a retired `Preemption` handler replaced) would have done with the signal."""
    handler = _live(handler)
    if callable(handler):
        handler(signum, frame)
    elif handler == signal.SIG_DFL:  # the default action (terminate), as if the signal had never been caught
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _restore(installed: dict[signal.Signals, Callable]) -> None:
    """Give each signal back the handler ours replaced, if ours is still the one installed. Objects are collected
    in any order (a Trainer built and never fitted keeps its handlers until then): restoring a handler that is no
    longer ours would uninstall a live run's and put back one whose owner is gone, and the signal would be lost.
    A handler left behind retires (its owner left its `with` or was collected) and forwards to the one it replaced."""
    for ours in installed.values():
        ours.retired = True  # from now on it forwards to what it replaced, wherever it is left in a chain
    if threading.current_thread() is not threading.main_thread():  # the collector may run in any thread
        return
    for sig, ours in installed.items():
        previous = _live(ours.previous)
        if signal.getsignal(sig) is ours and previous is not None:
            signal.signal(sig, previous)
    installed.clear()


def unread_shutdown_timeout() -> str | None:
    """One line when this process runs under a torchrun that does not read TORCH_ELASTIC_SHUTDOWN_TIMEOUT (set by the
    Slurm templates: the time torchrun gives its workers to save after forwarding SIGTERM) though it is set: torch
    before 2.12, whose torchrun SIGKILLs them after 30 s. None otherwise."""
    from torch.distributed.launcher.api import LaunchConfig

    asked = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    if asked is None or "TORCHELASTIC_RUN_ID" not in os.environ or "shutdown_timeout" in LaunchConfig.__annotations__:
        return None
    return (f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={asked} is not read by torch {torch.__version__}'s torchrun (torch 2.12+ "
            "reads it): after forwarding a preemption's SIGTERM it SIGKILLs the workers in 30 s, so a checkpoint that "
            "takes longer to write is lost")


class Preemption:
    """Catches the preemption signals while a run trains (a context manager) and agrees on stopping."""

    def __init__(self, names: list[str], device: torch.device, distributed: bool,
                 exit_minutes: float | None = None) -> None:
        """Installs the handlers at once (a job preempted while it loads data, builds the model or resumes stops
        after its first step, requeued too); leaving the `with` block (the end of `Trainer.fit`), or this object
        being collected, gives the signals back their previous handlers. `exit_minutes`: stop too once that many
        minutes have passed since now (`trainer.exit_duration_minutes`; None: no time limit)."""
        self.signals = signal_numbers(names)
        self.device, self.distributed = device, distributed
        self.received: signal.Signals | None = None
        self.exit_minutes, self.started = exit_minutes, time.monotonic()
        self.watching = bool(self.signals) or exit_minutes is not None  # whether there is anything to agree on
        self._installed: dict[signal.Signals, Callable] = {}
        self._install()
        weakref.finalize(self, _restore, self._installed)
        if self.signals and os.environ.get("RANK", "0") == "0" and (line := unread_shutdown_timeout()):
            log.warning(line)

    @staticmethod
    def _handler(ref: weakref.ref, previous: object) -> Callable[[int, FrameType | None], None]:
        """The signal handler: it only sets the flag. It holds this object weakly (so that collecting it restores
        the previous handlers), and once this object is gone it forwards to `previous`, the handler it replaced."""
        def handle(signum: int, frame: FrameType | None) -> None:
            if _retired(handle):
                _forward(previous, signum, frame)
            elif (owner := ref()).received is None:
                owner.received = signal.Signals(signum)
        handle.owner, handle.previous, handle.retired = ref, previous, False
        return handle

    def _install(self) -> None:
        if self._installed:
            return
        if threading.current_thread() is not threading.main_thread():
            if self.signals:
                log.warning("preemption signals are not caught: the trainer runs outside the main thread")
            return
        for sig in self.signals:
            self._installed[sig] = handle = self._handler(weakref.ref(self), signal.getsignal(sig))
            signal.signal(sig, handle)

    def __enter__(self) -> Preemption:
        self._install()
        return self

    def __exit__(self, *exc) -> None:
        _restore(self._installed)

    def minutes(self) -> float:
        """Minutes since the trainer started (this object was made)."""
        return (time.monotonic() - self.started) / 60

    def due(self) -> bool:
        """Whether this process asks to stop: a signal came, or the time limit has passed on its clock."""
        return self.received is not None or (self.exit_minutes is not None and self.minutes() >= self.exit_minutes)

    def log_stop(self, step: int, checkpoint: object) -> None:
        if self.received is not None:
            why = f"preempted by {self.received.name}"
        elif self.due():
            why = f"trainer.exit_duration_minutes={self.exit_minutes:g} reached ({self.minutes():.1f} minutes in)"
        else:
            why = "stopped by another rank (a preemption signal or trainer.exit_duration_minutes on its clock)"
        log.warning(f"{why}: saved {checkpoint} at step {step}; exiting with {REQUEUE_EXIT_CODE} for the launcher to "
                    "requeue the run")

    def reduced_flag(self) -> torch.Tensor:
        """Whether any rank asks to stop (`due`: a signal, or the time limit), max-reduced over every rank on the
        device (collective when distributed: every rank calls it at the same point of its step), for the step's one
        host read: a float64 tensor of one element, or of none when there is nothing to agree on (one process, or no
        signals caught and no time limit).
        Read on its own after the step, it cost every step a second host sync, which kept the host from queueing the
        next step's kernels."""
        if not self.distributed or not self.watching:
            return torch.zeros(0, dtype=torch.float64, device=self.device)
        # a kernel, no copy to wait on; on the device: NCCL reduces no CPU tensors
        flag = torch.full((1,), float(self.due()), dtype=torch.float64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    def requested(self, reduced: float | None) -> bool:
        """Whether to stop: `reduced`, the step's read of `reduced_flag()`, where the ranks agree; else this
        process's own `due`."""
        if not self.distributed or not self.watching:
            return self.due()
        if reduced is None:
            raise ValueError("a distributed run agrees on preemption: pass the step's read of reduced_flag()")
        return bool(reduced)

    def agreed_now(self) -> bool:
        """Whether any rank asks to stop, agreed now (collective, and a host sync: only at a step boundary
        where every rank waited anyway, after an evaluation or a save)."""
        flag = self.reduced_flag()
        return bool(flag.item()) if flag.numel() else self.due()
