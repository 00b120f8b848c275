"""Where a sharded parameter's local tensor sits in the full model's parameter: one `ShardSpec`.

Every layout must start from, save, and account for the same single-process model (docs/architecture.md,
"Data and init are layout-independent"). Three readers need to know how a local tensor relates to the
full one: `init_weights` (draw the full value, keep this rank's part), checkpoints (write each piece
once, reshard on load) and the gradient norm (count every element of the full model once). They all
read the same small record, declared by the module that owns the parameter:

    module.shard_specs = {"weight": ShardSpec(...), "bias": ShardSpec(...)}

A `ShardSpec` says: the full tensor of shape `full_shape` is cut along `dim` into `num_slices` equal
contiguous slices over the ranks of the mesh dimension `group` ("tp", or "ep" for the experts of an MoE layer); this
rank holds slice `index`; `replicas` consecutive ranks hold each slice (>1 for kv heads replicated when tensor
parallelism exceeds the kv head count). A `FusedShardSpec` is the spec of a fused
projection (megalm/model/fused.py): the full tensor is parts stacked along dim 0, each cut by its own ShardSpec,
and a rank holds its slice of every part, concatenated. A parameter without a spec is the full tensor
(replicated on every rank that holds it). Specs live on modules, not as attributes of Parameter objects, so
`to_empty` / `.to()` (which replace Parameters) cannot drop them.

What every reader asks of a spec: `full_shape`, `local_shape`, `shard(full)`, `unshard(pieces)`,
`single_slice` (whether the local tensor is one contiguous slice held by one rank: checkpoints then write it
as a DTensor shard, else gather it whole) and `norm_rows` (the share of the full model's squared gradient norm
that each range of local rows carries: 1 / the ranks that hold it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from megalm.model.naming import canonical_named_modules


@dataclass(frozen=True)
class ShardSpec:
    full_shape: tuple[int, ...]
    dim: int
    num_slices: int
    index: int
    replicas: int = 1
    group: str = "tp"  # the mesh dimension the slices are spread over: "tp", or "ep" (expert parallelism)

    def __post_init__(self) -> None:
        if not 0 <= self.dim < len(self.full_shape):
            raise ValueError(f"shard dim {self.dim} is outside a tensor of shape {self.full_shape}")
        if self.full_shape[self.dim] % self.num_slices or not 0 <= self.index < self.num_slices:
            raise ValueError(f"cannot take slice {self.index} of {self.num_slices} along dim {self.dim} "
                             f"of shape {self.full_shape}")

    @property
    def length(self) -> int:
        """Elements of the slice along `dim`."""
        return self.full_shape[self.dim] // self.num_slices

    @property
    def start(self) -> int:
        return self.index * self.length

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.dim] = self.length
        return tuple(shape)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full tensor (a view)."""
        if tuple(full.shape) != self.full_shape:
            raise ValueError(f"expected the full tensor of shape {self.full_shape}, got {tuple(full.shape)}")
        return full.narrow(self.dim, self.start, self.length)

    def unshard(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's piece, in rank order (`num_slices * replicas` of them)."""
        if len(pieces) != self.num_slices * self.replicas:
            raise ValueError(f"expected {self.num_slices * self.replicas} pieces, got {len(pieces)}")
        return torch.cat(pieces[::self.replicas], dim=self.dim)

    @property
    def single_slice(self) -> bool:
        return self.replicas == 1

    @property
    def parts(self) -> tuple[ShardSpec, ...]:
        """The spec of each part of the local tensor, in row order (a FusedShardSpec's reading): itself."""
        return (self,)

    @property
    def norm_rows(self) -> tuple[tuple[int, int, float], ...]:
        """(first local row, rows, weight): the whole local tensor, counted 1/replicas."""
        return ((0, self.length, 1.0 / self.replicas),)


@dataclass(frozen=True)
class FusedShardSpec:
    """A fused projection's shard: the full tensor is `parts` (each one's `full_shape`) stacked along dim 0, and a
    rank holds `part.shard` of every part, concatenated in the same order."""

    parts: tuple[ShardSpec, ...]

    def __post_init__(self) -> None:
        if any(part.dim != 0 or part.full_shape[1:] != self.parts[0].full_shape[1:] for part in self.parts):
            raise ValueError(f"fused parts must be cut along dim 0 and agree in their other dims: {self.parts}")

    @property
    def dim(self) -> int:
        return 0

    @property
    def group(self) -> str:
        return "tp"

    @property
    def full_shape(self) -> tuple[int, ...]:
        return (sum(part.full_shape[0] for part in self.parts), *self.parts[0].full_shape[1:])

    @property
    def local_shape(self) -> tuple[int, ...]:
        return (sum(part.length for part in self.parts), *self.parts[0].full_shape[1:])

    @property
    def replicas(self) -> int:
        """The most ranks holding any of this rank's rows."""
        return max(part.replicas for part in self.parts)

    @property
    def single_slice(self) -> bool:
        return False

    @property
    def norm_rows(self) -> tuple[tuple[int, int, float], ...]:
        rows, start = [], 0
        for part in self.parts:
            rows.append((start, part.length, 1.0 / part.replicas))
            start += part.length
        return tuple(rows)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of every part of the full tensor, concatenated (a copy)."""
        if tuple(full.shape) != self.full_shape:
            raise ValueError(f"expected the full tensor of shape {self.full_shape}, got {tuple(full.shape)}")
        wholes = full.split([part.full_shape[0] for part in self.parts])
        return torch.cat([part.shard(whole) for part, whole in zip(self.parts, wholes, strict=True)])

    def unshard(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's local tensor, in rank order."""
        per_rank = [piece.split([part.length for part in self.parts]) for piece in pieces]
        return torch.cat([part.unshard([rank[i] for rank in per_rank]) for i, part in enumerate(self.parts)])


def shard_specs(model: nn.Module) -> dict[str, ShardSpec | FusedShardSpec]:
    """{canonical parameter name: its ShardSpec} for every sharded parameter of `model` (a GPT or
    pipeline chunks); parameters not listed are full tensors."""
    specs = {}
    for name, module in canonical_named_modules(model):
        for leaf, spec in getattr(module, "shard_specs", {}).items():
            specs[f"{name}.{leaf}" if name else leaf] = spec
    return specs


@torch.no_grad()
def copy_full_value(param: torch.Tensor, value: torch.Tensor) -> None:
    """Write `value`, the whole of `param` as this rank sees it (its TP-local tensor), into `param`: in place, or
    into its own chunk when `param` is a DTensor shard (FSDP shards dim 0 over its data-parallel ranks; the model
    does not know which layout holds it, so every writer of full values goes through here)."""
    param.copy_(laid_out_like(param, value.to(param.dtype)))


def laid_out_like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value`, whole as this rank sees `param`, laid out as `param` is held: its own chunk as a DTensor when `param`
    is an FSDP shard (every rank has `value`: no communication), else `value` itself (one already laid out so, too)."""
    if isinstance(param, DTensor) and value.shape == param.shape and not isinstance(value, DTensor):
        return distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    return value


def full_value(t: torch.Tensor) -> torch.Tensor:
    """The whole of `t` as this rank's layout sees it (its TP-local tensor): gathered from its FSDP shards when it is
    a DTensor (collective over its data-parallel ranks), else `t` itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's elements of `t`: an FSDP shard's local tensor, or `t` itself (no collective)."""
    return t.to_local() if isinstance(t, DTensor) else t


def empty_full_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised plain tensor of `t`'s whole (TP-local) shape, of `t`'s dtype (or `dtype`) and device (no
    collective)."""
    return torch.empty(t.shape, dtype=dtype or t.dtype, device=t.device)
