"""Single-process checkpoints: atomic, self-describing, loaded without executing pickled code.

Layout of a run dir:

    checkpoints/
      step_00000100/
        model.safetensors       # model weights
        optimizer.safetensors   # AdamW moments and step, keyed by parameter name
        rng.safetensors         # torch CPU (and CUDA) generator states
        state.json              # step, consumed tokens, seed, batch size, param-group hyper-parameters
        config.yaml             # the resolved run config (megalm-generate rebuilds the model from it)
      latest                    # text file naming the newest complete checkpoint

A save writes everything into `.tmp-step_…` first, fsyncs, renames the directory into place and
only then replaces `latest` (os.replace is atomic on POSIX). A crash at any point leaves the
previous `latest` pointing at a complete checkpoint; stale temporaries are removed by the next
save. Tensors go through safetensors and metadata through JSON/YAML, so loading never unpickles.
Optimizer state is keyed by parameter *name*, not position, so a checkpoint survives a change in
parameter-group layout and can be checked against the model it is loaded into.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from megalm.errors import CheckpointError

FORMAT_VERSION = 1
CHECKPOINTS = "checkpoints"
LATEST = "latest"
FILES = ("model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json", "config.yaml")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


# ---------------------------------------------------------------------------- optimizer state by name


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter names in the order `optimizer.state_dict()` numbers them."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def optimizer_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, list[dict]]:
    """Flatten AdamW state to {"<param>::<key>": tensor} and hyper-parameters per group."""
    state = optimizer.state_dict()
    names = _param_names(model, optimizer)
    tensors = {}
    for index, per_param in state["state"].items():
        for key, value in per_param.items():
            tensors[f"{names[index]}::{key}"] = value.detach().cpu().contiguous()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
    for group, torch_group in zip(groups, optimizer.param_groups, strict=True):
        group["param_names"] = _group_names(model, torch_group)
    return tensors, groups


def _group_names(model: nn.Module, group: dict) -> list[str]:
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [name_of[id(p)] for p in group["params"]]


def load_optimizer_tensors(model: nn.Module, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                           groups: list[dict]) -> None:
    names = _param_names(model, optimizer)
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        name, _, field = key.partition("::")
        if name not in names:
            raise CheckpointError(f"optimizer state has parameter {name!r} that this model lacks; "
                                  "the checkpoint is from another model")
        per_param.setdefault(names.index(name), {})[field] = value
    current = optimizer.state_dict()
    if len(groups) != len(current["param_groups"]):
        raise CheckpointError(f"checkpoint has {len(groups)} optimizer param groups, this run has "
                              f"{len(current['param_groups'])}; the checkpoint is from another setup")
    new_groups = []
    for saved, cur in zip(groups, current["param_groups"], strict=True):
        merged = {k: v for k, v in saved.items() if k != "param_names"}
        merged["params"] = cur["params"]
        new_groups.append(merged)
    optimizer.load_state_dict({"state": per_param, "param_groups": new_groups})


# ---------------------------------------------------------------------------- save / find / load


@dataclass
class LoadedCheckpoint:
    path: Path
    state: dict[str, Any]
    config: dict[str, Any]


def save_checkpoint(run_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: dict[str, Any], config: dict[str, Any], keep_last: int) -> Path:
    """Write the checkpoint of `step` atomically, point `latest` at it, keep the newest `keep_last`."""
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    name = checkpoint_name(step)
    tmp = root / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()

    model_state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(model_state, str(tmp / "model.safetensors"))
    opt_tensors, groups = optimizer_tensors(model, optimizer)
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    rng = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"torch_cuda_{i}"] = s
    save_file(rng, str(tmp / "rng.safetensors"))
    full_state = {"format_version": FORMAT_VERSION, "step": step, "optimizer_param_groups": groups, **state}
    (tmp / "state.json").write_text(json.dumps(full_state, indent=1))
    (tmp / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(config)))
    for f in FILES:
        _fsync_path(tmp / f)
    _fsync_path(tmp)

    final = root / name
    if final.exists():  # re-saving a step (e.g. after a resume): swap atomically, then drop the old copy
        old = root / f".old-{name}-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_path(root)
    _write_text_atomic(root / LATEST, name + "\n")
    _prune(root, keep_last)
    return final


def _step_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("step_*") if p.is_dir())


def _prune(root: Path, keep_last: int) -> None:
    for stale in [*root.glob(".tmp-*"), *root.glob(".old-*")]:  # debris of saves that crashed
        shutil.rmtree(stale, ignore_errors=True)
    for old in _step_dirs(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def is_complete(path: Path) -> bool:
    return path.is_dir() and all((path / f).is_file() for f in FILES)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint `latest` names; if that file is missing, the newest complete step dir."""
    root = Path(run_dir) / CHECKPOINTS
    pointer = root / LATEST
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if is_complete(candidate):
            return candidate
    complete = [p for p in _step_dirs(root) if is_complete(p)] if root.is_dir() else []
    return complete[-1] if complete else None


