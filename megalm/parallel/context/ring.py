"""Ring attention over zigzag shards of packed varlen documents, on an explicit ordered rank list.

Liu et al. 2023 "Ring Attention with Blockwise Transformers": each of the N ranks of a ring keeps
its queries and passes its K/V block around the ring; after N steps every query has seen every key,
and the partial softmaxes are merged with their log-sum-exp (Milakov & Gimelshein 2018, the online
softmax flash attention uses):

    lse = log(e^lse_a + e^lse_b),   out = e^(lse_a - lse) · out_a + e^(lse_b - lse) · out_b.

With the zigzag layout (zigzag.py) rank r holds chunks r and 2N-1-r of each document and the block
that arrives at step j comes from rank s = r - j (mod N). Chunk a attends fully to chunks b < a of
its document, causally to b == a, not at all to b > a, so each step is one dense half-block:

    s == r   causal attention of the local segments (front, back) onto themselves;
    s <  r   all local queries onto the front chunks (chunk s) of the block: full;
    s >  r   the back queries (chunk 2N-1-r) onto the whole block: full.

Every rank does the same work each step (Megatron-LM CP / zhuzilin's ring-flash-attention zigzag
variant), and the fully masked quadrants are never computed. Backward (flash-attention's: needs
the saved out and lse) accumulates dQ locally while dK/dV travel with their K/V block and come home
after N hops. Communication is batched isend/irecv between GLOBAL ranks on one group spanning them
(docs/architecture.md, "CP rings over explicit rank lists"): any ordered list of ranks forms a ring,
without a new communicator. Each step's transfer is posted before its compute, so the two overlap.

The per-block kernels (flash, memory-efficient, the reference) are in ring_kernels.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

import torch
import torch.distributed as dist
from torch.utils.flop_counter import register_flop_formula

from megalm import compat
from megalm.model.attention import select_attention_backend, varlen_attention
from megalm.parallel.context.ring_kernels import (
    accumulation_dtype,
    block_backward,
    block_forward,
    block_kernel,
    finite_lse,
)
from megalm.parallel.context.zigzag import ZigzagLayout, ZigzagPlan, as_layout
from megalm.parallel.progress import Progress

KV_TAG, DKV_TAG = 0x6B76, 0x646B  # distinct tags keep the K/V and dK/dV streams apart on one rank pair
# ------------------------------------------------------------------------------------------------ steps


def _step(layout: ZigzagLayout, r: int, s: int):
    """(query rows, key rows, cu_q, cu_k, max_q, max_k, causal) of rank r's step on rank s's block.

    Rows are local index tensors, or None for all rows.
    """
    lc, lm = layout.local_cu_seqlens, layout.local_max_seqlen
    hc, hm = layout.half_cu_seqlens, layout.max_chunk
    if s == r:
        return None, None, lc, lc, lm, lm, True
    if s < r:  # everything here lies after chunk s; nothing here lies after chunk 2N-1-s
        return None, layout.front, lc, hc, lm, hm, False
    return layout.back, None, hc, lc, hm, lm, False  # only chunk 2N-1-r lies after (both chunks of) block s


def _rows(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return t if rows is None else t[rows]


def ring_step_forward(q, k, v, out, lse, layout: ZigzagLayout, r: int, s: int, scale: float,
                      kernel: str = "reference") -> None:
    """Merge rank r's attention onto rank s's K/V block into the running `out` [T, Hq, D] and `lse` [T, Hq]."""
    q_rows, kv_rows, cu_q, cu_k, max_q, max_k, causal = _step(layout, r, s)
    blk_out, blk_lse = block_forward(_rows(q, q_rows), _rows(k, kv_rows), _rows(v, kv_rows), cu_q, cu_k, max_q,
                                     max_k, causal, scale, kernel)
    old_out, old_lse = _rows(out, q_rows), _rows(lse, q_rows)
    new_lse = torch.logaddexp(old_lse, blk_lse)
    safe = finite_lse(new_lse)
    merged = old_out * torch.exp(old_lse - safe)[..., None] + blk_out * torch.exp(blk_lse - safe)[..., None]
    if q_rows is None:
        out.copy_(merged)
        lse.copy_(new_lse)
    else:
        out[q_rows], lse[q_rows] = merged, new_lse


def ring_step_backward(dout, q, k, v, out, lse, dq, dk, dv, layout: ZigzagLayout, r: int, s: int, scale: float,
                       kernel: str = "reference") -> None:
    """Add rank r's gradient contributions for its step on rank s's block into dq (local) and dk/dv (the block's)."""
    q_rows, kv_rows, cu_q, cu_k, max_q, max_k, causal = _step(layout, r, s)
    bq, bk, bv = block_backward(_rows(dout, q_rows), _rows(q, q_rows), _rows(k, kv_rows), _rows(v, kv_rows),
                                _rows(out, q_rows), _rows(lse, q_rows), cu_q, cu_k, max_q, max_k, causal, scale,
                                kernel)
    for acc, grad, rows in ((dq, bq, q_rows), (dk, bk, kv_rows), (dv, bv, kv_rows)):
        if rows is None:
            acc += grad
        else:
            acc.index_add_(0, rows, grad.to(acc.dtype))


# ------------------------------------------------------------------------------------------------- ring


def _post(send: torch.Tensor, recv: torch.Tensor, nxt: int, prv: int, tag: int) -> list:
    """Send `send` to global rank `nxt` and receive `recv` from `prv`, posted together (no deadlock)."""
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, tag=tag),
                                   dist.P2POp(dist.irecv, recv, prv, tag=tag)])


