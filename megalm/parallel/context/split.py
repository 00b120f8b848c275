"""Static context parallelism's split of a step: every micro-batch sharded over the rank's CP ring.

Wraps the data-parallel split (megalm/parallel/data_parallel/slices.py): each whole micro-batch of
this DP rank becomes this CP rank's zigzag shard (zigzag.py) on the ring of the mesh's CP ranks, which
the parallelism then turns into the micro-batch's `RingContext` (attention.py).
"""

from __future__ import annotations

from megalm.parallel.context.zigzag import shard_batch, zigzag_plan
from megalm.parallel.microbatch import LocalMicroBatch, Ring


def shard_over_ring(mb: LocalMicroBatch, ring: Ring) -> LocalMicroBatch:
    """This rank's zigzag shard of a whole micro-batch over `ring` (static context parallelism: every
    micro-batch runs on the rank's CP ring). The ring's first member counts the documents."""
    plan = zigzag_plan(mb.batch.cu_seqlens, len(ring.ranks), ring.inner)
    batch = shard_batch(mb.batch, plan, ring.index)
    counted = mb.counted_doc_lengths if ring.index == 0 else []
    return LocalMicroBatch(batch, mb.index, ring, counted, real_tokens=plan.local_source(ring.index) >= 0)


class ContextShards:
    """A step split (e.g. data_parallel.slices.DataParallelSlices) whose micro-batches are each sharded over
    this rank's CP ring."""

    def __init__(self, split, ring: Ring):
        self.split, self.ring = split, ring

    def micro_batches(self, dataset, ids: range) -> tuple[list[LocalMicroBatch], int]:
        micro_batches, loss_tokens = self.split.micro_batches(dataset, ids)
        return [shard_over_ring(mb, self.ring) for mb in micro_batches], loss_tokens
