"""Python objects named to custom ops by CPU tensors.

A custom op (`torch.library.custom_op`) takes tensors, not objects, and a compiled graph must not specialise on which
layer it runs for (every block shares one graph). So an object an op needs at run time (a precision recipe's layer,
a zero-bubble layer's weight-gradient sink) is named by a CPU int64 tensor, `handle_of(obj)`: an index into a table of
weak references, so that the table never keeps a model alive, and an entry leaves with its object.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch

_OBJECTS: dict[int, weakref.ref] = {}
_KEYS = itertools.count()


def handle_of(obj: Any) -> torch.Tensor:
    """A new CPU tensor that names `obj` to `object_of`, for as long as `obj` lives."""
    key = next(_KEYS)
    _OBJECTS[key] = weakref.ref(obj, lambda _, key=key: _OBJECTS.pop(key, None))
    return torch.tensor(key, dtype=torch.int64)


def object_of(handle: torch.Tensor, what: str) -> Any:
    """The object `handle` names; `what` says what it is, in the error raised if it was freed."""
    ref = _OBJECTS.get(int(handle))
    obj = ref() if ref is not None else None
    if obj is None:  # a compiled graph holds the handle, not the object
        raise RuntimeError(f"the {what} of compiled layer {int(handle)} was freed before its graph ran; keep the layer "
                           "alive while its graph runs")
    return obj