def _wait(works: list | None) -> None:
    for work in works or ():
        work.wait()


def _ring_forward(q, k, v, layout: ZigzagLayout, ranks: tuple[int, ...], r: int, kernel: str, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T, Hq, D] in q's dtype, lse [T, Hq] in the accumulation dtype) of rank r's queries over the ring."""
    n = len(ranks)
    nxt, prv = ranks[(r + 1) % n], ranks[(r - 1) % n]
    acc = accumulation_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=acc, device=q.device)
    kv = torch.stack([k, v]).contiguous()
    for j in range(n):
        works, incoming = None, None
        if j < n - 1:  # post the next block's transfer first: it runs while this step computes
            incoming = torch.empty_like(kv)
            works = _post(kv, incoming, nxt, prv, KV_TAG)
        ring_step_forward(q, kv[0], kv[1], out, lse, layout, r, (r - j) % n, scale, kernel)
        _wait(works)
        kv = incoming if incoming is not None else kv
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, layout: ZigzagLayout, ranks: tuple[int, ...], r: int, kernel: str,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of rank r's shard: dQ stays here, dK/dV travel with their block and come home after N hops."""
    n = len(ranks)
    nxt, prv = ranks[(r + 1) % n], ranks[(r - 1) % n]
    acc = accumulation_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = torch.stack([k, v]).contiguous()
    dkv, dkv_works, dkv_in = None, None, None
    for j in range(n):
        kv_works, kv_in = None, None
        if j < n - 1:
            kv_in = torch.empty_like(kv)
            kv_works = _post(kv, kv_in, nxt, prv, KV_TAG)
        grads = torch.zeros(kv.shape, dtype=acc, device=q.device)  # this rank's share for the held block
        ring_step_backward(dout, q, kv[0], kv[1], out, lse, dq, grads[0], grads[1], layout, r, (r - j) % n, scale,
                           kernel)
        _wait(dkv_works)  # the block's dK/dV accumulated by the ranks it visited before
        dkv = grads if dkv_in is None else grads.add_(dkv_in)
        if n > 1:  # pass it on with the block (it overlaps the next step); after N hops it is home
            dkv_in = torch.empty_like(dkv)
            dkv_works = _post(dkv, dkv_in, nxt, prv, DKV_TAG)
        _wait(kv_works)
        kv = kv_in if kv_in is not None else kv
    if n > 1:
        _wait(dkv_works)
        dkv = dkv_in
    # outputs of one op must not alias each other: dK and dV are copies (of their dtype), not views of one tensor
    return dq.to(q.dtype), dkv[0].to(k.dtype, copy=True), dkv[1].to(v.dtype, copy=True)


