"""What the training loop returns: one optimizer step's global figures (`StepResult`, from `Trainer.train_step`)
and a run's (`TrainSummary`, from `Trainer.fit`)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    tokens: int  # input tokens processed in the step
    flops: float  # model training FLOPs of the step
    skipped: bool = False  # the loss or grad norm was not finite: no update (trainer.nonfinite=skip)
    rank_tokens: list[int] = field(default_factory=list)  # HDP: each domain rank's tokens (Parallelism.rank_loads)
    moe: dict[str, object] = field(default_factory=dict)  # MoE: expert load, drops, balancing losses (expert_load.py)
    preempt: float | None = None  # any rank's preemption signal, as the step read it (Preemption.reduced_flag)
    batch_seconds: float = 0.0  # the host's time making this rank's batches of the step (StepShare.host_seconds)


@dataclass
class TrainSummary:
    steps: int
    val_loss: float | None
    tokens: int
    seconds: float
    checkpoint: Path | None
    run_dir: Path
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss) of every step this run trained
    preempted: bool = False  # stopped by a preemption signal, with a checkpoint: exit REQUEUE_EXIT_CODE
    has_tokenizer: bool = True  # text to sample: synthetic data has none, and megalm-generate refuses its checkpoint

    @property
    def first_loss(self) -> float | None:
        """This run's first step's loss (after a resume, not step 1's)."""
        return self.losses[0][1] if self.losses else None

    @property
    def last_loss(self) -> float | None:
        """This run's last step's loss: every step's, not only the logged ones' (a resumed or preempted run ends
        between log lines)."""
        return self.losses[-1][1] if self.losses else None

    def lines(self, max_steps: int, peak_memory_gib: float) -> list[str]:
        """What a finished (or stopped) run says last: where it ended, its losses and memory, where its checkpoint,
        a command to sample from it and its metrics are."""
        done = "finished" if self.steps >= max_steps else "stopped early"
        parts = [f"{done} at step {self.steps}/{max_steps} in {self.seconds:.1f}s"]
        if self.losses:  # this run's own steps: after a resume the first is not step 1
            (first, first_loss), (last, last_loss) = self.losses[0], self.losses[-1]
            parts.append(f"loss {first_loss:.3f} at step {first} -> {last_loss:.3f} at step {last}" if first != last
                         else f"loss {last_loss:.3f} at step {last}")
        if self.val_loss is not None:
            parts.append(f"val loss {self.val_loss:.3f}")
        parts.append(f"peak memory {peak_memory_gib:.2f} GiB")
        out = [" | ".join(parts)]
        if self.checkpoint is not None:
            out.append(f"checkpoint: {self.checkpoint}")
            if self.has_tokenizer:
                out.append(f"sample from it: megalm-generate {shlex.quote(str(self.checkpoint))} --prompt 'def '")
        return out + [f"metrics: {self.run_dir / 'metrics.jsonl'}"]
