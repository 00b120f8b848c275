"""NCCL's first rule, checked on CPU: no tensor made on the host may reach a collective.

`init_process_group("nccl")` has no CPU backend, so a collective on a CPU tensor crashes the first
multi-GPU run. On a CPU/gloo test every tensor is a CPU tensor, so the device alone cannot tell; what can
is how a tensor was made. `HostTensorGuard` is a TorchFunctionMode that tags the tensors factory functions
make without a `device=` (torch.tensor, zeros, ones, empty, full, arange, as_tensor) and everything computed
from them, untags what `.to(device)` / `.cuda()` returns, and wraps the collectives of torch.distributed
(and megalm's aliases of them) to fail on a tagged tensor, naming where it was made. What megalm makes on
the run's device (`device=self.device`, `*_like` of a device tensor) passes; a `torch.tensor(n)` passed to
`all_reduce` fails, as it would under NCCL.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import traceback
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange}
MOVES = {torch.Tensor.to, torch.Tensor.cuda}
# isend/irecv are checked inside batch_isend_irecv (P2POp accepts only the unwrapped functions).
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
               "reduce_scatter_single", "reduce_scatter", "broadcast", "all_to_all_single", "all_to_all", "send",
               "recv", "batch_isend_irecv", "reduce", "gather", "scatter")


class HostTensorGuard(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.host: dict[int, tuple[weakref.ref, str]] = {}  # id -> (the tensor, where it was made)

    def site(self, t: torch.Tensor) -> str | None:
        entry = self.host.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def _tag(self, out, where: str) -> None:
        for t in _tensors(out):
            self.host[id(t)] = (weakref.ref(t), where)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in FACTORIES:
            if kwargs.get("device") is None:
                frame = next((f for f in reversed(traceback.extract_stack()[:-1]) if "/megalm/" in f.filename), None)
                self._tag(out, f"{frame.filename}:{frame.lineno}" if frame else "outside megalm")
        elif func in MOVES and (args[1:] or kwargs.get("device") is not None or func is torch.Tensor.cuda):
            for t in _tensors(out):
                self.host.pop(id(t), None)
        elif _megalm_op(func):  # megalm's custom ops read small host tensors as metadata (the CP ring's `ring_meta`,
            pass  # read on the host by design) and compute their outputs on the device of their data
        else:
            sites = [s for t in _tensors((args, kwargs)) if (s := self.site(t))]
            target = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if sites and out is not target:  # an in-place op (param.copy_(host)) leaves its tensor where it is
                self._tag(out, sites[0])
        return out

    def check(self, name: str, args, kwargs) -> None:
        for t in _tensors((args, kwargs)):
            where = self.site(t)
            if where is not None:
                raise AssertionError(f"dist.{name} got a tensor made on the host at {where} (no device=): "
                                     "NCCL has no CPU backend")


def _megalm_op(func) -> bool:
    """Whether `func` is one of megalm's torch.library custom ops (namespace megalm::)."""
    name = getattr(func, "_qualified_op_name", None) or getattr(func, "name", lambda: "")
    name = name() if callable(name) else name
    return isinstance(name, str) and name.startswith("megalm::")


def _tensors(obj) -> Iterator[torch.Tensor]:
    """Every tensor in a nest of tuples, lists, dicts and P2POps."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)
    elif isinstance(obj, dist.P2POp):
        yield obj.tensor


@contextlib.contextmanager
def host_tensor_guard() -> Iterator[HostTensorGuard]:
    """Enter the guard and wrap the collectives (torch.distributed's and the aliases megalm modules keep)."""
    guard = HostTensorGuard()
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    wrapped = {}
    for name, fn in originals.items():
        @functools.wraps(fn)
        def checked(*args, _fn=fn, _name=name, **kwargs):
            guard.check(_name, args, kwargs)
            return _fn(*args, **kwargs)

        wrapped[name] = checked
    aliases = [(module, attr, value) for mod_name, module in list(sys.modules.items())
               if mod_name.startswith("megalm") and module is not None
               for attr, value in list(vars(module).items()) if any(value is fn for fn in originals.values())]
    by_fn = {id(fn): wrapped[name] for name, fn in originals.items()}
    try:
        for name, fn in wrapped.items():
            setattr(dist, name, fn)
        for module, attr, value in aliases:
            setattr(module, attr, by_fn[id(value)])
        with guard:
            yield guard
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        for module, attr, value in aliases:
            setattr(module, attr, value)
