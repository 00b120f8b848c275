"""Live tensor storages, counted from the tensors themselves: the memory probe of every memory figure megalm
reports on CPU and under fake tensors.

A `TorchDispatchMode` sees each aten op's outputs; every new storage (an output the op's schema does not declare
an alias of an input: views, in-place and out= results are not new) is counted by its bytes and
uncounted by a `weakref.finalize` when torch frees it (a view keeps its storage alive, so views are never
counted twice and a storage is freed only with its last view); what DTensor's sharding propagation makes (its
reruns of an op at the global shape, `in_sharding_propagation`) is not counted. Nothing here reads a megalm counter,
so a feature's own bookkeeping (an offload store's "resident bytes", a planner's estimate) can be checked against it.
It works on real CPU tensors, on `FakeTensorMode` tensors (which carry sizes but no data: the way to measure one
rank of a 1,024-GPU layout on a laptop) and on CUDA, where `torch.cuda.max_memory_allocated` is the allocator's
own answer to compare with (that one also counts the allocator's rounding and workspaces). Compiled functions run
compiled under it: on fake tensors with megalm.measure.compiled_cost.InductorCosts as the backend their graphs' ops
are replayed and counted; inductor's real generated code allocates outside the dispatcher, unseen.

Hand-written because torch's `torch.distributed._tools.mem_tracker` is private API that changes across the
supported torch range, and counts by module rather than by the storages a test wants to see.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten


@dataclass
class _Live:
    nbytes: int
    device: str


def _new_outputs(func, out):  # noqa: ANN001, ANN202 - an OpOverload and what it returned
    """The outputs of `func` that are new storages: not those its schema says alias an input (a view, an in-place or
    out= result), which would make a storage made before the probe (a parameter, a reused pool buffer) look new."""
    returns = func._schema.returns
    if not any(r.alias_info is not None for r in returns):
        return out
    if len(returns) == 1:
        return ()
    return tuple(o for o, r in zip(out, returns, strict=True) if r.alias_info is None)


def _written_outputs(func, out) -> list[torch.Tensor]:  # noqa: ANN001 - an OpOverload and what it returned
    """The outputs of `func` that are inputs it wrote (an in-place or out= result): `resize_`, or an out= into a
    tensor too small, grows their storage in place."""
    returns = func._schema.returns
    outs = out if isinstance(out, (tuple, list)) and len(returns) > 1 else (out,)
    return [o for o, r in zip(outs, returns, strict=False)
            if r.alias_info is not None and r.alias_info.is_write and isinstance(o, torch.Tensor)]


def storage_identity(t: torch.Tensor | torch.UntypedStorage) -> int:
    """Which storage `t` (a tensor or its storage) is, while it lives: its StorageImpl's address, the same for every
    view and alias (detach()) of it. A data pointer would do on a device, but fake tensors have none: every one
    reads 0 (and torch warns that reading it is a bug)."""
    return (t if isinstance(t, torch.UntypedStorage) else t.untyped_storage())._cdata


def is_higher_order(func: object) -> bool:
    """Whether a dispatched `func` is a higher-order operator (a compiled graph's wrapper of other ops, such as the
    rng state saved for a region that recomputes) rather than one aten op. Modes that take them
    (`supports_higher_order_operators`) run them through: the ops inside dispatch below the mode."""
    return isinstance(func, torch._ops.HigherOrderOperator)


# Where torch.distributed.tensor reruns a DTensor op for its sharding propagation (torch 2.9 to 2.13): on fake tensors
# of the global shape for the output's metadata (ShardingPropagator's method), and, for an op without a sharding rule
# of its own, its decomposition on meta tensors once per candidate placement, over a mesh of its own (the module of
# DecompShardingStrategy, from 2.11)
_META_PROPAGATION = "_propagate_tensor_meta_non_cached"
_DECOMPOSITION_PROPAGATION = os.path.join("torch", "distributed", "tensor", "_decompositions.py")


def in_sharding_propagation(frames: int = 40) -> bool:
    """Whether the op being dispatched runs for DTensor's sharding propagation (`_META_PROPAGATION` and kin), which
    reruns an op on tensors of the global shape to learn its output's metadata (on a cache miss; every time while
    tracing, and in torch 2.11's dispatch slow path) or, for an op without a sharding rule, its placements. No
    kernel runs for it on a GPU and its tensors die at once, so the probes pass it through uncounted: counted, torch
    2.11 priced an FSDP rank's optimizer step at its shard plus the whole model, and the global-size copies doubled
    its activation peak. Read from the caller's frames (`frames` of them, the dispatch's own included: each dispatch
    mode between the propagation and the probe adds 2 to 4; the estimator's deepest case is 13), since the
    propagation announces itself nowhere else."""
    frame = sys._getframe(1)
    for _ in range(frames):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == _META_PROPAGATION or code.co_filename.endswith(_DECOMPOSITION_PROPAGATION):
            return True
        frame = frame.f_back
    return False


def _unaliased_outputs(out: object, inputs: object) -> list[torch.Tensor]:
    """The tensors of `out` on storages none of `inputs` has: what an op without a schema made."""
    seen = {storage_identity(t) for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)}
    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and storage_identity(t) not in seen]


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages under `tensors` (views and tensors sharing a storage count it once)."""
    storages = {storage_identity(s): s.untyped_storage().nbytes() for t in tensors for s in _own_elements(t)}
    return sum(storages.values())


