"""Activation offload plugged into the two runners: the pipeline runtime and the plain micro-batch loop.

`PipelineOffload` is the pipeline runtime's `MemoryHooks` (megalm/parallel/pipeline/runtime.py): it picks
the (rank, micro-batch, chunk) to offload from the schedule (megalm/offload/policy.py), records each F's
activations as one group, and moves them where the schedule's OFFLOAD / RELOAD actions say.

`LayerOffload` is the no-pipeline case (pp = 1): each transformer block's forward is one group; the first
`fraction` of the blocks go to the host right after their forward, and in backward the first unpack of a
block reloads the block before it (one ahead), so its copy runs under this block's backward; the last
blocks, whose backward comes first, stay resident. Under HDP's selective offload each micro-batch brings its
own fraction: r(s) for a long document planned on fewer ranks (megalm/parallel/hdp/cost.py), 0 otherwise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from torch import nn

from megalm.offload.policy import Timeline, layer_groups, select_pipeline
from megalm.offload.store import ActivationStore


class PipelineOffload:
    """MemoryHooks for the pipeline runtime: `policy` (uniform | lifespan | auto) and `fraction` pick the
    micro-batches, from the schedule's simulated `timeline`; `copy_to_compute` is PipeOffload's k (copy time
    / compute time of a micro-batch)."""

    def __init__(self, store: ActivationStore, policy: str, fraction: float, timeline: Callable[[object], Timeline],
                 copy_to_compute: float = 0.0) -> None:
        self.store, self.policy, self.fraction, self.copy_to_compute = store, policy, fraction, copy_to_compute
        self.timeline = timeline  # schedule -> its simulated timeline (pipeline.schedules.simulate)

    def select(self, schedule) -> set[tuple[int, int, int]]:
        return select_pipeline(schedule, self.timeline(schedule), self.policy, self.fraction, self.copy_to_compute)

    def start_step(self) -> None:
        self.store.reset_peak()

    def forward_context(self, key: tuple[int, int]) -> contextlib.AbstractContextManager:
        return self.store.hooks(key)

    def offload(self, key: tuple[int, int]) -> None:
        self.store.offload(key)

    def reload(self, key: tuple[int, int]) -> None:
        self.store.reload(key)

    def release(self, key: tuple[int, int]) -> None:
        self.store.release(key)


class LayerOffload:
    """Layer-wise offload for a model whose blocks are `blocks` (the GPT's `layers`)."""

    def __init__(self, blocks: nn.ModuleList, store: ActivationStore, fraction: float,
                 per_micro_batch: bool = False) -> None:
        self.store, self.fraction, self.per_micro_batch = store, fraction, per_micro_batch
        self.num_blocks = len(blocks)
        self.offloaded = set(layer_groups(self.num_blocks, fraction))
        self._open: dict[int, contextlib.AbstractContextManager] = {}
        self.active = False
        for index, block in enumerate(blocks):
            block.register_forward_pre_hook(self._enter(index))
            block.register_forward_hook(self._exit(index), always_call=True)
        store.on_unpack = self._prefetch

    def _enter(self, index: int):
        def hook(module, args):
            if self.active:
                self._open[index] = ctx = self.store.hooks(("layer", index))
                ctx.__enter__()
        return hook

    def _exit(self, index: int):
        def hook(module, args, output):
            ctx = self._open.pop(index, None)
            if ctx is not None:
                ctx.__exit__(None, None, None)
                if index in self.offloaded:
                    self.store.offload(("layer", index))
        return hook

    def _prefetch(self, key: object) -> None:
        """Backward reached block i: bring block i - 1 back while block i's backward runs."""
        _, index = key
        if index - 1 in self.offloaded and ("layer", index - 1) in self.store.groups:
            self.store.reload(("layer", index - 1))

    @contextlib.contextmanager
    def micro_batch(self, fraction: float = 0.0) -> Iterator[None]:
        """Around one micro-batch's forward and backward (training only: evaluation saves nothing). With
        `per_micro_batch` (HDP's selective offload) the micro-batch's own `fraction` of the blocks, rounded up
        so that at most 1 - fraction of its activations stay resident; else the fixed fraction."""
        if self.per_micro_batch:
            self.offloaded = set(layer_groups(self.num_blocks, fraction, round_up=True))
        self.active = True
        try:
            yield
        finally:
            self.active = False
            self.store.release_all()

    def start_step(self) -> None:
        self.store.reset_peak()
