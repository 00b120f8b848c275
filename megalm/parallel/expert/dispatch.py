"""Expert parallelism: each rank of an EP group holds E/ep of every MoE layer's experts; tokens travel to them.

Per MoE layer and micro-batch (Megatron's all-to-all token dispatcher; GShard, Lepikhin et al. 2020, §2.2):

1. routing is local (megalm/model/moe.py): each rank routes its own tokens over all E experts, and drops what a
   capacity factor drops, so every layout drops the same assignments;
2. the kept assignments are sorted by expert (a stable sort: token order within an expert), which groups them by
   the rank holding the expert, since rank r holds experts [r·E/ep, (r+1)·E/ep);
3. the counts go first: an all-to-all of the [E] per-expert counts tells every rank how many rows it will get from
   each peer for each of its experts, then the step's one host read of this layer (the splits an all-to-all with
   variable sizes needs on the host, NCCL's as gloo's);
4. the rows go by `all_to_all_single` with those splits; arrived grouped by source, then expert, they are sorted by
   expert (stable: source rank, then the source's token order: deterministic), run as one grouped GEMM pair,
   unsorted, and sent back by the reverse all-to-all; the backward runs the same two all-to-alls the other way.

Only device tensors travel (NCCL's rule); the splits are host lists read once, after the counts' exchange. Written
by hand because torch has no expert-parallel dispatcher outside DTensor's experimental ones; the permutation's
determinism and the one host read per layer are what megalm needs of it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor

from megalm.compat import as_function_output
from megalm.model.moe import GroupedExperts, Routing
from megalm.parallel.progress import Progress, note_collective


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with variable splits whose backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup,
                progress: Progress | None) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.progress = (out_splits, in_splits), group, progress
        return as_function_output(_all_to_all(x, out_splits, in_splits, group, progress))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad.contiguous(), in_splits, out_splits, ctx.group, ctx.progress), None, None, None, None


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup,
                progress: Progress | None) -> torch.Tensor:
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    note_collective(progress, "all_to_all (MoE tokens)", len(out_splits))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class AllToAllDispatcher:
    """The MoE layer's dispatcher under expert parallelism (module docstring): `experts` holds this rank's
    `num_experts / ep` experts, those of EP rank `ep_rank`."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int, progress: Progress | None = None) -> None:
        self.group, self.num_experts, self.progress = group, num_experts, progress
        self.ep = dist.get_world_size(group)
        self.num_local = num_experts // self.ep

    def __call__(self, x: torch.Tensor, routing: Routing, experts: GroupedExperts) -> torch.Tensor:
        ep, local = self.ep, self.num_local
        top_k = routing.experts.shape[-1]
        flat = routing.experts.reshape(-1)
        # kept assignments by expert (token order within one); the dropped ones last, never sent
        key = torch.where(routing.kept.reshape(-1), flat, self.num_experts)
        order = torch.argsort(key, stable=True)
        send_counts = routing.counts.round().to(torch.int64)  # [E] kept assignments per expert
        recv_counts = torch.empty_like(send_counts)  # [ep * local]: from each source, for each of my experts
        note_collective(self.progress, "all_to_all (MoE counts)", ep)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        if isinstance(send_counts, FakeTensor):  # the estimator's step (sizes, no data): balanced splits assumed
            send = recv = [flat.numel() // ep] * ep
        else:
            counts = torch.cat([send_counts, recv_counts]).tolist()  # the layer's one host read
            send = [sum(counts[r * local:(r + 1) * local]) for r in range(ep)]
            recv = [sum(counts[self.num_experts + r * local:self.num_experts + (r + 1) * local]) for r in range(ep)]
        sent = order[:sum(send)]
        rows = _AllToAll.apply(x[sent // top_k], recv, send, self.group, self.progress)
        # arrived by source, then expert: sort by expert (stable: by source, then the source's order)
        expert_of_row = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(
            recv_counts, output_size=sum(recv))
        by_expert = torch.argsort(expert_of_row, stable=True)
        y = experts(rows[by_expert], recv_counts.view(ep, local).sum(0))
        y = torch.empty_like(y).index_copy(0, by_expert, y)  # back to arrival order
        back = _AllToAll.apply(y, send, recv, self.group, self.progress)
        return back.new_zeros(flat.numel(), x.shape[-1]).index_copy(0, sent, back)
