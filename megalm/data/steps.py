"""Which samples each optimizer step takes: a fixed global batch, one ramping up to it, or a token budget.

Every rule here keeps the global batch a function of (seed, step) only, never of the layout (docs/architecture.md):
step s takes a contiguous run of sample ids, starting where step s - 1 stopped.

- `GlobalBatchSteps`: `trainer.global_batch_size` samples a step, or, with `trainer.rampup_batch_size` =
  [start, increment, samples], Megatron-LM's batch-size ramp-up (`--rampup-batch-size`, after GPT-3's: Brown et al.
  2020, section 2.3): a step that begins after `consumed` samples takes start + increment·⌊consumed·n / samples⌋ of
  them, n = (global - start) / increment, and the whole global batch once `samples` are consumed. Megatron computes
  ⌊consumed / (samples / n)⌋ in floating point; here it is exact, which differs only where that quotient rounds
  across an integer. Hand-written: it is a dozen lines of arithmetic (`megalm.config.ramp_phases`, which the config
  checks read too), and the data order must not depend on a library's float.
- `TokenBudgetSteps`: `trainer.tokens_per_step` (varlen data), as many samples as fit the budget.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

from megalm.config import ramp_phases
from megalm.data.dataset import SampleDataset, VarlenDataset


class GlobalBatchSteps:
    """Step s's samples at a fixed global batch size, or under a ramp-up to it (module docstring).

    The ramp is laid out once as phases, one per batch size it reaches (at most n + 1, some sizes skipped when a step
    overshoots the next boundary): (first step, first sample, batch size). A step's samples are then a bisect away,
    from step 0, so a resumed run needs no cursor and no scan of its history.
    """

    def __init__(self, global_batch_size: int, rampup: Sequence[int] | None = None):
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size={global_batch_size} must be >= 1")
        self.global_batch_size = global_batch_size
        self.rampup = list(rampup) if rampup else None
        self._phases = ramp_phases(global_batch_size, self.rampup)  # (first step, first sample, batch size)
        self._first_steps = [phase[0] for phase in self._phases]

    def _phase(self, step: int) -> tuple[int, int, int]:
        if step < 0:
            raise IndexError(f"step {step} is negative")
        return self._phases[bisect.bisect_right(self._first_steps, step) - 1]

    def batch_size(self, step: int) -> int:
        """Samples in step `step`."""
        return self._phase(step)[2]

    def start(self, step: int) -> int:
        """The first sample of step `step` (the samples the steps before it took)."""
        first_step, first_sample, size = self._phase(step)
        return first_sample + (step - first_step) * size

    def ids(self, step: int) -> range:
        """Sample indices of step `step`."""
        return range(self.start(step), self.start(step) + self.batch_size(step))

    def describe(self) -> str:
        """One line for the log: each batch size of the ramp and the steps it runs."""
        *ramp, (step, consumed, size) = self._phases
        if not ramp:
            return f"trainer.rampup_batch_size={self.rampup} starts at the whole global batch ({size}): no ramp-up"
        spans = [f"{batch} from step {first + 1}" for first, _, batch in ramp]
        return (f"global batch ramping up (trainer.rampup_batch_size={self.rampup}): {', '.join(spans)}, the whole "
                f"{size} from step {step + 1} on ({consumed} samples in)")


class TokenBudgetSteps:
    """Which samples each step takes under a token budget (`trainer.tokens_per_step`, varlen data).

    Step s takes samples start(s), start(s) + 1, ... while their input tokens fit the budget, and at
    least one; start(s + 1) is where step s stopped. Still a function of (seed, step) only, never of
    the layout. Boundaries are found forward from a known point: sample 0 at step 0, or a checkpoint's
    cursor (`next_sample`) when resuming, so a resumed run does not rescan its whole history.
    """

    def __init__(self, dataset: VarlenDataset, tokens_per_step: int, first_step: int = 0, first_sample: int = 0):
        if tokens_per_step < 1:
            raise ValueError(f"tokens_per_step={tokens_per_step} must be >= 1")
        self.dataset, self.budget = dataset, int(tokens_per_step)
        self.first_step = first_step
        self._starts = [int(first_sample)]  # _starts[i] = first sample of step first_step + i

    def start(self, step: int) -> int:
        if step < self.first_step:
            raise IndexError(f"step {step} is before step {self.first_step}, where these boundaries start")
        while len(self._starts) <= step - self.first_step:
            k, total = self._starts[-1], 0
            while True:
                n = self.dataset.sample_length(k) - 1
                if total and total + n > self.budget:
                    break
                total += n
                k += 1
            self._starts.append(k)
        return self._starts[step - self.first_step]

    def ids(self, step: int) -> range:
        """Sample indices of step `step`."""
        return range(self.start(step), self.start(step + 1))


def step_samples(trainer: Any, dataset: SampleDataset, first_step: int = 0, first_sample: int = 0,
                 rampup: bool = True) -> GlobalBatchSteps | TokenBudgetSteps:
    """The steps of a run's `trainer` config over `dataset`: a token budget's (from a resume's cursor, `first_step`
    and `first_sample`), or the global batch's, ramping up unless `rampup` is false (validation batches are whole)."""
    if trainer.tokens_per_step:
        return TokenBudgetSteps(dataset, trainer.tokens_per_step, first_step, first_sample)
    return GlobalBatchSteps(trainer.global_batch_size, trainer.rampup_batch_size if rampup else None)
