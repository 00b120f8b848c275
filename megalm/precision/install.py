"""Installing a precision recipe on a model's linear layers, from outside the model, and the per-layer state the
trainer and checkpoints reach through the model: the seed stream's (step, micro-batch), the delayed-scaling amax
histories.

`apply_precision(model, recipe, skip=...)` sets each linear layer's `gemm_recipe` hook (megalm/model/linear.py) to a
`RecipeGemms` (megalm/precision/linear.py; what the recipes compute: recipes.py), which the layer's GEMM function reads;
tensor-parallel layers have the same hook, and a zero-bubble pipeline's weight-gradient sink composes with it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from megalm.model.linear import LinearHooks, linear_modules
from megalm.model.naming import canonical_named_modules, model_chunks
from megalm.precision.amax_history import reduce_pending
from megalm.precision.layer_state import LinearState, WeightsVersion, set_steps
from megalm.precision.linear import RecipeGemms
from megalm.precision.recipes import Recipe, get_recipe


def _last_layer(model: nn.Module) -> int | None:
    num_layers = getattr(getattr(model_chunks(model)[0], "cfg", None), "num_layers", None)
    return None if num_layers is None else num_layers - 1


def skip_predicate(model: nn.Module, skip: Iterable[str] | Callable[[str, nn.Module], bool]
                   ) -> Callable[[str, nn.Module], bool]:
    """`skip` (fnmatch patterns on canonical layer names, `{last}` the model's last layer; or a predicate on
    (name, module)) as a predicate: whether a layer stays out of the recipe."""
    if callable(skip):
        return skip
    patterns = expand_layer_patterns(skip, _last_layer(model))
    return lambda name, module: any(fnmatch.fnmatchcase(name, p) for p in patterns)


def expand_layer_patterns(patterns: Iterable[str], last: int | None) -> list[str]:
    """`{last}` (or `{L-1}`) in a pattern is the index of the model's last layer."""
    out = []
    for pattern in patterns:
        if "{last}" in pattern or "{L-1}" in pattern:
            if last is None:
                raise ValueError(f"pattern {pattern!r} needs a model with cfg.num_layers")
            pattern = pattern.replace("{last}", str(last)).replace("{L-1}", str(last))
        out.append(pattern)
    return out


def apply_precision(
    model: nn.Module,
    recipe: str | Recipe,
    skip: Iterable[str] | Callable[[str, nn.Module], bool] = (),
    overrides: Mapping[str, str | Recipe] | None = None,
    seed: int = 0,
    weights_version: WeightsVersion | None = None,
    noise_rank: int = 0,
) -> dict[str, LinearState]:
    """Run the linear layers of `model` in `recipe`; returns {layer name: its LinearState}.

    Every layer that runs its GEMMs through megalm.model.linear (the model's `Linear`, megalm's
    Column/RowParallelLinear) gets a `RecipeGemms` as its `gemm_recipe` hook; its `forward` is left
    alone, so a zero-bubble weight-gradient sink on the same layer composes with it. Names are
    canonical (`layers.{layer_id}...`, see megalm.model.naming). `skip`: fnmatch patterns (or a
    predicate on (name, module)) of layers left untouched, e.g. ("output", "layers.0.*",
    "layers.{last}.*") keeps the head and the first and last blocks in the trainer's precision.
    `overrides`: {pattern: recipe}, first match wins, for layers that take another recipe. The
    embedding and a tied output head (F.linear on the embedding) are not linear layers: untouched.
    A plain torch nn.Linear has no hook and is refused. A previous `apply_precision` is undone first.
    `weights_version`: shared by every layer's state; `weights_version.watch(optimizer)` lets them cache a
    quantized weight for the optimizer step (see `LinearState.quantized_weight`).
    """
    remove_precision(model)
    recipe, weights_version = get_recipe(recipe), weights_version or WeightsVersion()
    last = _last_layer(model)
    skipped = skip_predicate(model, skip)
    override_patterns = [(p, get_recipe(r)) for p, r in (overrides or {}).items()]
    override_patterns = [(expand_layer_patterns([p], last)[0], r) for p, r in override_patterns]
    states = {}
    for name, module in canonical_named_modules(model):
        if not isinstance(module, (nn.Linear, LinearHooks)) or skipped(name, module):
            continue
        if not isinstance(module, LinearHooks):
            raise TypeError(f"{name} is a plain torch nn.Linear, which has no precision hook; build it as "
                            "megalm.model.linear.Linear (same parameters)")
        chosen = next((r for p, r in override_patterns if fnmatch.fnmatchcase(name, p)), recipe)
        state = LinearState(name, seed, weights_version=weights_version, noise_rank=noise_rank)
        module.gemm_recipe = None if chosen.is_fp32 else RecipeGemms(chosen, state, module=module)
        states[name] = state
    return states


