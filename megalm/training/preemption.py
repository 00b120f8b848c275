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
import weakref
from collections.abc import Callable
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


def _restore(previous: dict[signal.Signals, object]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    previous.clear()


class Preemption:
    """Catches the preemption signals while a run trains (a context manager) and agrees on stopping."""

    def __init__(self, names: list[str], device: torch.device, distributed: bool) -> None:
        """Installs the handlers at once (a job preempted while it loads data, builds the model or resumes stops
        after its first step, requeued too); leaving the `with` block (the end of `Trainer.fit`), or this object
        being collected, gives the signals back their previous handlers."""
        self.signals = signal_numbers(names)
        self.device, self.distributed = device, distributed
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}
        self._install()
        weakref.finalize(self, _restore, self._previous)

    @staticmethod
    def _handler(ref: weakref.ref) -> Callable[[int, FrameType | None], None]:
        """The signal handler: it only sets the flag, and holds this object weakly (so that collecting it restores
        the previous handlers)."""
        def handle(signum: int, frame: FrameType | None) -> None:
            owner = ref()
            if owner is not None and owner.received is None:
                owner.received = signal.Signals(signum)
        return handle

    def _install(self) -> None:
        if self._previous:
            return
        if threading.current_thread() is not threading.main_thread():
            if self.signals:
                log.warning("preemption signals are not caught: the trainer runs outside the main thread")
            return
        handle = self._handler(weakref.ref(self))
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, handle)

    def __enter__(self) -> Preemption:
        self._install()
        return self

    def __exit__(self, *exc) -> None:
        _restore(self._previous)

    def log_stop(self, step: int, checkpoint: object) -> None:
        who = self.received.name if self.received is not None else "a signal to another rank"
        log.warning(f"preempted by {who}: saved {checkpoint} at step {step}; exiting with {REQUEUE_EXIT_CODE} for "
                    "the launcher to requeue the run")

    def requested(self) -> bool:
        """Whether any rank received a preemption signal (collective when distributed: call it on every rank)."""
        flag = self.received is not None
        if not self.distributed or not self.signals:  # nothing to agree on: no collective, no host sync
            return flag
        t = torch.tensor(float(flag), device=self.device)  # on the device: NCCL reduces no CPU tensors
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())
