"""The device a run uses, and the default it decides: `precision=auto`.

`configs/config.yaml` defaults to `precision: auto` so that a run on a GPU trains in bf16 without being asked:
bf16 on a CUDA device of compute capability 8.0+ (Ampere and newer: bf16 tensor cores), fp32 on CPU and on older
GPUs. `resolve_auto_precision` replaces the whole `precision` section with the chosen recipe's config before
validation, exactly as if the user had written `precision=bf16` / `precision=fp32` (keys the user set under
`precision.*` kept), so nothing downstream (validation, the run dir's config.yaml, checkpoints, metrics, FLOPs)
ever sees "auto". Every run path resolves through `megalm.training.validation.validate_run`; the CLI resolves
its Hydra config first so the run dir's config.yaml names the recipe.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from megalm.config import MegalmConfig, PrecisionConfig
from megalm.errors import ConfigError

log = logging.getLogger("megalm")

AUTO = "auto"
BF16_MIN_CAPABILITY = (8, 0)  # Ampere: the first GPUs with bf16 tensor cores
PRECISION_CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "precision"


def select_device(name: str) -> torch.device:
    """The device of `trainer.device` (auto: CUDA when visible, else CPU)."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu or auto")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def auto_recipe(device: torch.device | str, capability: tuple[int, int] | None = None) -> tuple[str, str]:
    """(recipe, why) that `precision=auto` picks on `device`: bf16 on CUDA sm80+, fp32 elsewhere. `capability`
    stands in for `torch.cuda.get_device_capability(device)` (tests without a GPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "fp32", device.type
    if device.index is None and torch.cuda.is_available():  # "cuda": this process's current GPU (LOCAL_RANK's)
        device = torch.device("cuda", torch.cuda.current_device())
    major, minor = capability if capability is not None else torch.cuda.get_device_capability(device)
    where = f"{device} sm{major}{minor}"
    if (major, minor) >= BF16_MIN_CAPABILITY:
        return "bf16", where
    return "fp32", f"{where}: no bf16 tensor cores before sm80; precision=bf16 forces it"


def _recipe_section(name: str, current: dict[str, Any]) -> dict[str, Any]:
    """The `precision` section of `precision=<name>` (its configs/precision YAML over the schema defaults),
    with the keys the user set on top of `precision=auto` (those that differ from the schema's) kept."""
    defaults = dataclasses.asdict(PrecisionConfig())
    file = PRECISION_CONFIGS / f"{name}.yaml"
    recipe = OmegaConf.to_container(OmegaConf.load(file)) if file.is_file() else {"name": name}
    user = {k: v for k, v in current.items() if k != "name" and k in defaults and v != defaults[k]}
    return {**defaults, **recipe, **user}  # type: ignore[dict-item]


def resolve_auto_precision(cfg: MegalmConfig | DictConfig, device: torch.device | str,
                           capability: tuple[int, int] | None = None) -> str | None:
    """Replace `precision=auto` in `cfg` (a MegalmConfig or a composed Hydra config, changed in place) by the
    recipe `device` calls for, and log one line ("precision: auto -> bf16 (cuda:0 sm90)"). Returns the recipe,
    or None when `cfg` names one itself (then nothing changes)."""
    if cfg.precision.name != AUTO:
        return None
    recipe, why = auto_recipe(device, capability)
    is_hydra = isinstance(cfg, DictConfig)
    current = OmegaConf.to_container(cfg.precision, resolve=True) if is_hydra else dataclasses.asdict(cfg.precision)
    section = OmegaConf.merge(OmegaConf.structured(PrecisionConfig), _recipe_section(recipe, current))  # typed
    cfg.precision = section if is_hydra else OmegaConf.to_object(section)  # type: ignore[assignment]
    log.info(f"precision: auto -> {recipe} ({why})")
    return recipe
