"""Collective helpers every parallelism shares: a group of None means "one rank, no communication".

The flat-tensor collectives (all_gather_flat, reduce_scatter_flat) come from megalm.compat: torch 2.13 renamed
them, and the floor has only the old names.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalm.compat import all_gather_flat, reduce_scatter_flat
from megalm.model.shard import FusedShardSpec, ShardSpec
from megalm.parallel.progress import Progress, note_collective

__all__ = ["all_gather_flat", "reduce_scatter_flat", "group_size", "group_rank", "all_reduce_sum",
           "gather_unsharded"]


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in `group`; 1 for None."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank inside `group`; 0 for None."""
    return 0 if group is None else dist.get_rank(group)


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None, what: str = "",
                   progress: Progress | None = None) -> torch.Tensor:
    """Sum `tensor` in place over `group` (nothing to do for None or one rank); returns it. `what` names it in
    the hang report `progress` holds."""
    if group_size(group) > 1:
        note_collective(progress, f"all_reduce{f' ({what})' if what else ''}", group_size(group))
        dist.all_reduce(tensor, group=group)
    return tensor


def gather_unsharded(local: torch.Tensor, spec: ShardSpec | FusedShardSpec,
                     group: dist.ProcessGroup | None) -> torch.Tensor:
    """The full tensor of a TP-sharded one: every rank's piece of `group` all-gathered (collective), put together as
    `spec` cut it (`unshard`)."""
    pieces = [torch.empty_like(local) for _ in range(group_size(group))]
    dist.all_gather(pieces, local.contiguous(), group=group)
    return spec.unshard(pieces)
