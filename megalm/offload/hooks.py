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
import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn

from megalm.offload.policy import Timeline, layer_groups, select_pipeline
from megalm.offload.store import ActivationStore

log = logging.getLogger("megalm")


def _tensors(values: tuple) -> list[torch.Tensor]:
    """The tensors among `values`, and inside the tuples among them (a block's (cos, sin))."""
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (tuple, list)):
            found.extend(_tensors(tuple(value)))
    return found


class PipelineOffload:
    """MemoryHooks for the pipeline runtime: `policy` (uniform | lifespan | auto) and `fraction` pick the
    micro-batches, from the schedule's simulated `timeline`; `copy_to_compute` is PipeOffload's k (copy time
    / compute time of a micro-batch)."""

    def __init__(self, store: ActivationStore, policy: str, fraction: float, timeline: Callable[[object], Timeline],
                 copy_to_compute: float = 0.0) -> None:
        self.store, self.policy, self.fraction, self.copy_to_compute = store, policy, fraction, copy_to_compute
        self.timeline = timeline  # schedule -> its simulated timeline (pipeline.schedules.simulate_schedule)

    def select(self, schedule) -> set[tuple[int, int, int]]:
        chosen = select_pipeline(schedule, self.timeline(schedule), self.policy, self.fraction, self.copy_to_compute)
        if not chosen:  # once per schedule: the runtime builds one per micro-batch count
            log.warning(f"offload.enabled=true offloads nothing in this step's {schedule.name} schedule "
                        f"({schedule.num_micro_batches} micro-batches over {schedule.num_stages} stages): no "
                        f"micro-batch's copy would free memory while something computes"
                        f"{'' if self.policy == 'uniform' else ' and hide under it'} (more micro-batches a step "
                        "give it room)")
        return chosen

    def start_step(self) -> None:
        self.store.reset_peak()

    def forward_context(self, key: tuple[int, int], micro_batch=None) -> contextlib.AbstractContextManager:
        return self.store.hooks(key)

    def offload(self, key: tuple[int, int]) -> None:
        self.store.offload(key)

    def reload(self, key: tuple[int, int]) -> None:
        self.store.reload(key)

    def release(self, key: tuple[int, int]) -> None:
        self.store.release(key)


class LayerOffload:
    """Layer-wise offload of transformer blocks: `blocks` is the GPT's `layers`, or one `layers` per pipeline
    chunk. A block's group key is (micro-batch prefix, chunk, block index): the prefix is () without a
    pipeline (one micro-batch at a time, `micro_batch`), the micro-batch's position in the step inside a
    pipeline (`forward_context`, the pipeline runtime's MemoryHooks plug: HDP's selective offload there)."""

    def __init__(self, blocks: nn.ModuleList | list[nn.ModuleList], store: ActivationStore, fraction: float,
                 per_micro_batch: bool = False) -> None:
        self.store, self.fraction, self.per_micro_batch = store, fraction, per_micro_batch
        chunks = list(blocks) if isinstance(blocks, (list, tuple)) else [blocks]
        self.num_blocks = [len(chunk) for chunk in chunks]
        self.offloaded: dict[tuple, set[int]] = {}  # (prefix, chunk) -> offloaded block indices
        self.prefix: tuple = ()
        self._open: dict[tuple, contextlib.AbstractContextManager] = {}
        self.active = False
        for c, chunk in enumerate(chunks):
            for index, block in enumerate(chunk):
                block.register_forward_pre_hook(self._enter(c, index))
                block.register_forward_hook(self._exit(c, index), always_call=True)
        store.on_unpack = self._prefetch

    def _enter(self, chunk: int, index: int):
        def hook(module, args):
            if self.active:  # the block's inputs past the hidden states are its caller's (RoPE tables of all blocks)
                key = (*self.prefix, chunk, index)
                self._open[key] = ctx = self.store.hooks(key, keep=_tensors(args[1:]))
                ctx.__enter__()
        return hook

    def _exit(self, chunk: int, index: int):
        def hook(module, args, output):
            key = (*self.prefix, chunk, index)
            ctx = self._open.pop(key, None)
            if ctx is not None:
                ctx.__exit__(None, None, None)
                if index in self.offloaded.get(key[:-1], ()):
                    self.store.offload(key)
        return hook

    def _prefetch(self, key: tuple) -> None:
        """Backward reached block i: bring block i - 1 back while block i's backward runs."""
        before = (*key[:-1], key[-1] - 1)
        if key[-1] - 1 in self.offloaded.get(key[:-1], ()) and before in self.store.groups:
            self.store.reload(before)

    def _choose(self, prefix: tuple, chunk: int, fraction: float) -> None:
        """The micro-batch's blocks to offload: its own `fraction` (HDP, rounded up: at most 1 - fraction of
        its activations stay resident) or the fixed one."""
        blocks = self.num_blocks[chunk]
        chosen = layer_groups(blocks, fraction, round_up=True) if self.per_micro_batch else \
            layer_groups(blocks, self.fraction)
        self.offloaded[(*prefix, chunk)] = set(chosen)

    @contextlib.contextmanager
    def micro_batch(self, fraction: float = 0.0) -> Iterator[None]:
        """Without a pipeline: around one micro-batch's forward and backward (training only: evaluation saves
        nothing)."""
        self.prefix = ()
        self._choose((), 0, fraction)
        self.active = True
        try:
            yield
        finally:
            self.active = False
            self.store.release_all()

    # -------------------------------------------------- the pipeline runtime's MemoryHooks

    def select(self, schedule) -> set[tuple[int, int, int]]:
        """No whole micro-batch moves: the blocks do, inside each F."""
        return set()

    @contextlib.contextmanager
    def forward_context(self, key: tuple[int, int], micro_batch=None) -> Iterator[None]:
        """Around one F of the pipeline: the blocks of (micro-batch, chunk) `key` record their groups."""
        mb, chunk = key
        self.prefix = (mb,)
        self._choose(self.prefix, chunk, getattr(micro_batch, "offload_fraction", 0.0))
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def offload(self, key: tuple[int, int]) -> None:
        raise RuntimeError("layer-wise offload inserts no OFFLOAD actions")

    reload = offload

    def release(self, key: tuple[int, int]) -> None:
        """After the micro-batch's B: its block groups were released as autograd dropped them."""

    def start_step(self) -> None:
        self.store.reset_peak()
