"""Transformer Engine's FP8 recipes on megalm's linear layers (`precision.backend=te`).

Why a second fp8 path: TE's fused FP8 GEMMs, amax bookkeeping and scaling recipes are NVIDIA's
reference implementation and what most Megatron-LM users run; where TE is installed, megalm uses it
instead of re-deriving it. The native path (`precision/linear.py`) stays the default and the one that
always works (CPU emulation, `torch._scaled_mm` on Hopper).

How, from outside the model (docs/architecture.md): every selected model `Linear` is swapped for a
`transformer_engine.pytorch.Linear` of the same shape, keeping the parameter names (`weight`,
`bias`) and values, so initialisation by name, checkpoints and the optimizer see the same
parameters; and `precision.autocast` enters `te.pytorch.fp8_autocast(enabled=True, fp8_recipe=...)`
around every forward. Recipes (Format.HYBRID: E4M3 forward, E5M2 gradients, as in the native path):

    fp8          Float8CurrentScaling   per-tensor scales from the current amax
    fp8_delayed  DelayedScaling         scales from an amax history (16 steps, max)

`fp8_rowwise` has no TE counterpart (TE's block scaling uses 1×128 / 128×128 tiles, not rows) and stays
native. megalm's tensor-parallel layers are not TE modules, so the TE path takes tp = 1 (config rule).
"""

from __future__ import annotations

import contextlib
import logging
import re

import torch
from torch import nn

from megalm.model.linear import Linear
from megalm.model.naming import canonical_named_modules
from megalm.precision.install import skip_predicate

log = logging.getLogger("megalm")

TE_RECIPES = ("fp8", "fp8_delayed")
TE_DEVICES = ("cuda",)  # TE has no CPU kernels (tests with a stand-in TE add "cpu")
TE_TOKEN_MULTIPLE = 16  # TE's FP8 GEMMs need every dimension divisible by 16: the trainer pads micro-batches
AMAX_HISTORY = 16
TE_MIN_VERSION = {"fp8": (2, 2)}  # Float8CurrentScaling first shipped in TE 2.2; DelayedScaling is older


def version_problem(name: str, version: str) -> str | None:
    """Why TE `version` cannot run recipe `name` (with the fix), or None when it can."""
    need = TE_MIN_VERSION.get(name)
    found = re.match(r"(\d+)\.(\d+)", version)
    if need is None or (found and (int(found[1]), int(found[2])) >= need):
        return None
    floor = f"{need[0]}.{need[1]}"
    return (f"transformer_engine {version or '(no __version__)'} has no Float8CurrentScaling (TE >= {floor}; "
            f"pip install 'transformer-engine>={floor}' or use precision=fp8_delayed)")


def te_recipe(name: str):
    """The TE recipe object for megalm recipe `name`."""
    from transformer_engine.common import recipe

    if name == "fp8":
        return recipe.Float8CurrentScaling(fp8_format=recipe.Format.HYBRID)
    if name == "fp8_delayed":
        return recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=AMAX_HISTORY,
                                     amax_compute_algo="max")
    raise ValueError(f"precision={name} has no Transformer Engine recipe; TE runs {', '.join(TE_RECIPES)}")


def te_autocast(name: str, amax_group: object = None) -> contextlib.AbstractContextManager:
    """TE's fp8 autocast with the recipe for `name`, around a forward pass. `amax_group`: the ranks that split the
    batch (data and context parallel), over which TE reduces its amaxes, as Megatron passes its amax group; TE's
    default (None) is the whole world, which under pipeline parallelism mixes stages of other layers."""
    import transformer_engine.pytorch as te

    return te.fp8_autocast(enabled=True, fp8_recipe=te_recipe(name), fp8_group=amax_group)


def apply_te(model: nn.Module, name: str, skip: list[str] | tuple[str, ...] = ()) -> int:
    """Swap the model `Linear` layers of `model` not matched by `skip` (as `apply_precision` reads it: fnmatch on
    canonical names, `{last}` the last layer) for TE Linear layers with the same parameters. Returns how many."""
    import transformer_engine.pytorch as te

    te_recipe(name)  # fail early on a recipe TE does not run
    parents = {id(child): (parent, attr) for parent in model.modules() for attr, child in parent.named_children()}
    skipped, swapped = skip_predicate(model, skip), 0
    for canonical, module in list(canonical_named_modules(model)):
        if not isinstance(module, Linear) or skipped(canonical, module):
            continue
        weight = module.weight
        layer = te.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                          params_dtype=weight.dtype, device=weight.device)
        if weight.device.type != "meta":
            with torch.no_grad():
                layer.weight.copy_(weight)
                if module.bias is not None:
                    layer.bias.copy_(module.bias)
        parent, attr = parents[id(module)]
        setattr(parent, attr, layer)
        swapped += 1
    return swapped
