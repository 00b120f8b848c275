"""`megalm.parallel.fsdp.grads.shard_offset`: where a rank's FSDP shard starts, read from the mesh coordinates, equals
torch's own `compute_local_shape_and_global_offset` (which on torch 2.11 runs tensor ops that fake tensors cannot
read, so megalm-estimate's FSDP step could not take the grad norm) for every rank of FSDP and HSDP meshes, rows
that divide and rows that do not (short and empty last shards)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from megalm.compat import init_fake_process_group
from megalm.parallel.fsdp.grads import shard_offset


@pytest.mark.parametrize(("mesh_shape", "placements"),
                         [((4,), [Shard(0)]), ((3,), [Shard(0)]), ((2, 2), [Replicate(), Shard(0)])],
                         ids=["fsdp4", "fsdp3", "hsdp"])
def test_shard_offset_is_torchs_for_every_rank(mesh_shape, placements):
    world = 1
    for size in mesh_shape:
        world *= size
    for rank in range(world):
        init_fake_process_group(rank, world)
        try:
            mesh = init_device_mesh("cpu", mesh_shape)
            for rows in (1, 5, 7, 8, 10):
                local_shape, offset = compute_local_shape_and_global_offset((rows, 3), mesh, placements)
                param = DTensor.from_local(torch.zeros(local_shape), mesh, placements, shape=torch.Size((rows, 3)),
                                           stride=(3, 1), run_check=False)
                assert shard_offset(param) == offset[0] * 3, (rank, rows)
        finally:
            dist.destroy_process_group()
