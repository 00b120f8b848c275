"""The communication of tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism
(Korthikanti et al. 2022), as pairs of conjugate autograd functions.

Tensor parallelism (TP) splits every weight matrix of a block over the `tp` ranks of a TP group:

    column-parallel  Y_r = X A_r        A split by output rows: each rank computes some heads / ffn units
    row-parallel     Y = sum_r X_r B_r  B split by input columns: partial sums, reduced over TP

so attention and the MLP each need one reduction in the forward pass (after the row-parallel layer)
and one in the backward pass (of the input gradient of the column-parallel layers). The conjugate
pairs below make that explicit: a function and its backward are each other's transpose.

    copy_to_tp            fwd identity            bwd all-reduce       (enter the TP region)
    reduce_from_tp        fwd all-reduce          bwd identity         (leave it)

Sequence parallelism (SP) notices that between two TP regions (norms, dropout, residual adds) every
TP rank holds the same [T, h] activations and does the same work. SP splits that stream along the
token dimension instead, [T/tp, h] per rank, and replaces each all-reduce by a reduce-scatter plus an
all-gather of the same total volume, so it costs no extra communication and saves (tp-1)/tp of
those activations:

    gather_from_sp        fwd all-gather dim 0    bwd reduce-scatter   (enter the TP region under SP)
    reduce_scatter_to_sp  fwd reduce-scatter      bwd all-gather       (leave it under SP)
    split_to_sp           fwd keep own chunk      bwd all-gather       (replicated -> sequence shard)

Every TP gradient synchronisation happens inside autograd: after backward, each parameter's .grad is
already the gradient of its local shard or replica, so data-parallel hooks (post-accumulate-grad)
see final gradients and nothing needs calling afterwards. Two weight-side functions do the cases
where a replicated parameter saw only part of the work:
    sync_grad_over_tp        replicated params fed by a sequence shard under SP (norms, row bias)
    sum_grad_over_sharers    kv rows held by several ranks (GQA with tp > num_kv_heads)

Every group argument may be None or a group of size 1: then every function here is the identity and
every layer is its unsharded self, so the same code runs in one process. The sharded layers that use
them are in layers.py. `progress` (the mesh's `Progress`, carried by each layer) records the collective a rank
enters, for the hang watchdog's report.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megalm.compat import as_function_output
from megalm.parallel.collectives import all_gather_flat, group_rank, group_size, reduce_scatter_flat
from megalm.parallel.progress import Progress, note_collective

Group = dist.ProcessGroup | None



# ---------------------------------------------------------------------------------------------------
# Group helpers and the raw collectives (fresh output tensors; inputs are left alone, but by an in-place all-reduce)
# ---------------------------------------------------------------------------------------------------


tp_world_size = group_size  # ranks of the TP group; 1 for None (a single process)
tp_rank = group_rank  # this process's rank inside the TP group; 0 for None


class Pending:
    """A collective in flight (Megatron's async tensor-parallel communication): `wait()` returns its result once the
    collective is done (on NCCL: once the compute stream waits for it, with no host sync). `work` None: it ran
    synchronously (asked so, as the forward's gather is, or inside a compiled graph, where dynamo traces the
    collective as a functional one)."""

    def __init__(self, out: torch.Tensor, work: dist.Work | None = None) -> None:
        self.out, self.work = out, work

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.out


def _in_flight() -> bool:
    """Whether a collective may be left in flight: eager only (dynamo traces a synchronous collective)."""
    return not torch.compiler.is_compiling()


def _launch(collective: Callable[..., dist.Work | None], *tensors: torch.Tensor, group: Group,
            in_flight: bool) -> dist.Work | None:
    """Call `collective(*tensors, group=group)`: left in flight (its work handle returned) where `in_flight` asks and
    `_in_flight` allows, else synchronously, with no `async_op` argument (what dynamo's collective remapping hands
    back for one differs by torch release: torch 2.11 returns the output tensor)."""
    if in_flight and _in_flight():
        return collective(*tensors, group=group, async_op=True)
    collective(*tensors, group=group)
    return None


def start_all_reduce(x: torch.Tensor, group: Group, progress: Progress | None, *, in_place: bool = False,
                     in_flight: bool = True) -> Pending:
    """Sum `x` over `group` into what `wait()` returns: with `in_place`, `x` itself where it is contiguous (the
    caller hands it over), else a copy."""
    out = x.contiguous() if in_place else x.contiguous().clone()
    note_collective(progress, "TP all_reduce", tp_world_size(group))
    return Pending(out, _launch(dist.all_reduce, out, group=group, in_flight=in_flight))


def start_all_gather_dim0(x: torch.Tensor, group: Group, progress: Progress | None, *,
                          in_flight: bool = True) -> Pending:
    """[T/tp, ...] shards -> [T, ...], rank order along dim 0."""
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * tp_world_size(group), *x.shape[1:]))
    note_collective(progress, "TP all_gather", tp_world_size(group))
    return Pending(out, _launch(all_gather_flat, out, x, group=group, in_flight=in_flight))


def start_reduce_scatter_dim0(x: torch.Tensor, group: Group, progress: Progress | None, *,
                              in_flight: bool = True) -> Pending:
    """[T, ...] partial sums -> this rank's summed [T/tp, ...] chunk."""
    size = _sp_shards(x, group)
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    note_collective(progress, "TP reduce_scatter", size)
    return Pending(out, _launch(reduce_scatter_flat, out, x, group=group, in_flight=in_flight))


def _all_reduce(x: torch.Tensor, group: Group, progress: Progress | None) -> torch.Tensor:
    return start_all_reduce(x, group, progress, in_flight=False).out


def _all_gather_dim0(x: torch.Tensor, group: Group, progress: Progress | None) -> torch.Tensor:
    return start_all_gather_dim0(x, group, progress, in_flight=False).out


def _sp_shards(x: torch.Tensor, group: Group) -> int:
    """The number of sequence shards of `x` along tokens (tp), refusing a token count they do not divide."""
    size = tp_world_size(group)
    if x.shape[0] % size:
        raise ValueError(f"sequence parallelism needs the token count ({x.shape[0]}) to be a multiple of tp={size}; "
                         "pad the batch with megalm.data.batch.pad_to_multiple")
    return size


def _reduce_scatter_dim0(x: torch.Tensor, group: Group, progress: Progress | None) -> torch.Tensor:
    return start_reduce_scatter_dim0(x, group, progress, in_flight=False).out


def _own_chunk_dim0(x: torch.Tensor, group: Group, progress: Progress | None) -> torch.Tensor:
    return x.chunk(_sp_shards(x, group), dim=0)[tp_rank(group)].contiguous()


# ---------------------------------------------------------------------------------------------------
# Conjugate communication functions
# ---------------------------------------------------------------------------------------------------


def _conjugate(name: str, forward: Callable, backward: Callable) -> type[torch.autograd.Function]:
    """An autograd function applying `forward(x, group, progress)` and, to the gradient, `backward(grad, group,
    progress)` (`progress`: where the hang watchdog reads the collective this rank last entered, or None)."""

    def fwd(ctx, x: torch.Tensor, group: Group, progress: Progress | None) -> torch.Tensor:
        ctx.group, ctx.progress = group, progress
        return as_function_output(forward(x, group, progress))

    def bwd(ctx, grad: torch.Tensor):
        return backward(grad, ctx.group, ctx.progress), None, None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


_identity = lambda x, group, progress: x.view_as(x)
#                            forward            backward
_CopyToTP = _conjugate("_CopyToTP", _identity, _all_reduce)
_ReduceFromTP = _conjugate("_ReduceFromTP", _all_reduce, _identity)
_GatherFromSP = _conjugate("_GatherFromSP", _all_gather_dim0, _reduce_scatter_dim0)
_ReduceScatterToSP = _conjugate("_ReduceScatterToSP", _reduce_scatter_dim0, _all_gather_dim0)
_SplitToSP = _conjugate("_SplitToSP", _own_chunk_dim0, _all_gather_dim0)


def copy_to_tp(x: torch.Tensor, group: Group, progress: Progress | None = None) -> torch.Tensor:
    """Enter the TP region: identity forward; backward all-reduces the gradient.

    Each rank's column-parallel layer gives only the part of dL/dx that flows through its own
    output columns; the full input gradient is their sum over the TP group.
    """
    return x if tp_world_size(group) == 1 else _CopyToTP.apply(x, group, progress)


def reduce_from_tp(x: torch.Tensor, group: Group, progress: Progress | None = None) -> torch.Tensor:
    """Leave the TP region: all-reduce the partial sums of a row-parallel layer; backward identity
    (every rank needs the same, full output gradient, which it already has)."""
    return x if tp_world_size(group) == 1 else _ReduceFromTP.apply(x, group, progress)


def gather_from_sp(x: torch.Tensor, group: Group, progress: Progress | None = None) -> torch.Tensor:
    """Enter the TP region under SP: all-gather the sequence shards [T/tp, ...] -> [T, ...].

    Backward reduce-scatters: the full-sequence gradient is a partial sum on each rank (its own
    heads / columns), and each rank keeps the summed gradient of its own tokens.
    """
    return x if tp_world_size(group) == 1 else _GatherFromSP.apply(x, group, progress)


def reduce_scatter_to_sp(x: torch.Tensor, group: Group, progress: Progress | None = None) -> torch.Tensor:
    """Leave the TP region under SP: sum the partial [T, ...] outputs and keep this rank's tokens
    [T/tp, ...] (half of an all-reduce). Backward all-gathers the gradient of the shards."""
    return x if tp_world_size(group) == 1 else _ReduceScatterToSP.apply(x, group, progress)


class SequenceGather:
    """The input collectives of a column-parallel linear under SP (megalm.model.linear.InputCollectives): the layer
    keeps its [T/tp, h] input shard for the backward and all-gathers it again there, where `gather_from_sp`
    before the layer would have it keep the gathered [T, h] (Korthikanti et al. 2022, sec. 4.2.2: Megatron's
    sequence-parallel linear). In the backward both run in flight: the re-gather beside dgrad's GEMM, the input
    gradient's reduce-scatter beside wgrad's."""

    shards_input = True  # the layer's input is a shard of the tokens its GEMMs see

    def __init__(self, group: Group, progress: Progress | None = None) -> None:
        self.group, self.progress = group, progress

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return _all_gather_dim0(x, self.group, self.progress)

    def start_gather(self, x: torch.Tensor) -> Pending:
        return start_all_gather_dim0(x, self.group, self.progress)

    def start_scatter(self, dx: torch.Tensor) -> Pending:
        return start_reduce_scatter_dim0(dx, self.group, self.progress)


class InputGradAllReduce:
    """The input collectives of a column-parallel linear under plain TP (megalm.model.linear.InputCollectives): the
    input is whole on every rank (nothing to gather), and its gradient, a partial sum on each (its own output
    columns), is all-reduced in the layer's backward, in flight beside wgrad's GEMM: what `copy_to_tp` before the
    layer does after the layer's whole backward (Megatron's async tensor-parallel all-reduce)."""

    shards_input = False

    def __init__(self, group: Group, progress: Progress | None = None) -> None:
        self.group, self.progress = group, progress

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def start_gather(self, x: torch.Tensor) -> Pending:
        return Pending(x)

    def start_scatter(self, dx: torch.Tensor) -> Pending:
        return start_all_reduce(dx, self.group, self.progress, in_place=True)  # dx is the layer's own


def split_to_sp(x: torch.Tensor, group: Group, progress: Progress | None = None) -> torch.Tensor:
    """A replicated [T, ...] tensor -> this rank's chunk [T/tp, ...] of dim 0 (no communication).

    Backward all-gathers: the replicated producer gets the full gradient on every rank, as it
    would without SP, so its own parameters need no further synchronisation.
    """
    return x if tp_world_size(group) == 1 else _SplitToSP.apply(x, group, progress)


def sync_grad_over_tp(param: torch.Tensor, group: Group, progress: Progress | None = None) -> torch.Tensor:
    """Weight-side copy_to_tp: use `sync_grad_over_tp(p)` in place of a replicated parameter `p`.

    Under SP a replicated parameter applied to a sequence shard (norm weight/bias, the bias of a
    row-parallel layer) gets a gradient summed over T/tp tokens only; the all-reduce in backward
    makes every rank's .grad the gradient over all T tokens, before it is accumulated.
    """
    return copy_to_tp(param, group, progress)


class _SumGradOverSharers(torch.autograd.Function):
    @staticmethod
    def forward(ctx, param: torch.Tensor, group: Group, shared: tuple[tuple[int, int, int, int], ...]) -> torch.Tensor:
        ctx.group, ctx.shared = group, shared
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # every shared piece's full rows, back to back in one buffer: one all-reduce for all of them
        bases = [sum(full_rows for *_, full_rows in ctx.shared[:i]) for i in range(len(ctx.shared))]
        full = grad.new_zeros((sum(full_rows for *_, full_rows in ctx.shared), *grad.shape[1:]))
        for base, (local, rows, start, _) in zip(bases, ctx.shared, strict=True):
            full[base + start:base + start + rows] = grad[local:local + rows]
        dist.all_reduce(full, group=ctx.group)
        out = grad.clone()
        for base, (local, rows, start, _) in zip(bases, ctx.shared, strict=True):
            out[local:local + rows] = full[base + start:base + start + rows]
        return out, None, None


def sum_grad_over_sharers(param: torch.Tensor, group: Group, shared: tuple[tuple[int, int, int, int], ...]
                          ) -> torch.Tensor:
    """Weight-side sync for local rows that several TP ranks hold identical copies of (kv heads when tp >
    num_kv_heads). `shared`: (local start, rows, start in the full part, the full part's rows) per such piece
    (one for a kv projection, two in a fused qkv projection: k and v).

    Each holder's gradient covers only its own query heads; the true gradient of those rows is the sum
    over the holders. Backward scatters each shared piece's local gradient into a zero buffer of the part's
    full shape, all-reduces them over TP in one call (ranks holding other rows add zeros there) and takes
    its rows back; the other rows' gradients pass unchanged.
    """
    if tp_world_size(group) == 1:
        return param
    return _SumGradOverSharers.apply(param, group, tuple(shared))
