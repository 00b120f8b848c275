"""What `optim.name=muon` adds to a rank's step, by the layout search's closed form (megalm/estimate/layout_search.py).

Muon (megalm/training/muon.py) keeps one fp32 momentum a matrix element where AdamW keeps two moments, and its step
orthogonalises every transformer-block matrix by `optim.muon_ns_steps` Newton-Schulz iterations in fp32, each
matrix once among the data-parallel replicas whose gradients are the same (megalm/parallel/matrices.py): the TP
ranks of its owner gather it whole and each computes the whole iteration, then the owner's slice of the update is
broadcast to the other replicas. Per iteration on the wide orientation of an m x n matrix (m <= n): its Gram matrix
(2·m²·n FLOPs), the Gram's square (2·m³) and the product with the matrix (2·m²·n). Under ZeRO-1 the optimizer is
sharded by whole matrices (megalm/parallel/data_parallel/layerwise.py): the gradients are all-reduced whole, each
parameter's states and main weight live on its owner, which broadcasts the new working weight.

The closed form prices the mean rank: its replicas' iterations shared out evenly. `share_out` gives each matrix to
the least loaded replica, the costliest first, so a rank's share of a deep stage's matrices is within one matrix of
the mean; at the one or two layers of the search's shallow runs it is not, so the search confirms a Muon layout at
its full depth instead (layout_search.shallow_rank).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from megalm.parallel.matrices import iteration_flops

MUON_STATE_BYTES = 4  # the momentum of a matrix element (fp32), where AdamW keeps 8 (two moments)
ADAMW_STATE_BYTES = 8


def newton_schulz_flops(rows: int, cols: int, steps: int) -> float:
    """The FLOPs of `steps` iterations on one rows x cols matrix (muon.orthogonalise)."""
    return steps * iteration_flops(rows, cols)


def mlp_flops(hidden: int, ffn: int, steps: int) -> float:
    """A SwiGLU MLP's three matrices: gate and up (ffn x hidden, orthogonalised apart), down (hidden x ffn)."""
    return 2 * newton_schulz_flops(ffn, hidden, steps) + newton_schulz_flops(hidden, ffn, steps)


def static_bytes(bf16: bool, zero1: bool, dp: int, matrices: float, adamw: float) -> float:
    """Weights, gradient buckets, optimizer states and fp32 main weights of `matrices` Muon and `adamw` AdamW
    parameters a rank holds, over `dp` replicas: sharded by whole matrices under ZeRO-1 (the gradients whole, no
    gather buffers), else every state on every replica."""
    weight, main = (2, 4) if bf16 else (4, 0)
    own = 1 / dp if zero1 else 1.0
    return sum(count * (weight + 4 + (main + states) * own)
               for count, states in ((matrices, MUON_STATE_BYTES), (adamw, ADAMW_STATE_BYTES)))


def replica_bytes(bf16: bool, zero1: bool, replicas: int, matrices: float, params: float) -> float:
    """What a rank sends a step over its replicas' links past the gradients' all-reduce: each matrix's fp32 update
    broadcast from its owner (each rank of a broadcast passes it once), or under ZeRO-1 every parameter's new
    working weight."""
    if replicas == 1:
        return 0.0
    return (2 if bf16 else 4) * params if zero1 else 4 * matrices


def gather_bytes(tp: int, replicas: int, matrices: float) -> float:
    """What a rank sends over TP a step gathering the fp32 directions of the matrices its replica owns (1/replicas of
    its `matrices` TP shards): an all-gather passes (tp - 1) shards."""
    return 4 * (tp - 1) * matrices / replicas


def replica_seconds(optimizer: object, seconds: Callable[[tuple[int, ...]], float]) -> tuple[float, float]:
    """(this rank's Newton-Schulz seconds a step, those plus its wait for the busiest replicas), from the owners the
    trainer's Muon optimizer drew (`share_out`) and `seconds` of the iterations on one matrix of a shape (a stack of
    experts' too): each broadcast of an update (or, under ZeRO-1, of a weight) waits for its owner. Each group of
    replicas is its own (the dense matrices' dp x cp ranks; an MoE model's experts' expert-data-parallel ranks, which
    span the TP peers, who iterate on the same dense matrices as this rank): the wait is the sum of each group's
    busiest replica's excess over this rank's share, an upper bound where the busiest of two groups differ.
    (0, 0) for an optimizer without matrices."""
    import torch.distributed as dist

    update = getattr(optimizer, "update", None) or getattr(optimizer, "matrix_update", None)
    matrices = getattr(update, "matrices", None)
    if not matrices:
        return 0.0, 0.0
    owners = getattr(optimizer, "owner", None) or update.owners  # ZeRO-1's by whole matrices, or the update's
    seconds = functools.cache(seconds)  # (a model has a few shapes of matrices)
    rank, loads = dist.get_rank(), {}  # loads: id(group) -> {owner: seconds}
    for key, layout in matrices.items():
        owner = owners.get(key)
        group = loads.setdefault(None if owner is None else id(layout.replicas), {})
        owner = rank if owner is None else owner
        group[owner] = group.get(owner, 0.0) + sum(seconds((*layout.full_shape[:-2], rows, layout.full_shape[-1]))
                                                   for rows in layout.parts)
    own = sum(group.get(rank, 0.0) for group in loads.values())
    return own, own + sum(max(group.values()) - group.get(rank, 0.0) for group in loads.values())
