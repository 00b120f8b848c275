"""Precision recipes, applied from outside the model (DESIGN.md joint 5).

- fp32: nothing; bf16: autocast around the forward, fp32 master weights and optimizer state.
- fp8*, mxfp8, mxfp4*: bf16 autocast for everything (attention, norms, the skipped layers) and the
  recipe's low-precision GEMMs in the linear layers (`precision/linear.py`, installed by
  `apply_recipe` on plain and tensor-parallel linear layers alike).
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
from torch import nn

log = logging.getLogger("megalm")


def autocast(precision, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast around forward passes (fp32 master weights): for bf16, and for the low-precision
    recipes unless `precision.autocast` is false (then everything but the recipe's GEMMs runs in fp32).
    `precision` is a PrecisionConfig or a recipe name."""
    name = getattr(precision, "name", precision)
    if name == "bf16" or (name != "fp32" and getattr(precision, "autocast", True)):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@functools.cache
def transformer_engine_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a build that does not match this torch
        return False
    return True


def apply_recipe(model: nn.Module, name: str, forward: str | None = None, skip: list[str] | tuple[str, ...] = (),
                 backend: str = "native", seed: int = 0) -> str:
    """Install recipe `name` on the linear layers of `model` (a GPT or pipeline chunks); returns a
    one-line description of what runs, for the log. fp32 and bf16 install nothing."""
    if name in ("fp32", "bf16"):
        return f"{name} (autocast only)"
    if backend == "te":
        from megalm.errors import ConfigError

        if not transformer_engine_available():
            raise ConfigError("precision.backend=te but transformer_engine is not importable; install it or use "
                              "precision.backend=native")
        raise ConfigError("precision.backend=te is detected but not wired into megalm yet; use "
                          "precision.backend=native (the native fp8 path uses torch._scaled_mm on Hopper)")
    from megalm.precision.linear import apply_precision, get_recipe

    recipe = get_recipe(name, forward=forward)
    states = apply_precision(model, recipe, skip=list(skip), seed=seed)
    skipped = f", skipping {list(skip)}" if skip else ""
    return f"{name} on {len(states)} linear layers (native emulation/scaled_mm){skipped}"
