"""Weights and optimizer state in DCP's layout, and back.

Optimizer state is keyed by parameter *name* (`canonical_named_parameters`), not position, so that it loads into
any layout. A tensor-parallel slice is handed to DCP as a DTensor over the TP mesh (an expert-parallel one over the
EP mesh), so each rank writes its own and a load into another layout reshards. Vocab tables padded to another row
count are resized on load. A fused projection (qkv_proj, gate_up_proj: megalm/model/fused.py) is stored as its parts
under their unfused names (`stored_pieces`): each part is one contiguous slice per rank, which DCP reshards alone,
and the files keep the layout of checkpoints written before the fusion, which therefore load as they are.
"""

from __future__ import annotations

import errno
import logging
import warnings
from collections.abc import Container
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException, HuggingFaceStorageReader
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard, distribute_tensor

from megalm import compat
from megalm.errors import CheckpointError
from megalm.model.fused import part_rows, split_fused_name, unfused_names
from megalm.model.gpt import VOCAB_PARAMS, resize_vocab_rows
from megalm.model.naming import canonical_named_buffers, canonical_named_parameters, model_chunks
from megalm.model.shard import (
    FusedShardSpec,
    ShardSpec,
    copy_full_value,
    empty_full_like,
    full_value,
    laid_out_like,
    shard_specs,
)
from megalm.parallel.collectives import gather_unsharded

if TYPE_CHECKING:  # annotations only: checkpoints take the mesh they are given
    from megalm.parallel.dims import ParallelMesh

log = logging.getLogger("megalm")
HYPERPARAMETERS = ("betas", "eps", "weight_decay")  # what a resume may change (`load_optimizer_tensors`)


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter names in the order `optimizer.state_dict()` numbers them."""
    return [name for group in optimizer.param_groups for name in _group_names(model, group)]


def optimizer_tensors(model: nn.Module, optimizer: torch.optim.Optimizer, whole: bool = True
                      ) -> tuple[dict, list[dict]]:
    """Flatten AdamW state to {"<param>::<key>": tensor} and hyper-parameters per group. `whole=False` leaves an
    FSDP shard's state as its DTensor (no collective), for a caller that gathers one tensor at a time."""
    state = optimizer.state_dict()
    names = _param_names(model, optimizer)
    tensors = {}
    for index, per_param in state["state"].items():
        for key, value in per_param.items():
            tensors[f"{names[index]}::{key}"] = full_value(value.detach()).contiguous() if whole else value.detach()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
    for group, torch_group in zip(groups, optimizer.param_groups, strict=True):
        group["param_names"] = _group_names(model, torch_group)
    return tensors, groups


def _group_names(model: nn.Module, group: dict) -> list[str]:
    name_of = {id(p): n for n, p in canonical_named_parameters(model)}
    return [name_of[id(p)] for p in group["params"]]


