"""The whole matrices behind a rank's parameters, for an optimizer that updates matrices, not elements (Muon).

AdamW is elementwise: a TP shard steps as the whole would, and a fused projection as its parts would. An update that
orthogonalises a matrix (Muon's Newton-Schulz iteration) is not: the orthogonal factor of a shard is not the shard
of the orthogonal factor, nor is that of q, k and v stacked the stack of theirs. So each parameter of a transformer
block gets a `WholeMatrices`: gather its local tensor over the TP group into the full one (`ShardSpec.unshard`, the
layout the checkpoints read), split it into the matrices of the unfused model (q, k, v of `qkv_proj`; gate and up of
`gate_up_proj`, an expert's too), and after the update take this rank's slice back (`ShardSpec.shard`). Every TP
rank computes the same full update (Megatron-LM's "duplicated" mode for its Muon). The data-parallel ranks, whose
reduced gradients are the same, share the work out instead: each matrix parameter is updated by one replica (its TP
group gathering it), the costliest first to the least loaded (`share_out`), and broadcast to the others, as
Moonlight's distributed Muon splits the Newton-Schulz iterations over the ranks (Liu et al. 2025): computed on every
one of them, the iterations cost about 5·m/T of a step's matrix FLOPs (m the smaller side of the matrix, T the
tokens a rank trains a step): more than the step itself at m = 4,096 and 16K tokens. An expert-parallel slice holds
whole experts, the leading dimension of a stack of matrices: nothing to gather, its replicas the
expert-data-parallel ranks. The embedding, the output layer and the router are not among them (Muon's authors keep
AdamW for those), nor are norms and biases.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megalm.config import ModelConfig
from megalm.model.fused import part_rows
from megalm.model.naming import canonical_named_parameters
from megalm.model.shard import FusedShardSpec, ShardSpec, shard_specs
from megalm.parallel.collectives import gather_unsharded


@dataclass(frozen=True)
class WholeMatrices:
    """One parameter's local tensor as whole matrices: `gather` it, `split` the full tensor along its rows (dim -2;
    leading dims are a stack of experts), update each matrix, `cat` them back and `scatter` this rank's part."""

    parts: tuple[int, ...]  # the rows of each matrix in the full tensor
    full_shape: tuple[int, ...]  # the full tensor's
    spec: ShardSpec | FusedShardSpec | None = None  # TP's cut (None: the local tensor is the full one)
    group: dist.ProcessGroup | None = None  # the ranks holding the pieces, in spec order
    # the data-parallel ranks whose reduced gradients of this parameter are the same (dp x cp, or the expert-data-
    # parallel group of an expert slice): one of them computes its update and sends it to the others (`share_out`)
    replicas: dist.ProcessGroup | None = None

    @property
    def cost(self) -> int:
        """The FLOPs of one Newton-Schulz iteration on each of its matrices (`iteration_flops`)."""
        batch = math.prod(self.full_shape[:-2])
        return batch * sum(iteration_flops(rows, self.full_shape[-1]) for rows in self.parts)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        return local if self.spec is None else gather_unsharded(local, self.spec, self.group)

    def split(self, full: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return full.split(self.parts, dim=-2)

    def scatter(self, full: torch.Tensor) -> torch.Tensor:
        return full if self.spec is None else self.spec.shard(full)


def iteration_flops(rows: int, cols: int) -> int:
    """One Newton-Schulz iteration's FLOPs on a rows x cols matrix (megalm/training/muon.py `orthogonalise`, on the
    wide orientation m x n, m <= n): the Gram matrix x·xᵀ (2·m²·n), its square (2·m³) and their product with x
    (2·m²·n). Until 2026-12-08 the replicas were balanced by m²·n, which weighed a square matrix's iterations 4/6 of
    a wide one's."""
    m, n = sorted((rows, cols))
    return 4 * m * m * n + 2 * m**3


def share_out(layouts: list[WholeMatrices]) -> list[int | None]:
    """The global rank that updates each of `layouts` (in order, the same list on every rank that holds them; anything
    with a `cost` and its `replicas`: layerwise.py shares AdamW's parameters out by size too): among
    its replicas, the least loaded so far, the costliest first (longest processing time first: the busiest replica
    ends within one matrix's cost of the idlest); None where a rank holds the parameter alone. Each group of replicas
    is balanced on its own, by position in the group: a rank's dense and expert parameters have different replicas
    (the TP ranks are among the experts' under sequence parallelism), and each of those ranks must find the same
    owners from what it shares with them."""
    owners: list[int | None] = [None] * len(layouts)
    loads: dict[int, list[int]] = {}  # id(group) -> work given to each of its positions
    for index in sorted(range(len(layouts)), key=lambda i: -layouts[i].cost):  # (sorted is stable: ties in order)
        replicas = layouts[index].replicas
        if replicas is None or dist.get_world_size(replicas) == 1:
            continue
        load = loads.setdefault(id(replicas), [0] * dist.get_world_size(replicas))
        position = load.index(min(load))
        load[position] += layouts[index].cost
        owners[index] = dist.get_process_group_ranks(replicas)[position]
    return owners


def _fused_parts(name: str, rows: int, cfg: ModelConfig) -> tuple[int, ...]:
    """The rows of each matrix of parameter `name` (full rows `rows`): q, k, v; gate, up; or the whole."""
    if name.endswith("attention.qkv_proj.weight"):
        return part_rows("attention.qkv_proj", cfg)
    if name.endswith("gate_up_proj.weight"):  # the dense MLP's, a shared expert's, each routed expert's
        return rows // 2, rows // 2
    return (rows,)


def whole_matrices(model: nn.Module, cfg: ModelConfig, tp_group: dist.ProcessGroup | None,
                   replicas: dict[int, dist.ProcessGroup | None] | None = None) -> dict[int, WholeMatrices]:
    """{id(parameter): its WholeMatrices} for the matrices of `model`'s transformer blocks (a GPT or pipeline
    chunks), router excepted; `tp_group` gathers the TP shards, `replicas` ({id(parameter): group}) names the ranks
    whose reduced gradients are the same, over which the updates are shared out."""
    replicas = replicas or {}
    specs, found = shard_specs(model), {}
    for name, param in canonical_named_parameters(model):
        if param.ndim < 2 or not name.startswith("layers.") or ".router." in name or not param.requires_grad:
            continue
        spec = specs.get(name)
        gathered = spec is not None and spec.parts[0].group == "tp" and spec.parts[0].num_slices > 1
        full = ((sum(part.full_shape[0] for part in spec.parts), spec.parts[0].full_shape[1]) if gathered
                else tuple(param.shape))
        found[id(param)] = WholeMatrices(_fused_parts(name, full[-2], cfg), full, spec if gathered else None,
                                         tp_group if gathered else None, replicas.get(id(param)))
    return found
