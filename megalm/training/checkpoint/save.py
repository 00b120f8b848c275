"""Saving: a checkpoint is written into a temporary dir, fsynced, renamed into place, and only then named by
`latest` (layout.py); `Checkpointer` holds what one run's saves share: where, how many to keep, and for
`trainer.async_save` the save in flight and the gloo group its collectives run on."""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint import CheckpointException

from megalm import compat
from megalm.errors import CheckpointError
from megalm.model.naming import canonical_named_buffers, canonical_named_parameters
from megalm.model.shard import full_value, shard_specs
from megalm.precision.install import amax_history_tensors
from megalm.training.checkpoint.layout import (
    CHECKPOINTS,
    FORMAT_VERSION,
    LATEST,
    checkpoint_name,
    fsync_path,
    layout_tag,
    step_dirs,
    write_text_atomic,
)
from megalm.training.checkpoint.tensors import (
    dcp_pieces,
    optimizer_tensors,
    save_tensors,
    stored_names,
    write_failed,
)
from megalm.training.optim import full_precision_weights

if TYPE_CHECKING:  # annotations only: checkpoints take the mesh they are given
    from megalm.parallel.dims import ParallelMesh

log = logging.getLogger("megalm")


@dataclass
class PendingCheckpoint:
    """A checkpoint whose tensors are being written in the background (`Checkpointer` with `async_save`).
    `wait()` (collective, every rank at the same point) finishes the write and only then makes the checkpoint
    visible: state.json, the rename into place and `latest`, as a synchronous save does."""

    path: Path  # where it will be once complete
    _future: Future
    _finalize: Callable[[], None]

    def written(self) -> bool:
        """Whether this rank's background write has ended (well or not: `wait()` says which)."""
        return self._future.done()

    def wait(self) -> Path:
        try:
            self._future.result()  # re-raises an error of the background write
        except (OSError, CheckpointException) as e:
            raise write_failed(self.path, e) from None
        self._finalize()
        return self.path


def _barrier(mesh: ParallelMesh | None) -> None:
    if mesh is not None and mesh.is_distributed:
        dist.barrier()


