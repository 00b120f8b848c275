"""The squared gradient norm of many tensors in a few kernels, every parallelism's share of the global norm.

`torch._foreach_norm` computes every tensor's norm in one fused launch per device and dtype (what
`torch.nn.utils.clip_grad_norm_` uses), in fp32 for bf16 gradients; a Python loop of `.pow(2).sum()` would launch
three kernels per parameter (hundreds per step) and upcast a full copy of each bf16 gradient first.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch

# A parameter's share of the full model's squared gradient norm: one weight, or (start, end, weight) ranges of its
# flattened elements where parts differ (a fused qkv projection under TP with kv rows replicated)
NormShare = float | tuple[tuple[int, int, float], ...]


def scaled_share(share: NormShare, factor: float) -> NormShare:
    """`share` times `factor` (every range of it)."""
    if not isinstance(share, tuple):
        return share * factor
    return tuple((start, end, weight * factor) for start, end, weight in share)


def share_pairs(flat: torch.Tensor, first: int, share: NormShare) -> list[tuple[torch.Tensor, float]]:
    """(tensor, weight) pairs for `flat`, the parameter's elements [first, first + len(flat)) (a whole flattened
    gradient, or the piece of it in a ZeRO-1 shard), under `share`."""
    if not isinstance(share, tuple):
        return [(flat, share)]
    last = first + flat.numel()
    return [(flat[max(start, first) - first:min(end, last) - first], weight)
            for start, end, weight in share if max(start, first) < min(end, last)]


def weighted_sq_norm(pairs: Iterable[tuple[torch.Tensor, float]], device: torch.device | None) -> torch.Tensor:
    """sum(weight * ||t||^2) over (tensor, weight) pairs, as an fp32 scalar on `device`; pairs of weight 0 are
    skipped. One foreach norm per distinct weight (a layout has a few: 1, 1/tp, 1/replicas), no host sync."""
    by_weight: dict[float, list[torch.Tensor]] = defaultdict(list)
    for tensor, weight in pairs:
        if weight:
            by_weight[float(weight)].append(tensor)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for weight, tensors in by_weight.items():
        norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
        total += torch.stack(norms).square().sum() * weight
    return total
