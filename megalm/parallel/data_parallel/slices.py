"""Each data-parallel rank's share of a step: a contiguous slice of the step's samples, in micro-batches.

The global batch of a step is a function of (seed, step) only (docs/architecture.md); DP rank r of dp
reads only samples [r·n/dp, (r+1)·n/dp) of it, so no rank reads another's data. The loss normaliser
is the loss-token count of the whole batch: each rank counts its slice and the counts are summed over
the DP group (on the compute device: NCCL has no CPU tensors). Each micro-batch's index in the step
(which seeds random rounding) is the position of its first sample in the global batch, so replicas
draw independent noise and any DP size draws the same noise for the same samples.
"""

from __future__ import annotations

import logging

import torch

from megalm.config import MegalmConfig, ParallelConfig, choice, positive, ramp_batch_sizes, set_away_from_default
from megalm.data.dataset import SampleDataset, loss_token_count, micro_batches
from megalm.errors import ConfigError
from megalm.parallel.collectives import all_reduce_sum
from megalm.parallel.dims import ParallelMesh
from megalm.parallel.microbatch import LocalMicroBatch

log = logging.getLogger("megalm")


class DataParallelSlices:
    """This DP rank's micro-batches of a step (tensor- and context-parallel ranks of one DP rank share them).

    `partial_last`: under a token budget the slices differ by at most one sample (a rank may get none)
    and the last micro-batch may be smaller than `micro_batch_size`.
    """

    def __init__(self, mesh: ParallelMesh, micro_batch_size: int, partial_last: bool, device: torch.device):
        self.mesh, self.micro_batch_size, self.partial_last, self.device = mesh, micro_batch_size, partial_last, device

    def sample_ids(self, ids: range) -> range:
        """This DP rank's contiguous slice of the step's sample ids."""
        dp, rank = self.mesh.dims.dp, self.mesh.dp_rank
        return ids[rank * len(ids) // dp:(rank + 1) * len(ids) // dp]

    def micro_batches(self, dataset: SampleDataset, ids: range) -> tuple[list[LocalMicroBatch], torch.Tensor]:
        """This rank's micro-batches (on the host) of the step whose samples are `ids`, and the step's
        global loss-token count (a 0-dim tensor on the compute device)."""
        mine = self.sample_ids(ids)
        samples = [dataset[k] for k in mine]
        count = torch.full((), loss_token_count(samples), dtype=torch.int64, device=self.device)
        loss_tokens = all_reduce_sum(count, self.mesh.dp_group, "loss-token count",
                                     self.mesh.progress)  # stays on the device: no host sync
        packed = micro_batches(samples, self.micro_batch_size, partial_last=self.partial_last)
        first = mine.start - ids.start
        return [LocalMicroBatch(batch, first + i * self.micro_batch_size, counted_doc_lengths=list(batch.doc_lengths))
                for i, batch in enumerate(packed)], loss_tokens


def validate_data_parallel(cfg: MegalmConfig) -> None:
    """Data-parallel rules: the batch splits evenly over DP ranks and micro-batches, the reduce dtype."""
    p, t = cfg.parallel, cfg.trainer
    if p.grad_reduce_dtype is not None:
        choice(p.grad_reduce_dtype, "parallel.grad_reduce_dtype", ("fp32", "bf16"))
    positive(p.bucket_size_mb, "parallel.bucket_size_mb")
    if not (p.zero1 or p.fsdp) and (unread := set_away_from_default(p, ParallelConfig, ["overlap_param_gather"])):
        log.warning(f"parallel.{unread[0]} times ZeRO-1's all-gather of the updated parameters, and "
                    "parallel.zero1=false gathers none: not used")
    if p.gradient_accumulation_fusion and p.fsdp:
        raise ConfigError("parallel.gradient_accumulation_fusion adds into the data-parallel buckets, which FSDP "
                          "replaces with its own sharded gradients: drop one of the two")
    if not p.hdp and t.tokens_per_step is None:
        split = t.micro_batch_size * p.dp
        if t.global_batch_size % split:
            raise ConfigError(f"trainer.global_batch_size={t.global_batch_size} is not divisible by "
                              f"micro_batch_size*dp={t.micro_batch_size}*{p.dp}; change one of them")
        if uneven := [size for size in ramp_batch_sizes(t.global_batch_size, t.rampup_batch_size) if size % split]:
            raise ConfigError(f"trainer.rampup_batch_size={list(t.rampup_batch_size)} takes a global batch of "
                              f"{uneven[0]}, not divisible by micro_batch_size*dp={t.micro_batch_size}*{p.dp}; make "
                              f"its start and increment multiples of {split}")
