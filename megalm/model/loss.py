"""Per-token loss: a sum over tokens, normalised once by the token count of the whole global batch.

Averaging per micro-batch would weight a token by 1 / (tokens in its micro-batch), so the gradient
would depend on how the global batch is split over micro-batches, data-parallel ranks or CP shards.
Summing and dividing by the global count makes every split give the same gradient — the property
the parallel equivalence tests (and ByteScale HDP, where ranks run different numbers of micro-batches
of different lengths) rely on.

The cross entropy runs over chunks of tokens, forward and backward (as fused-cross-entropy kernels such as
Liger's do): the fp32 logits, their softmax and its gradient exist for one chunk at a time, never as [T, V] fp32
tensors of the whole micro-batch (824 MB each for 4,096 tokens at a 50k vocab) held from the forward to the
backward. The backward writes each chunk's gradient into one [T, V] buffer in the logits' dtype; what the loss
keeps for the backward is the logits as the head produced them (bf16 under autocast).
"""

from __future__ import annotations

import torch

from megalm.compat import as_function_output

CHUNK_BYTES = 256 * 2**20  # the fp32 logits of one chunk: a quarter GB whatever the vocab


def _chunks(total: int, chunk: int) -> list[slice]:
    return [slice(start, min(start + chunk, total)) for start in range(0, total, chunk)]


def _fp32_logits(logits: torch.Tensor, vocab_size: int | None) -> torch.Tensor:
    """One chunk's logits in fp32, the vocab padding (columns >= vocab_size) at -inf: no probability mass."""
    x = logits.float()
    if vocab_size is not None and vocab_size < x.shape[-1]:
        x[:, vocab_size:] = float("-inf")
    return x


class _ChunkedTokenLossSum(torch.autograd.Function):
    """sum_t weight_t * (logsumexp(logits_t) - logits_t[label_t]), over chunks of tokens."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, vocab_size: int | None,
                chunk: int) -> torch.Tensor:
        loss = torch.zeros((), dtype=torch.float32, device=logits.device)
        for part in _chunks(logits.shape[0], chunk):
            x = _fp32_logits(logits[part], vocab_size)
            target = x.gather(-1, labels[part].unsqueeze(-1)).squeeze(-1)
            loss += ((torch.logsumexp(x, dim=-1) - target) * weight[part]).sum()
        ctx.save_for_backward(logits, labels, weight)
        ctx.vocab_size, ctx.chunk = vocab_size, chunk
        return as_function_output(loss)  # built in place (+=): a compiled loss on torch 2.11 would lose its gradient

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, labels, weight = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        scale = weight * grad
        for part in _chunks(logits.shape[0], ctx.chunk):
            # d loss_t / d logit_v = weight_t * (softmax_v - [v == label_t])
            softmax = torch.softmax(_fp32_logits(logits[part], ctx.vocab_size), dim=-1)
            softmax.scatter_add_(-1, labels[part].unsqueeze(-1), -torch.ones_like(softmax[:, :1]))
            grad_logits[part] = softmax.mul_(scale[part].unsqueeze(-1))
        return grad_logits, None, None, None, None


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
                   vocab_size: int | None = None, chunk_tokens: int | None = None) -> torch.Tensor:
    """Sum of next-token cross entropy over the positions where `loss_mask` is 1, in fp32.

    `vocab_size`: the real vocab when `logits` has padding columns past it (they get no probability
    mass, and so no gradient). `chunk_tokens`: tokens per chunk; None: as many as fit CHUNK_BYTES in fp32.
    Labels equal to -100 are ignored, as by F.cross_entropy.
    """
    chunk = chunk_tokens or max(1, CHUNK_BYTES // (4 * logits.shape[-1]))
    ignored = labels == -100
    weight = loss_mask.float().masked_fill(ignored, 0.0)
    return _ChunkedTokenLossSum.apply(logits, labels.masked_fill(ignored, 0), weight, vocab_size, chunk)
