"""Checkpoints: atomic, self-describing, resharable, loaded without executing pickled code.

Layout of a run dir:

    checkpoints/
      step_00000100/
        shard-0000R-model-00001-of-00001.safetensors   # weights + optimizer state, per saving rank
        rng-rank0000R.safetensors                       # every rank's torch CPU (and CUDA) generator
        state.json        # step, consumed tokens, seed, batch size, optimizer hyper-parameters
        config.yaml       # the resolved run config (megalm-generate rebuilds the model from it)
      latest              # text file naming the newest complete checkpoint

Tensors go through torch.distributed.checkpoint (DCP) with its Hugging Face storage: safetensors
files whose JSON headers hold each shard's offsets, so loading reads no pickle (DCP's default
storage pickles its metadata). Every rank writes its own tensor-parallel shards (as DTensors over
the TP mesh; DCP writes a replicated tensor once), and a load into another layout reshards —
both handled by DCP. Optimizer state is keyed by parameter *name*, not position. Names are the
full model's (`canonical_named_parameters`), so a pipeline stage writes `layers.5.…` for the layers
it holds and every stage saves its own part of one checkpoint, which loads into any other layout.

A save writes into `.tmp-step_…`, fsyncs, renames the directory into place and only then replaces
`latest` (os.replace is atomic on POSIX). A crash at any point leaves the previous `latest`
pointing at a complete checkpoint; stale temporaries are removed by the next save.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint import CheckpointException, HuggingFaceStorageReader
from torch.distributed.tensor import DTensor, Shard

from megalm import compat
from megalm.config import ModelConfig, resolve_model_defaults
from megalm.errors import CheckpointError
from megalm.model.gpt import GPT, VOCAB_PARAMS, resize_vocab_rows
from megalm.model.naming import canonical_named_parameters
from megalm.model.shard import ShardSpec, shard_specs

if TYPE_CHECKING:  # annotations only: checkpoints take the mesh they are given
    from megalm.parallel.dims import ParallelMesh

log = logging.getLogger("megalm")
# One process saves without a process group on purpose; DCP warns about it, from async_save's thread too.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
FORMAT_VERSION = 1
CHECKPOINTS = "checkpoints"
LATEST = "latest"
FILES = ("state.json", "config.yaml")  # plus shard-*.safetensors and rng-rank*.safetensors


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def fsync_path(path: Path) -> None:
    """Flush a file's (or a directory's entries') writes to the disk."""
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
    fsync_path(path.parent)


# ---------------------------------------------------------------------------- optimizer state by name


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter names in the order `optimizer.state_dict()` numbers them."""
    return [name for group in optimizer.param_groups for name in _group_names(model, group)]


def optimizer_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, list[dict]]:
    """Flatten AdamW state to {"<param>::<key>": tensor} and hyper-parameters per group."""
    state = optimizer.state_dict()
    names = _param_names(model, optimizer)
    tensors = {}
    for index, per_param in state["state"].items():
        for key, value in per_param.items():
            tensors[f"{names[index]}::{key}"] = value.detach().contiguous()
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


# ---------------------------------------------------------------------------- tensors <-> DCP layout


def _for_dcp(local: torch.Tensor, spec: ShardSpec | None, mesh: ParallelMesh | None) -> torch.Tensor:
    """What DCP should see for a tensor laid out like a parameter with `spec`: a DTensor over the TP mesh
    for a slice one rank holds (each rank writes its own), the gathered full tensor for slices several
    ranks hold (kv rows replicated when tp > kv heads: small), the tensor itself when it is not sharded
    (DCP writes replicated tensors once)."""
    if spec is None or mesh is None or mesh.dims.tp == 1:
        return local
    if spec.replicas > 1:
        pieces = [torch.empty_like(local) for _ in range(mesh.dims.tp)]
        dist.all_gather(pieces, local.contiguous(), group=mesh.tp_group)
        return spec.unshard(pieces)
    full_shape = torch.Size(spec.full_shape)
    stride = torch.empty(full_shape, device="meta").stride()
    return DTensor.from_local(local.contiguous(), mesh.mesh["tp"], [Shard(spec.dim)], shape=full_shape,
                              stride=stride)


def _load_target(like: torch.Tensor, spec: ShardSpec | None, mesh: ParallelMesh | None) -> torch.Tensor:
    """An empty tensor for DCP to load into, laid out as `_for_dcp` saved one like `like`: a DTensor slice,
    the full tensor of slices several ranks hold (no collective: only its shape matters), or a plain one."""
    if spec is not None and mesh is not None and mesh.dims.tp > 1 and spec.replicas > 1:
        return torch.empty(spec.full_shape, dtype=like.dtype, device=like.device)
    return _for_dcp(torch.empty_like(like), spec, mesh)


def _from_dcp(loaded: torch.Tensor, spec: ShardSpec | None) -> torch.Tensor:
    """This rank's local tensor from what `_for_dcp` made and DCP filled."""
    if isinstance(loaded, DTensor):
        return loaded.to_local()
    if spec is not None and tuple(loaded.shape) == spec.full_shape != spec.local_shape:
        return spec.shard(loaded)
    return loaded


