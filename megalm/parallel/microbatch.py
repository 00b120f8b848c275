"""What a rank runs in one step: its micro-batches, each ready for the model, and the step's normaliser.

Every parallelism hands the same two types around, so the pipeline runtime, the plain loop, HDP and
context parallelism need not know about each other:

- `LocalMicroBatch`: this rank's part of one micro-batch (whole packed documents, or its zigzag shard
  of documents that a `Ring` of ranks shares), its index in the step (which seeds random rounding) and
  the documents this rank counts for throughput; once prepared (padded, on the compute device) it
  also carries the attention context that says how its attention runs over the ring;
- `StepShare`: the step number, this rank's micro-batches in execution order, and the global
  loss-token count of the step (the loss normaliser, docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from megalm.data.batch import PackedBatch
from megalm.model.attention import AttentionContext, varlen_attention
from megalm.model.moe import WholeTokens


@dataclass(frozen=True)
class Ring:
    """The ordered global ranks a micro-batch's documents are sharded over, and this rank's position."""

    ranks: tuple[int, ...]
    index: int
    inner: int = 1  # > 1: hierarchical, all-to-all in groups of `inner` consecutive ranks (context/hierarchical.py)


@dataclass
class LocalMicroBatch:
    batch: PackedBatch
    index: int  # global index of the micro-batch in its step: seeds random rounding, the same on every layout
    ring: Ring | None = None  # None: the documents are whole on this rank; else `batch` is its zigzag shard
    counted_doc_lengths: list[int] = field(default_factory=list)  # documents this rank counts in tokens/FLOPs
    attention: AttentionContext | None = None  # set when prepared: how attention runs over `ring` (or PaddedContext)
    offload_fraction: float = 0.0  # share of its activations it must offload (HDP selective offload)
    real_tokens: torch.Tensor | None = None  # a zigzag shard's tokens that are not padding (bool [T]); None: all

    @property
    def ring_position(self) -> int:
        """This rank's position on the micro-batch's ring (0 where it is whole here). It seeds random rounding
        beside `index`: the ranks of a ring hold different tokens, so each draws its own noise, as one process
        draws independent noise for every token (a shared stream correlated the ring's rounding errors, and the
        summed weight gradient's error grew with the ring's size)."""
        return 0 if self.ring is None else self.ring.index

    def run(self, model: nn.Module, inputs: torch.Tensor | None = None) -> torch.Tensor:
        """`model` (a GPT or pipeline chunk) on this micro-batch: on its tokens, or on `inputs` (the hidden
        states a previous pipeline stage sent)."""
        b = self.batch
        return model(b.tokens if inputs is None else inputs, b.position_ids, b.cu_seqlens, b.max_seqlen,
                     self.attention)


class PaddedContext:
    """The `AttentionContext` of a micro-batch whose documents are whole on this rank but that the layout padded
    (sequence parallelism's multiple of tp, FP8's of 16): attention runs as without a context, and an MoE router
    is told which tokens are the padding (`moe_tokens`), so they take no place in a capacity queue, a balancing
    loss or the load counts, as under context parallelism (megalm/parallel/context/tokens.py)."""

    def __init__(self, batch: PackedBatch, real_tokens: int, device: torch.device) -> None:
        """`batch`: the padded micro-batch, already on `device` (its cu_seqlens are used as they are)."""
        self.cu_seqlens, self.max_seqlen = batch.cu_seqlens.to(device), batch.max_seqlen
        real = torch.arange(batch.num_tokens, device=device) < real_tokens
        self.moe_tokens = WholeTokens(self.cu_seqlens, batch.num_tokens, real)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str, dropout_p: float = 0.0,
               scale: float | None = None, window: int | None = None) -> torch.Tensor:
        return varlen_attention(q, k, v, self.cu_seqlens, self.max_seqlen, backend, dropout_p=dropout_p, scale=scale,
                                window=window)


@dataclass
class StepShare:
    step: int
    micro_batches: list[LocalMicroBatch]
    # Loss-carrying tokens of the whole global batch: an int, or a 0-dim tensor on the compute device where it
    # came from a collective (reading it would be a host sync).
    loss_tokens: int | torch.Tensor
    host_seconds: float = 0.0  # the host's time making it (Parallelism.share_of_step: read, pack, copy to the device)

    @property
    def normaliser(self) -> int | torch.Tensor:
        """What every token loss of the step is divided by: the loss-token count, at least 1."""
        if isinstance(self.loss_tokens, torch.Tensor):
            return self.loss_tokens.clamp(min=1)
        return max(self.loss_tokens, 1)

    @property
    def counted_doc_lengths(self) -> list[int]:
        return [n for mb in self.micro_batches for n in mb.counted_doc_lengths]