def _barrier_raising(mesh: ParallelMesh | None, error: BaseException | None, path: Path) -> None:
    """A barrier after which every rank raises when one rank's part of the save failed (`error`: a full disk, a lost
    mount), where the others had waited in the next barrier until the process group's timeout."""
    failed = error is not None
    if mesh is not None and mesh.is_distributed:
        on_gloo = "gloo" in str(dist.get_backend())  # ("cuda:nccl,cpu:gloo" too); NCCL reduces no CPU tensors
        device = "cpu" if on_gloo else torch.device("cuda", torch.cuda.current_device())
        flag = torch.tensor([float(failed)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        failed = bool(flag.item())
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"checkpoint {path} could not be written on another rank (its error line says why); "
                              "the checkpoints saved before it are kept")


def _write(run_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
           config: dict[str, Any], keep_last: int, mesh: ParallelMesh | None,
           write_tensors: Callable[[dict[str, torch.Tensor], Path], Any]) -> tuple[Path, Any, Callable[[], None]]:
    """Everything of a save but its publication: the temporary dir, the tensors (`write_tensors(tensors, dir)`,
    whose result is returned) and every rank's RNG file. Returns (final path, that result, publish)."""
    rank = mesh.rank if mesh is not None else 0
    root = Path(run_dir) / CHECKPOINTS
    name = checkpoint_name(step)
    tmp = root / f".tmp-{name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-*"):  # a failed save's files (one save is in flight at a time): they could
            shutil.rmtree(stale, ignore_errors=True)  # fill the disk this one needs
        tmp.mkdir()
    _barrier(mesh)

    params, specs = dict(canonical_named_parameters(model)), shard_specs(model)
    with full_precision_weights(optimizer):  # fp32 weights, whatever the recipe (async: staged before the exit)
        # one tensor gathered at a time (FSDP: each rank keeps its chunks, `dcp_pieces`)
        tensors = {f"model/{stored}": handed for n, p in params.items()
                   for stored, handed in dcp_pieces(n, p.detach(), specs.get(n), model, mesh).items()}
        tensors.update({f"model/{n}": b.detach().clone() for n, b in canonical_named_buffers(model)})
        opt_tensors, groups = optimizer_tensors(model, optimizer, whole=False)
        for key, value in opt_tensors.items():
            param_name, _, field = key.partition("::")
            if value.shape == params[param_name].shape:  # a moment, laid out like its parameter
                for stored, handed in dcp_pieces(param_name, value, specs.get(param_name), model, mesh).items():
                    tensors[f"optim/{stored}::{field}"] = handed
            else:  # the step count, with every stored piece
                tensors.update({f"optim/{stored}::{field}": full_value(value).clone()
                                for stored in stored_names(param_name)})
        written = write_tensors(tensors, tmp)
    rng = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"torch_cuda_{i}"] = s
    rng |= amax_history_tensors(model, layout_tag(mesh))  # fp8_delayed's per-rank histories: this layout's state
    rng_file, failed = tmp / f"rng-rank{rank:05d}.safetensors", None
    try:
        save_file(rng, str(rng_file))
        fsync_path(rng_file)
    except Exception as e:  # (safetensors' own error for a full disk, too): every rank raises at the first barrier
        failed = write_failed(root / name, e)
    full_state = {"format_version": FORMAT_VERSION, "step": step, "optimizer_param_groups": groups,
                  "optimizer_state": bool(opt_tensors),  # False: every step so far was skipped (no AdamW state yet)
                  "world_size": mesh.dims.world_size if mesh is not None else 1, "layout": layout_tag(mesh), **state}
    return root / name, written, functools.partial(_publish, root, name, full_state, config, keep_last, mesh, failed)


def save_checkpoint(run_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: dict[str, Any], config: dict[str, Any], keep_last: int,
                    mesh: ParallelMesh | None = None) -> Path:
    """Write the checkpoint of `step` atomically, point `latest` at it, keep the newest `keep_last`.
    Collective when `mesh` is distributed: every rank must call it."""
    final, _, publish = _write(run_dir, step, model, optimizer, state, config, keep_last, mesh, save_tensors)
    publish()
    return final


def _publish(root: Path, name: str, full_state: dict, config: dict[str, Any], keep_last: int,
             mesh: ParallelMesh | None, failed: BaseException | None = None) -> None:
    """The second half of a save, once every rank's files are written (`failed`: this rank's RNG file was not):
    state.json and config.yaml, fsync, the rename into place, then `latest` (collective). A file system error is
    one line on every rank."""
    rank = mesh.rank if mesh is not None else 0
    final = root / name
    _barrier_raising(mesh, failed, final)
    try:
        if rank == 0:
            _publish_files(root, name, full_state, config, keep_last)
    except Exception as e:  # whatever it is, the other ranks meet this rank at the next collective
        failed = write_failed(final, e)
    _barrier_raising(mesh, failed, final)


def _publish_files(root: Path, name: str, full_state: dict, config: dict[str, Any], keep_last: int) -> None:
    """Rank 0's part of `_publish`."""
    tmp, final = root / f".tmp-{name}", root / name
    # every rank's files, by size: a resume refuses a checkpoint that lost one (DCP's reader indexes the files
    # it finds, and left a missing rank's rows uninitialised without a word)
    files = {f.name: f.stat().st_size for f in sorted(tmp.glob("*.safetensors"))}
    (tmp / "state.json").write_text(json.dumps({**full_state, "files": files}, indent=1))
    (tmp / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(config)))
    for f in tmp.iterdir():
        fsync_path(f)
    fsync_path(tmp)
    if final.exists():  # a step saved before, which a resume went back past (its files were damaged): kept
        kept = root / f"replaced-{name}-{time.strftime('%Y%m%dT%H%M%S')}"
        os.rename(final, kept)
        log.warning(f"checkpoint {final} is saved again by this run; the one it replaces is kept as {kept} "
                    "for inspection (delete it when done)")
    os.rename(tmp, final)
    fsync_path(root)
    write_text_atomic(root / LATEST, name + "\n")
    _prune(root, keep_last, name)


