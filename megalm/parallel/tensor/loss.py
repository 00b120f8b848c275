"""Vocab-parallel cross entropy: the summed token loss on logits sharded over the vocabulary [T, V/tp].

The output head of a tensor-parallel model is column-parallel over the vocabulary, so each rank holds
logits for V/tp classes. Gathering [T, V] logits would cost T·V floats per rank; instead the softmax's
max, sum of exponentials and the target logit are reduced over TP (Megatron-LM's vocab-parallel CE).
Like `megalm.model.loss.token_loss_sum`, it returns a *sum* over tokens (docs/architecture.md: the loss
is normalised once, by the step's global token count).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalm.parallel.tensor.comm import Group, tp_rank, tp_world_size


class _VocabParallelTokenLossSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, group: Group,
                vocab_size: int | None):
        local_vocab = logits.shape[-1]
        start = tp_rank(group) * local_vocab
        x = logits.float()
        if vocab_size is not None and start + local_vocab > vocab_size:
            # Vocab padding: exp(-inf) = 0, so those ids get no probability mass and no gradient. A rank
            # whose slice is all padding has a local max of -inf; the all-reduced max is a real logit.
            padding = torch.arange(start, start + local_vocab, device=x.device) >= vocab_size
            x = x.masked_fill(padding, float("-inf"))
        # log-sum-exp over the full vocabulary: the global max keeps exp() in range.
        row_max = x.max(dim=-1).values
        if tp_world_size(group) > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        exp = (x - row_max.unsqueeze(-1)).exp()
        local_target = labels - start
        in_shard = (local_target >= 0) & (local_target < local_vocab)
        local_target = local_target.masked_fill(~in_shard, 0)
        target_logit = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) - row_max
        target_logit = target_logit.masked_fill(~in_shard, 0.0)
        # One all-reduce for both sums: [sum exp, target logit] per token.
        sums = torch.stack([exp.sum(dim=-1), target_logit])
        if tp_world_size(group) > 1:
            dist.all_reduce(sums, group=group)
        sum_exp, target_logit = sums[0], sums[1]
        losses = sum_exp.log() - target_logit
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_target, in_shard, weight)
        ctx.logits_dtype = logits.dtype
        return (losses * weight).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local_target, in_shard, weight = ctx.saved_tensors
        # d loss_t / d logit_v = softmax_v - [v == label_t], scaled by the token's weight.
        grad_logits = softmax.scatter_add(-1, local_target.unsqueeze(-1), -in_shard.to(softmax.dtype).unsqueeze(-1))
        grad_logits.mul_((weight * grad).unsqueeze(-1))
        return grad_logits.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_token_loss_sum(
    logits_shard: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor, group: Group,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """`token_loss_sum` on vocab-sharded logits [T, V/tp] without ever forming [T, V] (Megatron).

    The max, the sum of exponentials and the target logit are each reduced over TP (the target
    lives on one rank; the others add 0), in fp32. Every TP rank returns the same scalar, and the
    backward needs no communication: each rank's logit gradient is softmax - onehot on its own
    vocabulary slice. Labels equal to -100 are ignored, as by F.cross_entropy. `vocab_size`: the real
    vocab when the shards hold padding columns past it (masked).
    """
    ignored = labels == -100
    weight = loss_mask.float().masked_fill(ignored, 0.0)
    return _VocabParallelTokenLossSum.apply(logits_shard, labels.masked_fill(ignored, 0), weight, group, vocab_size)
