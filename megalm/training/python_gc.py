"""Python's garbage collector between steps only (TorchTitan's `training.gc_freq`, Megatron's `--manual-gc`).

CPython's cyclic collector runs whenever allocations cross its thresholds, so a collection lands wherever the
allocation that crosses one happens: inside a step. The young generations take well under a millisecond, but a full
collection walks every tracked object, and a training process holds hundreds of thousands (torch, the model, the
compiled graphs): 69 ms at 333k objects on this project's CPU machine, 151 ms at 528k with compiled blocks
(tools/bench/python_gc.py). On one GPU such a pause stops the host launching kernels; on many ranks the rank that
pauses holds every other one at the next collective, at a random step on a random rank (a straggler).

So while `Trainer.fit` trains, the automatic collector is off (`trainer.gc_interval` > 0), and it is run at step
boundaries instead: generations 0 and 1 every `gc_interval` steps (what the steps since allocated: 0.3 ms a step on
the CPU machine), a full collection when training starts and after each evaluation or checkpoint, where every rank
waits anyway. A megalm step or evaluation leaves no reference cycle holding a tensor or an autograd node
(tests/unit/test_python_gc.py checks it across recipes and layouts): what a young collection finds in steady
training is small Python objects (torch's pytree helpers under recompute). Two kinds of garbage hold more:
- what dynamo and AOT autograd held while compiling (fake tensors, functional wrappers of a few real activations):
  dynamo's own `gc.collect(1)` after each compile moves it to the old generation, and it is released in stages
  over the next steps, so after any step that compiled (dynamo's frame counter moved) the collector runs a full
  collection at each of the next `DRAIN_STEPS` boundaries (11 in a 24-layer compiled run's first steps, 2.3 s);
- on torch 2.11 (the GPU image's), a compiled block leaves every step a class its `autograd_function_apply` makes, in
  a cycle with the tensors it saved; 2.13 leaves none. The default interval, 1, frees them when the step ends, as the
  automatic collector would; TorchTitan's `gc_freq` of 50 would keep 50 steps of them, device memory included.
The collector's state is restored when training ends, however it ends.
"""

from __future__ import annotations

import gc
import logging
from types import TracebackType

from megalm import compat

log = logging.getLogger("megalm")


DRAIN_STEPS = 3  # boundaries after a compile that run a full collection: compiling's garbage is released in stages


class StepBoundaryGC:
    """A context manager for the training loop: the automatic collector off inside it (interval > 0), and
    `after_step(step)` / `full()` collect at the boundaries. interval 0: Python's automatic collection, untouched."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self._was_enabled = True
        self._compiled = 0  # dynamo's frame count at the last boundary
        self._drains_left = 0

    def __enter__(self) -> StepBoundaryGC:
        if self.interval:
            self._was_enabled = gc.isenabled()
            self.full()  # before the collector goes off: nothing between here and `with` can leave it off
            gc.disable()
            self._compiled = compat.dynamo_frames_compiled()
            log.info("trainer.gc_interval=%d: Python's garbage collector runs between steps only (generations 0-1 "
                     "every %d steps, a full collection after each evaluation and checkpoint, and after a compile)",
                     self.interval, self.interval)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self.interval and self._was_enabled:
            gc.enable()

    def after_step(self, step: int) -> None:
        """After optimizer step `step` (1-based): a full collection if dynamo compiled in the last `DRAIN_STEPS`
        steps (what compiling held), else the young generations, every `interval` steps."""
        if not self.interval:
            return
        compiled = compat.dynamo_frames_compiled()
        if compiled != self._compiled:
            self._compiled, self._drains_left = compiled, DRAIN_STEPS
        if self._drains_left:
            self._drains_left -= 1
            gc.collect()
        elif step % self.interval == 0:
            gc.collect(1)

    def full(self) -> None:
        """A full collection, where every rank waits anyway (evaluation, checkpoint)."""
        if self.interval:
            gc.collect()