def _prune(root: Path, keep_last: int, published: str) -> None:
    """Drop crash debris and all but the newest `keep_last` checkpoints up to `published` (the one `latest` now
    names). Newer step dirs are left alone: they are those a resume skipped as damaged (kept for inspection, and
    moved to `replaced-...` when the run saves their step again). `.old-*` is the debris of saves before
    2026-12-04."""
    for stale in [*root.glob(".tmp-*"), *root.glob(".old-*")]:  # debris of saves that crashed
        shutil.rmtree(stale, ignore_errors=True)
    for old in [p for p in step_dirs(root) if p.name <= published][:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


class Checkpointer:
    """One run's saves: into `run_dir`, keeping the newest `keep_last`, collective over `mesh`.

    With `async_save`, `save` returns once the tensors are staged in host memory and DCP's thread writes them
    while training goes on; the checkpoint is published by `publish_if_written()` at the first step boundary where
    every rank's write has ended (Megatron's `maybe_finalize_async_save`), or by `finish()` (before the next save
    and at the end), on every rank at the same point. The background write's collectives run on a gloo group of
    this checkpointer's own, made at its first distributed save, so they never interleave with the training's;
    the ranks agree that their writes ended on a second one (a collective of its own, beside the thread's).
    """

    def __init__(self, run_dir: Path, keep_last: int, mesh: ParallelMesh | None = None, async_save: bool = False):
        self.run_dir, self.keep_last, self.mesh, self.async_save = Path(run_dir), keep_last, mesh, async_save
        self.pending: PendingCheckpoint | None = None
        self._async_group: dist.ProcessGroup | None = None
        self._poll_group: dist.ProcessGroup | None = None

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
             config: dict[str, Any]) -> Path:
        """The checkpoint of `step` (published on return, or by `finish()` when saving asynchronously)."""
        self.finish()  # one save in flight at a time
        if not self.async_save:
            return save_checkpoint(self.run_dir, step, model, optimizer, state, config, self.keep_last, self.mesh)
        final, future, publish = _write(self.run_dir, step, model, optimizer, state, config, self.keep_last,
                                        self.mesh, self._start_async_write)
        self.pending = PendingCheckpoint(final, future, publish)
        return final

    def finish(self) -> Path | None:
        """Publish the save in flight, if any (collective); its path."""
        pending, self.pending = self.pending, None
        return pending.wait() if pending is not None else None

    def publish_if_written(self) -> Path | None:
        """Publish the save in flight if every rank's background write has ended; its path, or None. Collective
        while a save is in flight (one all-reduce of a flag, on a gloo group: no device sync), free otherwise.
        Published only at the next save or the end, a run that died between two saves lost the checkpoint its
        threads had finished writing (the resume went back to the one before, or to step 0)."""
        if self.pending is None:
            return None
        written = self.pending.written()
        if self._poll_group is not None:
            flag = torch.tensor(int(written))
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._poll_group)
            written = bool(flag.item())
        return self.finish() if written else None

    def _start_async_write(self, tensors: dict[str, torch.Tensor], path: Path) -> Future:
        """DCP's async save: the tensors are staged (copied to host memory) before it returns, then written by a
        thread."""
        if self.mesh is not None and self.mesh.is_distributed and self._async_group is None:
            self._async_group = dist.new_group(backend="gloo")
            self._poll_group = dist.new_group(backend="gloo")
        with warnings.catch_warnings():  # one process: DCP warns that it saves without a process group
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            return dcp.async_save(tensors, storage_writer=compat.hf_storage_writer(str(path)),
                                  process_group=self._async_group)
