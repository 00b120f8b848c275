"""Precision recipes, applied from outside the model (DESIGN.md joint 5).

- fp32: nothing; bf16: autocast around the forward, fp32 master weights and optimizer state.
- fp8*, mxfp8, mxfp4*: bf16 autocast for everything (attention, norms, the skipped layers) and the
  recipe's low-precision GEMMs in the linear layers (`precision/linear.py`, installed by
  `apply_recipe` on plain and tensor-parallel linear layers alike).
- `precision.backend=te` with fp8 / fp8_delayed: Transformer Engine's Linear and fp8 recipes
  (`precision/te.py`) when TE is importable; otherwise the native path, and the log says so.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator

import torch
from torch import nn

log = logging.getLogger("megalm")


@contextlib.contextmanager
def autocast(precision, device: torch.device) -> Iterator[None]:
    """bf16 autocast around forward passes (fp32 master weights): for bf16, and for the low-precision
    recipes unless `precision.autocast` is false (then everything but the recipe's GEMMs runs in fp32);
    plus TE's fp8_autocast when the recipe runs on Transformer Engine. Nothing is entered before the
    `with`. `precision` is a PrecisionConfig or a recipe name."""
    name = getattr(precision, "name", precision)
    with contextlib.ExitStack() as stack:
        if name == "bf16" or (name != "fp32" and getattr(precision, "autocast", True)):
            stack.enter_context(torch.autocast(device_type=device.type, dtype=torch.bfloat16))
        if uses_transformer_engine(name, getattr(precision, "backend", "native"), device):
            from megalm.precision.te import te_autocast

            stack.enter_context(te_autocast(name))
        yield


def uses_transformer_engine(name: str, backend: str, device: torch.device | None = None) -> bool:
    """Whether recipe `name` under `backend` runs Transformer Engine's layers: te requested, TE importable,
    and (when `device` is given) a CUDA device — TE has no CPU kernels."""
    from megalm.precision import te

    on_gpu = device is None or torch.device(device).type in te.TE_DEVICES
    return backend == "te" and name in te.TE_RECIPES and on_gpu and transformer_engine_available()


@functools.cache
def transformer_engine_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a build that does not match this torch
        return False
    return True


def apply_recipe(model: nn.Module, name: str, forward: str | None = None, skip: list[str] | tuple[str, ...] = (),
                 backend: str = "native", seed: int = 0, device: torch.device | None = None) -> str:
    """Install recipe `name` on the linear layers of `model` (a GPT or pipeline chunks); returns a
    one-line description of what runs, for the log. fp32 and bf16 install nothing."""
    if name in ("fp32", "bf16"):
        return f"{name} (autocast only)"
    skipped = f", skipping {list(skip)}" if skip else ""
    fallback = ""
    if uses_transformer_engine(name, backend, device):
        from megalm.precision.te import apply_te, te_recipe

        count = apply_te(model, name, list(skip))
        return f"{name} on {count} linear layers (transformer_engine {type(te_recipe(name)).__name__}){skipped}"
    if backend == "te":
        why = "transformer_engine not importable" if not transformer_engine_available() else "no CUDA device"
        log.warning("precision.backend=te but %s; running the native %s path", why, name)
        fallback = f", {why}"
    from megalm.precision.linear import apply_precision, get_recipe

    recipe = get_recipe(name, forward=forward)
    states = apply_precision(model, recipe, skip=list(skip), seed=seed)
    return f"{name} on {len(states)} linear layers (native emulation/scaled_mm{fallback}){skipped}"
