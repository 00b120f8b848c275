"""The names of a run dir's checkpoints, atomic writes, and finding the newest complete checkpoint."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from megalm.errors import CheckpointError

if TYPE_CHECKING:  # annotations only
    from megalm.parallel.dims import ParallelMesh

FORMAT_VERSION = 1


CHECKPOINTS = "checkpoints"


LATEST = "latest"


FILES = ("state.json", "config.yaml")  # plus shard-*.safetensors and rng-rank*.safetensors


def layout_tag(mesh: ParallelMesh | None) -> str:
    """The parallel layout as a name ("tp2-pp1-cp1-dp4-ep1"), for per-rank state that holds only under it."""
    if mesh is None:
        return "tp1-pp1-cp1-dp1-ep1"
    d = mesh.dims
    return f"tp{d.tp}-pp{d.pp}-cp{d.cp}-dp{d.dp}-ep{d.ep}"


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def fsync_path(path: Path) -> None:
    """Flush a file's (or a directory's entries') writes to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def step_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("step_*") if p.is_dir())


def is_complete(path: Path) -> bool:
    return (path.is_dir() and all((path / f).is_file() for f in FILES)
            and any(path.glob("shard-*.safetensors")))


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint `latest` names; if that file is missing, the newest complete step dir."""
    root = Path(run_dir) / CHECKPOINTS
    pointer = root / LATEST
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if is_complete(candidate):
            return candidate
    complete = [p for p in step_dirs(root) if is_complete(p)] if root.is_dir() else []
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
