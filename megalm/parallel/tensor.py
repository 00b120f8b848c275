"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism (Korthikanti et al. 2022).

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
every layer is its unsharded self, so the same code runs in one process.

Sharded parameters carry `full_shape` and `shard_full` (read by `megalm.model.gpt.init_weights`, so
every layout starts from the same weights), `tp_sharded = True` and `tp_replicas` (how many TP ranks
hold this same shard; >1 only for replicated kv rows), which gradient-norm code needs to count every
element of the full model exactly once (see `tp_grad_norm_squared`).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

Group = dist.ProcessGroup | None

# torch >= 2.13 renamed the single-tensor collectives (the old names warn); older torch has only those.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---------------------------------------------------------------------------------------------------
# Group helpers and the raw collectives (fresh output tensors; inputs are never modified)
# ---------------------------------------------------------------------------------------------------


def tp_world_size(group: Group) -> int:
    """Size of the TP group; 1 for None (a single process)."""
    return 1 if group is None else dist.get_world_size(group)


def tp_rank(group: Group) -> int:
    """This process's rank inside the TP group; 0 for None."""
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def _all_gather_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * tp_world_size(group), *x.shape[1:]))
    _all_gather_single(out, x, group=group)
    return out


def _reduce_scatter_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    size = tp_world_size(group)
    if x.shape[0] % size:
        raise ValueError(f"sequence parallelism needs the token count ({x.shape[0]}) to be a multiple of tp={size}; "
                         "pad the batch with megalm.parallel.parallelize.pad_for_sequence_parallel")
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    _reduce_scatter_single(out, x, group=group)
    return out


def _own_chunk_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    size = tp_world_size(group)
    if x.shape[0] % size:
        raise ValueError(f"sequence parallelism needs the token count ({x.shape[0]}) to be a multiple of tp={size}; "
                         "pad the batch with megalm.parallel.parallelize.pad_for_sequence_parallel")
    return x.chunk(size, dim=0)[tp_rank(group)].contiguous()


# ---------------------------------------------------------------------------------------------------
# Conjugate communication functions
# ---------------------------------------------------------------------------------------------------


