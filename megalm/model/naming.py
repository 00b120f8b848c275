"""Canonical names: every parameter and module is named as in the full single-process model.

A pipeline rank holds chunks (GPTs keeping a slice of the layers); `layers.{i}` of a chunk is renamed
to the block's global `layer_id`, so init (drawn by name), checkpoints (keyed by name), precision
recipes (installed by name) and tests see the same names under every layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch import nn


def model_chunks(model: nn.Module) -> list[nn.Module]:
    """The GPT chunks of `model`: the chunks a pipeline rank holds (an nn.ModuleList of modules with
    `layers`), or the model itself."""
    if isinstance(model, nn.ModuleList) and len(model) and all(hasattr(m, "layers") for m in model):
        return list(model)
    return [model]


def _canonical_named(model: nn.Module, named: Callable[[nn.Module], Iterator[tuple[str, Any]]]
                     ) -> Iterator[tuple[str, Any]]:
    """`named(chunk)` over every chunk, each object once, with `layers.{i}` renamed to the block's
    global `layer_id` (a module without `layers` keeps its names)."""
    seen: set[int] = set()
    for chunk in model_chunks(model):
        layers = getattr(chunk, "layers", None)
        for name, obj in named(chunk):
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if isinstance(layers, nn.ModuleList) and name.startswith("layers."):
                _, index, *rest = name.split(".", 2)
                name = ".".join(["layers", str(getattr(layers[int(index)], "layer_id", index)), *rest])
            yield name, obj


def canonical_named_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """(name, parameter) with the name the full model gives it: `layers.{i}` uses the block's
    global `layer_id`, so a pipeline stage holding a slice of the layers gets the full model's names.

    `model` is a GPT or an nn.ModuleList of GPT chunks (a pipeline rank with virtual stages); a
    parameter two chunks share (tied embeddings on one rank) is yielded once.
    """
    return _canonical_named(model, lambda chunk: chunk.named_parameters())


def canonical_named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) with the full model's names, as `canonical_named_parameters` (the chunks' own
    prefixes are dropped), for code that installs things on modules by name (precision recipes)."""
    return _canonical_named(model, lambda chunk: chunk.named_modules())


def _persistent_buffers(chunk: nn.Module) -> Iterator[tuple[str, Any]]:
    for module_name, module in chunk.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buffer


def canonical_named_buffers(model: nn.Module) -> Iterator[tuple[str, Any]]:
    """(name, buffer) of the persistent buffers, the model's state that is not trained (an MoE router's balancing
    bias), with the full model's names as `canonical_named_parameters`. Every rank holding the module holds it whole."""
    return _canonical_named(model, _persistent_buffers)


def model_parts(names: Iterable[str]) -> dict[str, list[str]]:
    """Canonical `names` in parts, keyed by the module that holds each: one block (`layers.{i}`) or one top-level
    module (`embedding`, `final_norm`, ...), in the order they first appear. What a whole-model conversion
    (megalm-import, megalm-export) holds at a time, so that its host memory is one part's, not the model's (a
    Llama-70B block is 3.4 GB in fp32, the model 280 GB)."""
    parts: dict[str, list[str]] = {}
    for name in names:
        head, _, rest = name.partition(".")
        parts.setdefault(f"{head}.{rest.partition('.')[0]}" if head == "layers" else head, []).append(name)
    return parts