def load_optimizer_tensors(model: nn.Module, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                           groups: list[dict]) -> None:
    names = _param_names(model, optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        name, _, field = key.partition("::")
        if name not in names:
            raise CheckpointError(f"optimizer state has parameter {name!r} that this model lacks; "
                                  "the checkpoint is from another model")
        index = names.index(name)
        per_param.setdefault(index, {})[field] = laid_out_like(params[index], value)  # a moment: as its parameter
    current = optimizer.state_dict()
    if len(groups) != len(current["param_groups"]):
        raise CheckpointError(f"checkpoint has {len(groups)} optimizer param groups, this run has "
                              f"{len(current['param_groups'])}; the checkpoint is from another setup")
    # The groups' settings are this run's (optim.*: betas, eps, weight decay, the kernel), not the checkpoint's, which
    # `load_state_dict` would otherwise restore: lowering beta2 on a resume to tame a divergence must take effect. A
    # change is said in one line. The learning rate is the checkpoint's (the schedule sets it before each step).
    changed = sorted({f"{k}={_plain(saved[k])} (this run: {_plain(cur[k])})"
                      for saved, cur in zip(groups, current["param_groups"], strict=True)
                      for k in HYPERPARAMETERS if k in saved and k in cur and _plain(saved[k]) != _plain(cur[k])})
    if changed:
        log.warning(f"optimizer settings differ from the checkpoint's: {', '.join(changed)}; this run's are used")
    new_groups = []
    for saved, cur in zip(groups, current["param_groups"], strict=True):
        merged = {**{k: v for k, v in saved.items() if k != "param_names"}, **cur}
        if "lr" in saved:
            merged["lr"] = saved["lr"]
        new_groups.append(merged)
    optimizer.load_state_dict({"state": per_param, "param_groups": new_groups})



def _plain(value: Any) -> Any:
    """A setting as JSON keeps it (a checkpoint's betas are a list, the optimizer's a tuple)."""
    return list(value) if isinstance(value, tuple | list) else value


def stored_pieces(name: str, local: torch.Tensor, spec: ShardSpec | FusedShardSpec | None,
                  model: nn.Module) -> list[tuple[str, torch.Tensor, ShardSpec | None]]:
    """(stored name, this rank's tensor of it, its spec) for a tensor laid out like parameter `name` of `model`:
    itself, or a fused projection's parts under their unfused names (views of `local`'s rows)."""
    parts = unfused_names(name)
    if parts is None:
        return [(name, local, spec)]
    if isinstance(spec, FusedShardSpec):
        return list(zip(parts, local.split([part.length for part in spec.parts]), spec.parts, strict=True))
    rows = part_rows(split_fused_name(name)[1], model_chunks(model)[0].cfg)
    return [(part, piece, None) for part, piece in zip(parts, local.split(rows), strict=True)]


def stored_names(name: str) -> list[str]:
    """The names parameter `name` is stored under (see `stored_pieces`)."""
    return unfused_names(name) or [name]


def for_dcp(local: torch.Tensor, spec: ShardSpec | None, mesh: ParallelMesh | None) -> torch.Tensor:
    """What DCP should see for a tensor laid out like a parameter with `spec`: a DTensor over the TP mesh (the EP
    mesh for an expert slice) for a slice one rank holds (each rank writes its own), the gathered full tensor for
    slices several ranks hold (kv rows replicated when tp > kv heads: small), the tensor itself when it is not
    sharded (DCP writes replicated tensors once)."""
    if spec is None or mesh is None or (mesh.dims.ep if spec.group == "ep" else mesh.dims.tp) == 1:
        return local
    if not spec.single_slice:
        return gather_unsharded(local, spec, mesh.tp_group)
    full_shape = torch.Size(spec.full_shape)
    stride = torch.empty(full_shape, device="meta").stride()
    # a view (a fused projection's part) is copied: DCP's async staging cannot deep-copy a DTensor over a view
    local = local.clone() if local._base is not None else local.contiguous()
    device_mesh = mesh.ep_mesh if spec.group == "ep" else mesh.mesh["tp"]
    return DTensor.from_local(local, device_mesh, [Shard(spec.dim)], shape=full_shape, stride=stride)


def fsdp_chunk(value: torch.Tensor, device_mesh: DeviceMesh, placements: tuple[Placement, ...]) -> DTensor:
    """`value`, a whole tensor on every rank of `device_mesh`, as a DTensor over it holding only this rank's chunk
    (a copy: the whole can go), which DCP writes and reads alone and reshards into any layout. What a save and a load
    of an FSDP run hold (1/dp of the model's 12 bytes a parameter, and one gathered tensor at a time): handed whole,
    DCP had held the TP-local fp32 weights and both Adam moments on every rank (96 GB at 8B with tp 1, 12 GB at 70B
    with tp 8)."""
    chunk = distribute_tensor(value, device_mesh, placements, src_data_rank=None)
    return DTensor.from_local(chunk.to_local().clone(), chunk.device_mesh, chunk.placements, shape=chunk.shape,
                              stride=chunk.stride())


def fsdp_tp_mesh(param: DTensor, mesh: ParallelMesh) -> DeviceMesh:
    """FSDP-sharded `param`'s mesh with the TP ranks beside it as its last dimension (ranks are tp fastest,
    `ParallelDims.rank_of`): where a save's chunks of a TP slice are cut over both (no collective; its groups exist)."""
    tp, own = mesh.dims.tp, param.device_mesh
    grid = own.mesh
    ranks = torch.stack([grid - grid % tp + t for t in range(tp)], dim=-1)
    groups = [own.get_group(i) for i in range(own.ndim)] + [mesh.tp_group]
    return DeviceMesh.from_group(groups, own.device_type, mesh=ranks, mesh_dim_names=(*own.mesh_dim_names, "tp"))


def fsdp_pieces_chunk(whole: torch.Tensor, param: DTensor, spec: ShardSpec | None, mesh: ParallelMesh | None
                      ) -> DTensor:
    """This rank's chunk of `whole` (a stored piece of FSDP-sharded `param`, whole on every rank), over FSDP's mesh;
    a TP slice's (spec's group tp, tp > 1) over FSDP's and TP's ranks together, `fsdp_tp_mesh`, so that no rank keeps
    its whole TP slice of every tensor at once."""
    if spec is None or spec.group != "tp" or mesh is None or mesh.dims.tp == 1 or not spec.single_slice:
        return fsdp_chunk(whole, param.device_mesh, param.placements)
    return fsdp_chunk(whole, fsdp_tp_mesh(param, mesh), (*param.placements, Shard(spec.dim)))


def dcp_pieces(name: str, value: torch.Tensor, spec: ShardSpec | FusedShardSpec | None, model: nn.Module,
               mesh: ParallelMesh | None) -> dict[str, torch.Tensor]:
    """{stored name: what DCP is handed} for `value`, laid out like parameter `name` (the weight, or a moment):
    each stored piece `for_dcp`'s, and of an FSDP shard (a DTensor `value`, gathered here for the one tensor) each
    piece whole (gathered over TP too where TP slices it) and cut into this rank's `fsdp_pieces_chunk`."""
    whole = full_value(value)
    out = {}
    for stored, piece, piece_spec in stored_pieces(name, whole, spec, model):
        handed = for_dcp(piece, piece_spec, mesh)
        if isinstance(value, DTensor) and (not isinstance(handed, DTensor) or piece_spec.group == "tp"):
            handed = fsdp_pieces_chunk(handed.full_tensor() if isinstance(handed, DTensor) else handed, value,
                                       piece_spec, mesh)
        out[stored] = handed
    return out


def _load_target(like: torch.Tensor, spec: ShardSpec | None, mesh: ParallelMesh | None) -> torch.Tensor:
    """The tensor DCP loads into, laid out as `for_dcp` saved one like `like`: `like` itself (its storage is
    written: a parameter loads in place) or a DTensor over it for a slice; a new full tensor for slices several ranks
    hold (no collective: only its shape matters)."""
    if spec is not None and mesh is not None and mesh.dims.tp > 1 and not spec.single_slice:
        return torch.empty(spec.full_shape, dtype=like.dtype, device=like.device)
    return for_dcp(like, spec, mesh)


def from_dcp(loaded: torch.Tensor, spec: ShardSpec | None) -> torch.Tensor:
    """This rank's local tensor from what `for_dcp` made and DCP filled."""
    if isinstance(loaded, DTensor):
        return loaded.to_local()
    if spec is not None and tuple(loaded.shape) == spec.full_shape != spec.local_shape:
        return spec.shard(loaded)
    return loaded


def _dcp_cause(error: BaseException) -> BaseException:
    """A CheckpointException's first rank's cause (its `failures` map each rank to (exception, traceback)), else the
    error itself."""
    cause = next(iter(getattr(error, "failures", {}).values()), error)
    if isinstance(cause, tuple) and cause and isinstance(cause[0], BaseException):
        cause = cause[0]
    return cause


def dcp_failure(error: BaseException) -> str:
    """The first line of what went wrong in a DCP call, named by its type."""
    cause = _dcp_cause(error)
    first = (str(cause).strip().splitlines() or [""])[0][:200]
    return f"{type(cause).__name__}: {first}" if first else type(cause).__name__


def write_failed(path: Path, error: BaseException) -> CheckpointError | KeyboardInterrupt:
    """The one-line error of a checkpoint that could not be written (a full disk, a lost mount); a Ctrl-C that DCP
    caught and wrapped is a KeyboardInterrupt again (megalm-train's one line says what resumes), not a disk to free."""
    cause = _dcp_cause(error)
    if isinstance(cause, KeyboardInterrupt):
        return KeyboardInterrupt()
    full = getattr(cause, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(cause)
    fix = (f"free space on {Path(path).parent}'s file system" if full  # (safetensors' error carries only the text)
           else f"fix what it names (the file system of {Path(path).parent}, its permissions or mount)"
           if isinstance(cause, OSError) else "fix what it names")
    return CheckpointError(f"checkpoint {path} could not be written ({dcp_failure(error)}); the checkpoints saved "
                           f"before it are kept: {fix} and resume with trainer.resume=auto")


def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write `tensors` (plain or DTensor) into the safetensors files of a checkpoint dir through DCP (collective)."""
    try:
        with warnings.catch_warnings():  # one process: DCP warns that it saves without a process group
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(tensors, storage_writer=compat.hf_storage_writer(str(path)))
    except (OSError, CheckpointException) as e:
        raise write_failed(path, e) from None


class HeadersReadOnce(HuggingFaceStorageReader):
    """DCP's safetensors reader that reads the files' headers once, for many loads from one checkpoint (megalm-export
    reads a block at a time: each load would read every file's header again, every rank's optimizer keys too)."""

    _metadata: Any = None

    def read_metadata(self) -> Any:
        if self._metadata is None:
            self._metadata = super().read_metadata()
        return self._metadata


def dcp_load(tensors: dict[str, torch.Tensor], path: Path, collective: bool,
             reader: HuggingFaceStorageReader | None = None) -> None:
    """Read `tensors` from a checkpoint dir through DCP: with `collective`, every rank of the default group together;
    else this process alone, even where a process group exists (each rank of a run reading a whole model to start
    from, `model.init_from`, without pairing its reads with the other ranks'). `reader`: one kept for many loads
    (`HeadersReadOnce`)."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(tensors, storage_reader=reader or HuggingFaceStorageReader(str(path)), no_dist=not collective)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP raises many types
        # megalm-generate, megalm-export and model.init_from read checkpoints too: the fix names no training key
        raise CheckpointError(f"checkpoint {path} cannot be read into this model ({dcp_failure(e)}); "
                              "it is corrupt or from another model: use another checkpoint") from None


def saved_vocab_rows(config: dict[str, Any]) -> int | None:
    """The rows of the vocab tables a checkpoint holds (its padded vocab; older ones padded none)."""
    model = config.get("model", {})
    return model.get("padded_vocab_size") or model.get("vocab_size")


def _vocab_resized(name: str, like: torch.Tensor, spec: ShardSpec | None, saved_rows: int | None) -> bool:
    """Whether `name`'s full tensor has another row count in the checkpoint (a layout padded differently)."""
    rows = spec.full_shape[0] if spec is not None else like.shape[0]
    return name in VOCAB_PARAMS and saved_rows is not None and saved_rows != rows


def target_tensor(name: str, like: torch.Tensor, spec: ShardSpec | None, mesh: ParallelMesh | None,
            saved_rows: int | None) -> torch.Tensor:
    """`_load_target`, except a vocab table padded to another row count: read whole, resized by `local_tensor`."""
    if _vocab_resized(name, like, spec, saved_rows):
        return torch.empty((saved_rows, *like.shape[1:]), dtype=like.dtype, device=like.device)
    return _load_target(like, spec, mesh)


def local_tensor(name: str, loaded: torch.Tensor, spec: ShardSpec | None, like: torch.Tensor,
           saved_rows: int | None) -> torch.Tensor:
    """This rank's tensor from what DCP filled: `from_dcp`, after resizing a differently padded table; an
    `fsdp_pieces_chunk` target gathered whole (and a TP slice's cut to this rank's)."""
    if isinstance(loaded, DTensor) and loaded.shape == like.shape:
        return loaded.full_tensor()
    if isinstance(loaded, DTensor) and loaded.device_mesh.ndim > 1 and loaded.device_mesh.mesh_dim_names[-1] == "tp":
        return spec.shard(loaded.full_tensor())  # `fsdp_pieces_chunk` of a TP slice: whole, then this rank's slice
    if _vocab_resized(name, like, spec, saved_rows):
        loaded = resize_vocab_rows(loaded, spec.full_shape[0] if spec is not None else like.shape[0])
    return from_dcp(loaded, spec)


def like_targets(prefix: str, name: str, like: torch.Tensor, spec: ShardSpec | FusedShardSpec | None,
                 model: nn.Module, mesh: ParallelMesh | None, saved_rows: int | None,
                 suffix: str = "", fsdp: DTensor | None = None) -> dict[str, torch.Tensor]:
    """DCP's targets for a tensor laid out like parameter `name` (`like`): one per stored piece,
    keyed `{prefix}{stored name}{suffix}`; where `fsdp` (the parameter, an FSDP shard) is given, a whole target or
    a TP slice's becomes its `fsdp_pieces_chunk` (a save's layout: this rank reads only its rows)."""
    targets = {}
    for stored, piece, piece_spec in stored_pieces(name, like, spec, model):
        target = target_tensor(stored, piece, piece_spec, mesh, saved_rows)
        if fsdp is not None and (target.shape == piece.shape if not isinstance(target, DTensor)
                                 else piece_spec.group == "tp"):
            target = fsdp_pieces_chunk(torch.empty(target.shape, dtype=target.dtype, device=piece.device), fsdp,
                                       piece_spec, mesh)
        targets[f"{prefix}{stored}{suffix}"] = target
    return targets


def local_from_targets(prefix: str, name: str, like: torch.Tensor, spec: ShardSpec | FusedShardSpec | None,
                       model: nn.Module, targets: dict[str, torch.Tensor], saved_rows: int | None,
                       suffix: str = "") -> torch.Tensor:
    """This rank's tensor laid out like parameter `name` from what DCP filled into `like_targets`' targets."""
    pieces = [local_tensor(stored, targets[f"{prefix}{stored}{suffix}"], piece_spec, piece, saved_rows)
              for stored, piece, piece_spec in stored_pieces(name, like, spec, model)]
    if len(pieces) == 1:
        return pieces[0]
    whole = _whole_of(pieces, like.shape)
    return torch.cat(pieces) if whole is None else whole


def _whole_of(pieces: list[torch.Tensor], shape: torch.Size) -> torch.Tensor | None:
    """The tensor `pieces` are consecutive row views of, end to end (a fused parameter's parts loaded in place into
    one target), else None: concatenating them would copy what is already whole."""
    base = pieces[0]._base
    if base is None or tuple(base.shape) != tuple(shape) or not base.is_contiguous():
        return None
    offset = 0
    for piece in pieces:
        if piece._base is not base or piece.storage_offset() != base.storage_offset() + offset \
                or not piece.is_contiguous():
            return None
        offset += piece.numel()
    return base if offset == base.numel() else None


def model_targets(model: nn.Module, mesh: ParallelMesh | None, saved_rows: int | None,
                  names: Container[str] | None = None) -> dict[str, torch.Tensor]:
    """DCP's targets for `model`'s weights and buffers (those of `names` only, where given): a plain parameter is its
    own target (read in place: a load holds no second copy of the model; `copy_model` then copies it onto itself),
    an FSDP shard's is its chunk."""
    specs = shard_specs(model)
    targets = {key: target for n, p in canonical_named_parameters(model) if names is None or n in names
               for key, target in like_targets("model/", n, empty_full_like(p) if isinstance(p, DTensor)
                                               else p.detach(), specs.get(n), model, mesh, saved_rows,
                                               fsdp=p if isinstance(p, DTensor) else None).items()}
    return targets | {f"model/{n}": torch.empty_like(b) for n, b in canonical_named_buffers(model)
                      if names is None or n in names}


@torch.no_grad()
def copy_model(model: nn.Module, targets: dict[str, torch.Tensor], path: Path, saved_rows: int | None,
               names: Container[str] | None = None) -> None:
    specs = shard_specs(model)
    for name, param in canonical_named_parameters(model):
        if names is not None and name not in names:
            continue
        value = local_from_targets("model/", name, empty_full_like(param), specs.get(name), model, targets,
                                   saved_rows)
        if value.shape != param.shape:
            raise CheckpointError(f"checkpoint {path} has {name} of shape {tuple(value.shape)}, this model "
                                  f"{tuple(param.shape)}; use the matching model config")
        copy_full_value(param, value)
    for name, buffer in canonical_named_buffers(model):  # replicated state that is not trained
        if names is not None and name not in names:
            continue
        buffer.copy_(targets[f"model/{name}"])
