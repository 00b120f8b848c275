"""Context parallelism wired into the step, one process: which ring each rank's micro-batches carry, and
the sequence-parallel padding of a zigzag shard."""

from __future__ import annotations

import pytest
import torch

from megalm.data.batch import packed_from_documents, pad_to_multiple
from megalm.parallel.context.attention import RingContext
from megalm.parallel.context.split import ContextShards
from megalm.parallel.context.zigzag import layout_from_local_cu_seqlens, shard_batch, zigzag_plan
from megalm.parallel.dims import ParallelDims, ParallelMesh
from megalm.parallel.microbatch import LocalMicroBatch, Ring


def test_cp_ranks_follow_the_mesh_order():
    dims = ParallelDims(tp=2, cp=2, dp=2, pp=2)  # rank = ((pp * dp + dp_rank) * cp + cp_rank) * tp + tp_rank
    assert ParallelMesh(dims, rank=0).cp_ranks == [0, 2]
    assert ParallelMesh(dims, rank=7).cp_ranks == [5, 7]
    assert ParallelMesh(dims, rank=13).cp_ranks == [13, 15]  # tp1 cp0 dp1 pp1
    assert ParallelMesh(ParallelDims(cp=4, dp=2), rank=6).cp_ranks == [4, 5, 6, 7]


class FixedSplit:
    """A step split that returns the same whole micro-batches every time."""

    def __init__(self, micro_batches):
        self.mbs = micro_batches

    def micro_batches(self, dataset, ids):
        return list(self.mbs), 99


@pytest.mark.parametrize("cp_rank", [0, 1])
def test_context_shards_give_every_micro_batch_the_ranks_ring(cp_rank: int):
    """Static CP: every micro-batch becomes this rank's zigzag shard on the mesh's CP ring (data, not a layer
    binding), and only the ring's first rank counts its documents."""
    docs = [torch.arange(n + 1) + 3 for n in (5, 12)]
    whole = LocalMicroBatch(packed_from_documents(docs), 4, counted_doc_lengths=[5, 12])
    mesh = ParallelMesh(ParallelDims(tp=2, cp=2), rank=2 * cp_rank + 1)
    ring = Ring(tuple(mesh.cp_ranks), mesh.cp_rank)
    (mb,), loss_tokens = ContextShards(FixedSplit([whole]), ring).micro_batches(None, range(0))
    assert loss_tokens == 99 and mb.ring == Ring((1, 3), cp_rank) and mb.index == 4
    expect = shard_batch(whole.batch, zigzag_plan(whole.batch.cu_seqlens, 2), cp_rank)
    assert torch.equal(mb.batch.tokens, expect.tokens) and torch.equal(mb.batch.cu_seqlens, expect.cu_seqlens)
    assert mb.counted_doc_lengths == ([5, 12] if cp_rank == 0 else [])
    context = RingContext.for_shard(mb.batch, mb.ring, torch.device("cpu"), "a2a", group=None)
    assert context.comm == "a2a" and context.layout.local_tokens == mb.batch.num_tokens


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
        padded = pad_to_multiple(local, tp, even=True)
        assert padded.num_tokens % tp == 0 and padded.num_tokens - local.num_tokens < 2 * tp
        segments = (padded.cu_seqlens[1:] - padded.cu_seqlens[:-1]).tolist()
        assert all(n % 2 == 0 for n in segments)
        assert layout_from_local_cu_seqlens(padded.cu_seqlens, cp).local_tokens == padded.num_tokens
        total_loss_tokens += padded.num_loss_tokens()
    assert total_loss_tokens == batch.num_loss_tokens()


@pytest.mark.parametrize("comm, inner", [("ring", 1), ("a2a", 1), ("a2a+p2p", 2)])
def test_a_micro_batchs_ring_moves_to_the_device_without_a_stream_sync(monkeypatch, comm, inner):
    """`for_shard` runs for every CP micro-batch as it is prepared: each of its layout tensors went host to device in
    a plain copy (from pageable memory: a stream sync on CUDA, waiting for the step before's optimizer), and a
    hierarchical ring read the moved layout back (an audit: 7 and 15 syncs a micro-batch). It builds on the host and
    moves without blocking, as the batch does. 'meta' stands in for CUDA: every copy to it is recorded."""
    batch = packed_from_documents([torch.arange(13), torch.arange(20), torch.arange(5)])
    shard = shard_batch(batch, zigzag_plan(batch.cu_seqlens, 4, inner), 1)
    blocking, reads = [], []
    to, cpu = torch.Tensor.to, torch.Tensor.cpu

    def recorded_to(self, *args, **kwargs):
        out = to(self, *args, **kwargs)
        if self.device.type == "cpu" and out.device.type != "cpu" and not kwargs.get("non_blocking", False):
            blocking.append(tuple(self.shape))
        return out

    def recorded_cpu(self, *args, **kwargs):
        if self.device.type != "cpu":
            reads.append(tuple(self.shape))
            return torch.zeros(self.shape, dtype=self.dtype)  # meta has no values
        return cpu(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", recorded_to)
    monkeypatch.setattr(torch.Tensor, "cpu", recorded_cpu)
    context = RingContext.for_shard(shard, Ring((0, 1, 2, 3), 1, inner), torch.device("meta"), comm)
    monkeypatch.undo()
    assert blocking == [] and reads == []
    assert context.layout.indices.device.type == "meta" and (context.hierarchical is not None) == (inner > 1)
    if inner > 1:  # the hierarchical ring's tensors that its attention reads are on the device too
        assert context.hierarchical.to_position.device.type == "meta"
        assert context.hierarchical.position_layout.indices.device.type == "meta"


def test_to_device_pins_before_a_copy_to_cuda_without_blocking(monkeypatch):
    """A copy from pageable memory synchronises the stream whatever `non_blocking` says: `to_device` pins first, only
    toward CUDA with `non_blocking` (a CPU torch has no pinned memory; a blocking copy needs none)."""
    from megalm.parallel.context.zigzag import to_device

    pinned, copies = [], []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(self.shape) or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, device, non_blocking=False: copies.append(
        (str(device), non_blocking)) or self)
    t = torch.arange(4)
    to_device(t, "cuda", non_blocking=True)
    assert pinned == [(4,)] and copies == [("cuda", True)]
    to_device(t, "cuda")
    to_device(t, "cpu", non_blocking=True)
    to_device(t, "meta", non_blocking=True)
    assert pinned == [(4,)] and [c[1] for c in copies] == [True, False, True, True]