def remove_precision(model: nn.Module) -> None:
    """Undo `apply_precision`: every layer runs its GEMMs in the trainer's precision again."""
    for module in linear_modules(model):
        module.__dict__.pop("gemm_recipe", None)


def _layer_states(model: nn.Module) -> Iterator[tuple[LinearState, torch.device]]:
    """(state, weight's device) of every layer running a recipe with a `LinearState`."""
    for module in linear_modules(model):
        gemms = module.gemm_recipe
        if isinstance(gemms, RecipeGemms) and gemms.state is not None:
            yield gemms.state, module.weight.device


def reduce_amax_histories(model: nn.Module, group: object, device: torch.device, step: int) -> None:
    """End training step `step`'s backward under delayed scaling: every history's step amax maxed over the ranks of
    `group` (the ranks that split the batch; `amax_history.reduce_pending`). Every rank of `group` calls it once a
    step. A layer this rank ran no micro-batch through in the step (an idle HDP rank's) is moved to the step first,
    as a forward would have: its rings take the last step's max, and it joins with nothing, not that max again."""
    states = [state for state, _ in _layer_states(model)]
    set_steps([state for state in states if state.step != step], step)
    histories = [history for state in states for history in state.amax.values()]
    if histories:
        reduce_pending(histories, group, device)


def amax_history_tensors(model: nn.Module, layout: str) -> dict[str, torch.Tensor]:
    """This rank's delayed-scaling amax histories, as tensors a checkpoint keeps beside the rank's RNG state:
    {"amax/<layout>/<layer>/<x|w|dy>/<count|history|pending>": tensor}; empty under any other recipe. A history
    holds the amaxes of the layer's shard on this rank, so it is tagged with the parallel layout (`layout`) and
    restored under the same one only."""
    out = {}
    for state, _ in _layer_states(model):
        for tensor, history in state.amax.items():
            saved = history.state_dict()
            if saved["history"] is None and saved["pending"] is None:
                continue
            for field, value in saved.items():
                if value is not None:
                    out[f"amax/{layout}/{state.name}/{tensor}/{field}"] = torch.as_tensor(value).detach().cpu().clone()
    return out


def load_amax_histories(model: nn.Module, tensors: Mapping[str, torch.Tensor], layout: str,
                        device: torch.device | None = None) -> set[str]:
    """Restore `amax_history_tensors`' histories saved under `layout` (other keys ignored) onto `device` (where the
    layers compute; default: each layer's weight's). Returns the other layouts whose histories the tensors hold."""
    for state, weight_device in _layer_states(model):
        for tensor, history in state.amax.items():
            key = f"amax/{layout}/{state.name}/{tensor}/"
            if key + "count" in tensors:
                saved = {field: tensors.get(key + field) for field in ("history", "pending")}
                history.load_state_dict({"count": int(tensors[key + "count"]),
                                         **{f: None if t is None else t.to(device or weight_device)
                                            for f, t in saved.items()}})
    return {k.split("/")[1] for k in tensors if k.startswith("amax/")} - {layout}


def set_precision_step(model: nn.Module, step: int, micro_batch: int = 0, shard: int = 0) -> None:
    """Start the seed stream of every low-precision layer at (step, micro_batch, shard); call it before each
    micro-batch's forward for draws that do not depend on the schedule. `shard`: this rank's position on the
    micro-batch's context-parallel ring (0 when the micro-batch is whole here)."""
    set_steps((state for state, _ in _layer_states(model)), step, micro_batch, shard)