def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write `tensors` (plain or DTensor) into the safetensors files of a checkpoint dir through DCP (collective)."""
    with warnings.catch_warnings():  # one process: DCP warns that it saves without a process group
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(tensors, storage_writer=compat.hf_storage_writer(str(path)))


def _dcp_load(tensors: dict[str, torch.Tensor], path: Path) -> None:
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(path)))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP raises many types
        cause = next(iter(getattr(e, "failures", {}).values()), e)  # CheckpointException: per-rank causes
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:200]
        raise CheckpointError(f"checkpoint {path} cannot be read into this model ({type(cause).__name__}: {first}); "
                              "it is corrupt or from another model — resume from another with "
                              "trainer.resume=PATH") from None


def _barrier(mesh: ParallelMesh | None) -> None:
    if mesh is not None and mesh.is_distributed:
        dist.barrier()


# ---------------------------------------------------------------------------- save / find / load


@dataclass
class LoadedCheckpoint:
    path: Path
    state: dict[str, Any]
    config: dict[str, Any]


@dataclass
class PendingCheckpoint:
    """A checkpoint whose tensors are being written in the background (`save_checkpoint(async_save=True)`).
    `wait()` (collective, every rank at the same point) finishes the write and only then makes the checkpoint
    visible: state.json, the rename into place and `latest`, as a synchronous save does."""

    path: Path  # where it will be once complete
    _future: Any
    _finalize: Any

    def wait(self) -> Path:
        self._future.result()  # re-raises an error of the background write
        self._finalize()
        return self.path


_async_groups: dict[int, dist.ProcessGroup] = {}  # by the id of the world group it was made in


def _async_save(tensors: dict[str, torch.Tensor], path: Path, mesh: ParallelMesh | None) -> Any:
    """DCP's async save: the tensors are staged (copied to host memory) before it returns, then written by a
    thread. Its collectives run on a gloo group of their own, so they never interleave with the training's (one
    per process group: a new `init_process_group`, as in a Hydra multirun, gets a new one)."""
    group = None
    if mesh is not None and mesh.is_distributed:
        key = id(dist.group.WORLD)
        if key not in _async_groups:
            _async_groups.clear()
            _async_groups[key] = dist.new_group(backend="gloo")
        group = _async_groups[key]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return dcp.async_save(tensors, storage_writer=compat.hf_storage_writer(str(path)),
                              process_group=group)


def save_checkpoint(run_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: dict[str, Any], config: dict[str, Any], keep_last: int, mesh: ParallelMesh | None = None,
                    async_save: bool = False) -> Path | PendingCheckpoint:
    """Write the checkpoint of `step` atomically, point `latest` at it, keep the newest `keep_last`.

    Collective when `mesh` is distributed: every rank must call it. `async_save`: return once the tensors are
    copied to host memory, with a `PendingCheckpoint` to `wait()` on (before the next save and at the end).
    """
    rank = mesh.rank if mesh is not None else 0
    root = Path(run_dir) / CHECKPOINTS
    name = checkpoint_name(step)
    tmp = root / f".tmp-{name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier(mesh)

    params, specs = dict(canonical_named_parameters(model)), shard_specs(model)
    tensors = {f"model/{n}": _for_dcp(p.detach(), specs.get(n), mesh) for n, p in params.items()}
    opt_tensors, groups = optimizer_tensors(model, optimizer)
    for key, value in opt_tensors.items():
        param_name = key.split("::")[0]
        shaped = value.shape == params[param_name].shape  # moments are laid out like their parameter; "step" is not
        tensors[f"optim/{key}"] = _for_dcp(value, specs.get(param_name), mesh) if shaped else value
    future = _async_save(tensors, tmp, mesh) if async_save else save_tensors(tensors, tmp)
    rng = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"torch_cuda_{i}"] = s
    rng_file = tmp / f"rng-rank{rank:05d}.safetensors"
    save_file(rng, str(rng_file))
    fsync_path(rng_file)
    full_state = {"format_version": FORMAT_VERSION, "step": step, "optimizer_param_groups": groups,
                  "world_size": mesh.dims.world_size if mesh is not None else 1, **state}
    final = root / name
    finalize = functools.partial(_publish, root, name, full_state, config, keep_last, mesh)
    if async_save:
        return PendingCheckpoint(final, future, finalize)
    finalize()
    return final


def _publish(root: Path, name: str, full_state: dict, config: dict[str, Any], keep_last: int,
             mesh: ParallelMesh | None) -> None:
    """The second half of a save, once every rank's files are written: state.json and config.yaml, fsync, the
    rename into place, then `latest` (collective)."""
    rank = mesh.rank if mesh is not None else 0
    tmp, final = root / f".tmp-{name}", root / name
    _barrier(mesh)
    if rank == 0:
        (tmp / "state.json").write_text(json.dumps(full_state, indent=1))
        (tmp / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(config)))
        for f in tmp.iterdir():
            fsync_path(f)
        fsync_path(tmp)
        if final.exists():  # re-saving a step (e.g. after a resume): swap, then drop the old copy
            old = root / f".old-{name}"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
        fsync_path(root)
        _write_text_atomic(root / LATEST, name + "\n")
        _prune(root, keep_last, name)
    _barrier(mesh)


def _step_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("step_*") if p.is_dir())


def _prune(root: Path, keep_last: int, published: str) -> None:
    """Drop crash debris and all but the newest `keep_last` checkpoints up to `published` (the one `latest` now
    names). Newer step dirs are left alone: they are those a resume skipped as damaged (kept for inspection)."""
    for stale in [*root.glob(".tmp-*"), *root.glob(".old-*")]:  # debris of saves that crashed
        shutil.rmtree(stale, ignore_errors=True)
    for old in [p for p in _step_dirs(root) if p.name <= published][:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


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


def _damaged(file: Path, why: str) -> CheckpointError:
    return CheckpointError(f"checkpoint file {file} is damaged ({why}); resume from another checkpoint with "
                           "trainer.resume=PATH")


def _check_safetensors(file: Path) -> None:
    """A safetensors file is an 8-byte header length, a JSON header, then exactly the data it describes: a
    truncated file or another kind of file fails this without reading any tensor."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= min(size - 8, 1 << 27):
            raise _damaged(file, "not a safetensors file")
        try:
            header = json.loads(f.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            raise _damaged(file, "not a safetensors file: its header is not safetensors JSON") from None
    if 8 + n + end != size:
        raise _damaged(file, f"truncated: {size} bytes, its header describes {8 + n + end}")


def verify_checkpoint(path: Path) -> LoadedCheckpoint:
    """Refuse (one line naming the file) a checkpoint whose files were damaged after it was written: an
    unreadable state.json or config.yaml, a truncated or foreign .safetensors file. Reads headers only; returns
    the metadata it read."""
    meta = read_checkpoint_meta(path)
    for file in sorted(path.glob("*.safetensors")):
        _check_safetensors(file)
    return meta


def resumable_checkpoint(run_dir: Path, resume: str) -> Path | None:
    """The checkpoint `trainer.resume` names, checked by `verify_checkpoint`. A path: that checkpoint, or a one-line
    error naming its damaged file. "auto": the run dir's `latest`, or, when its files are damaged, the newest older
    complete checkpoint that is intact (a warning names what was skipped); None when the run dir has none."""
    if resume != "auto":
        path = resolve_checkpoint_path(resume)
        if verify_checkpoint(path).state.get("weights_only"):
            raise CheckpointError(f"checkpoint {path} holds weights only (megalm-import); start from it with "
                                  f"model.init_from={path} instead of trainer.resume")
        return path
    latest = latest_checkpoint(run_dir)
    if latest is None:
        return None
    older = [p for p in reversed(_step_dirs(latest.parent)) if p.name < latest.name and is_complete(p)]
    for candidate in [latest, *older]:
        try:
            verify_checkpoint(candidate)
            return candidate
        except CheckpointError as e:
            log.warning(f"{e}; trainer.resume=auto falls back to the previous complete checkpoint")
    raise CheckpointError(f"every checkpoint in {latest.parent} is damaged (see the warnings above); move them "
                          "away to start over, or resume from a copy with trainer.resume=PATH")


def _read_text_file(file: Path, parse: Any) -> Any:
    try:
        return parse(file.read_text())
    except Exception as e:  # noqa: BLE001 - I/O, decoding, JSON and YAML errors all mean "damaged"
        first = str(e).strip().splitlines()[0][:120] if str(e).strip() else ""
        raise _damaged(file, f"{type(e).__name__}: {first}") from None


def read_checkpoint_meta(path: Path) -> LoadedCheckpoint:
    """state.json and config.yaml of a checkpoint; a one-line error naming the file when one cannot be read."""
    state = _read_text_file(path / "state.json", json.loads)
    config = _read_text_file(path / "config.yaml",
                             lambda text: OmegaConf.to_container(OmegaConf.create(text), resolve=True))
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


def saved_vocab_rows(config: dict[str, Any]) -> int | None:
    """The rows of the vocab tables a checkpoint holds (its padded vocab; older ones padded none)."""
    model = config.get("model", {})
    return model.get("padded_vocab_size") or model.get("vocab_size")


def _vocab_resized(name: str, like: torch.Tensor, spec: ShardSpec | None, saved_rows: int | None) -> bool:
    """Whether `name`'s full tensor has another row count in the checkpoint (a layout padded differently)."""
    rows = spec.full_shape[0] if spec is not None else like.shape[0]
    return name in VOCAB_PARAMS and saved_rows is not None and saved_rows != rows


def _target(name: str, like: torch.Tensor, spec: ShardSpec | None, mesh: ParallelMesh | None,
            saved_rows: int | None) -> torch.Tensor:
    """`_load_target`, except a vocab table padded to another row count: read whole, resized by `_local`."""
    if _vocab_resized(name, like, spec, saved_rows):
        return torch.empty((saved_rows, *like.shape[1:]), dtype=like.dtype, device=like.device)
    return _load_target(like, spec, mesh)


def _local(name: str, loaded: torch.Tensor, spec: ShardSpec | None, like: torch.Tensor,
           saved_rows: int | None) -> torch.Tensor:
    """This rank's tensor from what DCP filled: `_from_dcp`, after resizing a differently padded table."""
    if _vocab_resized(name, like, spec, saved_rows):
        loaded = resize_vocab_rows(loaded, spec.full_shape[0] if spec is not None else like.shape[0])
    return _from_dcp(loaded, spec)


def _model_targets(model: nn.Module, mesh: ParallelMesh | None, saved_rows: int | None) -> dict[str, torch.Tensor]:
    specs = shard_specs(model)
    return {f"model/{n}": _target(n, p.detach(), specs.get(n), mesh, saved_rows)
            for n, p in canonical_named_parameters(model)}


@torch.no_grad()
def _copy_model(model: nn.Module, targets: dict[str, torch.Tensor], path: Path, saved_rows: int | None) -> None:
    specs = shard_specs(model)
    for name, param in canonical_named_parameters(model):
        value = _local(name, targets[f"model/{name}"], specs.get(name), param, saved_rows)
        if value.shape != param.shape:
            raise CheckpointError(f"checkpoint {path} has {name} of shape {tuple(value.shape)}, this model "
                                  f"{tuple(param.shape)}; use the matching model config")
        param.copy_(value)


def load_model_weights(path: Path, model: nn.Module, mesh: ParallelMesh | None = None) -> None:
    """Weights only (megalm-generate, fine-tuning starts)."""
    saved_rows = saved_vocab_rows(read_checkpoint_meta(path).config)
    targets = _model_targets(model, mesh, saved_rows)
    _dcp_load(targets, path)
    _copy_model(model, targets, path, saved_rows)


def load_saved_model(path: str | Path, device: str | torch.device = "cpu") -> tuple[LoadedCheckpoint, GPT]:
    """The whole model of a checkpoint (or of a run dir's `latest`) in one process on `device`, whatever layout
    wrote it (DCP reshards), built from its config.yaml (its saved padded vocab kept): what megalm-generate,
    megalm-export and model.init_from read. No initialization is drawn: every parameter is loaded."""
    ckpt = resolve_checkpoint_path(path)
    meta = read_checkpoint_meta(ckpt)
    model = GPT(resolve_model_defaults(ModelConfig(**meta.config["model"])), device="meta")
    model.to_empty(device=device)
    load_model_weights(ckpt, model)
    return meta, model


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    mesh: ParallelMesh | None = None) -> LoadedCheckpoint:
    """Load weights, optimizer and this rank's RNG state in place; return the checkpoint's metadata.

    The saved layout may differ from this run's: DCP reads each rank's pieces from whichever shards
    hold them. Collective when `mesh` is distributed.
    """
    meta = read_checkpoint_meta(path)
    saved_rows = saved_vocab_rows(meta.config)
    targets = _model_targets(model, mesh, saved_rows)
    params, specs = dict(canonical_named_parameters(model)), shard_specs(model)
    if optimizer is not None:
        like, groups = optimizer_tensors(model, optimizer)
        if not like:  # a fresh torch AdamW has no state yet: take one step's worth of shapes
            like = {f"{n}::{k}": torch.zeros(() if k == "step" else p.shape, dtype=torch.float32, device=p.device)
                    for n, p in params.items() for k in ("step", "exp_avg", "exp_avg_sq")}
        for key, value in like.items():
            param_name = key.split("::")[0]
            shaped = value.shape == params[param_name].shape
            targets[f"optim/{key}"] = (_target(param_name, value, specs.get(param_name), mesh, saved_rows)
                                       if shaped else value.clone())
    _dcp_load(targets, path)
    _copy_model(model, targets, path, saved_rows)
    if optimizer is not None:
        tensors = {}
        for key, value in targets.items():
            if key.startswith("optim/"):
                name = key[len("optim/"):]
                param_name = name.split("::")[0]
                param = params[param_name]
                shaped = value.shape[1:] == param.shape[1:] and value.dim() == param.dim() and value.dim() > 0
                tensors[name] = (_local(param_name, value, specs.get(param_name), param, saved_rows) if shaped
                                 else _from_dcp(value, specs.get(param_name)))
        load_optimizer_tensors(model, optimizer, tensors, meta.state["optimizer_param_groups"])
    rank = mesh.rank if mesh is not None else 0
    rng_file = path / f"rng-rank{rank:05d}.safetensors"
    if rng_file.is_file() and meta.state.get("world_size", 1) == (mesh.dims.world_size if mesh else 1):
        rng = _load_tensors(rng_file)
        torch.set_rng_state(rng["torch_cpu"])
        cuda_states = [rng[k] for k in sorted(rng) if k.startswith("torch_cuda_")]
        if cuda_states and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda_states[: torch.cuda.device_count()])
    return meta


def check_same_data_order(saved: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    """Refuse to resume with settings that would change which samples later steps see (seed, batch size, ...)."""
    for key, value in current.items():
        if saved.get(key) != value:
            raise CheckpointError(f"checkpoint {path} was trained with {key}={saved.get(key)}, this run has {value}; "
                                  "resuming would change the data order — set it back or start a new hydra.run.dir")
