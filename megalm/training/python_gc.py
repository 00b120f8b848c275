"""Python's garbage collector between steps only (TorchTitan's `training.gc_freq`, Megatron's `--manual-gc`).

CPython's cyclic collector runs whenever allocations cross its thresholds, so a collection lands wherever the
allocation that crosses one happens: inside a step. The young generations take well under a millisecond, but a full
collection walks every tracked object, and a training process holds hundreds of thousands (torch, the model, the
compiled graphs): 99 ms at 337k objects on this project's CPU machine, 179 ms at 574k with compiled blocks
(tools/bench/python_gc.py). On one GPU such a pause stops the host launching kernels; on many ranks the rank
that pauses holds every other one at the next collective, at a random step on a random rank (a straggler).

So while `Trainer.fit` trains, the automatic collector is off (`trainer.gc_interval` > 0), and it is run at step
boundaries instead: generations 0 and 1 every `gc_interval` steps (what the steps since allocated: 0.4 ms a step on
the CPU machine), a full collection when training starts and after each evaluation and checkpoint, where every rank
waits anyway. A megalm step leaves no reference cycle holding a tensor (tests/unit/test_python_gc.py checks it across
recipes and layouts): what a collection finds in steady training is small Python objects (torch's pytree helpers
under recompute). Compiling is different: what dynamo and AOT autograd held while compiling (fake tensors, and
functional wrappers of a few real activations) turns into cyclic garbage over the next two steps. The default
interval, 1, frees it then, as the automatic collector would; TorchTitan's 50 would keep it up to 50 steps, device
memory included. The collector's state is restored when training ends, however it ends.
"""

from __future__ import annotations

import gc
import logging
from types import TracebackType

log = logging.getLogger("megalm")


class StepBoundaryGC:
    """A context manager for the training loop: the automatic collector off inside it (interval > 0), and
    `after_step(step)` / `full()` collect at the boundaries. interval 0: Python's automatic collection, untouched."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self._was_enabled = True

    def __enter__(self) -> StepBoundaryGC:
        if self.interval:
            self._was_enabled = gc.isenabled()
            gc.disable()
            self.full()
            log.info("trainer.gc_interval=%d: Python's garbage collector runs between steps only (generations 0-1 "
                     "every %d steps, a full collection after each evaluation and checkpoint)",
                     self.interval, self.interval)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self.interval and self._was_enabled:
            gc.enable()

    def after_step(self, step: int) -> None:
        """After optimizer step `step` (1-based): the young generations, every `interval` steps."""
        if self.interval and step % self.interval == 0:
            gc.collect(1)

    def full(self) -> None:
        """A full collection, where every rank waits anyway (evaluation, checkpoint)."""
        if self.interval:
            gc.collect()
