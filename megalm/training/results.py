"""What the training loop returns: one optimizer step's global figures (`StepResult`, from `Trainer.train_step`)
and a run's (`TrainSummary`, from `Trainer.fit`)."""

from __future__ import annotations

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


@dataclass
class TrainSummary:
    steps: int
    first_loss: float | None
    last_loss: float | None
    val_loss: float | None
    tokens: int
    seconds: float
    checkpoint: Path | None
    run_dir: Path
    losses: list[tuple[int, float]] = field(default_factory=list)
    preempted: bool = False  # stopped by a preemption signal, with a checkpoint: exit REQUEUE_EXIT_CODE