# ------------------------------------------------------------------------------------- the ring as one op
#
# The ring runs as one opaque custom op, forward and backward, so that a compiled block traces through it without
# a graph break (dynamo cannot trace batch_isend_irecv, and the kernel choice logs) and without a recompile per
# micro-batch: everything that varies between micro-batches travels in tensors (the layout's index tensors and a
# small host tensor `ring_meta`), never as Python ints that dynamo would specialise on. The ring runs on the
# default group (its ranks are global ranks: any list forms a ring), and the hang record is noted before the op.


def ring_meta(layout: ZigzagLayout, ranks: Sequence[int], rank_index: int) -> torch.Tensor:
    """The ring's host-side description for the op, made once per micro-batch: int64 [max_chunk, index, *ranks]
    on the CPU (read there without a device sync)."""
    return compat.host_tensor([layout.max_chunk, rank_index, *(int(rank) for rank in ranks)])


def ring_note(ranks: Sequence[int]) -> str:
    """What the hang record says while this rank is in the ring's op."""
    return f"CP ring attention over ranks {list(ranks)}"


def _layout_tensors(layout: ZigzagLayout) -> list[torch.Tensor]:
    """The op's `layout` argument: the layout's tensors in field order (chunk_sizes first)."""
    return [getattr(layout, f.name) for f in fields(layout) if f.name not in ("n", "max_chunk", "inner")]


def _unpack(layout_tensors: list[torch.Tensor], meta: torch.Tensor) -> tuple[ZigzagLayout, tuple[int, ...], int]:
    max_chunk, index, *ranks = meta.tolist()
    return ZigzagLayout(len(ranks), *layout_tensors, max_chunk=max_chunk), tuple(ranks), index


@torch.library.custom_op("megalm::ring_attention", mutates_args=())
def _ring_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: list[torch.Tensor], meta: torch.Tensor,
             backend: str, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    layout_, ranks, index = _unpack(layout, meta)
    return _ring_forward(q, k, v, layout_, ranks, index, block_kernel(backend, q.device, q.dtype), scale)


@_ring_op.register_fake
def _(q, k, v, layout, meta, backend, scale):
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=accumulation_dtype(q.dtype))


@torch.library.custom_op("megalm::ring_attention_backward", mutates_args=())
def _ring_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor, layout: list[torch.Tensor], meta: torch.Tensor, backend: str,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    layout_, ranks, index = _unpack(layout, meta)
    return _ring_backward(dout, q, k, v, out, lse, layout_, ranks, index, block_kernel(backend, q.device, q.dtype),
                          scale)


