"""Mixture-of-experts models under megalm's layouts (megalm/model/moe.py holds the layer, free of collectives).

Expert parallelism (`parallel.ep`, dispatch.py): every MoE layer's experts are split over `ep` consecutive ranks of
each dp x cp domain (`ParallelDims.expert_groups`); rank i of an EP group holds experts [i·E/ep, (i+1)·E/ep) of
every MoE layer, declared by a `ShardSpec` over the "ep" group on both expert weights, so `init_weights` draws the
single-process experts and keeps its slice, and checkpoints write each slice once (a DTensor shard on the EP mesh)
and reshard on load to any ep. The layer's dispatcher becomes an all-to-all. Gradients of the expert weights are
summed over the expert-data-parallel group (the ranks holding the same experts: dp x cp / ep of them, and under
sequence parallelism their TP peers too), every other gradient over dp x cp as without experts
(megalm/parallel/data_parallel/reducer.py's per-bucket groups; under FSDP the experts are a unit over that group).

What composes today, each proven against one process on gloo: data parallelism (ZeRO-1 too), expert parallelism
over it, tensor parallelism (the routed experts whole on every TP rank, the shared ones split as an MLP; under
sequence parallelism each TP rank routes its own tokens: megalm/parallel/tensor/tokens.py), context
parallelism (the routers see the whole micro-batch: megalm/parallel/context/tokens.py), pipeline stages (the
balancing losses of a stage that is not the last reach the gradient through the layer's scaler; the load counts
are summed over the stages with the loss), recomputation, activation offload, and HDP for dropless models without
the switch loss (`micro_batch_settings`: HDP cuts micro-batches of its own); under ep > 1 HDP's ranks run in lockstep,
as many micro-batches each, since every EP rank must join each all-to-all (megalm/parallel/hdp/pipelined.py). HDP
with a capacity factor or the switch loss is refused, and so is HSDP with ep > 1 or sequence parallelism, each in one
line. Under a zero-bubble
schedule the experts' grouped GEMMs defer their weight gradients to the W action as every linear does
(megalm/parallel/pipeline/weight_grad.py). The FP8/MX recipes leave the experts' grouped GEMMs in bf16
(megalm/parallel/parallelism.py logs it).
"""

from __future__ import annotations

import torch
from torch import nn

from megalm.config import MegalmConfig, is_hsdp
from megalm.errors import ConfigError
from megalm.model.moe import MoE
from megalm.model.shard import ShardSpec
from megalm.parallel.dims import ParallelMesh
from megalm.parallel.expert.dispatch import AllToAllDispatcher

__all__ = ["validate_experts", "apply_expert_parallel", "expert_parameters", "micro_batch_settings"]


def validate_experts(cfg: MegalmConfig) -> None:
    """The layouts an MoE model (`model.moe.num_experts` > 0) may run under today (one-line errors)."""
    p, experts = cfg.parallel, cfg.model.moe.num_experts
    if p.ep < 1:
        raise ConfigError(f"parallel.ep={p.ep} must be >= 1")
    if not experts:
        if p.ep > 1:
            raise ConfigError(f"parallel.ep={p.ep} needs a mixture-of-experts model (model.moe.num_experts > 0); "
                              "set parallel.ep=1")
        return
    domain = (p.dp or 1) * p.cp
    if experts % p.ep or domain % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} must divide model.moe.num_experts={experts} and dp*cp={domain} "
                          "(expert-parallel ranks are carved from the data-parallel ones); change parallel.ep")
    if p.ep > 1 and cfg.trainer.tokens_per_step is not None and (p.dp or 1) > 1 and not p.hdp:  # HDP: lockstep
        raise ConfigError(f"trainer.tokens_per_step with parallel.ep={p.ep} is not supported: under a token budget the "
                          "data-parallel ranks may run different numbers of micro-batches, while an expert-parallel "
                          "layer needs every rank in each all-to-all; use trainer.global_batch_size, "
                          "parallel.hdp=true (whose ranks run in lockstep), or parallel.ep=1")
    per_micro_batch = micro_batch_settings(cfg.model.moe)
    if per_micro_batch and p.hdp:
        raise ConfigError(f"parallel.hdp=true with {' and '.join(per_micro_batch)} is not supported: HDP packs each "
                          "step's documents into its own micro-batches, and the capacity queues and the switch loss "
                          "are a micro-batch's, so the run would not be one process's; drop them (the sequence and z "
                          "losses and the selection bias are fine)")
    if per_micro_batch and cfg.trainer.tokens_per_step is not None and (p.dp or 1) > 1:
        raise ConfigError(f"trainer.tokens_per_step with {' and '.join(per_micro_batch)} over dp > 1 is not "
                          "supported: under a token budget each data-parallel rank cuts its own micro-batches, and "
                          "the capacity queues and the switch loss are a micro-batch's, so the run would not be one "
                          "process's; use trainer.global_batch_size, or drop them (the sequence and z losses and "
                          "the selection bias are fine)")
    if is_hsdp(p) and (p.ep > 1 or p.sequence_parallel):  # fsdp_shard_size = dp*cp is plain FSDP
        raise ConfigError(f"parallel.fsdp_shard_size={p.fsdp_shard_size} (HSDP) with parallel.ep={p.ep} or sequence "
                          "parallelism is not supported for mixture-of-experts models: the routed experts shard over "
                          "their own expert-data-parallel ranks; leave parallel.fsdp_shard_size=null")


def micro_batch_settings(moe: object) -> list[str]:
    """`model.moe.key=value` of the settings that make a micro-batch part of the loss (a capacity queue, the switch
    loss): a layout that cuts micro-batches of its own (HDP, a token budget over dp) would not be one process's."""
    return [f"model.moe.{k}={getattr(moe, k)}" for k in ("capacity_factor", "aux_loss_coeff")
            if getattr(moe, k) not in (None, 0, 0.0)]


def apply_expert_parallel(chunk: nn.Module, mesh: ParallelMesh) -> None:
    """Keep this rank's slice of every MoE layer's experts (on the meta device, before materialisation) and give
    the layer the all-to-all dispatcher. A no-op without expert parallelism."""
    ep = mesh.dims.ep
    if ep == 1:
        return
    for module in chunk.modules():
        if not isinstance(module, MoE):
            continue
        for linear in (module.experts.gate_up_proj, module.experts.down_proj):
            spec = ShardSpec(tuple(linear.weight.shape), 0, ep, mesh.ep_rank, group="ep")
            linear.weight = nn.Parameter(torch.empty(spec.local_shape, dtype=linear.weight.dtype,
                                                     device=linear.weight.device))
            linear.shard_specs = {"weight": spec}
        module.dispatcher = AllToAllDispatcher(mesh.ep_group, module.num_experts, mesh.progress)


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The routed experts' weights (expert-parallel slices under `parallel.ep`): their gradients are summed over
    the expert-data-parallel group (`ParallelMesh.expert_dp_group`), not over dp x cp."""
    return [linear.weight for module in model.modules() if isinstance(module, MoE)
            for linear in (module.experts.gate_up_proj, module.experts.down_proj)]
