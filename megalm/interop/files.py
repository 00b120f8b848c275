"""Files for export and import: all-or-nothing output directories, safetensors shards, megalm weights on CPU.

An output directory is written as a hidden sibling and renamed into place only when complete, so an error or a
crash never leaves a half-written model where a user (or transformers) would load it, and an existing directory
is only replaced when asked (`--overwrite`) and only after the new one is complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from megalm.config import ModelConfig, resolve_model_defaults
from megalm.interop.hf_mapping import InteropError
from megalm.model import GPT
from megalm.model.naming import canonical_named_parameters
from megalm.training.checkpoint import (
    LoadedCheckpoint,
    load_model_weights,
    read_checkpoint_meta,
    resolve_checkpoint_path,
)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
DEFAULT_MAX_SHARD = "5GB"  # transformers' save_pretrained default


def parse_size(text: str) -> int:
    """Bytes of "5GB", "500MB", "20KB" or a plain integer (decimal units, as transformers' max_shard_size)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", text.upper())
    if not match:
        raise InteropError(f"--max-shard-size={text} is not a size; write e.g. 5GB, 500MB or 20KB")
    unit = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9}[match[2]]
    return int(float(match[1]) * unit)


def check_output_dir(out: Path, overwrite: bool) -> None:
    """Refuse an output path that is a file, or a non-empty directory without `overwrite`."""
    if out.exists() and not out.is_dir():
        raise InteropError(f"--out {out} is a file; pass a directory path")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise InteropError(f"--out {out} exists and is not empty; pass --overwrite to replace it or choose "
                           "another directory")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_output_dir(out: Path, overwrite: bool) -> Iterator[Path]:
    """Yield an empty temporary directory next to `out`; on success it replaces `out` in one rename (the old
    one is removed afterwards), on error it is deleted and `out` is untouched."""
    out = Path(out).absolute()
    check_output_dir(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file():
                _fsync(f)
        _fsync(tmp)
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.rename(out, old)
        os.rename(tmp, out)
        _fsync(out.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor that owns its storage (safetensors refuses views into a larger tensor's memory)."""
    t = t.contiguous()
    return t if t.untyped_storage().nbytes() == t.nbytes and t.storage_offset() == 0 else t.clone()


def write_safetensors(directory: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[str]:
    """transformers' weight layout: model.safetensors, or model-0000i-of-0000n.safetensors shards of at most
    `max_shard_bytes` (a tensor larger than that gets a shard of its own) plus model.safetensors.index.json."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = _own_storage(t)
        size += t.nbytes
    if len(shards) == 1:
        save_file(shards[0], str(directory / SINGLE), metadata={"format": "pt"})
        return [SINGLE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(names, shards, strict=True):
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return [*names, INDEX]


def _load(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file), device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise InteropError(f"{file} is not a readable safetensors file ({str(e).strip()[:200]})") from None


def read_safetensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a transformers model dir: sharded (model.safetensors.index.json) or one file. Pickle
    weights (pytorch_model.bin, ...) are refused: loading them runs arbitrary code."""
    index = hf_dir / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise InteropError(f"{index} is not a safetensors index ({type(e).__name__}); re-save the model") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (hf_dir / f).is_file()]
        if missing:
            raise InteropError(f"{hf_dir}: {INDEX} names {missing[0]}, which is missing"
                               f"{f' (+{len(missing) - 1} more)' if len(missing) > 1 else ''}; copy every shard")
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            tensors.update(_load(hf_dir / f))
        absent = [k for k in weight_map if k not in tensors]
        if absent:
            raise InteropError(f"{hf_dir}: {INDEX} maps {absent[0]} to {weight_map[absent[0]]}, which lacks it")
        return tensors
    if (hf_dir / SINGLE).is_file():
        return _load(hf_dir / SINGLE)
    found = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    if len(found) == 1:
        return _load(hf_dir / found[0])
    if found:
        raise InteropError(f"{hf_dir} holds {len(found)} .safetensors files but no {INDEX}; "
                           "add the index transformers wrote with them")
    pickles = sorted(p.name for p in hf_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise InteropError(f"{hf_dir} holds only pickle weights ({pickles[0]}); megalm reads safetensors only "
                           "(pickle can run code): re-save with save_pretrained(..., safe_serialization=True)")
    raise InteropError(f"{hf_dir} holds no model weights ({SINGLE} or {INDEX}); pass a transformers model dir")


def read_megalm_weights(path: str | Path) -> tuple[LoadedCheckpoint, ModelConfig, dict[str, torch.Tensor]]:
    """The full model's weights of a megalm checkpoint (or run dir: its `latest`) on CPU, whatever layout wrote
    it (TP/PP/ZeRO-1: DCP reshards into one process), with the model config from its config.yaml."""
    ckpt = resolve_checkpoint_path(path)
    meta = read_checkpoint_meta(ckpt)
    cfg = resolve_model_defaults(ModelConfig(**meta.config["model"]))  # keeps a saved padded vocab
    model = GPT(cfg, device="meta")
    model.to_empty(device="cpu")  # no init: every parameter is loaded next
    load_model_weights(ckpt, model)
    return meta, model.cfg, {name: p.detach() for name, p in canonical_named_parameters(model)}
