"""Guards of a long run: non-finite steps skipped (or stopping the run), loss spikes reported, and no checkpoint
written from non-finite weights.

One bad batch or an fp8 overflow can make a step's loss or gradient norm inf/NaN. Applying that update would
poison the weights and the Adam moments for good, and the next checkpoint would carry them. So the trainer reads
the step's loss and global grad norm before `optimizer.step()` (the step's one host sync, moved ahead of the
update as in Megatron-LM's found-inf check) and skips the update when either is not finite: the weights and
optimizer state stay as they were, the step still counts (schedule and data advance). Many skips in a row mean the
run is broken, not unlucky: it stops with the step named. Every rank reads the same all-reduced values, so all
ranks skip together.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterable

import torch
import torch.distributed as dist

from megalm.config.checks import SPIKE_MIN_HISTORY
from megalm.errors import MegalmError
from megalm.model.shard import local_part

log = logging.getLogger("megalm")


class NonFiniteError(MegalmError):
    """The run met non-finite values it must not continue with."""


class NonFiniteGuard:
    """`trainer.nonfinite`: skip | stop; `trainer.max_consecutive_skips` skips in a row end the run."""

    def __init__(self, mode: str, max_consecutive_skips: int) -> None:
        self.mode, self.max_consecutive = mode, max_consecutive_skips
        self.consecutive = 0
        self.skipped_steps: list[int] = []

    def should_skip(self, step: int, loss: float, grad_norm: float) -> bool:
        """Whether step `step` (1-based, as logged) must not update the weights; raises when the run must stop."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.consecutive = 0
            return False
        what = f"loss {loss}, grad norm {grad_norm} at step {step}"
        if self.mode == "stop":
            raise NonFiniteError(f"{what}; stopped (trainer.nonfinite=stop). Resume from the last checkpoint with a "
                                 "lower optim.lr, or set trainer.nonfinite=skip to skip such steps")
        self.consecutive += 1
        self.skipped_steps.append(step)
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteError(f"{what}: {self.consecutive} non-finite steps in a row (trainer.max_consecutive_"
                                 f"skips={self.max_consecutive}); the run diverged — resume from the last checkpoint "
                                 "with a lower optim.lr")
        log.warning(f"{what}: update skipped ({self.consecutive} in a row)")
        return True

    def state_dict(self) -> dict:
        """What a checkpoint keeps, so that a resume neither restarts the count in a row (each requeue gave the run a
        fresh max_consecutive_skips) nor the skipped steps metrics.jsonl counts."""
        return {"nonfinite_consecutive": self.consecutive, "nonfinite_skipped_steps": list(self.skipped_steps)}

    def load_state_dict(self, state: dict) -> None:
        """From a checkpoint's state (one before 2026-12-04 has neither key: none skipped)."""
        self.consecutive = int(state.get("nonfinite_consecutive", 0))
        self.skipped_steps = [int(s) for s in state.get("nonfinite_skipped_steps", [])]


class SpikeDetector:
    """Flags a loss more than `zscore` standard deviations above the mean of the last `window` finite losses.

    A spike stays out of the history, so that it cannot hide the next one; but a loss that stays up is a new level,
    not a spike: from the `SHIFT`-th spike in a row they join it (else the history would stay frozen at the old
    level, and every later step be reported). A history of equal losses has no spread: the deviation is measured
    against at least 1e-4 of their mean, so that the next step's rounding is not a spike."""

    SHIFT = 3

    def __init__(self, window: int, zscore: float, min_history: int = SPIKE_MIN_HISTORY) -> None:
        self.zscore, self.min_history = zscore, min_history
        self.history: deque[float] = deque(maxlen=max(window, 1))
        self.in_a_row = 0

    def check(self, loss: float, step: int | None = None, sample_ids: range | None = None) -> float | None:
        """The loss's z-score when it is a spike (then logged with `step` and its `sample_ids`, and not added to
        the history), else None."""
        if not math.isfinite(loss):
            return None
        if self.zscore > 0 and len(self.history) >= self.min_history:
            mean = sum(self.history) / len(self.history)
            std = math.sqrt(sum((x - mean) ** 2 for x in self.history) / len(self.history))
            z = (loss - mean) / max(std, 1e-4 * abs(mean), 1e-12)
            if z > self.zscore:
                samples = f"; its samples are {sample_ids.start}..{sample_ids.stop - 1} of the train split" \
                    if sample_ids is not None else ""
                self.in_a_row += 1
                shift = self.in_a_row >= self.SHIFT
                log.warning(f"loss spike at step {step}: {loss:.4f} is {z:.1f} standard deviations above the last "
                            f"{len(self.history)} steps' mean{samples}" + (
                                f" ({self.in_a_row} in a row: taken as the loss's new level)" if shift else ""))
                if shift:
                    self.history.append(loss)
                return z
        self.in_a_row = 0
        self.history.append(loss)
        return None


def check_finite_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, device: torch.device,
                       distributed: bool) -> None:
    """Refuse (one line) to checkpoint weights or optimizer state that hold inf/NaN anywhere (collective)."""
    tensors = [*model.parameters(), *(v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v))]
    if not all_finite(tensors, device, distributed):
        raise NonFiniteError(f"weights or optimizer state are not finite at step {step}: no checkpoint written; "
                             "resume from the last one with a lower optim.lr")


@torch.no_grad()
def all_finite(tensors: Iterable[torch.Tensor], device: torch.device, distributed: bool) -> bool:
    """Whether every tensor is finite on every rank (collective when `distributed`): the check before a save."""
    bad = torch.zeros((), device=device)
    for t in map(local_part, tensors):  # an FSDP shard: this rank's elements (every rank checks its own)
        if t.is_floating_point():
            bad += (~torch.isfinite(t)).any().to(bad.device, bad.dtype)
    if distributed:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bool(bad.item())
