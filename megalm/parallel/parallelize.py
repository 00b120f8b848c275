"""Apply tensor (and sequence) parallelism to a plain GPT from outside, TorchTitan style.

The model definition (megalm/model) holds nn.Linear / nn.Embedding and no collectives;
`apply_tensor_parallel` swaps them in place for the layers of megalm/parallel/tensor.py:

    embedding                  VocabParallelEmbedding   (partial lookups summed: all-reduce / reduce-scatter)
    q_proj, k_proj, v_proj     ColumnParallelLinear     (this rank's heads; attention infers heads from widths)
    o_proj                     RowParallelLinear        (all-reduce, or reduce-scatter under SP)
    gate_proj, up_proj         ColumnParallelLinear
    down_proj                  RowParallelLinear
    attention_norm, mlp_norm,  ParallelNorm             (enter the TP region: copy_to_tp, or gather_from_sp
    final_norm                                           under SP, once for q/k/v, gate/up or the head)
    output                     ColumnParallelLinear over the vocabulary -> logits [T, V/tp]
    (tied: the head is F.linear with the VocabParallelEmbedding shard, also [T, V/tp])

Under sequence parallelism the residual stream between the TP regions is this rank's [T/tp, h]
chunk of tokens: the embedding reduce-scatters into it, a learned position embedding (GPT-2) is
computed for all T positions and split to the same chunk (split_to_sp, whose backward all-gathers
so the table gets its full gradient on every rank), norms run on the chunk, and the final norm
gathers [T, h] again for the head. T must then be a multiple of tp: `pad_for_sequence_parallel`.

Hidden dropout (after attention and the MLP) stays where the model puts it:
  * without SP it acts on the replicated [T, h] stream, so every TP rank must draw the same mask:
    give the TP ranks the same torch RNG seed (they then draw identical masks, as Megatron does);
  * under SP each rank drops out its own tokens, so masks differ per rank and the run differs
    from one process with the same seed, as in Megatron. Attention dropout draws per rank for the
    rank's own heads either way (with equal seeds, the masks of heads on different ranks are equal).

Order for the trainer: build the model (CPU or "meta") -> apply_tensor_parallel -> (`to_empty` if meta)
-> init_weights(model, seed); shards are slices of the single-process initial weights.

Context parallelism (`apply_context_parallel`) only rebinds each attention's core op to the ring or
all-to-all version (megalm/parallel/context.py); the batch is zigzag-sharded by the trainer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from megalm.data.batch import PackedBatch
from megalm.model.gpt import GPT
from megalm.parallel.context import context_attention
from megalm.parallel.dims import ParallelMesh
from megalm.parallel.tensor import (
    ColumnParallelLinear,
    Group,
    ParallelNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    split_to_sp,
    vocab_parallel_token_loss_sum,
)
from megalm.training.loss import token_loss_sum

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _check_divisible(model: GPT, tp: int) -> None:
    cfg = model.cfg
    rules = [
        (cfg.num_heads % tp == 0, f"num_heads={cfg.num_heads} is not divisible by tp={tp}"),
        (cfg.num_kv_heads % tp == 0 or tp % cfg.num_kv_heads == 0,
         f"num_kv_heads={cfg.num_kv_heads} and tp={tp}: one must divide the other"),
        (cfg.ffn_hidden_size % tp == 0, f"ffn_hidden_size={cfg.ffn_hidden_size} is not divisible by tp={tp}"),
        (cfg.vocab_size % tp == 0, f"vocab_size={cfg.vocab_size} is not divisible by tp={tp}"),
    ]
    for ok, message in rules:
        if not ok:
            raise ValueError(f"apply_tensor_parallel: {message}")


def _split_output_hook(group: Group, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """Forward hook: a replicated [T, h] output -> this rank's sequence chunk [T/tp, h]."""
    return split_to_sp(output, group)


