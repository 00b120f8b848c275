"""The whole matrices behind a rank's parameters, for an optimizer that updates matrices, not elements (Muon).

AdamW is elementwise: a TP shard steps as the whole would, and a fused projection as its parts would. An update that
orthogonalises a matrix (Muon's Newton-Schulz iteration) is not: the orthogonal factor of a shard is not the shard
of the orthogonal factor, nor is that of q, k and v stacked the stack of theirs. So each parameter of a transformer
block gets a `WholeMatrices`: gather its local tensor over the TP group into the full one (`ShardSpec.unshard`, the
layout the checkpoints read), split it into the matrices of the unfused model (q, k, v of `qkv_proj`; gate and up of
`gate_up_proj`, an expert's too), and after the update take this rank's slice back (`ShardSpec.shard`). Every TP rank
computes the same full update (Megatron-LM's "duplicated" mode for its Muon), as every data-parallel rank does: the
gradients are reduced first. An expert-parallel slice holds whole experts, the leading dimension of a stack of
matrices: nothing to gather. The embedding, the output layer and the router are not among them (Muon's authors keep
AdamW for those), nor are norms and biases.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megalm.config import ModelConfig
from megalm.model.fused import part_rows
from megalm.model.naming import canonical_named_parameters
from megalm.model.shard import FusedShardSpec, ShardSpec, shard_specs


@dataclass(frozen=True)
class WholeMatrices:
    """One parameter's local tensor as whole matrices: `gather` it, `split` the full tensor along its rows (dim -2;
    leading dims are a stack of experts), update each matrix, `cat` them back and `scatter` this rank's part."""

    parts: tuple[int, ...]  # the rows of each matrix in the full tensor
    spec: ShardSpec | FusedShardSpec | None = None  # TP's cut (None: the local tensor is the full one)
    group: dist.ProcessGroup | None = None  # the ranks holding the pieces, in spec order

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        if self.spec is None:
            return local
        pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(pieces, local.contiguous(), group=self.group)
        return self.spec.unshard(pieces)

    def split(self, full: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return full.split(self.parts, dim=-2)

    def scatter(self, full: torch.Tensor) -> torch.Tensor:
        return full if self.spec is None else self.spec.shard(full)


def _fused_parts(name: str, rows: int, cfg: ModelConfig) -> tuple[int, ...]:
    """The rows of each matrix of parameter `name` (full rows `rows`): q, k, v; gate, up; or the whole."""
    if name.endswith("attention.qkv_proj.weight"):
        return part_rows("attention.qkv_proj", cfg)
    if name.endswith("gate_up_proj.weight"):  # the dense MLP's, a shared expert's, each routed expert's
        return rows // 2, rows // 2
    return (rows,)


def whole_matrices(model: nn.Module, cfg: ModelConfig, tp_group: dist.ProcessGroup | None
                   ) -> dict[int, WholeMatrices]:
    """{id(parameter): its WholeMatrices} for the matrices of `model`'s transformer blocks (a GPT or pipeline
    chunks), router excepted; `tp_group` gathers the TP shards."""
    specs, found = shard_specs(model), {}
    for name, param in canonical_named_parameters(model):
        if param.ndim < 2 or not name.startswith("layers.") or ".router." in name or not param.requires_grad:
            continue
        spec = specs.get(name)
        gathered = spec is not None and spec.parts[0].group == "tp" and spec.parts[0].num_slices > 1
        rows = sum(part.full_shape[0] for part in spec.parts) if gathered else param.shape[-2]
        found[id(param)] = WholeMatrices(_fused_parts(name, rows, cfg), spec if gathered else None,
                                         tp_group if gathered else None)
    return found
