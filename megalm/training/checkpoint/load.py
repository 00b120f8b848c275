"""Loading a checkpoint into a model (and optimizer) of any layout, or a whole model into one process."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn
from torch.distributed.tensor import DTensor

from megalm.errors import CheckpointError
from megalm.model.gpt import GPT, reset_buffers
from megalm.model.naming import canonical_named_buffers, canonical_named_parameters, model_parts
from megalm.model.shard import empty_full_like, laid_out_like, shard_specs
from megalm.parallel.data_parallel.optimizer_face import matrix_parameter_ids
from megalm.precision.install import load_amax_histories
from megalm.training.checkpoint.layout import layout_tag, resolve_checkpoint_path
from megalm.training.checkpoint.tensors import (
    HeadersReadOnce,
    copy_model,
    dcp_load,
    like_targets,
    load_optimizer_tensors,
    local_from_targets,
    model_targets,
    optimizer_tensors,
    saved_vocab_rows,
    stored_names,
)
from megalm.training.checkpoint.verify import (
    LoadedCheckpoint,
    check_same_optimizer,
    read_checkpoint_meta,
    saved_model_config,
    verify_checkpoint,
)
from megalm.training.optim import full_precision_weights

if TYPE_CHECKING:  # annotations only: checkpoints take the mesh they are given
    from megalm.parallel.dims import ParallelMesh

log = logging.getLogger("megalm")


def load_safetensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file), device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint file {file} is corrupt ({e}); "
                              "resume from another checkpoint with trainer.resume=PATH") from None


def load_model_weights(path: Path, model: nn.Module, mesh: ParallelMesh | None = None) -> None:
    """Weights only (megalm-generate, fine-tuning starts); collective when `mesh` is distributed."""
    saved_rows = saved_vocab_rows(read_checkpoint_meta(path).config)
    targets = model_targets(model, mesh, saved_rows)
    dcp_load(targets, path, collective=mesh is not None and mesh.is_distributed)
    copy_model(model, targets, path, saved_rows)


def load_saved_model(path: str | Path, device: str | torch.device = "cpu") -> tuple[LoadedCheckpoint, GPT]:
    """The whole model of a checkpoint (or of a run dir's `latest`) in one process on `device`, whatever layout
    wrote it (DCP reshards), built from its config.yaml (its saved padded vocab kept): what megalm-generate,
    megalm-export and model.init_from read. No initialization is drawn: every parameter is loaded."""
    ckpt = resolve_checkpoint_path(path)
    meta = verify_checkpoint(ckpt)  # a damaged file is one line naming it, before DCP reads any of it
    model = GPT(saved_model_config(meta), device="meta")
    model.to_empty(device=device)
    reset_buffers(model)
    load_model_weights(ckpt, model)
    return meta, model


class SavedModelParts:
    """The whole model of a checkpoint (or of a run dir's `latest`), as `load_saved_model` reads it, one part at a
    time on the CPU (a block or a top-level module: `model_parts`): megalm-export holds one part in host memory,
    not the model. `shapes()` gives each part's parameters on the meta device, for planning before anything is
    read; iterating reads each part's (DCP reshards any saved layout), which are the caller's until it lets them go.
    `buffers()`: the persistent buffers (an MoE router's selection bias), read alone."""

    def __init__(self, path: str | Path) -> None:
        self.path = resolve_checkpoint_path(path)
        self.meta = verify_checkpoint(self.path)  # a damaged file is one line naming it, before DCP reads any of it
        self.model = GPT(saved_model_config(self.meta), device="meta")
        self.cfg = self.model.cfg
        self.parts = model_parts(n for n, _ in canonical_named_parameters(self.model))
        self._reader = HeadersReadOnce(str(self.path))  # one read of the files' headers for all the parts

    def _parameters(self, names: list[str]) -> dict[str, torch.Tensor]:
        held = dict(canonical_named_parameters(self.model))
        return {name: held[name].detach() for name in names}

    def shapes(self) -> Iterator[dict[str, torch.Tensor]]:
        return (self._parameters(names) for names in self.parts.values())

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        saved_rows = saved_vocab_rows(self.meta.config)
        for module_name, names in self.parts.items():
            module = self.model.get_submodule(module_name)
            module.to_empty(device="cpu")
            targets = model_targets(self.model, None, saved_rows, set(names))
            dcp_load(targets, self.path, collective=False, reader=self._reader)
            copy_model(self.model, targets, self.path, saved_rows, set(names))
            del targets
            part = self._parameters(names)
            module.to_empty(device="meta")  # the part's memory is now the caller's alone
            yield part
            del part  # before the next part is read: one part is held at a time

    def buffers(self) -> dict[str, torch.Tensor]:
        targets = {f"model/{n}": torch.empty_like(b, device="cpu") for n, b in canonical_named_buffers(self.model)}
        if targets:
            dcp_load(targets, self.path, collective=False, reader=self._reader)
        return {key.removeprefix("model/"): value for key, value in targets.items()}


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    mesh: ParallelMesh | None = None, device: torch.device | None = None) -> LoadedCheckpoint:
    """Load weights, optimizer and this rank's RNG state (and fp8_delayed's amax histories, onto `device`, where the
    layers compute) in place; return the checkpoint's metadata.

    The saved layout may differ from this run's: DCP reads each rank's pieces from whichever shards
    hold them. Collective when `mesh` is distributed.
    """
    meta = read_checkpoint_meta(path)
    if optimizer is not None:
        check_same_optimizer(meta.config, optimizer, path)
    with full_precision_weights(optimizer):  # checkpoints hold the fp32 weights, whatever the recipe
        _load_tensors(path, meta, model, optimizer, mesh)

    rank = mesh.rank if mesh is not None else 0
    rng_file = path / f"rng-rank{rank:05d}.safetensors"
    rng = load_safetensors(rng_file) if rng_file.is_file() else {}
    # each rank's streams hold only under the layout that drew them: in another one, ranks that must draw alike
    # (TP's dropout on replicated activations) would start apart; the run's fresh seed is the same on every rank
    saved_layout = meta.state.get("layout")  # checkpoints before 2026-12-04: the world size
    same_layout = (saved_layout == layout_tag(mesh) if saved_layout is not None
                   else meta.state.get("world_size", 1) == (mesh.dims.world_size if mesh else 1))
    if rng and not same_layout and rank == 0:
        log.info(f"random streams start from the run's seed: the checkpoint drew them in layout {saved_layout}, "
                 f"this run is {layout_tag(mesh)}")
    if rng and same_layout:
        torch.set_rng_state(rng["torch_cpu"])
        # by device number: as text, torch_cuda_10 sorted before torch_cuda_2 and devices past 9 took others' states
        cuda_states = [rng[k] for k in sorted((k for k in rng if k.startswith("torch_cuda_")),
                                              key=lambda k: int(k.rsplit("_", 1)[1]))]
        if cuda_states and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda_states[: torch.cuda.device_count()])
    delayed = meta.config.get("precision", {}).get("name") == "fp8_delayed"  # (a stage may hold no history itself)
    if same_layout and delayed and mesh is not None and mesh.dims.pp > 1:
        rng = rng | _other_stages_amax(path, mesh, rng)
    others = load_amax_histories(model, rng, layout_tag(mesh), device)
    if others and rank == 0:
        log.info(f"precision=fp8_delayed: amax histories start afresh (the checkpoint holds them per shard of layout "
                 f"{', '.join(sorted(others))}; this run is {layout_tag(mesh)})")
    return meta


def _other_stages_amax(path: Path, mesh: ParallelMesh, own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fp8_delayed's amax histories held by this rank's peers on the other pipeline stages (its tp, cp and dp
    coordinates): a run that moves layers between stages (parallel.layers_per_stage, parallel.vpp) keeps the layout
    tag, and a layer's history is in the file of the rank that held it, which the layer's new rank reads here (they
    had started afresh without a word). Keys this rank's own file holds are its own; the others are ignored by
    `load_amax_histories` unless this rank now holds their layer."""
    found: dict[str, torch.Tensor] = {}
    coords = {k: getattr(mesh, f"{k}_rank") for k in ("tp", "cp", "dp")}
    for stage in range(mesh.dims.pp):
        if stage == mesh.pp_rank:
            continue
        peer = path / f"rng-rank{mesh.dims.rank_of(**coords, pp=stage):05d}.safetensors"
        if peer.is_file():
            found |= {k: v for k, v in load_safetensors(peer).items() if k.startswith("amax/") and k not in own}
    return found


def _load_tensors(path: Path, meta: LoadedCheckpoint, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                  mesh: ParallelMesh | None) -> None:
    """The weights and optimizer state of `load_checkpoint`."""
    saved_rows = saved_vocab_rows(meta.config)
    targets = model_targets(model, mesh, saved_rows)
    params, specs = dict(canonical_named_parameters(model)), shard_specs(model)
    if optimizer is not None and not meta.state.get("optimizer_state", True):
        log.info(f"checkpoint {path} holds no optimizer state (every step before it was skipped): AdamW starts "
                 "afresh")
        optimizer = None
    if optimizer is not None:
        # the state's shapes (a fresh torch AdamW has none yet: one step's worth, on the meta device); each moment's
        # targets are made, and read back, one whole tensor at a time (`empty_full_like`, transient)
        like, groups = optimizer_tensors(model, optimizer, whole=False)
        if not like:  # (Muon's matrices keep a momentum: "muon" param groups)
            matrices = matrix_parameter_ids(optimizer.param_groups)
            like = {f"{n}::{k}": torch.zeros(() if k == "step" else p.shape, dtype=torch.float32, device="meta")
                    for n, p in params.items()
                    for k in (("momentum_buffer",) if id(p) in matrices else ("step", "exp_avg", "exp_avg_sq"))}
        for key, value in like.items():
            param_name, _, field = key.partition("::")
            param = params[param_name]
            if value.shape == param.shape:  # a moment, laid out like its parameter
                targets.update(like_targets("optim/", param_name, empty_full_like(param, value.dtype),
                                            specs.get(param_name), model, mesh, saved_rows, f"::{field}",
                                            fsdp=param if isinstance(param, DTensor) else None))
            else:  # the step count, stored with every piece: the first one's is read
                targets[f"optim/{stored_names(param_name)[0]}::{field}"] = torch.zeros(
                    value.shape, dtype=value.dtype, device=param.device if value.is_meta else value.device)
    dcp_load(targets, path, collective=mesh is not None and mesh.is_distributed)
    copy_model(model, targets, path, saved_rows)
    if optimizer is not None:
        tensors = {}
        for key, value in like.items():
            param_name, _, field = key.partition("::")
            param = params[param_name]
            if value.shape == param.shape:  # whole, then this rank's layout of it (its FSDP chunk), at once
                tensors[key] = laid_out_like(param, local_from_targets(
                    "optim/", param_name, empty_full_like(param, value.dtype), specs.get(param_name), model,
                    targets, saved_rows, f"::{field}"))
            else:
                tensors[key] = targets[f"optim/{stored_names(param_name)[0]}::{field}"]
        load_optimizer_tensors(model, optimizer, tensors, meta.state["optimizer_param_groups"])
