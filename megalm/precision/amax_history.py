"""Delayed scaling's state: each FP8 tensor's amax history, and the scales a step casts with.

Transformer Engine's delayed-scaling recipe (and torchao's, as it was): a tensor is cast with a scale taken from the
max of its last `length` steps' amaxes, so the cast needs no pass over the tensor first; the cast's own pass yields
this step's amax, pushed when the next step starts (fp8.py's `quantize_delayed`). Hand-written, because the
histories' bookkeeping is the recipe's: a step's amaxes are kept per history and reduced between micro-batches and
steps for every layer at once (`compact_histories`, `roll_histories`), and a step's scales are made once for every
history rolled together (`AmaxHistory.scale`), in a few kernels for the whole model instead of a few per layer.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
import torch.distributed as dist

from megalm.precision.fp8 import scale_from_amax


def scales_from_histories(histories: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """`scale_from_amax(h.amax(), dtype)` of each amax history h (`AmaxHistory`'s, of one length and device),
    in one batch of kernels: the histories a step's `roll_histories` rolled take theirs together (`_StepScales`).
    Each scale is a view 16 bytes from the last (row k of an [n, 4] result), so that every one is as aligned as a
    tensor of its own: inductor compiles a graph for the alignment of the inputs it first saw, and copies an input
    that arrives less aligned in every call. A non-finite amax in a ring (a step that overflowed, which the trainer's
    non-finite guard skipped) counts as 0: kept, it would make the history's scale NaN, or 1, for `length` steps."""
    maxes = torch.stack(histories).nan_to_num(nan=0.0, posinf=0.0).amax(dim=1, keepdim=True)
    return list(scale_from_amax(maxes.expand(-1, 4), dtype)[:, 0].unbind())


class AmaxHistory:
    """The amax history of one tensor for delayed scaling: a ring of the last `length` steps' amaxes, on the
    tensor's device (no host syncs). `scale` uses the max of the history, or the current amax while the history is
    empty (the first step); `update` takes the max of the step's amaxes, and `roll` pushes it when the next step
    begins. So the scale is fixed within a step, as torchao's delayed scaling syncs its history once per iteration:
    a recomputed forward (activation checkpointing) casts with the scale its forward used, and its amaxes, the same
    again, leave the step's max as it was; the number of micro-batches and the order the schedule runs them in do
    not change the history. The ring is written by torch ops (which count its version) or replaced, never through
    `.data` or NumPy: `scale` keeps a step's scales until the ring's version says it changed."""

    def __init__(self, length: int = 16) -> None:
        self.length = length
        self.history: torch.Tensor | None = None
        self.count = 0
        self.pending: list[torch.Tensor] = []  # the step's amaxes, reduced and pushed by `roll`
        self.rolled_with: _StepScales | None = None  # the histories of its last roll, whose scales are made together

    def scale(self, current_amax: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """The scale to cast with in `dtype`: from the history's max, or from `current_amax` while the history is
        empty. A step's scales are made once, for every history its `roll_histories` rolled (`_StepScales`)."""
        if self.history is None:
            return scale_from_amax(current_amax, dtype)
        if self.rolled_with is None:
            self.rolled_with = _StepScales([self])
        return self.rolled_with.scale(self, dtype)

    def update(self, amax: torch.Tensor) -> None:
        """Keep a use's amax for the step. No op runs here: torch's selective checkpointing requires a recomputed
        forward to dispatch the very ops its forward did, so the max is taken in `roll`, between steps."""
        self.pending.append(amax.detach())

    def compact(self) -> None:
        """The step's amaxes so far as one (their max), between micro-batches: the list stays short."""
        compact_histories([self])

    def roll(self) -> None:
        """End the step: the max of its amaxes joins the history (nothing if the tensor was not used)."""
        roll_histories([self])

    def state_dict(self) -> dict:
        self.compact()
        return {"history": self.history, "count": self.count, "pending": self.pending[0] if self.pending else None}

    def load_state_dict(self, state: dict) -> None:
        self.history, self.count = state["history"], state["count"]
        self.pending = [state["pending"]] if state.get("pending") is not None else []
        self.rolled_with = None


def compact_histories(histories: Iterable[AmaxHistory]) -> None:
    """`AmaxHistory.compact` of many histories in two kernels a group: those holding k > 1 amaxes (of one device and
    dtype) stacked into one [n, k] tensor and reduced along k, where each history took two kernels of its own (three
    histories a layer after every micro-batch: a few thousand launches a step at 1.3B with 8 micro-batches)."""
    groups: dict[tuple, list[AmaxHistory]] = {}
    for history in histories:
        if len(history.pending) > 1:
            first = history.pending[0]
            groups.setdefault((len(history.pending), first.device, first.dtype), []).append(history)
    for group in groups.values():
        maxes = torch.stack([a for history in group for a in history.pending]).reshape(len(group), -1).amax(dim=1)
        for history, step_max in zip(group, maxes.unbind(), strict=True):
            history.pending = [step_max]


def reduce_pending(histories: Iterable[AmaxHistory], group: dist.ProcessGroup, device: torch.device) -> None:
    """Delayed scaling on ranks that split a batch (data, context, HDP parallelism): each history's step amax becomes
    the max over the ranks of `group`, as one process's is over the whole batch, so that every rank casts the next
    step with one process's scales (Transformer Engine and Megatron reduce over their amax group likewise). One
    all-reduce of every history's step max, on the device, after a step's backward on every rank (an HDP rank that
    ran no micro-batch joins with nothing: -1, below any amax). A history no rank used takes an amax of 0."""
    histories = list(histories)
    compact_histories(histories)
    unused = torch.full((), -1.0, device=device)
    maxes = torch.stack([h.pending[0].float() if h.pending else unused for h in histories])
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
    for history, step_max in zip(histories, maxes.clamp_(min=0).unbind(), strict=True):
        history.pending = [step_max]


def roll_histories(histories: Iterable[AmaxHistory]) -> None:
    """`AmaxHistory.roll` of many histories: compacted together (`compact_histories`), then each step's max written
    into its history's ring by one `_foreach_copy_` a device (one multi-tensor kernel on CUDA; the first step's rings
    zeroed by one `_foreach_zero_`, not a kernel each)."""
    histories = list(histories)
    compact_histories(histories)
    rolling = [history for history in histories if history.pending]
    groups: dict[torch.device, list[AmaxHistory]] = {}
    for history in rolling:
        groups.setdefault(history.pending[0].device, []).append(history)
    for device, group in groups.items():
        new = [h for h in group if h.history is None]  # the first step's: allocated once
        for history in new:
            history.history = torch.empty(history.length, dtype=torch.float32, device=device)
        if new:
            torch._foreach_zero_([history.history for history in new])
        torch._foreach_copy_([h.history[h.count % h.length] for h in group], [h.pending[0].float() for h in group])
    for history in rolling:
        history.count, history.pending = history.count + 1, []
    together: dict[tuple[torch.device, torch.Size], list[AmaxHistory]] = {}
    for history in rolling:  # by ring: a checkpoint may have restored one of another length than `length`
        together.setdefault((history.history.device, history.history.shape), []).append(history)
    for group in together.values():
        step_scales = _StepScales(group)
        for history in group:
            history.rolled_with = step_scales


class _StepScales:
    """The histories one `roll_histories` rolled (one device and ring shape), whose scales for a format are made for
    all of them at once, the first time one is asked for (`scales_from_histories`: 10 small ops), and kept for the
    step: a ring changes only when the next step rolls it. Each scale is kept with its ring and the ring's version
    counter, so one written since in place or replaced is scaled by what it holds. Held by weak reference: a history
    dropped is not kept alive by those rolled with it."""

    def __init__(self, histories: list[AmaxHistory]) -> None:
        self.histories = [weakref.ref(history) for history in histories]
        self.made: dict[torch.dtype, dict[int, tuple[torch.Tensor, int, torch.Tensor]]] = {}

    def scale(self, history: AmaxHistory, dtype: torch.dtype) -> torch.Tensor:
        made = self.made.get(dtype, {}).get(id(history))
        if made is None or made[0] is not history.history or made[1] != history.history._version:
            ring = history.history
            alike = [history] + [h for ref in self.histories if (h := ref()) is not None and h is not history
                                 and h.rolled_with is self and h.history is not None
                                 and h.history.shape == ring.shape and h.history.device == ring.device]
            scales = scales_from_histories([h.history for h in alike], dtype)
            self.made.setdefault(dtype, {}).update(
                {id(h): (h.history, h.history._version, s) for h, s in zip(alike, scales, strict=True)})
            made = self.made[dtype][id(history)]
        return made[2]
