"""Context parallelism: zigzag sharding of packed varlen micro-batches over a ring of N ranks.

Why zigzag: with causal attention, token t attends to t + 1 keys, so cutting a document into N
contiguous pieces leaves the last rank with ~2N-1 times the work of the first. Cutting every
document into 2N equal chunks and giving rank i chunks i and 2N-1-i (Megatron-LM's CP, Brandon et
al. 2023 "Striped Attention" discuss the same imbalance) gives every rank the same work, for every
document of a packed micro-batch independently (docs/architecture.md: the batch is a list of documents).

Padding rule. A document of L tokens is padded AT ITS END to P = ceil(L / 2N) * 2N tokens (L = 0
stays 0), so each of its 2N chunks has c = P / 2N tokens. Padding tokens have token id 0, label 0,
loss_mask 0 and position ids that continue the document (L, L+1, ...). Because attention is causal
and the padding sits after the document's last real token, no real token ever attends to padding;
padding outputs carry loss_mask 0, so no gradient flows from them. With the global token count as
the loss denominator (docs/architecture.md), the loss and every gradient are exactly those of the unpadded batch.

Layout on rank i: for every document d in order, chunk i (c_d tokens) then chunk 2N-1-i (c_d
tokens). The local `cu_seqlens` have ONE segment of 2·c_d tokens per document. The two chunks of a
segment are not contiguous in the document, but since chunk 2N-1-i lies after chunk i, plain causal
attention over the segment is exactly the part of the document's attention that stays on the rank
(step 0 of the ring). The rest comes from the other ranks: see ring.py and ulysses.py.

The attention ops only need a `ZigzagLayout` (N and the chunk size of every document), which the
local `cu_seqlens` alone determine (`layout_from_local_cu_seqlens`; a micro-batch's `RingContext`
carries it, attention.py); a `ZigzagPlan` adds the original document lengths needed to shard and
unshard a batch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from megalm.data.batch import PackedBatch


def _cumsum(lengths: torch.Tensor) -> torch.Tensor:
    """int64 offsets [len + 1] of consecutive segments of `lengths`."""
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])


@dataclass(frozen=True, eq=False)
class ZigzagLayout:
    """Where every token of a zigzag-sharded micro-batch lives; the same on every rank of the ring.

    chunk_sizes int64 [D]: c_d. Derived (int64 unless noted):
      local_cu_seqlens int32 [D+1]: offsets of the 2·c_d-token segments on a rank (front chunk, back chunk);
      half_cu_seqlens int32 [D+1]: offsets of the c_d-token front (or back) chunks once gathered together;
      front, back [T_local / 2]: local indices of the front (chunk i) and back (chunk 2N-1-i) tokens;
      indices [N, T_local]: index in the padded stream of each local token of each rank;
      padded_cu_seqlens int32 [D+1]: offsets of the padded documents (2N·c_d tokens) in the padded stream.
    """

    n: int
    chunk_sizes: torch.Tensor
    local_cu_seqlens: torch.Tensor
    half_cu_seqlens: torch.Tensor
    front: torch.Tensor
    back: torch.Tensor
    indices: torch.Tensor
    padded_cu_seqlens: torch.Tensor
    max_chunk: int
    inner: int = 1  # hierarchical CP (hierarchical.py): ranks per all-to-all group; 1 is the flat zigzag

    @property
    def local_tokens(self) -> int:
        return int(self.front.numel() * 2)

    @property
    def padded_tokens(self) -> int:
        return self.local_tokens * self.n

    @property
    def local_max_seqlen(self) -> int:
        """The longest local segment (2·c_d), what varlen kernels want as max_seqlen."""
        return 2 * self.max_chunk

    @property
    def padded_max_seqlen(self) -> int:
        return 2 * self.n * self.max_chunk

    def to(self, device: torch.device | str, non_blocking: bool = False) -> ZigzagLayout:
        """This layout with its index tensors on `device` (the kernels want them next to q); `non_blocking`: from
        page-locked host memory (`to_device`), as a micro-batch's layout is moved when it is prepared."""
        moved = {f.name: to_device(getattr(self, f.name), device, non_blocking) for f in fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **moved)


def to_device(t: torch.Tensor, device: torch.device | str, non_blocking: bool = False) -> torch.Tensor:
    """t on `device`; `non_blocking` from host to CUDA: pinned first, as the batch is (Parallelism._prepare), since a
    copy from pageable memory synchronises the stream (and waits for the optimizer's kernels of the step before)."""
    device = torch.device(device)
    if non_blocking and t.device.type == "cpu" and device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=non_blocking)


