"""Files for export and import: all-or-nothing output directories and safetensors shards (the writing side;
reading a Hugging Face directory is megalm/model/hf_files.py's, reading megalm weights megalm/training/init_from.py's).

An output directory is written as a hidden sibling and renamed into place only when complete, so an error or a
crash never leaves a half-written model where a user (or transformers) would load it, and an existing directory
is only replaced when asked (`--overwrite`) and only after the new one is complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from megalm.model.hf import INDEX, SINGLE, InteropError
from megalm.training.checkpoint import fsync_path
from megalm.training.run_dir import check_creatable

DEFAULT_MAX_SHARD = "5GB"  # transformers' save_pretrained default


def parse_size(text: str) -> int:
    """Bytes of "5GB", "500MB", "20KB" or a plain integer (decimal units, as transformers' max_shard_size)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", text.upper())
    if not match:
        raise InteropError(f"--max-shard-size={text} is not a size; write e.g. 5GB, 500MB or 20KB")
    unit = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9}[match[2]]
    return int(float(match[1]) * unit)


def check_output_dir(out: Path, overwrite: bool, source: Path | str | None = None) -> None:
    """Refuse an output path that is a file, one that cannot be made or written (under a file, on a read-only disk),
    a non-empty directory without `overwrite`, or the `source` being read (or a directory that holds it), which
    `--overwrite` would replace with its own output."""
    if source is not None:
        source, target = Path(source).expanduser().resolve(), Path(out).expanduser().resolve()
        if source == target or target in source.parents:
            raise InteropError(f"--out {out} is the input {source}" + (" or holds it" if source != target else "")
                               + "; writing there would delete it: choose another --out")
    if out.exists() and not out.is_dir():
        raise InteropError(f"--out {out} is a file; pass a directory path")
    check_creatable(out.absolute().parent, f"--out {out}", "choose an --out you may write to")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise InteropError(f"--out {out} exists and is not empty; pass --overwrite to replace it or choose "
                           "another directory")


@contextmanager
def atomic_output_dir(out: Path, overwrite: bool, source: Path | str | None = None) -> Iterator[Path]:
    """Yield an empty temporary directory next to `out`; on success it replaces `out` in one rename (the old
    one is removed afterwards), on error it is deleted and `out` is untouched. `source`: the input, which `out`
    must neither be nor hold (`check_output_dir`)."""
    out = Path(out).absolute()
    check_output_dir(out, overwrite, source)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file():
                fsync_path(f)
        fsync_path(tmp)
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.rename(out, old)
        os.rename(tmp, out)
        fsync_path(out.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor that owns its storage (safetensors refuses views into a larger tensor's memory)."""
    t = t.contiguous()
    return t if t.untyped_storage().nbytes() == t.nbytes and t.storage_offset() == 0 else t.clone()


def plan_shards(nbytes: Mapping[str, int], max_shard_bytes: int) -> list[list[str]]:
    """The tensors' names, in order, in shards of at most `max_shard_bytes` (a larger tensor gets a shard of its
    own), as transformers' save_pretrained cuts them."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, n in nbytes.items():
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def hf_file_names(count: int) -> list[str]:
    """transformers' weight files: model.safetensors, or model-0000i-of-0000n.safetensors shards."""
    return [SINGLE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_shards(directory: Path, files: list[str], shards: list[list[str]],
                 parts: Iterable[Mapping[str, torch.Tensor]]) -> None:
    """Write shard i's tensors to `directory / files[i]` as soon as `parts` (tensors in the plan's order, a part at a
    time) has given them all: what is held at once is one part and the shard it fills, not the model."""
    shard_of = {name: i for i, names in enumerate(shards) for name in names}
    pending: dict[int, dict[str, torch.Tensor]] = {}
    written = 0
    for part in parts:
        for name, t in part.items():
            pending.setdefault(shard_of[name], {})[name] = _own_storage(t)
        part = t = None  # let the part go before the next is read (a shard keeps the tensors it holds)
        for i in [i for i, held in pending.items() if len(held) == len(shards[i])]:
            save_file(pending.pop(i), str(directory / files[i]), metadata={"format": "pt"})
            written += 1
    if written != len(shards):  # a plan and parts that disagree: a bug, never a partial output
        raise RuntimeError(f"wrote {written} of {len(shards)} planned weight files")


def converted_parts(parts: Iterable[Any], convert: Callable[[Any], dict[str, torch.Tensor]]
                    ) -> Iterator[dict[str, torch.Tensor]]:
    """`convert(part)` for each of `parts`, each let go before the next part is read (a generator expression's loop
    variable would hold the last one while the next is read: two parts in memory, not one)."""
    for part in parts:
        converted = convert(part)
        part = None
        yield converted
        converted = None


def write_hf_index(directory: Path, files: list[str], shards: list[list[str]], total_bytes: int) -> None:
    """model.safetensors.index.json for sharded weights (none for one file, as transformers writes)."""
    if len(files) > 1:
        weight_map = {name: file for file, names in zip(files, shards, strict=True) for name in names}
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
