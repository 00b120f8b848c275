"""The sharded layers of tensor parallelism: column- and row-parallel linear, vocab-parallel embedding,
and the norm that enters the TP region (Megatron-LM, Shoeybi et al. 2019; SP: Korthikanti et al. 2022).

    column-parallel  Y_r = X A_r        A split by output rows: each rank computes some heads / ffn units
    row-parallel     Y = sum_r X_r B_r  B split by input columns: partial sums, reduced over TP

Hand-written rather than torch's DTensor-based `parallelize_module`: megalm's batches are packed [T, h]
streams of documents whose token count changes every step, GQA needs kv rows replicated over TP
ranks when tp exceeds the kv heads, and every layer here must also run its GEMM through the precision
and weight-gradient hooks (`LinearHooks`, megalm/model/linear.py). The collectives are the conjugate
functions of comm.py, all inside autograd, so after backward every `.grad` is final for its shard.

Each layer declares how its parameters relate to the full model's (`shard_specs`, megalm/model/shard.py):
init draws the full tensor and keeps this rank's slice, checkpoints write each slice once, and the
gradient norm counts every element of the full model once. With a group of None (or of size 1) every
layer is its unsharded self.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from megalm.model.deferred_wgrad import LayerSink
from megalm.model.linear import LinearHooks, linear
from megalm.model.shard import FusedShardSpec, ShardSpec
from megalm.parallel.progress import Progress
from megalm.parallel.tensor.comm import (
    Group,
    InputGradAllReduce,
    SequenceGather,
    copy_to_tp,
    gather_from_sp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    sum_grad_over_sharers,
    sync_grad_over_tp,
    tp_rank,
    tp_world_size,
)


def _spec(parts: tuple[int, ...], replicas: tuple[int, ...], tp: int, rank: int,
          rest: tuple[int, ...]) -> ShardSpec | FusedShardSpec:
    """This rank's slice of each part (of shape (rows, *rest)); one part is a plain ShardSpec."""
    specs = tuple(ShardSpec((rows, *rest), 0, tp // copies, rank // copies, copies)
                  for rows, copies in zip(parts, replicas, strict=True))
    return specs[0] if len(specs) == 1 else FusedShardSpec(specs)


def _take_params(source: nn.Module, layer: nn.Module) -> None:
    """Give `layer` copies of `source`'s own parameters: this rank's slice where `layer.shard_specs`
    declares one, the whole tensor otherwise (meta stays meta); and keep a precision recipe /
    weight-gradient sink already installed on `source`."""
    with torch.no_grad():
        for name, value in source.named_parameters(recurse=False):
            spec = layer.shard_specs.get(name)
            local = spec.shard(value.detach()) if spec is not None else value.detach()
            setattr(layer, name, nn.Parameter(local.clone(), requires_grad=value.requires_grad))
    for hook in ("gemm_recipe", "weight_grad_sink"):
        if hook in source.__dict__:
            value = source.__dict__[hook]
            if isinstance(value, LayerSink):  # its op reads the parameter from its layer: this one
                value = LayerSink(value.sink, layer)
            setattr(layer, hook, value)


class ColumnParallelLinear(LinearHooks, nn.Module):
    """y[:, rows_r] = x W[rows_r]^T + b[rows_r]: weight [out/tp, in], output stays sharded.

    The output dimension is cut into tp / replicas contiguous slices; rank r holds slice
    r // replicas. `replicas` > 1 means several consecutive ranks hold the same slice (GQA kv heads
    with tp > num_kv_heads); their weight gradients are summed over those ranks in backward.
    A fused projection gives `parts` (the output rows of each part, e.g. q, k, v) and one `replicas` per
    part: each part is cut on its own and the rank holds its slice of every part, concatenated
    (`FusedShardSpec`), so the forward splits the local output by width with no communication.

    The input must be the full [T, in] activation with a gradient that is summed over TP. By default
    the layer does that itself, inside its own GEMM function: the all-reduce of the input's gradient
    (`InputGradAllReduce`, in flight beside the weight gradient's GEMM), or under SP the gather of the [T/tp, in]
    shards (`SequenceGather`: the shard is what it keeps for the backward, gathered again there beside the input
    gradient's GEMM); inside a compiled block the collectives are synchronous (the graph's, which inductor does
    not reorder by default) and the plain TP's all-reduce is `copy_to_tp`'s. `input_in_tp_region=True` says the
    caller already did (the output head after the final norm).
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
        replicas: int | tuple[int, ...] = 1,
        parts: tuple[int, ...] | None = None,
        progress: Progress | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        tp = tp_world_size(group)
        parts = parts or (out_features,)
        replicas = (replicas,) * len(parts) if isinstance(replicas, int) else tuple(replicas)
        if sum(parts) != out_features or len(replicas) != len(parts):
            raise ValueError(f"ColumnParallelLinear: parts {parts} (replicas {replicas}) do not make "
                             f"out_features={out_features}")
        for rows, copies in zip(parts, replicas, strict=True):
            if tp % copies or rows % (tp // copies):
                raise ValueError(f"ColumnParallelLinear: {rows} output rows must split into tp/replicas="
                                 f"{tp}/{copies} slices")
        self.in_features, self.out_features = in_features, out_features
        self.group, self.sequence_parallel, self.input_in_tp_region = group, sequence_parallel, input_in_tp_region
        self.progress = progress  # the mesh's record of the collective entered (hang reports)
        self.replicas = replicas
        rank = tp_rank(group)
        self.shard_specs = {"weight": _spec(parts, replicas, tp, rank, (in_features,))}
        if bias:
            self.shard_specs["bias"] = _spec(parts, replicas, tp, rank, ())
        self.local_out = self.shard_specs["weight"].local_shape[0]
        # the local rows that several ranks hold (their gradients summed over the holders): (local start,
        # rows, start in the part, the part's rows)
        pieces = self.shard_specs["weight"].parts
        offsets = itertools.accumulate((piece.length for piece in pieces), initial=0)
        self.shared_rows = tuple((offset, piece.length, piece.start, piece.full_shape[0])
                                 for offset, piece in zip(offsets, pieces, strict=False) if piece.replicas > 1)
        # the input's collectives, run by the GEMM's function: under SP this rank's tokens are gathered (and again
        # in the backward); under plain TP the input's gradient is all-reduced
        entry = not input_in_tp_region and tp > 1
        self.input_comm = (None if not entry else SequenceGather(group, progress) if sequence_parallel else
                           InputGradAllReduce(group, progress))
        self.weight = nn.Parameter(torch.empty(self.local_out, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(self.local_out, device=device, dtype=dtype)) if bias else None

    @classmethod
    def from_linear(cls, source: nn.Linear, group: Group, **kwargs) -> ColumnParallelLinear:
        """The column-parallel shard of `source` (its current values are sliced, meta stays meta)."""
        layer = cls(source.in_features, source.out_features, source.bias is not None, group=group,
                    device="meta", **kwargs)
        _take_params(source, layer)
        return layer

    def _synced(self, param: torch.Tensor) -> torch.Tensor:
        if not self.shared_rows:
            return param
        return sum_grad_over_sharers(param, self.group, self.shared_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        comm = self.input_comm
        if isinstance(comm, InputGradAllReduce) and torch.compiler.is_compiling():
            x, comm = copy_to_tp(x, self.group, self.progress), None  # the graph's all-reduce, as the block's others
        bias = None if self.bias is None else self._synced(self.bias)
        return linear(x, self._synced(self.weight), bias, self.gemm_recipe, self.weight_grad_sink, comm)

    def extra_repr(self) -> str:
        entry = "caller" if self.input_in_tp_region else type(self.input_comm).__name__ if self.input_comm else "none"
        return (f"in={self.in_features}, out={self.out_features} (local {self.local_out}), bias="
                f"{self.bias is not None}, replicas={self.replicas}, input_entry={entry}")


class RowParallelLinear(LinearHooks, nn.Module):
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
        progress: Progress | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        tp = tp_world_size(group)
        if in_features % tp:
            raise ValueError(f"RowParallelLinear: in_features={in_features} is not divisible by tp={tp}")
        self.in_features, self.out_features = in_features, out_features
        self.group, self.sequence_parallel, self.progress = group, sequence_parallel, progress
        self.shard_specs = {"weight": ShardSpec((out_features, in_features), 1, tp, tp_rank(group))}
        self.local_in, self.start = self.shard_specs["weight"].length, self.shard_specs["weight"].start
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None

    @classmethod
    def from_linear(cls, source: nn.Linear, group: Group, **kwargs) -> RowParallelLinear:
        """The row-parallel shard of `source` (its current values are sliced, meta stays meta)."""
        layer = cls(source.in_features, source.out_features, source.bias is not None, group=group,
                    device="meta", **kwargs)
        _take_params(source, layer)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = linear(x, self.weight, None, self.gemm_recipe, self.weight_grad_sink)
        if self.sequence_parallel:
            out = reduce_scatter_to_sp(partial, self.group, self.progress)
            bias = None if self.bias is None else sync_grad_over_tp(self.bias, self.group, self.progress)
        else:
            out = reduce_from_tp(partial, self.group, self.progress)
            bias = self.bias
        return out if bias is None else out + bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {self.local_in} from {self.start}), out={self.out_features}, "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
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
        progress: Progress | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        tp = tp_world_size(group)
        if num_embeddings % tp:
            raise ValueError(f"VocabParallelEmbedding: vocab {num_embeddings} is not divisible by tp={tp}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.group, self.sequence_parallel, self.progress = group, sequence_parallel, progress
        self.shard_specs = {"weight": ShardSpec((num_embeddings, embedding_dim), 0, tp, tp_rank(group))}
        self.local_vocab, self.start = self.shard_specs["weight"].length, self.shard_specs["weight"].start
        self.weight = nn.Parameter(torch.empty(self.local_vocab, embedding_dim, device=device, dtype=dtype))

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: Group, **kwargs) -> VocabParallelEmbedding:
        """The vocab shard of `embedding` (its current values are sliced, meta stays meta)."""
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group=group, device="meta", **kwargs)
        _take_params(embedding, layer)
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.local_vocab)
        partial = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sp(partial, self.group, self.progress)
        return reduce_from_tp(partial, self.group, self.progress)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (local {self.local_vocab} from {self.start}), {self.embedding_dim}, "
                f"sequence_parallel={self.sequence_parallel}")


class ReplicatedOnShard(nn.Module):
    """A module every TP rank holds whole, run on this rank's [T/tp, ...] tokens under SP (an MoE router): its
    parameters' gradients, partial over the tokens, are all-reduced over TP in backward (sync_grad_over_tp).

    The wrapped module's parameters and buffers are registered here under their own names (`weight`, a router's
    `expert_bias`), so parameter names, state dicts and `init_weights` are unchanged; the wrapped module is kept
    unregistered and run with `torch.func.functional_call`, which keeps its math the single source of truth.
    """

    def __init__(self, module: nn.Module, group: Group, sequence_parallel: bool = True,
                 progress: Progress | None = None) -> None:
        super().__init__()
        self.group, self.sequence_parallel, self.progress = group, sequence_parallel, progress
        self._module = (module,)  # a tuple: not a registered submodule (its parameters are ours)
        for name, param in list(module.named_parameters(recurse=False)):
            self.register_parameter(name, param)
        for name, buffer in list(module.named_buffers(recurse=False)):
            self.register_buffer(name, buffer, persistent=name not in module._non_persistent_buffers_set)

    def run_wrapped(self, *args: object) -> torch.Tensor:
        state = dict(self.named_parameters(recurse=False))
        if self.sequence_parallel:
            state = {name: sync_grad_over_tp(p, self.group, self.progress) for name, p in state.items()}
        return torch.func.functional_call(self._module[0], state | dict(self.named_buffers(recurse=False)), args)

    def forward(self, *args: object) -> torch.Tensor:
        return self.run_wrapped(*args)

    def extra_repr(self) -> str:
        return f"{self._module[0]!r}, sequence_parallel={self.sequence_parallel}"


class ParallelNorm(ReplicatedOnShard):
    """A model norm whose output feeds column-parallel layers.

    Without SP the norm runs on the replicated [T, h] stream. Under SP it runs on this rank's [T/tp, h]
    tokens (the point of SP: norms cost 1/tp) and its weight/bias gradients, partial over tokens, are
    all-reduced over TP in backward (`ReplicatedOnShard`). With `enter_tp_region` its output enters the TP
    region here (copy_to_tp, or all-gathered to [T, h] under SP), for a consumer that is not a
    column-parallel layer (the tied output head); otherwise the column-parallel layer after it enters.
    """

    def __init__(self, norm: nn.Module, group: Group, sequence_parallel: bool,
                 progress: Progress | None = None, enter_tp_region: bool = True) -> None:
        super().__init__(norm, group, sequence_parallel, progress)
        self.enter_tp_region = enter_tp_region

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.run_wrapped(x)
        if not self.enter_tp_region:
            return y
        enter = gather_from_sp if self.sequence_parallel else copy_to_tp
        return enter(y, self.group, self.progress)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, enters={self.enter_tp_region}"


class SequenceParallelDropout(nn.Module):
    """Hidden dropout on this rank's [T/tp, h] chunk of the residual stream under SP, drawn as one process draws it:
    the mask of the whole [T, h] stream, from the generator every TP rank seeds alike, of which this rank keeps its
    rows. A mask drawn for the chunk alone would be the same on every rank (token t and t + T/tp dropping the same
    features); Megatron gives each TP rank a stream of its own instead. Drawing the whole mask costs tp times the
    random numbers and a transient fp32 [T, h] tensor per call (and an fp32 [T/tp, h] mask saved for backward, where
    torch's fused kernel saves a bool one), only while dropout is on, and makes an SP run with
    dropout equal one process's (tests/dist/test_trainer_parallel.py). Recomputation draws it again from the restored
    generator state, as it does an unsharded dropout."""

    def __init__(self, p: float, group: Group) -> None:
        super().__init__()
        self.p, self.tp, self.rank = p, tp_world_size(group), tp_rank(group)  # (no group lookups in a traced forward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        rows = x.shape[0]
        # in fp32, whatever x's dtype: kept elements hold 1 / (1 - p) unrounded, as the fused CUDA kernel scales
        # (a bf16 mask would hold 1.109375 for p = 0.1); a bf16 x is multiplied in fp32 and rounded once
        noise = F.dropout(x.new_ones((rows * self.tp, *x.shape[1:]), dtype=torch.float32), self.p)
        return (x * noise.narrow(0, self.rank * rows, rows).clone()).to(x.dtype)  # (a copy: the whole mask is freed)

    def extra_repr(self) -> str:
        return f"p={self.p}, sequence_parallel=True"
