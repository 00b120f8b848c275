"""The packed variable-length micro-batch: the one batch format every part of megalm consumes.

A micro-batch is a list of documents concatenated into one token stream of T tokens, not a
[B, S] tensor. Document boundaries are kept in `cu_seqlens` (as flash-attn's varlen API wants),
positions restart at 0 in every document, and attention never crosses a boundary. A fixed-length
[B, S] batch is the special case of B documents of length S.

A `Sample` is one training sequence of n + 1 tokens (inputs are the first n, labels the last n)
plus the boundaries of the documents it contains. A label that crosses a document boundary (the
token after a document's last token belongs to the next document) is masked out of the loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class Sample:
    """One training sequence: `tokens` holds n + 1 tokens; `doc_lengths` splits them into documents.

    `doc_lengths` sums to len(tokens). A single document is `doc_lengths == [len(tokens)]`.
    """

    tokens: np.ndarray
    doc_lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if sum(self.doc_lengths) != len(self.tokens):
            raise ValueError(f"doc_lengths sum to {sum(self.doc_lengths)}, tokens has {len(self.tokens)}")
        if len(self.tokens) < 2:
            raise ValueError("a sample needs at least 2 tokens (one input and one label)")

    @property
    def num_inputs(self) -> int:
        return len(self.tokens) - 1

    def num_loss_tokens(self) -> int:
        """Input positions that carry a loss: all but those whose label starts a new document."""
        return self.num_inputs - (len(self.doc_lengths) - 1)


@dataclass
class PackedBatch:
    """A packed micro-batch of T tokens over N documents.

    tokens, labels, position_ids: int64 [T]; loss_mask: float32 [T] (1 where the label counts);
    cu_seqlens: int32 [N + 1], document start offsets in the packed stream, cu_seqlens[-1] == T;
    max_seqlen: the longest document (flash-attn needs it on the host).
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    doc_lengths: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def pin_memory(self) -> PackedBatch:
        """This batch in page-locked host memory (CUDA), so that `.to(cuda, non_blocking=True)` is asynchronous."""
        pin = lambda t: t.pin_memory()
        return PackedBatch(tokens=pin(self.tokens), labels=pin(self.labels), loss_mask=pin(self.loss_mask),
                           position_ids=pin(self.position_ids), cu_seqlens=pin(self.cu_seqlens),
                           max_seqlen=self.max_seqlen, doc_lengths=list(self.doc_lengths))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        move = lambda t: t.to(device, non_blocking=non_blocking)
        return PackedBatch(
            tokens=move(self.tokens),
            labels=move(self.labels),
            loss_mask=move(self.loss_mask),
            position_ids=move(self.position_ids),
            cu_seqlens=move(self.cu_seqlens),
            max_seqlen=self.max_seqlen,
            doc_lengths=list(self.doc_lengths),
        )


def _input_segments(sample: Sample) -> list[int]:
    """Document lengths over the n input positions (the last token is only a label)."""
    lengths = list(sample.doc_lengths)
    lengths[-1] -= 1
    return [n for n in lengths if n > 0]


def pack_samples(samples: list[Sample]) -> PackedBatch:
    """Concatenate samples into one packed micro-batch, keeping every document boundary."""
    if not samples:
        raise ValueError("cannot pack an empty list of samples")
    tokens, labels, mask, positions, doc_lengths = [], [], [], [], []
    for sample in samples:
        seq = np.asarray(sample.tokens, dtype=np.int64)
        tokens.append(seq[:-1])
        labels.append(seq[1:])
        # Document id of each of the n + 1 tokens; a label counts when it is in the input's document.
        doc_id = np.repeat(np.arange(len(sample.doc_lengths)), sample.doc_lengths)
        mask.append((doc_id[:-1] == doc_id[1:]).astype(np.float32))
        segments = _input_segments(sample)
        positions.append(np.concatenate([np.arange(n, dtype=np.int64) for n in segments]))
        doc_lengths.extend(segments)
    cu = np.zeros(len(doc_lengths) + 1, dtype=np.int32)
    np.cumsum(doc_lengths, out=cu[1:])
    return PackedBatch(
        tokens=torch.from_numpy(np.concatenate(tokens)),
        labels=torch.from_numpy(np.concatenate(labels)),
        loss_mask=torch.from_numpy(np.concatenate(mask)),
        position_ids=torch.from_numpy(np.concatenate(positions)),
        cu_seqlens=torch.from_numpy(cu),
        max_seqlen=max(doc_lengths),
        doc_lengths=doc_lengths,
    )


def packed_from_documents(documents: list[torch.Tensor | np.ndarray]) -> PackedBatch:
    """A micro-batch of whole documents, each its own sample (handy for tests and generation)."""
    return pack_samples([Sample(np.asarray(d), (len(d),)) for d in documents])


def pad_to_multiple(batch: PackedBatch, multiple: int, even: bool = False) -> PackedBatch:
    """Append a padding document so that T is a multiple of `multiple` (sequence parallelism splits
    T over tp ranks; Transformer Engine's FP8 GEMMs want T % 16 == 0).

    The padding tokens form their own document (own cu_seqlens entry, positions from 0), so
    attention never mixes them with real tokens, and carry loss_mask 0, so they change neither
    the loss nor any gradient. Returns `batch` itself when T is already a multiple.
    `even=True` keeps the padding document's length even: a zigzag shard (context parallelism) is
    made of 2·c-token segments, and the padding then reads as one more document of c-token chunks,
    padded identically on every CP rank (they all hold the same number of tokens).
    """
    pad = -batch.num_tokens % multiple
    if even and pad % 2:  # T is even (2·c segments), so pad is odd only for an odd multiple: add it once
        pad += multiple
    if pad == 0:
        return batch
    device = batch.tokens.device
    zeros = lambda t: torch.zeros(pad, dtype=t.dtype, device=device)
    total = batch.num_tokens + pad
    return PackedBatch(
        tokens=torch.cat([batch.tokens, zeros(batch.tokens)]),
        labels=torch.cat([batch.labels, zeros(batch.labels)]),
        loss_mask=torch.cat([batch.loss_mask, zeros(batch.loss_mask)]),
        position_ids=torch.cat([batch.position_ids,
                                torch.arange(pad, dtype=batch.position_ids.dtype, device=device)]),
        cu_seqlens=torch.cat([batch.cu_seqlens,
                              torch.tensor([total], dtype=batch.cu_seqlens.dtype, device=batch.cu_seqlens.device)]),
        max_seqlen=max(batch.max_seqlen, pad),
        doc_lengths=[*batch.doc_lengths, pad],
    )
