"""Hierarchical context parallelism (Megatron-LM's `a2a+p2p`): Ulysses all-to-all inside a node, ring attention
across nodes.

A flat ring of d ranks that spans nodes moves every rank's K/V block d−1 times over the NICs: ~3·s·kv_bytes per
rank per layer whatever d is (forward K/V, backward K/V and dK/dV). Seen as r = d/u positions of u ranks each
(u ranks of one node), the ring first trades tokens for heads inside each position with an all-to-all over
NVLink (Jacobs et al. 2023, DeepSpeed-Ulysses): each member then holds the position's whole shard for H/u
heads. Ring attention runs over the r positions, one ring per head group (the members with the same inner
index), each step moving a block u times larger but with u times fewer heads, over r−1 steps instead of d−1:
the NIC traffic falls by u, and each step's attention, u times longer, hides its transfer better. A second
all-to-all returns every member its tokens for all heads.

Layout. `zigzag_chunks(d, index, inner=u)`: position j holds the flat zigzag's chunks j and 2r−1−j of a 2r split,
each cut into u sub-chunks, member i the i-th of both. After the all-to-all the members' tokens, sorted by their
place in the padded stream, are exactly position j's flat zigzag shard over r (`zigzag_layout(u·c, r)`), so the
ring op of ring.py runs unchanged.

The all-to-all is point-to-point (batched isend/irecv between global ranks on the default group), like the ring:
any ordered rank list forms a hierarchical ring, so HDP can give any document one without a communicator per
group (docs/architecture.md, "CP rings over explicit rank lists"). It is a custom op, so compiled blocks trace
through it without a graph break. Written here because no library composes Ulysses with a ring over rank lists
of varlen zigzag shards (TransformerEngine's a2a+p2p needs fixed process groups and its own kernels).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalm import compat
from megalm.model.attention import select_attention_backend, varlen_attention
from megalm.parallel.context.ring import ring_attend, ring_meta
from megalm.parallel.context.zigzag import ZigzagLayout, to_device, zigzag_layout

A2A_TAG = 0x6132


def _post_all_to_all(x: torch.Tensor, ranks: Sequence[int], index: int) -> torch.Tensor:
    """Slot g of `x` [u, ...] goes to ranks[g]; slot m of the result comes from ranks[m] (own slot copied).
    Every send and receive is posted in one batch, so no pair waits on another."""
    peers = [g for g in range(len(ranks)) if g != index]
    received = {g: torch.empty_like(x[g]) for g in peers}
    ops = [op for g in peers for op in (dist.P2POp(dist.isend, x[g].contiguous(), ranks[g], tag=A2A_TAG),
                                        dist.P2POp(dist.irecv, received[g], ranks[g], tag=A2A_TAG))]
    for work in dist.batch_isend_irecv(ops) if ops else ():
        work.wait()
    return torch.stack([x[g] if g == index else received[g] for g in range(len(ranks))])


@torch.library.custom_op("megalm::p2p_all_to_all", mutates_args=())
def _all_to_all_op(x: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    index, *ranks = meta.tolist()
    return _post_all_to_all(x, ranks, index)


@_all_to_all_op.register_fake
def _(x, meta):
    return torch.empty_like(x)


def _all_to_all_backward(ctx, grad):
    # equal slots: the exchange is a permutation that is its own adjoint, so the gradient takes the same way back
    return _all_to_all_op(grad.contiguous(), ctx.meta), None


def _save_meta(ctx, inputs, output) -> None:
    ctx.meta = inputs[1]


_all_to_all_op.register_autograd(_all_to_all_backward, setup_context=_save_meta)


def p2p_all_to_all(x: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """Differentiable all-to-all of the equal slots of x [u, ...] among the ranks of `meta` = int64 [index,
    *ranks] (host): slot g goes to ranks[g], slot m of the result came from ranks[m]."""
    return _all_to_all_op(x.contiguous(), meta)


@dataclass(frozen=True, eq=False)
class HierarchicalRing:
    """What one member of a hierarchical ring needs, made once per micro-batch (outside compiled blocks)."""

    inner: int  # u, ranks per all-to-all group (one node's share of the ring)
    inner_meta: torch.Tensor  # int64 [i, *the u ranks of this position] (host)
    to_position: torch.Tensor  # int64 [u·T_local]: the received tokens in the position shard's order
    from_position: torch.Tensor  # its inverse
    position_layout: ZigzagLayout  # the flat zigzag of this position's shard over the r positions
    position_meta: torch.Tensor | None  # ring_meta of this head group's ring over the positions; None when r == 1

    @classmethod
    def build(cls, layout: ZigzagLayout, ranks: Sequence[int], index: int, device: torch.device | None = None
              ) -> HierarchicalRing:
        """`layout`: the member layout (`zigzag_layout(..., n=d, inner=u)`) of a ring over `ranks` (position-major:
        ranks[j·u + i] is member i of position j); `index`: this rank's place in `ranks`. `device`: where the
        attention runs, given a host `layout` (RingContext.for_shard): built on the host, moved without a sync."""
        u, d = layout.inner, layout.n
        r, (j, i) = d // u, divmod(index, u)
        members = range(j * u, (j + 1) * u)
        where = layout.indices[members.start:members.stop].reshape(-1)  # padded-stream index of every received token
        to_position = torch.argsort(where)
        position = zigzag_layout(layout.chunk_sizes * u, r, layout.chunk_sizes.device)
        from_position = torch.argsort(to_position)
        if device is not None:
            to_position, from_position = (to_device(t, device, True) for t in (to_position, from_position))
            position = position.to(device, non_blocking=True)
        outer = [int(ranks[p * u + i]) for p in range(r)]  # the ring of this rank's head group
        return cls(u, compat.host_tensor([i, *(int(ranks[m]) for m in members)]), to_position,
                   from_position, position, ring_meta(position, outer, j) if r > 1 else None)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str, scale: float | None = None
               ) -> torch.Tensor:
        """Causal attention of this member's tokens q/k/v [T_local, H, D] over the ring's whole documents."""
        u = self.inner
        if q.shape[1] % u or k.shape[1] % u:
            raise ValueError(f"hierarchical CP splits heads over all-to-all groups of {u}, but q has {q.shape[1]} and "
                             f"k/v {k.shape[1]} heads; use cp_comm=ring or a smaller parallel.cp_a2a_size")
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        qp, kp, vp = (self._to_position(t) for t in (q, k, v))
        if self.position_meta is None:  # one position: the shard holds whole documents
            layout = self.position_layout
            local = select_attention_backend(backend, q.device, q.dtype)
            out = varlen_attention(qp, kp, vp, layout.local_cu_seqlens, layout.local_max_seqlen, local, scale=scale)
        else:
            out = ring_attend(qp, kp, vp, self.position_layout, self.position_meta, backend, scale)
        return self._from_position(out, q.shape[0])

    def _to_position(self, t: torch.Tensor) -> torch.Tensor:
        """[T_local, H, D], all heads -> [u·T_local, H/u, D]: the position's tokens, this rank's head group."""
        tokens, heads, dim = t.shape
        slots = t.reshape(tokens, self.inner, heads // self.inner, dim).transpose(0, 1)  # slot g: head group g
        received = p2p_all_to_all(slots, self.inner_meta)  # slot m: member m's tokens, this rank's head group
        return received.reshape(-1, heads // self.inner, dim)[self.to_position.to(t.device)]

    def _from_position(self, out: torch.Tensor, tokens: int) -> torch.Tensor:
        """The inverse of `_to_position`: [u·T_local, H/u, D] -> [T_local, H, D]."""
        _, group_heads, dim = out.shape
        slots = out[self.from_position.to(out.device)].reshape(self.inner, tokens, group_heads, dim)
        received = p2p_all_to_all(slots, self.inner_meta)  # slot g: this rank's tokens, head group g
        return received.transpose(0, 1).reshape(tokens, self.inner * group_heads, dim)