def resolve_checkpoint_path(path: str | Path) -> Path:
    """A complete checkpoint dir from: a checkpoint dir, a run dir, its `checkpoints/` dir, or a dir
    of runs (such as `outputs/`, where the run whose `latest` was written last wins)."""
    path = Path(path).expanduser()
    if is_complete(path):
        return path
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist; pass a checkpoint dir or a run dir")
    found = latest_checkpoint(path.parent if path.name == CHECKPOINTS else path)
    if found is not None:
        return found
    pointers = sorted(path.glob(f"**/{CHECKPOINTS}/{LATEST}"), key=lambda p: p.stat().st_mtime)
    for pointer in reversed(pointers):
        found = latest_checkpoint(pointer.parent.parent)
        if found is not None:
            return found
    raise CheckpointError(f"{path} holds no complete checkpoint (needs {', '.join(FILES)}); "
                          "pass a checkpoint dir such as RUN_DIR/checkpoints/step_00000100")


def read_checkpoint_meta(path: Path) -> LoadedCheckpoint:
    try:
        state = json.loads((path / "state.json").read_text())
        config = OmegaConf.to_container(OmegaConf.load(path / "config.yaml"), resolve=True)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path} is corrupt ({type(e).__name__}: {e}); "
                              "resume from another one with trainer.resume=PATH") from None
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format version {state.get('format_version')}, "
                              f"this megalm reads {FORMAT_VERSION}")
    return LoadedCheckpoint(path=path, state=state, config=config)  # type: ignore[arg-type]


def _load_tensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file), device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint file {file} is corrupt ({e}); "
                              "resume from another checkpoint with trainer.resume=PATH") from None


def check_model_config(saved: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    """Refuse a checkpoint written by a model of another shape, naming the differing keys."""
    shape_keys = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size",
                  "norm", "activation", "position_embedding", "tie_embeddings", "bias", "max_position_embeddings")
    diffs = [f"{k}={saved.get(k)} (this run: {current.get(k)})" for k in shape_keys if saved.get(k) != current.get(k)]
    if diffs:
        raise CheckpointError(f"checkpoint {path} is from another model: {', '.join(diffs)}; use the matching "
                              "model=... overrides or a new hydra.run.dir")


def load_model_weights(path: Path, model: nn.Module) -> None:
    weights = _load_tensors(path / "model.safetensors")
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0]
        raise CheckpointError(f"checkpoint {path} does not fit this model ({first}); use the matching "
                              "model config") from None


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> LoadedCheckpoint:
    """Load weights, optimizer and RNG state in place; return the checkpoint's metadata."""
    meta = read_checkpoint_meta(path)
    load_model_weights(path, model)
    if optimizer is not None:
        load_optimizer_tensors(model, optimizer, _load_tensors(path / "optimizer.safetensors"),
                               meta.state["optimizer_param_groups"])
    rng = _load_tensors(path / "rng.safetensors")
    torch.set_rng_state(rng["torch_cpu"])
    cuda_states = [rng[k] for k in sorted(rng) if k.startswith("torch_cuda_")]
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states[: torch.cuda.device_count()])
    return meta
