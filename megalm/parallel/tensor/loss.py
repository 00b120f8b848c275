"""Vocab-parallel cross entropy: the summed token loss on logits sharded over the vocabulary [T, V/tp].

The output head of a tensor-parallel model is column-parallel over the vocabulary, so each rank holds
logits for V/tp classes. Gathering [T, V] logits would cost T·V floats per rank; instead the softmax's
max, sum of exponentials and the target logit are reduced over TP (Megatron-LM's vocab-parallel CE).
Like `megalm.model.loss.token_loss_sum`, it returns a *sum* over tokens (docs/architecture.md: the loss
is normalised once, by the step's global token count).

It is `token_loss_sum` on the rank's columns, with the per-token statistics of its chunks (max m, log s = log sum
exp(logit - m), the label's logit) combined over TP before the loss is summed: two all-reduces a micro-batch (of
[T] and [2, T]), whatever the chunking. So the shard's logits are never copied whole to fp32 (Megatron's form keeps
a [T, V/tp] fp32 softmax from the forward to the backward), the backward needs no communication and writes the
gradient over the shard's logits, and `trainer.compile` compiles the same chunk kernels as with one TP rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megalm.model.loss import Statistics, TokenLoss, token_loss_sum, whole_vocab
from megalm.parallel.tensor.comm import Group, tp_rank, tp_world_size


def combine_over_tp(group: Group) -> Callable[..., Statistics]:
    """The whole vocabulary's (m, log s, label logit) per token from each rank's over its columns: the max of the
    maxes, log sum_r exp(log s_r + m_r - m), and the one label logit (the other ranks hold 0). A rank of padding
    only has m_r = log s_r = -inf, and adds 0."""
    if tp_world_size(group) == 1:
        return whole_vocab

    def combine(m: torch.Tensor, log_s: torch.Tensor, target: torch.Tensor) -> Statistics:
        whole_m = m.clone()
        dist.all_reduce(whole_m, op=dist.ReduceOp.MAX, group=group)
        sums = torch.stack([(log_s + (m - whole_m)).exp_(), target])  # one all-reduce for both sums
        dist.all_reduce(sums, group=group)
        return whole_m, sums[0].log(), sums[1]

    return combine


def vocab_parallel_token_loss_sum(
    logits_shard: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor, group: Group,
    vocab_size: int | None = None, chunk_tokens: int | None = None,
) -> torch.Tensor:
    """`token_loss_sum` on vocab-sharded logits [T, V/tp] without ever forming [T, V] (Megatron).

    Every TP rank returns the same scalar; each rank's logit gradient is softmax - onehot on its own vocabulary
    slice (into a tensor of its own here; `VocabParallelTokenLoss`, the trainer's, writes it over the shard).
    Labels equal to -100 are ignored, as by F.cross_entropy. `vocab_size`: the real vocab when the shards hold
    padding columns past it (masked).
    """
    return token_loss_sum(logits_shard, labels, loss_mask, vocab_size, chunk_tokens,
                          first_column=first_column_of(logits_shard, group), combine=combine_over_tp(group))


def first_column_of(logits_shard: torch.Tensor, group: Group) -> int:
    """The vocabulary id of this TP rank's first column: the head's rows are split in rank order."""
    return tp_rank(group) * logits_shard.shape[-1]


class VocabParallelTokenLoss(TokenLoss):
    """`TokenLoss` (the gradient written over the logits, chunk kernels `compile`d by trainer.compile) on this TP
    rank's vocabulary shard of the logits, [T, V/tp]."""

    def __init__(self, group: Group, vocab_size: int | None = None, chunk_tokens: int | None = None) -> None:
        super().__init__(vocab_size, chunk_tokens)
        self.group, self.combine = group, combine_over_tp(group)

    def first_column(self, logits: torch.Tensor) -> int:
        return first_column_of(logits, self.group)