def _own_elements(t: torch.Tensor) -> list[torch.Tensor]:
    """What `t` stores on this rank: an FSDP shard's local tensor (a DTensor's own storage is its whole size), and
    a wrapper subclass's inner tensors (torchao's FP8-gathered weight wraps its shard; the wrapper's own storage is a
    placeholder, whose address a later one may reuse). The twin of megalm.model.shard.local_part, which this lowest
    layer may not import."""
    t = t.to_local() if isinstance(t, DTensor) else t
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [inner for name in names for inner in _own_elements(getattr(t, name))]
    return [t]


class LiveStorages(TorchDispatchMode):
    """Bytes of the live storages created under it (and of those passed to `track`), per device type.

    `with LiveStorages() as live: ...` then `live.bytes()`, `live.peak()`; `mark_peak()` restarts the peak at the
    current level. `at_backward_start` is the bytes live when the first backward began (autograd's own graph-task id
    tells it apart): the weights, and what the forward saved for the backward; `on_backward_start` is called then,
    to read what else was live at that moment.
    """

    def __init__(self, on_backward_start: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.on_backward_start = on_backward_start
        self.live: dict[int, _Live] = {}  # id of a storage object -> its bytes and device
        self._now: dict[str, int] = {}
        self._peak: dict[str, int] = {}
        self.at_backward_start: int | None = None
        self._label: str | None = None
        self._uncounted = False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let a compiled function run compiled under this probe (dynamo skips frames under any other dispatch mode,
        running them eager). Under fake tensors with `megalm.measure.compiled_cost.InductorCosts` as the backend
        (megalm-estimate, tools/bench) the compiled graphs' ops are replayed, so the probe counts what they make;
        inductor's own generated code allocates its buffers outside the dispatcher, where no probe sees them."""
        return True

    supports_higher_order_operators = True  # counted by their outputs (`is_higher_order`)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        if self.at_backward_start is None and torch._C._current_graph_task_id() != -1:
            self.at_backward_start = self.bytes()  # before the backward's first output
            if self.on_backward_start is not None:
                self.on_backward_start()
        out = func(*args, **(kwargs or {}))
        if not is_higher_order(func):
            for written in _written_outputs(func, out):  # a tracked storage grown in place
                for inner in _own_elements(written):
                    self._resized(inner.untyped_storage())
        new = _unaliased_outputs(out, (args, kwargs)) if is_higher_order(func) else _new_outputs(func, out)
        tensors = [t for t in tree_flatten(new)[0] if isinstance(t, torch.Tensor)]
        if tensors and not self._uncounted and not in_sharding_propagation():  # frames read only where there is
            # something to count
            self.track(tensors)
        return out

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count the storages of `tensors` (e.g. parameters made before the mode was entered) until freed."""
        for tensor in (inner for t in tensors for inner in _own_elements(t)):
            storage = tensor.untyped_storage()
            key = id(storage)
            if key in self.live:
                continue
            device = self._label or tensor.device.type
            self.live[key] = _Live(storage.nbytes(), device)
            self._now[device] = self._now.get(device, 0) + storage.nbytes()
            self._peak[device] = max(self._peak.get(device, 0), self._now[device])
            weakref.finalize(storage, self._free, key)

    def __enter__(self):
        # A storage resized in place (FSDP frees its gathered parameters with `resize_(0)` and re-allocates them
        # the same way) goes through no dispatched op: the probe watches UntypedStorage.resize_ while it is on.
        original = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, size: int):  # noqa: ANN202 - torch's method
            out = original(storage, size)
            self._resized(storage)
            return out

        self._resize_originals = [*getattr(self, "_resize_originals", []), original]
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):  # noqa: ANN002 - the context manager protocol
        torch.UntypedStorage.resize_ = self._resize_originals.pop()
        return super().__exit__(*exc)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        entry = self.live.get(id(storage))
        if entry is not None:
            delta, entry.nbytes = storage.nbytes() - entry.nbytes, storage.nbytes()
            self._now[entry.device] += delta
            self._peak[entry.device] = max(self._peak.get(entry.device, 0), self._now[entry.device])

    def _free(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self._now[entry.device] -= entry.nbytes

    def bytes(self, device: str | None = None) -> int:
        """Bytes live now, on `device` ("cpu", "cuda", "meta") or on all of them."""
        return sum(n for d, n in self._now.items() if device in (None, d))

    def peak(self, device: str | None = None) -> int:
        """The most bytes live at once since the start or the last `mark_peak`, per device (summed if None)."""
        return sum(n for d, n in self._peak.items() if device in (None, d))

    def mark_peak(self) -> None:
        """Restart the peaks at the bytes live now."""
        self._peak = dict(self._now)

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """Storages created inside are not counted (their bytes are given by `note_transient` instead): an eager
        replay of a compiled graph makes the values its fused kernels never write (megalm.measure.compiled_cost)."""
        previous, self._uncounted = self._uncounted, True
        try:
            yield
        finally:
            self._uncounted = previous

    def note_transient(self, nbytes: int, device: str) -> None:
        """Raise the peak to the bytes live now plus `nbytes` that were live for a while before now."""
        device = self._label or device
        self._peak[device] = max(self._peak.get(device, 0), self._now.get(device, 0) + nbytes)

    @contextlib.contextmanager
    def labelled(self, label: str) -> Iterator[None]:
        """Count the storages created inside under `label` instead of their device type: on a CPU, where the
        "device" and the host are the same memory, an offload store's host buffers are counted as "host"."""
        previous, self._label = self._label, label
        try:
            yield
        finally:
            self._label = previous

    @contextlib.contextmanager
    def labelling(self, owner: object, method: str, label: str) -> Iterator[None]:
        """While inside, what `owner.method` allocates is counted under `label` (e.g. an offload pool's
        `allocate`, "host"): the probe still counts the bytes itself, the label only says whose memory they are."""
        original, own = getattr(owner, method), method in vars(owner)

        @functools.wraps(original)
        def wrapped(*args, **kwargs):
            with self.labelled(label):
                return original(*args, **kwargs)

        setattr(owner, method, wrapped)
        try:
            yield
        finally:
            if own:
                setattr(owner, method, original)
            else:  # an instance's bound method: drop the wrapper, the class's method shows again
                delattr(owner, method)