def apply_tensor_parallel(model: GPT, mesh: ParallelMesh, sequence_parallel: bool) -> None:
    """Shard `model` in place over `mesh.tp_group` (Megatron TP; SP if `sequence_parallel`).

    Works on a model built on CPU (its current values are sliced) or on "meta" (shards stay meta:
    `to_empty` then `init_weights`). With tp == 1 it does nothing. Tolerates a model whose
    `embedding`/`output` were removed (a pipeline stage) and whose `layers` hold a subset.
    """
    tp = mesh.dims.tp
    if tp == 1:
        return
    group, sp = mesh.tp_group, sequence_parallel
    _check_divisible(model, tp)
    if isinstance(getattr(model, "embedding", None), VocabParallelEmbedding):
        raise RuntimeError("apply_tensor_parallel: the model is already tensor-parallel")

    column = functools.partial(ColumnParallelLinear.from_linear, group=group, sequence_parallel=sp,
                               input_in_tp_region=True)
    row = functools.partial(RowParallelLinear.from_linear, group=group, sequence_parallel=sp)
    norm = functools.partial(ParallelNorm, group=group, sequence_parallel=sp)
    # GQA with tp > num_kv_heads: rank r's query heads all read kv head r // (tp / num_kv_heads),
    # so tp / num_kv_heads consecutive ranks hold the same kv rows.
    kv_replicas = max(1, tp // model.cfg.num_kv_heads)

    if getattr(model, "embedding", None) is not None:
        model.embedding = VocabParallelEmbedding.from_embedding(model.embedding, group, sequence_parallel=sp)
    if sp and getattr(model, "position_embedding", None) is not None:
        model.position_embedding.register_forward_hook(functools.partial(_split_output_hook, group))

    for layer in model.layers:
        attention, mlp = layer.attention, layer.mlp
        attention.q_proj = column(attention.q_proj)
        attention.k_proj = column(attention.k_proj, replicas=kv_replicas)
        attention.v_proj = column(attention.v_proj, replicas=kv_replicas)
        attention.o_proj = row(attention.o_proj)
        for name in ("gate_proj", "up_proj"):
            if isinstance(getattr(mlp, name, None), nn.Linear):
                setattr(mlp, name, column(getattr(mlp, name)))
        mlp.down_proj = row(mlp.down_proj)
        layer.attention_norm = norm(layer.attention_norm)
        layer.mlp_norm = norm(layer.mlp_norm)

    if getattr(model, "final_norm", None) is not None:
        model.final_norm = norm(model.final_norm)
    if getattr(model, "output", None) is not None:
        model.output = column(model.output)


def apply_context_parallel(model: GPT, mesh: ParallelMesh, comm: str) -> None:
    """Make every attention layer of `model` (a GPT or a pipeline chunk) attend over this rank's CP ring.

    The layers then expect zigzag shards (`context.shard_batch`) and call `context_attention` with the
    ring's global ranks in cp order; `comm="ring"` passes K/V blocks over the default group (any rank
    list, DESIGN.md joint 4), `comm="a2a"` (Ulysses) needs the fixed cp group. No-op when cp == 1.
    """
    if mesh.dims.cp == 1:
        return
    if comm not in ("ring", "a2a"):
        raise ValueError(f"unknown context-parallel communication {comm!r}; use ring or a2a")
    fn = functools.partial(context_attention, ranks=mesh.cp_ranks, rank_index=mesh.cp_rank,
                           group=mesh.cp_group if comm == "a2a" else None, comm=comm)
    for layer in model.layers:
        layer.attention.attention_fn = fn


def loss_fn_for(mesh: ParallelMesh) -> LossFn:
    """loss(logits, labels, loss_mask) -> summed fp32 token loss for this layout: `token_loss_sum`
    on full logits when tp == 1, else the vocab-parallel loss on [T, V/tp] logits (same value on
    every TP rank)."""
    if mesh.dims.tp == 1:
        return token_loss_sum
    return functools.partial(vocab_parallel_token_loss_sum, group=mesh.tp_group)


def pad_for_sequence_parallel(batch: PackedBatch, tp: int, even: bool = False) -> PackedBatch:
    """Append a padding document so that T is a multiple of `tp` (sequence parallelism splits T).

    The padding tokens form their own document (own cu_seqlens entry, positions from 0), so
    attention never mixes them with real tokens, and carry loss_mask 0, so they change neither
    the loss nor any gradient. Returns `batch` itself when T is already a multiple of `tp`.
    `even=True` keeps the padding document's length even: a zigzag shard (context parallelism) is
    made of 2·c-token segments, and the padding then reads as one more document of c-token chunks,
    padded identically on every CP rank (they all hold the same number of tokens).
    """
    pad = -batch.num_tokens % tp
    if even and pad % 2:  # T is even (2·c segments), so pad is odd only for an odd tp: add tp once
        pad += tp
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
