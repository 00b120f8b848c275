"""The step's gradients under FSDP: the reducer's interface (megalm/parallel/data_parallel/reducer.py) over the
sharded gradients FSDP2 leaves in `p.grad`, so the rest of megalm (the grad norm, clipping, the trainer) runs
unchanged.

FSDP reduce-scatters each unit's gradients as its backward ends, every micro-batch, and adds them into the sharded
`p.grad` (a DTensor): after the last backward of a step each rank holds the step's summed gradient of its shard of
every parameter. What is left is what FSDP cannot know:
- which backward is a chunk's last of the step (`before_backward`, told by the runner): HSDP's all-reduce across
  replicas runs only then, the replicas' partial sums held reduce-scattered until it (FSDP2's
  set_requires_all_reduce; TorchTitan does the same), where they are summed in fp32 (FSDP2 sums the held ones in the
  reduce dtype: under `parallel.grad_reduce_dtype=bf16` the replicas all-reduce every micro-batch, as before, and
  each result joins the fp32 shard); `parallel.fsdp_reduce_each_micro_batch=false` defers the reduce-scatter as
  well (set_requires_gradient_sync: the unsharded gradients accumulate on each rank, in the reduce dtype);
- a pipeline's tied embedding has a copy on the first and the last stage whose sharded gradients are summed here
  (`finish`), as the DP reducer presums them.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from megalm.model.shard import local_part
from megalm.parallel.norms import share_pairs, weighted_sq_norm
from megalm.parallel.progress import Progress, note_collective


def shard_offset(param: DTensor) -> int:
    """Where this rank's shard starts in the parameter's flattened (TP-local) elements. FSDP shards dim 0 as
    `torch.chunk` does (chunks of ceil(rows / n), the last ones short or empty), over each mesh dimension that shards
    it, left to right (HSDP replicates over the first). Read from the mesh coordinates alone: torch 2.11's
    `compute_local_shape_and_global_offset` runs tensor ops, which fake tensors (megalm-estimate) cannot read, and
    `get_local_rank` resolves the dimension's group by name, which megalm-estimate's second rank of a pipeline
    (a fresh fake world in the same process) no longer finds: it raised for FSDP with pp > 1 (an audit)."""
    start, rows = 0, param.shape[0]
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            if placement.dim != 0:
                raise ValueError(f"FSDP gradients sharded on dim {placement.dim}: megalm's FSDP shards dim 0")
            chunk = -(-rows // param.device_mesh.size(mesh_dim))
            first = min(param.device_mesh.get_coordinate()[mesh_dim] * chunk, rows)
            start, rows = start + first, min(chunk, rows - first)
    return start * math.prod(param.shape[1:])


class FsdpGrads:
    """`GradReducer`'s interface for the trainer and `Parallelism` when FSDP reduces the gradients.

    `presum`: {tied parameter: group} whose gradients are summed over the group after the step's backward (the
    tied embedding's first- and last-stage copies; both hold the same shard rows, their dp ranks match)."""

    def __init__(self, params: list[nn.Parameter], mesh: DeviceMesh, presum: dict[nn.Parameter, dist.ProcessGroup]
                 | None = None, progress: Progress | None = None, reduce_each_micro_batch: bool = True,
                 reduce_dtype: torch.dtype = torch.float32):
        self.params, self.presum, self.progress = params, dict(presum or {}), progress
        self.world = mesh.size()
        self.shard_group = mesh.get_group(mesh.ndim - 1)  # shards partition the parameters over this group
        self.buckets: list = []  # FSDP owns the communication buffers (its units)
        self.reduce_each_micro_batch = reduce_each_micro_batch
        # HSDP: the replicas' all-reduce waits for a chunk's last backward where the held sums are fp32's
        self.defer_all_reduce = mesh.ndim > 1 and reduce_dtype == torch.float32

    def start_step(self, num_micro_batches: int) -> None:
        """Nothing to arm: FSDP's hooks reduce the micro-batches' gradients into the shards."""

    def before_backward(self, chunk: nn.Module, last: bool) -> None:
        """Before a backward of `chunk` (an FSDP unit, its blocks' units inside it): `last` when no other backward
        of the chunk follows in this step. Only the last sends the gradients across replicas (HSDP), or at all with
        `reduce_each_micro_batch` false; whatever a chunk held back is reduced with its last backward's."""
        if not self.reduce_each_micro_batch:
            chunk.set_requires_gradient_sync(last)
        elif self.defer_all_reduce:
            chunk.set_requires_all_reduce(last)

    @torch.no_grad()
    def finish(self) -> None:
        """After the step's last backward: sum the tied copies' sharded gradients over their stages."""
        for param, group in self.presum.items():
            if param.grad is not None:
                note_collective(self.progress, "tied embedding all_reduce", dist.get_world_size(group))
                dist.all_reduce(local_part(param.grad), group=group)

    def local_grad_sq_norm(self, weight=None) -> torch.Tensor:
        """Sum of squares of this rank's gradient shards (fp32 scalar; summed over `shard_group` it is the full
        norm²), each element weighted by its parameter's share at its position (`weight(param)`)."""
        pairs = [pair for p in self.params if p.grad is not None
                 for pair in share_pairs(local_part(p.grad).reshape(-1), shard_offset(p) if isinstance(p, DTensor)
                                         else 0, 1.0 if weight is None else weight(p))]
        return weighted_sq_norm(pairs, self.params[0].device if self.params else None)

    @torch.no_grad()
    def scale_grads(self, coef: float | torch.Tensor) -> None:
        """Multiply the gradient shards by `coef` (the clip coefficient)."""
        grads = [local_part(p.grad) for p in self.params if p.grad is not None]
        if grads:  # `coef` (a device scalar) onto the gradients' device: the host under parallel.fsdp_cpu_offload
            torch._foreach_mul_(grads, coef.to(grads[0].device) if isinstance(coef, torch.Tensor) else coef)

    def remove(self) -> None:
        """Nothing to detach: FSDP's hooks stay with its units."""
