"""Preemption: a signal asks the run to stop at the next step boundary, with a checkpoint, and to be requeued.

Schedulers warn before they take nodes back: Slurm sends SIGTERM to every process of a job (or the signal of
`#SBATCH --signal`) and SIGKILLs it `KillWait` seconds later; torchrun forwards SIGTERM to its workers. The
handler only sets a flag, because a checkpoint written from inside a signal handler could interrupt a collective
half-way. The trainer asks `requested()` after each optimizer step; ranks see the signal at different moments,
so the flag is max-reduced over all ranks and every rank stops after the same step. The run then saves and the
process exits with `REQUEUE_EXIT_CODE` (EX_TEMPFAIL, "try again"): the Slurm templates (scripts/slurm/) requeue
the job on it, and the next launch resumes from that checkpoint with `trainer.resume=auto`, exactly.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

import torch
import torch.distributed as dist

from megalm.errors import ConfigError

log = logging.getLogger("megalm")

REQUEUE_EXIT_CODE = 75  # sysexits.h EX_TEMPFAIL


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


class Preemption:
    """Catches the preemption signals while a run trains (a context manager) and agrees on stopping."""

    def __init__(self, names: list[str], device: torch.device, distributed: bool) -> None:
        self.signals = signal_numbers(names)
        self.device, self.distributed = device, distributed
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)

    def __enter__(self) -> Preemption:
        if threading.current_thread() is not threading.main_thread():
            if self.signals:
                log.warning("preemption signals are not caught: the trainer runs outside the main thread")
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def log_stop(self, step: int, checkpoint: object) -> None:
        who = self.received.name if self.received is not None else "a signal to another rank"
        log.warning(f"preempted by {who}: saved {checkpoint} at step {step}; exiting with {REQUEUE_EXIT_CODE} for "
                    "the launcher to requeue the run")

    def requested(self) -> bool:
        """Whether any rank received a preemption signal (collective when distributed: call it on every rank)."""
        flag = self.received is not None
        if not self.distributed:
            return flag
        t = torch.tensor(float(flag), device=self.device)  # on the device: NCCL reduces no CPU tensors
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())
