"""Apply tensor (and sequence) parallelism to a plain GPT from outside, TorchTitan style.

The model definition (megalm/model) holds `Linear` / nn.Embedding and no collectives;
`apply_tensor_parallel` swaps them in place for the layers of megalm/parallel/tensor/layers.py:

    embedding                  VocabParallelEmbedding   (partial lookups summed: all-reduce / reduce-scatter)
    qkv_proj                   ColumnParallelLinear     (parts q, k, v: this rank's heads of each; attention
                                                         infers heads from widths)
    o_proj                     RowParallelLinear        (all-reduce, or reduce-scatter under SP)
    gate_up_proj (up_proj)     ColumnParallelLinear     (parts gate, up: this rank's units of each)
    down_proj                  RowParallelLinear
    attention_norm, mlp_norm   ParallelNorm             (on the [T/tp, h] shard under SP; the GEMM after it
                                                         enters the TP region inside its GEMM function: its
                                                         input's gradient all-reduced, or under SP a gather that
                                                         keeps only the shard for the backward and gathers it
                                                         again there; in the eager backward both in flight
                                                         beside the GEMMs)
    final_norm                 ParallelNorm             (enters the TP region itself: copy_to_tp / gather_from_sp,
                                                         for the output head, tied or not)
    output                     ColumnParallelLinear over the vocabulary -> logits [T, V/tp]
    (tied: the head is F.linear with the VocabParallelEmbedding shard, also [T, V/tp])
    MoE shared_experts         as gate_up_proj / down_proj above
    MoE router, experts        whole on every rank; under SP each rank routes its [T/tp] tokens (tokens.py), the
                               router as ReplicatedOnShard (gradient summed over TP)

Under sequence parallelism the residual stream between the TP regions is this rank's [T/tp, h]
chunk of tokens: the embedding reduce-scatters into it, a learned position embedding (GPT-2) is
computed for all T positions and split to the same chunk (split_to_sp, whose backward all-gathers
so the table gets its full gradient on every rank), norms run on the chunk, and the final norm
gathers [T, h] again for the head. T must then be a multiple of tp: `megalm.data.batch.pad_to_multiple`.

Hidden dropout (after attention and the MLP) stays where the model puts it:
  * without SP it acts on the replicated [T, h] stream, so every TP rank must draw the same mask:
    give the TP ranks the same torch RNG seed (they then draw identical masks, as Megatron does);
  * under SP each rank holds its own tokens: `SequenceParallelDropout` draws the whole stream's mask from that
    shared seed and keeps this rank's rows, so the masks differ per rank as they do in Megatron (which seeds each
    TP rank apart) and the run equals one process's. Attention dropout draws per rank for the
    rank's own heads either way (with equal seeds, the masks of heads on different ranks are equal).

Order (megalm/parallel/parallelism.py): build the model (CPU or "meta") -> apply_tensor_parallel ->
(`to_empty` if meta) -> init_weights(model, seed); shards are slices of the single-process initial
weights (each layer's `shard_specs`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from megalm.config import ModelConfig, moe_layer_ids
from megalm.errors import ConfigError
from megalm.model.fused import part_rows
from megalm.model.loss import TokenLoss
from megalm.model.moe import MoE
from megalm.model.naming import canonical_named_parameters
from megalm.model.shard import FusedShardSpec, ShardSpec, shard_specs
from megalm.parallel.norms import NormShare, share_pairs, weighted_sq_norm
from megalm.parallel.progress import Progress
from megalm.parallel.tensor.comm import Group, split_to_sp, tp_world_size
from megalm.parallel.tensor.layers import (
    ColumnParallelLinear,
    ParallelNorm,
    ReplicatedOnShard,
    RowParallelLinear,
    SequenceParallelDropout,
    VocabParallelEmbedding,
)
from megalm.parallel.tensor.loss import VocabParallelTokenLoss
from megalm.parallel.tensor.tokens import route_sequence_chunks

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def check_tensor_parallel(model: ModelConfig, tp: int) -> None:
    """The model's shape rules for `tp` ranks (config validation and `apply_tensor_parallel` both ask)."""
    if model.num_heads % tp:
        raise ConfigError(f"model.num_heads={model.num_heads} is not divisible by parallel.tp={tp}; "
                          "choose tp among the divisors of num_heads")
    if model.num_kv_heads % tp and tp % model.num_kv_heads:
        raise ConfigError(f"model.num_kv_heads={model.num_kv_heads} and parallel.tp={tp}: one must divide the "
                          "other (kv heads are split over tp, or replicated when tp > kv heads)")
    # (qk_norm with kv heads replicated over tp > kv heads: each replica's k_norm gradient comes from its own query
    # heads, and ParallelNorm sums it over TP as the replicated k rows' gradients are summed: tests/dist)
    moe = model.moe
    split = []  # the MLP widths column/row-parallel layers split: dense blocks', and shared experts' (routed experts
    if len(moe_layer_ids(model)) < model.num_layers:  # are whole on a rank: expert parallelism splits those)
        split.append(("model.ffn_hidden_size", model.ffn_hidden_size))
    if moe.num_experts and moe.num_shared_experts:  # (resolved: resolve_model_defaults derives an unset width)
        split.append(("model.moe.shared_ffn_hidden_size", moe.shared_ffn_hidden_size))
    for key, width in split:
        if width % tp:
            raise ConfigError(f"{key}={width} is not divisible by parallel.tp={tp}; set it to a multiple of {tp}")
    rows = model.padded_vocab_size or model.vocab_size
    if rows % tp:
        raise ConfigError(f"the model's vocab rows ({rows}) are not divisible by parallel.tp={tp}; leave "
                          "model.padded_vocab_size unset so that it is padded for this tp")


