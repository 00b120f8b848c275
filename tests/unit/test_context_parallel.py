"""Context parallelism wired into the model, one process: which ring each rank's attention uses, and
the sequence-parallel padding of a zigzag shard."""

from __future__ import annotations

import pytest
import torch

from megalm.data.batch import packed_from_documents
from megalm.model.attention import varlen_attention
from megalm.model.gpt import GPT
from megalm.parallel.context import context_attention, layout_from_local_cu_seqlens, shard_batch, zigzag_plan
from megalm.parallel.dims import ParallelDims, ParallelMesh
from megalm.parallel.parallelize import apply_context_parallel, pad_for_sequence_parallel
from tests.conftest import compose_config


def test_cp_ranks_follow_the_mesh_order():
    dims = ParallelDims(tp=2, cp=2, dp=2, pp=2)  # rank = ((pp * dp + dp_rank) * cp + cp_rank) * tp + tp_rank
    assert ParallelMesh(dims, rank=0).cp_ranks == [0, 2]
    assert ParallelMesh(dims, rank=7).cp_ranks == [5, 7]
    assert ParallelMesh(dims, rank=13).cp_ranks == [13, 15]  # tp1 cp0 dp1 pp1
    assert ParallelMesh(ParallelDims(cp=4, dp=2), rank=6).cp_ranks == [4, 5, 6, 7]


@pytest.mark.parametrize("comm", ["ring", "a2a"])
def test_apply_context_parallel_binds_every_layer_to_its_ring(comm: str):
    model = GPT(compose_config().model, device="meta")
    apply_context_parallel(model, ParallelMesh(ParallelDims()), comm)  # cp = 1: nothing changes
    assert all(layer.attention.attention_fn is varlen_attention for layer in model.layers)

    mesh = ParallelMesh(ParallelDims(tp=2, cp=2), rank=3)
    apply_context_parallel(model, mesh, comm)
    for layer in model.layers:
        fn = layer.attention.attention_fn
        assert fn.func is context_attention
        assert fn.keywords == {"ranks": [1, 3], "rank_index": 1, "group": None, "comm": comm}


@pytest.mark.parametrize("tp", [2, 3, 4])
@pytest.mark.parametrize("cp", [2, 3])
def test_sequence_parallel_padding_of_a_zigzag_shard(tp: int, cp: int):
    """Shard first, then pad: T becomes a multiple of tp and the padding is one more even zigzag segment,
    so the ring's layout still reads from the local cu_seqlens; loss tokens are unchanged."""
    docs = [torch.arange(n + 1) + 7 for n in (1, 5, 13, 2)]
    batch = packed_from_documents(docs)
    plan = zigzag_plan(batch.cu_seqlens, cp)
    total_loss_tokens = 0
    for rank in range(cp):
        local = shard_batch(batch, plan, rank)
        padded = pad_for_sequence_parallel(local, tp, even=True)
        assert padded.num_tokens % tp == 0 and padded.num_tokens - local.num_tokens < 2 * tp
        segments = (padded.cu_seqlens[1:] - padded.cu_seqlens[:-1]).tolist()
        assert all(n % 2 == 0 for n in segments)
        assert layout_from_local_cu_seqlens(padded.cu_seqlens, cp).local_tokens == padded.num_tokens
        total_loss_tokens += padded.num_loss_tokens()
    assert total_loss_tokens == batch.num_loss_tokens()