@_ring_backward_op.register_fake
def _(dout, q, k, v, out, lse, layout, meta, backend, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save_for_ring_backward(ctx, inputs, output) -> None:
    q, k, v, layout, meta, ctx.backend, ctx.scale = inputs
    ctx.mark_non_differentiable(output[1])  # lse: the backward's input, not a result anyone differentiates
    ctx.save_for_backward(q, k, v, *output, meta, *layout)


def _ring_op_backward(ctx, dout, _dlse):
    q, k, v, out, lse, meta, *layout = ctx.saved_tensors
    dq, dk, dv = _ring_backward_op(dout, q, k, v, out, lse, layout, meta, ctx.backend, ctx.scale)
    return dq, dk, dv, [None] * len(layout), None, None, None


_ring_op.register_autograd(_ring_op_backward, setup_context=_save_for_ring_backward)


# ------------------------------------------------------------------------------------------ what the ring costs
#
# Under fake tensors (megalm-estimate) the ops run their fake kernels, which compute and send nothing; these say
# what the real ones do, for the cost traces: the FLOPs through torch's own registry of formulas
# (torch.utils.flop_counter, which megalm/measure/op_cost.py reads), the bytes sent for the estimator's link model.


def ring_pairs(chunk_sizes: Sequence[int], n: int) -> int:
    """Query-key pairs one rank's block kernels compute over a ring of n ranks (flash kernels skip what the causal
    mask hides), for documents of 2n·c_d padded tokens (c_d = `chunk_sizes`): per document 2·c² a step (the own
    block's causal (2c)²/2, every other one's c × 2c), 2·n·Σ c_d² in all, 1/n of the documents' causal
    Σ (2n·c_d)²/2."""
    return 2 * n * sum(c * c for c in chunk_sizes)


def ring_sent_bytes(q: torch.Tensor, k: torch.Tensor, n: int, backward: bool) -> int:
    """Bytes one rank sends over a ring of n ranks in the forward (its K/V block, n - 1 hops) or the backward (K/V
    again, and dK/dV in the accumulation dtype, n hops home): `_ring_forward`, `_ring_backward`."""
    if n < 2:
        return 0
    kv = 2 * k.numel() * k.element_size()
    if not backward:
        return (n - 1) * kv
    return (n - 1) * kv + n * 2 * k.numel() * accumulation_dtype(q.dtype).itemsize


def ring_ranks(meta: torch.Tensor) -> list[int]:
    """The ring's global ranks, read from the op's `ring_meta` (a host tensor, real even under fake tensors)."""
    return compat.host_values(meta)[2:]


@register_flop_formula(torch.ops.megalm.ring_attention, get_raw=True)
def _ring_flops(q, k, v, layout, meta, *args, **kwargs) -> float:  # noqa: ANN001 - torch's formula signature
    """QK^T and PV of each pair (`ring_pairs`): 2·(D_qk + D_v) FLOPs a query head. Any torch FLOP counter calls it,
    inductor's over fake tensors too: without the layout's values (fake), 0, never an error."""
    chunk_sizes, meta_values = compat.host_values(layout[0]), compat.host_values(meta)  # layout[0]: chunk_sizes
    if chunk_sizes is None or meta_values is None:
        return 0.0
    pairs = ring_pairs(chunk_sizes, len(meta_values) - 2)
    return 2.0 * pairs * q.shape[1] * (q.shape[-1] + v.shape[-1])


@register_flop_formula(torch.ops.megalm.ring_attention_backward, get_raw=True)
def _ring_backward_flops(dout, q, k, v, out, lse, layout, meta, *args, **kwargs) -> float:  # noqa: ANN001
    """Twice the forward's, as megalm prices every attention backward (measure/op_cost.py)."""
    return 2 * _ring_flops(q, k, v, layout, meta)


def ring_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: ZigzagLayout, meta: torch.Tensor,
                backend: str = "auto", scale: float | None = None) -> torch.Tensor:
    """Ring attention of a shard whose checks are done and whose `ring_meta` is made (a micro-batch's
    `RingContext`): the op alone, what a compiled block traces."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _ring_op(q, k, v, _layout_tensors(layout), meta, backend, scale)[0]


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: ZigzagPlan | ZigzagLayout,
    ranks: Sequence[int],
    rank_index: int,
    backend: str = "auto",
    scale: float | None = None,
    progress: Progress | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's zigzag shard against the whole documents held by the ring.

    q [T_local, Hq, D], k/v [T_local, Hkv, D] (Hkv divides Hq) are the shards of `plan` held by
    ring position `rank_index`; `ranks` are the ring's GLOBAL ranks in order (any N >= 1), passing K/V on the
    default group. Returns [T_local, Hq, D]. N == 1 is plain local varlen attention with no communication.
    `backend` as model.attention_backend. `progress`: where the ring is noted for the hang watchdog (the mesh's).
    """
    layout, ranks, n = as_layout(plan, q.device), tuple(int(rank) for rank in ranks), len(ranks)
    if n != layout.n or len(set(ranks)) != n:
        raise ValueError(f"ranks {list(ranks)} must be {layout.n} distinct ranks (the plan's ring size)")
    if not 0 <= rank_index < n:
        raise ValueError(f"rank_index {rank_index} is outside the ring {list(ranks)}")
    if q.shape[0] != layout.local_tokens or k.shape != v.shape or k.shape[0] != q.shape[0]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match the plan's "
                         f"{layout.local_tokens} local tokens")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of kv heads {k.shape[1]}")
    if n > 1 and dist.is_initialized() and dist.get_rank() != ranks[rank_index]:
        raise ValueError(f"this is global rank {dist.get_rank()}, but ranks[{rank_index}] = {ranks[rank_index]}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if n == 1:  # the local segments are the whole padded documents, in order
        local = select_attention_backend(backend, q.device, q.dtype)
        return varlen_attention(q, k, v, layout.local_cu_seqlens, layout.local_max_seqlen, local, scale=scale)
    if progress is not None:
        progress.note(collective=ring_note(ranks))
    return ring_attend(q, k, v, layout, ring_meta(layout, ranks, rank_index), backend, scale)
