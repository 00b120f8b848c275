"""An MoE router's view of this rank's sequence-parallel tokens, and the hook that gives the layer that view.

Under sequence parallelism the residual stream is this rank's contiguous [T/tp, h] chunk of the micro-batch (or of
its zigzag shard under context parallelism), and an MoE layer routes that chunk: the routed experts run on each
TP rank's own tokens, not on all T tokens on every rank. What the router computes over the whole micro-batch (the
capacity queues, the switch and sequence losses' routed counts: megalm/model/moe.py, `TokenShard`) reads the
whole's choices through `gather`: an all-gather over TP, then whatever the micro-batch's own view gathers (the CP
ring's, megalm/parallel/context/tokens.py).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from megalm.model.moe import MoE, TokenShard, WholeTokens
from megalm.parallel.collectives import group_rank, group_size
from megalm.parallel.progress import Progress
from megalm.parallel.tensor.comm import Group, gather_from_sp


class SequenceChunkTokens:
    """`TokenShard` of this TP rank's `chunk` of `inner`'s local tokens (split in equal contiguous chunks over
    `group`, in rank order)."""

    def __init__(self, inner: TokenShard, chunk: slice, group: Group, progress: Progress | None = None) -> None:
        self.inner, self.chunk, self.group, self.progress = inner, chunk, group, progress
        self.whole_tokens, self.num_docs = inner.whole_tokens, inner.num_docs
        self.real = None if inner.real is None else inner.real[chunk]

    @property
    def local_index(self) -> torch.Tensor:
        return self.inner.local_index[self.chunk]

    @property
    def local_docs(self) -> torch.Tensor:
        return self.inner.local_docs[self.chunk]

    @property
    def whole_docs(self) -> torch.Tensor:
        return self.inner.whole_docs

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every TP rank's rows of `t` [T/tp, ...] in order ([T, ...], the inner view's local rows: SP's own
        all-gather), then the inner view's gather (detached)."""
        return self.inner.gather(gather_from_sp(t.detach(), self.group, self.progress))


def _route_sequence_chunk(group: Group, progress: Progress | None, module: nn.Module,
                          args: tuple) -> tuple:
    """Forward pre-hook of an MoE layer under SP: its `tokens` argument becomes this rank's chunk of them."""
    x, cu_seqlens, *rest = args
    inner = rest[0] if rest else None
    n, rank, local = group_size(group), group_rank(group), x.numel() // x.shape[-1]
    if inner is None:
        inner = WholeTokens(cu_seqlens, local * n)
    chunk = slice(rank * local, (rank + 1) * local)
    return x, cu_seqlens, SequenceChunkTokens(inner, chunk, group, progress)


def route_sequence_chunks(model: nn.Module, group: Group, progress: Progress | None = None) -> None:
    """Give every MoE layer of `model` its TP rank's sequence chunk as its tokens (apply_tensor_parallel, SP)."""
    hook = functools.partial(_route_sequence_chunk, group, progress)
    for module in model.modules():
        if isinstance(module, MoE):
            module.register_forward_pre_hook(hook)