def zigzag_chunks(n: int, index: int, inner: int = 1) -> tuple[int, int]:
    """The two chunks (of 2n) rank `index` of a ring of n holds: i and 2n−1−i for the flat zigzag.

    Hierarchical CP (`inner` = u > 1, hierarchical.py) sees the ring as r = n/u positions of u ranks; position j
    holds the flat zigzag's chunks j and 2r−1−j of a 2r split, each cut in u sub-chunks, one per member: rank
    index = j·u + i holds fine chunks j·u + i and (2r−1−j)·u + i. The front chunk is the flat one; only the order
    of the back sub-chunks differs, so the causal front-before-back segment still holds."""
    if inner < 1 or n % inner:
        raise ValueError(f"a hierarchical ring of {n} ranks cannot have all-to-all groups of {inner}")
    j, i = divmod(index, inner)
    return index, (2 * (n // inner) - 1 - j) * inner + i


def zigzag_layout(chunk_sizes: Sequence[int] | torch.Tensor, n: int,
                  device: torch.device | str = "cpu", inner: int = 1) -> ZigzagLayout:
    """The layout of documents of 2N·c_d padded tokens (c_d = `chunk_sizes`) over a ring of `n` ranks
    (`inner` > 1: a hierarchical ring's chunk order, `zigzag_chunks`)."""
    if n < 1:
        raise ValueError(f"a context-parallel ring needs n >= 1 ranks, got {n}")
    zigzag_chunks(n, 0, inner)  # checks that inner divides n
    chunks = torch.as_tensor(chunk_sizes, dtype=torch.int64).cpu()
    if chunks.dim() != 1 or (chunks < 0).any():
        raise ValueError(f"chunk sizes must be a 1-d tensor of non-negative ints, got {chunk_sizes}")
    local_cu = _cumsum(2 * chunks)
    half_cu = _cumsum(chunks)
    padded_cu = _cumsum(2 * n * chunks)
    local_tokens = int(local_cu[-1])
    # For every local token: its document, its offset j in the 2c segment, front or back chunk, offset in chunk.
    doc = torch.repeat_interleave(torch.arange(len(chunks)), 2 * chunks, output_size=local_tokens)
    j = torch.arange(local_tokens) - local_cu[doc]
    c = chunks[doc]
    is_back = j >= c
    offset = j - is_back * c
    rank = torch.arange(n)[:, None]
    back_chunk = (2 * (n // inner) - 1 - rank // inner) * inner + rank % inner  # 2n-1-rank when inner == 1
    chunk_id = torch.where(is_back[None, :], back_chunk, rank)  # [n, T_local]
    indices = padded_cu[doc][None, :] + chunk_id * c[None, :] + offset[None, :]
    positions = torch.arange(local_tokens)
    to = functools.partial(torch.Tensor.to, device=device)
    return ZigzagLayout(
        n=n, chunk_sizes=to(chunks), local_cu_seqlens=to(local_cu.to(torch.int32)),
        half_cu_seqlens=to(half_cu.to(torch.int32)), front=to(positions[~is_back]), back=to(positions[is_back]),
        indices=to(indices), padded_cu_seqlens=to(padded_cu.to(torch.int32)),
        max_chunk=int(chunks.max()) if len(chunks) else 0, inner=inner,
    )


def layout_from_local_cu_seqlens(cu_seqlens: torch.Tensor, n: int, inner: int = 1) -> ZigzagLayout:
    """The layout of a rank's shard, recovered from its local `cu_seqlens` (segments of 2·c_d).

    Computed once per micro-batch when it is prepared (its `RingContext` keeps it), so no layer
    copies `cu_seqlens` to the host.
    """
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long().cpu()
    if (lengths % 2).any():
        raise ValueError(f"local cu_seqlens {cu_seqlens.tolist()} are not zigzag segments (odd length); "
                         "shard the batch with megalm.parallel.context.zigzag.shard_batch")
    return zigzag_layout(lengths // 2, n, cu_seqlens.device, inner)


@dataclass(frozen=True, eq=False)
class ZigzagPlan:
    """A `ZigzagLayout` plus the original documents: what sharding and unsharding a batch need.

    doc_lengths: L_d; padded_lengths: P_d = 2N·c_d; source int64 [T_pad]: for each token of the
    padded stream its index in the original packed stream, -1 for padding; padded_positions
    int64 [T_pad]: each padded-stream token's position in its (padded) document.
    """

    layout: ZigzagLayout
    doc_lengths: tuple[int, ...]
    padded_lengths: tuple[int, ...]
    source: torch.Tensor
    padded_positions: torch.Tensor

    @property
    def n(self) -> int:
        return self.layout.n

    @property
    def chunk_sizes(self) -> tuple[int, ...]:
        return tuple(self.layout.chunk_sizes.tolist())

    @property
    def num_tokens(self) -> int:
        return sum(self.doc_lengths)

    @property
    def local_tokens(self) -> int:
        return self.layout.local_tokens

    @property
    def local_cu_seqlens(self) -> torch.Tensor:
        return self.layout.local_cu_seqlens

    @property
    def local_max_seqlen(self) -> int:
        return self.layout.local_max_seqlen

    def local_source(self, rank_index: int) -> torch.Tensor:
        """int64 [T_local]: original packed index of each token of rank `rank_index`, -1 for padding."""
        return self.source[self.layout.indices[rank_index]]


def as_layout(plan: ZigzagPlan | ZigzagLayout, device: torch.device | str | None = None) -> ZigzagLayout:
    """The layout of a plan (or the layout itself), moved to `device` if it is elsewhere."""
    layout = plan.layout if isinstance(plan, ZigzagPlan) else plan
    return layout if device is None or layout.front.device == torch.device(device) else layout.to(device)


def zigzag_plan(cu_seqlens: torch.Tensor | Sequence[int], n: int, inner: int = 1) -> ZigzagPlan:
    """Plan the zigzag sharding over `n` ranks of a packed micro-batch with document offsets `cu_seqlens`.

    Each document of L tokens is padded at its end to P = ceil(L / 2n)·2n (see the module docstring)
    and cut into 2n chunks of P / 2n tokens; rank i holds chunks i and 2n-1-i of every document (with
    `inner` > 1, a hierarchical ring's chunks: `zigzag_chunks`).
    """
    cu = torch.as_tensor(cu_seqlens, dtype=torch.int64).cpu()
    if cu.dim() != 1 or len(cu) < 1 or int(cu[0]) != 0 or (cu[1:] < cu[:-1]).any():
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu.tolist()}")
    if n < 1:
        raise ValueError(f"a context-parallel ring needs n >= 1 ranks, got {n}")
    lengths = cu[1:] - cu[:-1]
    chunks = (lengths + 2 * n - 1) // (2 * n)
    device = cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else torch.device("cpu")
    layout = zigzag_layout(chunks, n, device, inner)
    padded = 2 * n * chunks
    padded_cu = _cumsum(padded)
    total = int(padded_cu[-1])
    doc = torch.repeat_interleave(torch.arange(len(lengths)), padded, output_size=total)
    pos = torch.arange(total) - padded_cu[doc]
    source = torch.where(pos < lengths[doc], cu[:-1][doc] + pos, -1)
    return ZigzagPlan(layout=layout, doc_lengths=tuple(lengths.tolist()), padded_lengths=tuple(padded.tolist()),
                      source=source.to(device), padded_positions=pos.to(device))


def shard_tensor(x: torch.Tensor, plan: ZigzagPlan, rank_index: int, pad_value: float = 0) -> torch.Tensor:
    """Rank `rank_index`'s zigzag shard [T_local, ...] of a full packed tensor [T, ...]; padding = `pad_value`.

    Differentiable (a gather), so tests can compare gradients of shards with those of the full tensor.
    """
    if x.shape[0] != plan.num_tokens:
        raise ValueError(f"tensor has {x.shape[0]} tokens, the plan {plan.num_tokens}")
    src = plan.local_source(rank_index).to(x.device)
    real = (src >= 0).view(-1, *([1] * (x.dim() - 1)))
    return torch.where(real, x[src.clamp(min=0)], torch.as_tensor(pad_value, dtype=x.dtype, device=x.device))


def shard_batch(batch: PackedBatch, plan: ZigzagPlan, rank_index: int) -> PackedBatch:
    """This rank's part of a packed micro-batch: its 2 chunks of every document, padding included.

    position_ids are the ORIGINAL positions (RoPE follows them), continued on padding; cu_seqlens
    has one 2·c_d segment per document (see the module docstring); padding has token 0, label 0,
    loss_mask 0. Summed over the ring, loss tokens equal those of `batch`.
    """
    if not 0 <= rank_index < plan.n:
        raise ValueError(f"rank_index {rank_index} is outside the ring of {plan.n}")
    if plan.doc_lengths != tuple((batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()):
        raise ValueError("the plan was made for a batch with different document boundaries")
    idx = plan.layout.indices[rank_index]
    src = plan.source[idx].to(batch.tokens.device)
    real = src >= 0
    at = lambda t: t[src.clamp(min=0)]
    padding_positions = plan.padded_positions[idx].to(batch.position_ids.device)
    layout = plan.layout
    return PackedBatch(
        tokens=torch.where(real, at(batch.tokens), 0),
        labels=torch.where(real, at(batch.labels), 0),
        loss_mask=torch.where(real, at(batch.loss_mask), 0),
        position_ids=torch.where(real, at(batch.position_ids), padding_positions),
        cu_seqlens=layout.local_cu_seqlens.to(batch.cu_seqlens.device),
        max_seqlen=layout.local_max_seqlen,
        doc_lengths=(2 * layout.chunk_sizes).tolist(),
    )


def unshard(local_tensors: Sequence[torch.Tensor], plan: ZigzagPlan) -> torch.Tensor:
    """The full packed tensor [T, ...] in original order from the shards of all ranks (padding dropped)."""
    if len(local_tensors) != plan.n:
        raise ValueError(f"unshard needs the shards of all {plan.n} ranks, got {len(local_tensors)}")
    stacked = torch.cat(list(local_tensors), dim=0)  # token k comes from padded index indices.flatten()[k]
    order = plan.layout.indices.reshape(-1).to(stacked.device)
    padded = stacked[torch.argsort(order)]
    return padded[(plan.source >= 0).to(stacked.device)]