def _split_output_hook(group: Group, progress: Progress | None, module: nn.Module, args: tuple,
                       output: torch.Tensor) -> torch.Tensor:
    """Forward hook: a replicated [T, h] output -> this rank's sequence chunk [T/tp, h]."""
    return split_to_sp(output, group, progress)


def apply_tensor_parallel(model: nn.Module, group: Group, sequence_parallel: bool,
                          progress: Progress | None = None) -> None:
    """Shard `model` (a GPT or a pipeline chunk) in place over the TP `group` (Megatron TP; SP if
    `sequence_parallel`).

    Works on a model built on CPU (its current values are sliced) or on "meta" (shards stay meta:
    `to_empty` then `init_weights`). With one TP rank it does nothing. `progress`: the mesh's record that the
    layers note their collectives in (hang reports). Tolerates a chunk whose
    `embedding`/`output` were removed (a pipeline stage) and whose `layers` hold a subset.
    """
    tp = tp_world_size(group)
    if tp == 1:
        return
    sp = sequence_parallel
    check_tensor_parallel(model.cfg, tp)
    if isinstance(getattr(model, "embedding", None), VocabParallelEmbedding):
        raise RuntimeError("apply_tensor_parallel: the model is already tensor-parallel")

    # each block norm feeds one (fused) column-parallel GEMM, which enters the TP region itself (under SP it keeps
    # the [T/tp, h] shard of its input for the backward); the final norm enters it for the head
    column = functools.partial(ColumnParallelLinear.from_linear, group=group, sequence_parallel=sp, progress=progress)
    row = functools.partial(RowParallelLinear.from_linear, group=group, sequence_parallel=sp, progress=progress)
    norm = functools.partial(ParallelNorm, group=group, sequence_parallel=sp, progress=progress, enter_tp_region=False)
    # GQA with tp > num_kv_heads: rank r's query heads all read kv head r // (tp / num_kv_heads),
    # so tp / num_kv_heads consecutive ranks hold the same kv rows.
    kv_replicas = max(1, tp // model.cfg.num_kv_heads)

    if getattr(model, "embedding", None) is not None:
        model.embedding = VocabParallelEmbedding.from_embedding(model.embedding, group, sequence_parallel=sp,
                                                                progress=progress)
    if sp and getattr(model, "position_embedding", None) is not None:
        model.position_embedding.register_forward_hook(functools.partial(_split_output_hook, group, progress))

    qkv = part_rows("attention.qkv_proj", model.cfg)
    for layer in model.layers:
        attention, mlp = layer.attention, layer.mlp
        attention.qkv_proj = column(attention.qkv_proj, parts=qkv, replicas=(1, kv_replicas, kv_replicas))
        attention.o_proj = row(attention.o_proj)
        if attention.q_norm is not None:  # QK-norm: this rank's heads are a shard of all of them, as SP's tokens are
            # of the sequence, so each weight's gradient is partial and is summed over TP in backward
            attention.q_norm, attention.k_norm = (ParallelNorm(n, group, sequence_parallel=True, progress=progress,
                                                               enter_tp_region=False)
                                                  for n in (attention.q_norm, attention.k_norm))
        # an MoE block's routed experts stay whole on every TP rank (expert parallelism splits them,
        # megalm/parallel/expert); without SP each runs the layer on the same tokens, under SP on its own sequence
        # chunk (tokens.py), so the router's gradient is summed over TP here and the experts' by the reducer (their
        # expert-data-parallel group spans TP). Its shared experts split as a dense MLP does.
        if isinstance(mlp, MoE) and sp:
            mlp.router = ReplicatedOnShard(mlp.router, group, progress=progress)
        dense = mlp.shared_experts if isinstance(mlp, MoE) else mlp
        if dense is not None:
            if isinstance(getattr(dense, "gate_up_proj", None), nn.Linear):  # [gate; up], each ffn rows
                ffn = dense.gate_up_proj.out_features // 2
                dense.gate_up_proj = column(dense.gate_up_proj, parts=(ffn, ffn))
            if isinstance(getattr(dense, "up_proj", None), nn.Linear):
                dense.up_proj = column(dense.up_proj)
            dense.down_proj = row(dense.down_proj)
        layer.attention_norm = norm(layer.attention_norm)
        layer.mlp_norm = norm(layer.mlp_norm)
        if sp:  # the residual stream's dropout acts on this rank's chunk: its rows of one process's mask
            layer.dropout = SequenceParallelDropout(layer.dropout.p, group)

    if sp:
        route_sequence_chunks(model, group, progress)
    if getattr(model, "final_norm", None) is not None:
        model.final_norm = norm(model.final_norm, enter_tp_region=True)
    if getattr(model, "output", None) is not None:
        model.output = column(model.output, input_in_tp_region=True)


def loss_fn_for(group: Group, vocab_size: int | None = None) -> LossFn:
    """loss(logits, labels, loss_mask) -> summed fp32 token loss: `TokenLoss` on full logits with one TP rank, else
    the vocab-parallel loss on [T, V/tp] logits (same value on every TP rank); trainer.compile compiles the chunk
    kernels of either. Logits of ids >= `vocab_size` (the vocab padding) are masked."""
    if tp_world_size(group) == 1:
        return TokenLoss(vocab_size)
    return VocabParallelTokenLoss(group, vocab_size)


def tp_norm_share(spec: ShardSpec | FusedShardSpec | None, tp: int, shape: torch.Size) -> NormShare:
    """The share of a parameter's local ||grad||^2 that belongs in the full model's squared norm once
    the local sums are all-reduced over TP: 1 for a shard, 1/replicas for rows several ranks hold
    (replicated kv rows: a whole kv projection, or the k and v rows of a fused qkv one), 1/tp for a
    parameter every TP rank holds whole. A float, or (first element, last element + 1, share) ranges
    of the flattened local tensor where the rows differ."""
    if spec is None or spec.group != "tp":  # whole on every TP rank (an expert slice is split over ep, not tp)
        return 1.0 / tp
    rows = spec.norm_rows
    if len({share for *_, share in rows}) == 1:
        return rows[0][2]
    row = math.prod(shape[1:])
    return tuple((start * row, (start + count) * row, share) for start, count, share in rows)


def tp_grad_norm_squared(model: nn.Module, group: Group) -> torch.Tensor:
    """Squared L2 norm of the full (unsharded) model's gradient from this rank's shards, counting every
    element once; the same on every TP rank."""
    specs, tp = shard_specs(model), tp_world_size(group)
    pairs = [pair for name, p in canonical_named_parameters(model) if p.grad is not None
             for pair in share_pairs(p.grad.reshape(-1), 0, tp_norm_share(specs.get(name), tp, p.shape))]
    total = weighted_sq_norm(pairs, next(model.parameters()).device)
    if tp > 1:
        dist.all_reduce(total, group=group)
    return total
