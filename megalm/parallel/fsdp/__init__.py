"""Fully sharded data parallelism (ZeRO-3) through torch's FSDP2 (`torch.distributed.fsdp.fully_shard`).

`parallel.fsdp=true` shards every parameter, its gradient and its optimizer state over the data-parallel ranks (dp,
or dp x cp flattened: the ranks that split a batch), as DTensors whose local piece is a dim-0 chunk of the
TP-local tensor. Each transformer block and the root (embedding, final norm, head) is one FSDP unit: its
parameters are all-gathered before its forward, freed after it (`parallel.fsdp_reshard_after_forward`), gathered
again for its backward, and its gradients reduce-scattered as its backward ends (FSDP2 prefetches the next unit's
gather and overlaps the reduce-scatter with the backward of the unit before). megalm hand-writes none of this:
the library does it well (TorchTitan's first axis); this package only decides the mesh, the units and the
precision, and gives the rest of megalm the reducer's interface over the sharded gradients (grads.py).

apply.py   the FSDP mesh (FSDP or HSDP), fully_shard per block and root, the precision policy, the config rules
grads.py   `FsdpGrads`: the step's gradients are FSDP's sharded ones; their norm, clipping and the tied embedding
"""

from megalm.parallel.fsdp.apply import apply_fsdp, fsdp_mesh, fsdp_shard_count, validate_fsdp
from megalm.parallel.fsdp.grads import FsdpGrads

__all__ = ["FsdpGrads", "apply_fsdp", "fsdp_mesh", "fsdp_shard_count", "validate_fsdp"]
