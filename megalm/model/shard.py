"""Where a sharded parameter's local tensor sits in the full model's parameter: one `ShardSpec`.

Every layout must start from, save, and account for the same single-process model (docs/architecture.md,
"Data and init are layout-independent"). Three readers need to know how a local tensor relates to the
full one: `init_weights` (draw the full value, keep this rank's part), checkpoints (write each piece
once, reshard on load) and the gradient norm (count every element of the full model once). They all
read the same small record, declared by the module that owns the parameter:

    module.shard_specs = {"weight": ShardSpec(...), "bias": ShardSpec(...)}

A spec says: the full tensor of shape `full_shape` is cut along `dim` into `num_slices` equal
contiguous slices; this rank holds slice `index`; `replicas` consecutive ranks hold each slice (>1 only
for kv heads replicated when tensor parallelism exceeds the kv head count). A parameter without a spec
is the full tensor (replicated on every rank that holds it). Specs live on modules, not as attributes of
Parameter objects, so `to_empty` / `.to()` (which replace Parameters) cannot drop them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megalm.model.naming import canonical_named_modules


@dataclass(frozen=True)
class ShardSpec:
    full_shape: tuple[int, ...]
    dim: int
    num_slices: int
    index: int
    replicas: int = 1

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


def shard_specs(model: nn.Module) -> dict[str, ShardSpec]:
    """{canonical parameter name: its ShardSpec} for every sharded parameter of `model` (a GPT or
    pipeline chunks); parameters not listed are full tensors."""
    specs = {}
    for name, module in canonical_named_modules(model):
        for leaf, spec in getattr(module, "shard_specs", {}).items():
            specs[f"{name}.{leaf}" if name else leaf] = spec
    return specs
