"""DeepSpeed-Ulysses context parallelism (Jacobs et al. 2023): trade the token shard for a head shard.

Each of the N ranks holds a shard of the tokens and all heads. An all-to-all over heads gives each
rank ALL tokens for Hq/N query heads (and Hkv/N kv heads), attention runs over the full documents
with an ordinary varlen kernel, and a second all-to-all returns every rank its tokens for all heads.
Communication per layer is 4 all-to-alls of T·h/N each, independent of N, but N must divide the
number of kv heads (use ring attention otherwise).

Token sharding is the zigzag one of zigzag.py, so both CP modes consume the same `shard_batch`
output: the gathered tokens are put back in original order (the padded stream, where padding sits
at the end of each document and never reaches a real token) before attention. Unlike the ring,
Ulysses needs a fixed group: `group` must contain exactly the ring's ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megalm.compat import as_function_output
from megalm.model.attention import select_attention_backend, varlen_attention
from megalm.parallel.context.zigzag import ZigzagLayout, ZigzagPlan, as_layout


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of a [N, ...] tensor: slot g goes to group rank g, slot g is filled from it.

    With equal slots this permutation is its own adjoint, so backward is the same all-to-all.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return as_function_output(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Differentiable all-to-all of equal slots along dim 0 (size = group size)."""
    return _AllToAll.apply(x, group)


def _slot_order(ranks: Sequence[int], group: dist.ProcessGroup | None) -> list[int]:
    """order[g] = ring position of the rank with group rank g (the a2a works in group-rank order)."""
    group = group if group is not None else dist.group.WORLD
    members = dist.get_process_group_ranks(group)
    if sorted(members) != sorted(ranks):
        raise ValueError(f"Ulysses needs a group of exactly the ranks {list(ranks)}, got one of {members}")
    order = [0] * len(ranks)
    for position, rank in enumerate(ranks):
        order[dist.get_group_rank(group, rank)] = position
    return order


def _in_order(t: torch.Tensor, order: list[int]) -> torch.Tensor:
    """t[order] along dim 0, and t itself where the group's ranks are in ring order (a static CP group's are): a list
    index is copied from the host, a stream sync on CUDA in every attention layer."""
    return t if order == sorted(order) else t[order]


def _heads_to_tokens(x: torch.Tensor, layout: ZigzagLayout, order: list[int], group) -> torch.Tensor:
    """[T_local, H, D] zigzag shard, all heads -> [T_pad, H/N, D] padded stream, this rank's head group."""
    n, (tokens, heads, dim) = layout.n, x.shape
    slots = _in_order(x.reshape(tokens, n, heads // n, dim).permute(1, 0, 2, 3), order)  # slot g: group order[g]
    received = all_to_all(slots, group)  # slot g: tokens of ring position order[g], my head group
    where = _in_order(layout.indices, order).reshape(-1).to(x.device)  # padded-stream index of each received token
    return received.reshape(n * tokens, heads // n, dim)[torch.argsort(where)]


def _tokens_to_heads(x: torch.Tensor, layout: ZigzagLayout, order: list[int], group) -> torch.Tensor:
    """The inverse of `_heads_to_tokens`: [T_pad, H/N, D] -> [T_local, H, D]."""
    n, (_, heads, dim) = layout.n, x.shape
    where = _in_order(layout.indices, order).to(x.device)  # [N, T_local]
    received = all_to_all(x[where], group)  # slot g: my tokens, head group order[g]
    inverse = sorted(range(n), key=order.__getitem__)  # (a permutation's inverse, on the host)
    return _in_order(received, inverse).permute(1, 0, 2, 3).reshape(where.shape[1], n * heads, dim)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: ZigzagPlan | ZigzagLayout,
    ranks: Sequence[int],
    rank_index: int,
    group: dist.ProcessGroup | None = None,
    backend: str = "auto",
    dropout_p: float = 0.0,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's zigzag shard via head all-to-alls; same contract as ring_attention, and a
    sliding `window` (each rank attends whole documents of its heads).

    q [T_local, Hq, D], k/v [T_local, Hkv, D]; `group` holds exactly `ranks` (default WORLD), and N
    must divide Hq and Hkv. Returns [T_local, Hq, D].
    """
    layout, n = as_layout(plan, q.device), len(ranks)
    if n != layout.n or not 0 <= rank_index < n:
        raise ValueError(f"ranks {list(ranks)} / rank_index {rank_index} do not match the plan's ring of {layout.n}")
    if q.shape[0] != layout.local_tokens:
        raise ValueError(f"q has {q.shape[0]} tokens, the plan {layout.local_tokens} per rank")
    resolved = select_attention_backend(backend, q.device, q.dtype, dropout=dropout_p > 0.0, window=window is not None)
    if n == 1:
        return varlen_attention(q, k, v, layout.local_cu_seqlens, layout.local_max_seqlen, resolved, dropout_p,
                                scale, window)
    if q.shape[1] % n or k.shape[1] % n:
        raise ValueError(f"Ulysses over {n} ranks splits heads, but q has {q.shape[1]} and k/v {k.shape[1]} heads; "
                         "use cp_comm=ring or a cp that divides the kv heads")
    if dist.get_rank() != ranks[rank_index]:
        raise ValueError(f"this is global rank {dist.get_rank()}, but ranks[{rank_index}] = {ranks[rank_index]}")
    order = _slot_order(ranks, group)
    q_full, k_full, v_full = (_heads_to_tokens(t, layout, order, group) for t in (q, k, v))
    out = varlen_attention(q_full, k_full, v_full, layout.padded_cu_seqlens, layout.padded_max_seqlen, resolved,
                           dropout_p, scale, window)
    return _tokens_to_heads(out, layout, order, group)
