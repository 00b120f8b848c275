"""The two seams `Parallelism` composes: how a rank gets its share of a step, and how it runs it.

- `StepSplit.micro_batches(dataset, ids)`: this rank's micro-batches of the step whose samples are `ids`, and the
  step's loss-token count: a data-parallel slice (data_parallel/slices.py), each micro-batch sharded over the CP
  ring (context/split.py), or the step's HDP plan (hdp/split.py).
- `Runner.run_micro_batches(...)`: forward and backward of each micro-batch on loss_sum / the step's loss tokens,
  by the plain loop (`LocalRunner`, here) or by the pipeline schedule (`PipelineRuntime`,
  megalm/parallel/pipeline/runtime.py); `forward_only` for evaluation.

Protocols, as TorchTitan names its seams: a new layout implements them without inheriting anything. The runners'
method is not called `step`, so that `optimizer.step()` is the only `step` on the way through a training step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from megalm.offload import LayerOffload
from megalm.parallel.microbatch import LocalMicroBatch
from megalm.parallel.progress import Progress
from megalm.parallel.tensor.apply import LossFn


class StepSplit(Protocol):
    """How a rank takes its share of a step's samples."""

    def micro_batches(self, dataset: Any, ids: range) -> tuple[list[LocalMicroBatch], int | torch.Tensor]: ...


class Runner(Protocol):
    """How a rank runs its micro-batches. `memory_hooks`: activation offload (None: off)."""

    memory_hooks: Any

    def run_micro_batches(self, micro_batches: list[LocalMicroBatch], n_loss_tokens: int | torch.Tensor,
                          step: int) -> torch.Tensor: ...

    def forward_only(self, micro_batches: list[LocalMicroBatch]) -> torch.Tensor: ...

    def tied_embedding(self) -> Any: ...


class LocalRunner:
    """Runs a step's micro-batches one after the other on the whole model (no pipeline)."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, forward_context: Callable, before_forward: Callable,
                 device: torch.device, progress: Progress | None = None,
                 before_backward: Callable[[nn.Module, bool], None] | None = None):
        self.model, self.loss_fn, self.device = model, loss_fn, device
        self.progress = progress or Progress()  # where the hang watchdog reads the micro-batch in flight
        self.forward_context, self.before_forward = forward_context, before_forward
        self.before_backward = before_backward  # (the model, whether it is the step's last backward)
        self.memory_hooks: LayerOffload | None = None  # activation offload of transformer blocks

    def _loss(self, mb: LocalMicroBatch) -> torch.Tensor:
        with self.forward_context():
            logits = mb.run(self.model)
        return self.loss_fn(logits, mb.batch.labels, mb.batch.loss_mask)

    def run_micro_batches(self, micro_batches: list[LocalMicroBatch], n_loss_tokens: int | torch.Tensor, step: int
                          ) -> torch.Tensor:
        """Forward and backward of each micro-batch on loss_sum / n_loss_tokens; returns the summed loss."""
        total = torch.zeros((), device=self.device)
        hooks = self.memory_hooks
        if hooks is not None:
            hooks.start_step()
        for i, mb in enumerate(micro_batches):
            self.progress.note(micro_batch=f"{i + 1} of {len(micro_batches)}")
            self.before_forward(self.model, step, mb.index, mb.ring_position)
            with hooks.micro_batch(mb.offload_fraction) if hooks is not None else contextlib.nullcontext():
                loss_sum = self._loss(mb)
                if self.before_backward is not None:
                    self.before_backward(self.model, i == len(micro_batches) - 1)
                (loss_sum / n_loss_tokens).backward()
            total += loss_sum.detach()
        return total

    @torch.no_grad()
    def forward_only(self, micro_batches: list[LocalMicroBatch]) -> torch.Tensor:
        return sum((self._loss(mb) for mb in micro_batches), torch.zeros((), device=self.device))

    def tied_embedding(self) -> None:
        """None: the tied embedding and head are one parameter here."""
        return None
