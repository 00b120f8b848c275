"""Per-token loss: a sum over tokens, normalised once by the token count of the whole global batch.

Averaging per micro-batch would weight a token by 1 / (tokens in its micro-batch), so the gradient
would depend on how the global batch is split over micro-batches, data-parallel ranks or CP shards.
Summing and dividing by the global count makes every split give the same gradient — the property
the parallel equivalence tests (and ByteScale HDP, where ranks run different numbers of micro-batches
of different lengths) rely on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
                   vocab_size: int | None = None) -> torch.Tensor:
    """Sum of next-token cross entropy over the positions where `loss_mask` is 1, in fp32.

    `vocab_size`: the real vocab when `logits` has padding columns past it (they get no probability
    mass, and so no gradient).
    """
    if vocab_size is not None and vocab_size < logits.shape[-1]:
        logits = logits[..., :vocab_size]
    losses = F.cross_entropy(logits.float(), labels, reduction="none")
    return (losses * loss_mask).sum()