def _conjugate(name: str, forward: Callable, backward: Callable) -> type[torch.autograd.Function]:
    """An autograd function applying `forward(x, group)` and, to the gradient, `backward(grad, group)`."""

    def fwd(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return forward(x, group)

    def bwd(ctx, grad: torch.Tensor):
        return backward(grad, ctx.group), None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


_identity = lambda x, group: x.view_as(x)
#                            forward            backward
_CopyToTP = _conjugate("_CopyToTP", _identity, _all_reduce)
_ReduceFromTP = _conjugate("_ReduceFromTP", _all_reduce, _identity)
_GatherFromSP = _conjugate("_GatherFromSP", _all_gather_dim0, _reduce_scatter_dim0)
_ReduceScatterToSP = _conjugate("_ReduceScatterToSP", _reduce_scatter_dim0, _all_gather_dim0)
_SplitToSP = _conjugate("_SplitToSP", _own_chunk_dim0, _all_gather_dim0)


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Enter the TP region: identity forward; backward all-reduces the gradient.

    Each rank's column-parallel layer gives only the part of dL/dx that flows through its own
    output columns; the full input gradient is their sum over the TP group.
    """
    return x if tp_world_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Leave the TP region: all-reduce the partial sums of a row-parallel layer; backward identity
    (every rank needs the same, full output gradient, which it already has)."""
    return x if tp_world_size(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_sp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Enter the TP region under SP: all-gather the sequence shards [T/tp, ...] -> [T, ...].

    Backward reduce-scatters: the full-sequence gradient is a partial sum on each rank (its own
    heads / columns), and each rank keeps the summed gradient of its own tokens.
    """
    return x if tp_world_size(group) == 1 else _GatherFromSP.apply(x, group)


def reduce_scatter_to_sp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Leave the TP region under SP: sum the partial [T, ...] outputs and keep this rank's tokens
    [T/tp, ...] (half of an all-reduce). Backward all-gathers the gradient of the shards."""
    return x if tp_world_size(group) == 1 else _ReduceScatterToSP.apply(x, group)


def split_to_sp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """A replicated [T, ...] tensor -> this rank's chunk [T/tp, ...] of dim 0 (no communication).

    Backward all-gathers: the replicated producer gets the full gradient on every rank, as it
    would without SP, so its own parameters need no further synchronisation.
    """
    return x if tp_world_size(group) == 1 else _SplitToSP.apply(x, group)


def sync_grad_over_tp(param: torch.Tensor, group: Group) -> torch.Tensor:
    """Weight-side copy_to_tp: use `sync_grad_over_tp(p)` in place of a replicated parameter `p`.

    Under SP a replicated parameter applied to a sequence shard (norm weight/bias, the bias of a
    row-parallel layer) gets a gradient summed over T/tp tokens only; the all-reduce in backward
    makes every rank's .grad the gradient over all T tokens, before it is accumulated.
    """
    return copy_to_tp(param, group)


class _SumGradOverSharers(torch.autograd.Function):
    @staticmethod
    def forward(ctx, param: torch.Tensor, group: Group, start: int, full_rows: int) -> torch.Tensor:
        ctx.group, ctx.start, ctx.full_rows = group, start, full_rows
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows = grad.shape[0]
        full = grad.new_zeros((ctx.full_rows, *grad.shape[1:]))
        full[ctx.start:ctx.start + rows] = grad
        dist.all_reduce(full, group=ctx.group)
        return full[ctx.start:ctx.start + rows].clone(), None, None, None


def sum_grad_over_sharers(param: torch.Tensor, group: Group, start: int, full_rows: int) -> torch.Tensor:
    """Weight-side sync for rows [start, start + len(param)) of a `full_rows`-row weight that several
    TP ranks hold identical copies of (kv heads when tp > num_kv_heads).

    Each holder's gradient covers only its own query heads; the true gradient of those rows is the sum
    over the holders. Backward scatters the local gradient into a zero buffer of the full shape,
    all-reduces it over TP (ranks holding other rows add zeros there) and takes its rows back.
    """
    if tp_world_size(group) == 1:
        return param
    return _SumGradOverSharers.apply(param, group, start, full_rows)


# ---------------------------------------------------------------------------------------------------
# Shard metadata
# ---------------------------------------------------------------------------------------------------


def _rows(start: int, stop: int, full: torch.Tensor) -> torch.Tensor:
    return full[start:stop]


def _cols(start: int, stop: int, full: torch.Tensor) -> torch.Tensor:
    return full[:, start:stop]


def _tag_shard(
    param: torch.Tensor, full_shape: tuple[int, ...], shard_full: Callable[[torch.Tensor], torch.Tensor],
    replicas: int = 1,
) -> None:
    param.full_shape = tuple(full_shape)
    param.shard_full = shard_full
    param.tp_sharded = True
    param.tp_replicas = replicas


class _TPModule(nn.Module, ABC):
    """Base of the sharded layers: re-attaches the shard metadata after `_apply`.

    `model.to_empty(...)` (from the meta device) and some `.to(...)` calls replace Parameter objects,
    dropping Python attributes such as `full_shape`; `init_weights` needs them afterwards.

    `linear_fn(x, weight, bias=None)` computes the layer's local GEMM (F.linear by default). It is
    the one place a caller may swap the GEMM from outside, e.g. to defer weight gradients for
    zero-bubble pipelines (megalm/parallel/weight_grad.py) or to apply a precision recipe.
    """

    linear_fn = staticmethod(F.linear)

    @abstractmethod
    def _tag_parameters(self) -> None:
        """Set `full_shape`, `shard_full`, `tp_sharded` (and `tp_replicas`) on this layer's parameters."""

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._tag_parameters()
        return self


def _new_param(source: torch.Tensor, shard: Callable[[torch.Tensor], torch.Tensor]) -> nn.Parameter:
    """A parameter holding `shard(source)` (a copy; meta stays meta)."""
    with torch.no_grad():
        return nn.Parameter(shard(source.detach()).clone(), requires_grad=source.requires_grad)


# ---------------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------------


class ColumnParallelLinear(_TPModule):
    """y[:, rows_r] = x W[rows_r]^T + b[rows_r]: weight [out/tp, in], output stays sharded.

    The output dimension is cut into tp / replicas contiguous slices; rank r holds slice
    r // replicas. `replicas` > 1 means several consecutive ranks hold the same slice (GQA kv heads
    with tp > num_kv_heads); their weight gradients are summed over those ranks in backward.

    The input must be the full [T, in] activation with a gradient that is summed over TP. By default
    the layer does that itself (copy_to_tp, or gather_from_sp under SP); `input_in_tp_region=True`
    says the caller already did, so that q, k and v (or gate and up) share one collective.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: Group = None,
        sequence_parallel: bool = False,
        input_in_tp_region: bool = False,
        replicas: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        tp = tp_world_size(group)
        if tp % replicas or out_features % (tp // replicas):
            raise ValueError(f"ColumnParallelLinear: out_features={out_features} must split into tp/replicas="
                             f"{tp}/{replicas} slices")
        self.in_features, self.out_features = in_features, out_features
        self.group, self.sequence_parallel, self.input_in_tp_region = group, sequence_parallel, input_in_tp_region
        self.replicas = replicas
        self.local_out = out_features // (tp // replicas)
        self.start = (tp_rank(group) // replicas) * self.local_out
        self.weight = nn.Parameter(torch.empty(self.local_out, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(self.local_out, device=device, dtype=dtype)) if bias else None
        self._tag_parameters()

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Group, **kwargs) -> ColumnParallelLinear:
        """The column-parallel shard of `linear` (its current values are sliced, meta stays meta)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group=group,
                    device="meta", **kwargs)
        layer.weight = _new_param(linear.weight, layer.weight.shard_full)
        if linear.bias is not None:
            layer.bias = _new_param(linear.bias, layer.bias.shard_full)
        layer._tag_parameters()
        return layer

    def _tag_parameters(self) -> None:
        shard = functools.partial(_rows, self.start, self.start + self.local_out)
        _tag_shard(self.weight, (self.out_features, self.in_features), shard, self.replicas)
        if self.bias is not None:
            _tag_shard(self.bias, (self.out_features,), shard, self.replicas)

    def _synced(self, param: torch.Tensor) -> torch.Tensor:
        if self.replicas == 1:
            return param
        return sum_grad_over_sharers(param, self.group, self.start, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_in_tp_region:
            x = gather_from_sp(x, self.group) if self.sequence_parallel else copy_to_tp(x, self.group)
        bias = None if self.bias is None else self._synced(self.bias)
        return self.linear_fn(x, self._synced(self.weight), bias)

    def extra_repr(self) -> str:
        entry = "caller" if self.input_in_tp_region else "gather_from_sp" if self.sequence_parallel else "copy_to_tp"
        return (f"in={self.in_features}, out={self.out_features} (local {self.local_out} from "
                f"{self.start}), bias={self.bias is not None}, replicas={self.replicas}, input_entry={entry}")


class RowParallelLinear(_TPModule):
    """y = sum_r x_r W[:, cols_r]^T + b: weight [out, in/tp], input sharded along its last dimension.

    The partial products are all-reduced (reduce-scattered along tokens under SP); the bias is
    replicated and added once, after the reduction. Under SP the bias sees only this rank's tokens,
    so its gradient is all-reduced over TP in backward (sync_grad_over_tp).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: Group = None,
        sequence_parallel: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        tp = tp_world_size(group)
        if in_features % tp:
            raise ValueError(f"RowParallelLinear: in_features={in_features} is not divisible by tp={tp}")
        self.in_features, self.out_features = in_features, out_features
        self.group, self.sequence_parallel = group, sequence_parallel
        self.local_in = in_features // tp
        self.start = tp_rank(group) * self.local_in
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self._tag_parameters()

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Group, **kwargs) -> RowParallelLinear:
        """The row-parallel shard of `linear` (its current values are sliced, meta stays meta)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group=group,
                    device="meta", **kwargs)
        layer.weight = _new_param(linear.weight, layer.weight.shard_full)
        if linear.bias is not None:
            layer.bias = _new_param(linear.bias, lambda full: full)
        layer._tag_parameters()
        return layer

    def _tag_parameters(self) -> None:
        shard = functools.partial(_cols, self.start, self.start + self.local_in)
        _tag_shard(self.weight, (self.out_features, self.in_features), shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.linear_fn(x, self.weight)
        if self.sequence_parallel:
            out = reduce_scatter_to_sp(partial, self.group)
            bias = None if self.bias is None else sync_grad_over_tp(self.bias, self.group)
        else:
            out = reduce_from_tp(partial, self.group)
            bias = self.bias
        return out if bias is None else out + bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {self.local_in} from {self.start}), out={self.out_features}, "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(_TPModule):
    """Embedding table split by vocabulary rows: weight [V/tp, h], rank r holds ids [r V/tp, (r+1) V/tp).

    Each rank looks up the ids in its range and writes zeros for the others; the partial outputs are
    summed over TP (all-reduce, or reduce-scatter into sequence shards under SP, which is how the
    residual stream enters the SP region). With tied embeddings the output head reuses this shard as
    a column-parallel [V/tp, h] weight, giving vocab-sharded logits.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        group: Group = None,
        sequence_parallel: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        tp = tp_world_size(group)
        if num_embeddings % tp:
            raise ValueError(f"VocabParallelEmbedding: vocab {num_embeddings} is not divisible by tp={tp}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.group, self.sequence_parallel = group, sequence_parallel
        self.local_vocab = num_embeddings // tp
        self.start = tp_rank(group) * self.local_vocab
        self.weight = nn.Parameter(torch.empty(self.local_vocab, embedding_dim, device=device, dtype=dtype))
        self._tag_parameters()

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: Group, **kwargs) -> VocabParallelEmbedding:
        """The vocab shard of `embedding` (its current values are sliced, meta stays meta)."""
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group=group, device="meta", **kwargs)
        layer.weight = _new_param(embedding.weight, layer.weight.shard_full)
        layer._tag_parameters()
        return layer

    def _tag_parameters(self) -> None:
        shard = functools.partial(_rows, self.start, self.start + self.local_vocab)
        _tag_shard(self.weight, (self.num_embeddings, self.embedding_dim), shard)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.local_vocab)
        partial = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sp(partial, self.group)
        return reduce_from_tp(partial, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (local {self.local_vocab} from {self.start}), {self.embedding_dim}, "
                f"sequence_parallel={self.sequence_parallel}")


class ParallelNorm(nn.Module):
    """A model norm whose output feeds column-parallel layers: it enters the TP region.

    Without SP the norm runs on the replicated [T, h] stream and its output goes through copy_to_tp.
    Under SP it runs on this rank's [T/tp, h] tokens (the point of SP: norms cost 1/tp), its output
    is all-gathered to [T, h], and its weight/bias gradients, partial over tokens, are all-reduced
    over TP in backward (sync_grad_over_tp).

    The wrapped norm's parameters are registered here under their own names (`weight`, `bias`), so
    parameter names, state dicts and `init_weights` are unchanged; the wrapped module is kept
    unregistered and run with `torch.func.functional_call`, which keeps its math (fp32 statistics)
    the single source of truth.
    """

    def __init__(self, norm: nn.Module, group: Group, sequence_parallel: bool) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self._norm = (norm,)  # a tuple: not a registered submodule (its parameters are ours)
        for name, param in list(norm.named_parameters(recurse=False)):
            self.register_parameter(name, param)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = dict(self.named_parameters(recurse=False))
        if self.sequence_parallel:
            params = {name: sync_grad_over_tp(p, self.group) for name, p in params.items()}
        y = torch.func.functional_call(self._norm[0], params, (x,))
        return gather_from_sp(y, self.group) if self.sequence_parallel else copy_to_tp(y, self.group)

    def extra_repr(self) -> str:
        return f"{self._norm[0]!r}, sequence_parallel={self.sequence_parallel}"


# ---------------------------------------------------------------------------------------------------
# Vocab-parallel cross entropy
# ---------------------------------------------------------------------------------------------------


class _VocabParallelTokenLossSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, group: Group):
        local_vocab = logits.shape[-1]
        start = tp_rank(group) * local_vocab
        x = logits.float()
        # log-sum-exp over the full vocabulary: the global max keeps exp() in range.
        row_max = x.max(dim=-1).values
        if tp_world_size(group) > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        exp = (x - row_max.unsqueeze(-1)).exp()
        local_target = labels - start
        in_shard = (local_target >= 0) & (local_target < local_vocab)
        local_target = local_target.masked_fill(~in_shard, 0)
        target_logit = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) - row_max
        target_logit = target_logit.masked_fill(~in_shard, 0.0)
        # One all-reduce for both sums: [sum exp, target logit] per token.
        sums = torch.stack([exp.sum(dim=-1), target_logit])
        if tp_world_size(group) > 1:
            dist.all_reduce(sums, group=group)
        sum_exp, target_logit = sums[0], sums[1]
        losses = sum_exp.log() - target_logit
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_target, in_shard, weight)
        ctx.logits_dtype = logits.dtype
        return (losses * weight).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local_target, in_shard, weight = ctx.saved_tensors
        # d loss_t / d logit_v = softmax_v - [v == label_t], scaled by the token's weight.
        grad_logits = softmax.scatter_add(-1, local_target.unsqueeze(-1), -in_shard.to(softmax.dtype).unsqueeze(-1))
        grad_logits.mul_((weight * grad).unsqueeze(-1))
        return grad_logits.to(ctx.logits_dtype), None, None, None


def vocab_parallel_token_loss_sum(
    logits_shard: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor, group: Group
) -> torch.Tensor:
    """`token_loss_sum` on vocab-sharded logits [T, V/tp] without ever forming [T, V] (Megatron).

    The max, the sum of exponentials and the target logit are each reduced over TP (the target
    lives on one rank; the others add 0), in fp32. Every TP rank returns the same scalar, and the
    backward needs no communication: each rank's logit gradient is softmax - onehot on its own
    vocabulary slice. Labels equal to -100 are ignored, as by F.cross_entropy.
    """
    ignored = labels == -100
    weight = loss_mask.float().masked_fill(ignored, 0.0)
    return _VocabParallelTokenLossSum.apply(logits_shard, labels.masked_fill(ignored, 0), weight, group)


# ---------------------------------------------------------------------------------------------------
# Gradient norm over TP
# ---------------------------------------------------------------------------------------------------


def tp_norm_share(param: torch.Tensor, group: Group) -> float:
    """The share of this rank's ||grad||^2 that belongs in the full model's squared norm when the
    local sums are then all-reduced over TP: 1 for a shard, 1/tp_replicas for a shard held by
    several ranks (replicated kv rows), 1/tp for a replicated parameter."""
    if getattr(param, "tp_sharded", False):
        return 1.0 / getattr(param, "tp_replicas", 1)
    return 1.0 / tp_world_size(group)


def tp_grad_norm_squared(params: Iterable[torch.Tensor], group: Group,
                         weight: Callable[[torch.Tensor], float] | None = None) -> torch.Tensor:
    """Squared L2 norm of the full (unsharded) model's gradient from this rank's parameters, counting
    every element once: sharded ones summed over TP, replicated ones once. fp32 scalar, same on all
    TP ranks. (Data parallelism needs no further reduction: DP replicas hold identical grads.)
    `weight(param)` replaces `tp_norm_share` as each parameter's share (a caller that also drops
    pipeline copies of a tied weight multiplies it in)."""
    share = weight or (lambda p: tp_norm_share(p, group))
    params = [p for p in params if p.grad is not None]
    device = params[0].grad.device if params else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        w = share(p)
        if w:
            total += p.grad.detach().float().pow(2).sum() * w
    if tp_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total
