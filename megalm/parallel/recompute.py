"""Activation recomputation: trade compute for the memory of saved activations, per pipeline stage.

A pipeline stage holds the activations of every micro-batch in flight: under 1F1B stage r keeps up to
p - r of them, so the first stages are the ones that run out of memory. Recomputation is therefore
chosen per stage (`parallel.recompute=full` for all stages, or one mode per pipeline rank such as
`[full,selective,none,none]`).

- ``full`` (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"): each transformer
  block keeps only its input; its forward runs again in backward. About one extra forward (~33% more
  compute; less by a dense block's down projection, which torch's checkpoint need not run again: it stops at the
  last tensor the backward needs, unless dropout, a GEMM recipe or gradient accumulation fusion saves one after that
  GEMM; in compiled blocks AOT's partitioner runs neither it nor the attention output projection again) for
  activation memory of one [T, h] tensor per layer.
- ``selective`` (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models"): keep the outputs of the matmuls and of attention (costly to recompute), recompute the cheap
  elementwise work between them (norms, RoPE, SwiGLU/GELU, residual adds, dropout masks from the saved
  RNG state) and tensor parallelism's collectives. Built on torch's selective activation checkpointing:
  the policy below decides per op. Under attention dropout the fused attention kernels (GPU) run again too: each
  draws its mask from the default generator, and only a kernel run again advances it as the forward did.
- ``none``: save everything.

Both run through `torch.utils.checkpoint` (non-reentrant), which restores the RNG state for the
recomputation, so dropout draws the same masks and a run with recomputation computes the same
gradients as one without.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from megalm import compat
from megalm.config import RECOMPUTE_MODES as MODES
from megalm.config import recompute_modes as recompute_modes  # re-exported: its users read it here

_aten = torch.ops.aten
# Ops whose outputs `selective` keeps: GEMMs and fused attention (the expensive ones).
SAVED_OPS = {
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default, _aten.linear.default,
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}
SAVED_OPS.update(compat.present_aten_ops(
    ("_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward", "_scaled_mm",
     "_grouped_mm")))  # _grouped_mm: the MoE experts' GEMMs


# Attention kernels registered as custom ops, saved by name: torch's varlen op, flash-attn's internals
# (flash_attn::_flash_attn_varlen_forward ...) and Transformer Engine's; and the GEMMs of a linear in a compiled
# block that run as ops: an FP8/MX recipe's (megalm::recipe_linear, and megalm::fp8_linear whose FP8 casts are in
# the graph: megalm/precision/compiled_linear.py), a zero-bubble layer's (megalm::deferred_fprop:
# megalm/model/deferred_wgrad.py).
SAVED_OP_NAMES = ("varlen_attn", "flash_attn", "fused_attn", "recipe_linear", "fp8_linear", "deferred_fprop",
                  "ring_attention")  # context parallelism's ring (megalm::ring_attention): not run again in backward


# Tensor parallelism's collectives and expert parallelism's all-to-alls, run again in the recompute rather than kept.
# Every TP (EP) rank recomputes the same ops in the same order, so they pair; a c10d collective writes its output in
# place, which torch's selective checkpointing cannot cache (the cached output is seen as mutated: the MoE
# dispatcher's counts all-to-all, kept, sized the recomputed token all-to-all from uninitialised memory); and SP's
# all-gathered [T, h] input is tp times the shard it is gathered from (Megatron gathers it again too).
RECOMPUTED_COLLECTIVES = ("allgather", "allreduce", "reduce_scatter", "alltoall")


def draws_dropout(op, args: tuple, kwargs: dict) -> bool:
    """Whether this call of `op` draws a dropout mask: an argument `dropout_p` > 0 (torch's fused attention kernels,
    flash-attn's, TE's), read by name from the op's schema."""
    arguments = getattr(getattr(op, "_schema", None), "arguments", ())
    for i, argument in enumerate(arguments):
        if argument.name == "dropout_p":
            value = kwargs.get("dropout_p", args[i] if i < len(args) else argument.default_value)
            return isinstance(value, (int, float)) and value > 0
    return False


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    name = str(op)
    if "c10d" in name and any(part in name for part in RECOMPUTED_COLLECTIVES):
        return CheckpointPolicy.PREFER_RECOMPUTE
    if op in SAVED_OPS or "c10d" in name or any(part in name for part in SAVED_OP_NAMES):
        if draws_dropout(op, args, kwargs):
            # An attention kernel drawing its dropout mask from the default generator: kept, the recompute would not
            # run it, so the generator (restored at the block's start) would not advance past its draw, and the
            # hidden dropout after attention would draw another mask than the forward's. Run again, it draws the same.
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE  # a GEMM, an attention kernel, or another collective
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_selective_policy)


def _checkpointed_forward(forward, selective: bool, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    if selective:
        return checkpoint(forward, *args, use_reentrant=False, context_fn=_selective_context, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_recompute(model: nn.Module, mode: str) -> int:
    """Wrap every transformer block of `model` (a GPT or a pipeline chunk) for `mode`.

    Returns the number of blocks wrapped (0 for "none").
    """
    if mode not in MODES:
        raise ValueError(f"recompute mode {mode!r}; expected one of {MODES}")
    if mode == "none":
        return 0
    layers = getattr(model, "layers", [])
    for layer in layers:
        layer.forward = functools.partial(_checkpointed_forward, layer.forward, mode == "selective")
    return len(layers)


def stage_mode(recompute: str | list[str], pp_rank: int, pp: int) -> str:
    """The recompute mode of pipeline rank `pp_rank`: one mode for all, or one per rank."""
    return recompute_modes(recompute, pp)[pp_rank]
