"""FSDP2 over megalm's model: which ranks shard, which modules are units, in which dtypes they gather and reduce.

Why the library: per-parameter sharding on DTensor, prefetched all-gathers, reduce-scatters overlapped with the
backward and mixed precision are what `fully_shard` does and is kept right by torch; nothing here re-implements
them.

Composition (docs/architecture.md, "Fully sharded data parallelism"):
- Tensor parallelism stays megalm's own: its layers hold plain TP-local tensors and call their collectives in the
  forward, so FSDP shards each TP rank's local tensors over that rank's data-parallel ranks (a 1-D mesh; TP ranks
  run independent FSDP instances), and nothing of the TP layers learns about DTensor.
- Context parallelism: the mesh is dp x cp flattened (TorchTitan's dp_cp): every CP rank holds the gradient of its
  tokens, summed by the reduce-scatter as the all-reduce sums them without FSDP.
- Pipeline parallelism: each stage's chunks are units of their own stage's data-parallel ranks; every rank of a
  stage runs the same schedule, so their collectives pair.
- Expert parallelism: an MoE block's routed experts (this rank's slice) are a unit over the expert-data-parallel
  ranks (the ranks holding the same experts; under sequence parallelism the TP ranks too), inside the block's unit
  over dp x cp.
- Precision: FSDP's `MixedPrecisionPolicy` holds it. The sharded parameters are the fp32 main weights the optimizer
  steps; precision=bf16 gathers them in bf16 (the working weights exist only while a unit computes) and the
  gradients are reduce-scattered in fp32 into fp32 shards (`parallel.grad_reduce_dtype` picks bf16 instead). There
  is no separate main_grad: the sharded fp32 gradient is it. FP8/MX recipes quantize each weight after its gather,
  every use (Parallelism.watch_optimizer: no per-step cache, which would hold a whole FP8 model per rank); gathering
  in FP8 needs a tensor subclass FSDP can all-gather, which megalm's recipes are not and torchao's weights are
  (`precision.fp8_all_gather`, precision/torchao_fp8.py).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from megalm.config import MegalmConfig, ParallelConfig, set_away_from_default, zero_bubble
from megalm.errors import ConfigError
from megalm.model.moe import MoE
from megalm.model.naming import model_chunks
from megalm.parallel.dims import ParallelMesh

log = logging.getLogger("megalm")


def validate_fsdp(cfg: MegalmConfig) -> None:
    """FSDP's rules, alone and with the rest of the layout (one-line ConfigErrors)."""
    p = cfg.parallel
    if not p.fsdp:
        if set_fsdp := set_away_from_default(p, ParallelConfig, ("fsdp_shard_size", "fsdp_cpu_offload",
                                                                 "fsdp_reshard_after_forward",
                                                                 "fsdp_reduce_each_micro_batch")):
            raise ConfigError(f"parallel.{set_fsdp[0]} needs parallel.fsdp=true; set it or drop the key")
        return
    if unread := set_away_from_default(p, ParallelConfig, ("bucket_size_mb", "overlap_param_gather")):
        # FSDP's units are its buckets, and it gathers each block's weights itself
        log.warning(f"parallel.{', parallel.'.join(unread)} sized or timed megalm's data-parallel buckets, which "
                    "FSDP replaces: not used")
    domain = (p.dp or 1) * p.cp
    if domain == 1:
        raise ConfigError("parallel.fsdp=true needs dp*cp > 1 ranks to shard over; raise parallel.dp or drop fsdp")
    if p.zero1:
        raise ConfigError("parallel.fsdp=true already shards the optimizer states (and weights and gradients): "
                          "drop parallel.zero1")
    if p.hdp:
        raise ConfigError("parallel.hdp=true with parallel.fsdp=true is not supported: HDP ranks run different "
                          "numbers of micro-batches, while every rank of an FSDP group must join each block's "
                          "all-gather; use parallel.zero1=true with HDP")
    if cfg.trainer.tokens_per_step is not None and (p.dp or 1) > 1:
        raise ConfigError("trainer.tokens_per_step with parallel.fsdp=true is not supported: under a token budget the "
                          "data-parallel ranks may run different numbers of micro-batches, while every rank of an FSDP "
                          "group must join each block's all-gather; use trainer.global_batch_size, or parallel.zero1")
    if zero_bubble(p):
        raise ConfigError("parallel.pp_schedule=zb with parallel.fsdp=true is not supported: its deferred weight "
                          "gradients land after FSDP's reduce-scatter has run; use 1f1b or interleaved")
    if cfg.precision.backend == "te":
        raise ConfigError("precision.backend=te with parallel.fsdp=true is not supported: Transformer Engine's layers "
                          "keep their own FP8 weight copies; use precision.backend=native")
    if p.fsdp_shard_size is not None and (p.fsdp_shard_size < 1 or domain % p.fsdp_shard_size):
        raise ConfigError(f"parallel.fsdp_shard_size={p.fsdp_shard_size} must divide dp*cp={domain} (HSDP: shard "
                          "within groups of that many ranks, replicate across them); null shards over all of them")
    if p.fsdp_shard_size == 1:  # it ran, every rank gathering its own whole model through FSDP's hooks
        raise ConfigError("parallel.fsdp_shard_size=1 shards nothing: every rank would hold the whole model and its "
                          "optimizer states; drop parallel.fsdp (parallel.zero1=true shards the optimizer states) or "
                          "shard over more ranks")


def fsdp_shard_count(p: ParallelConfig) -> int:
    """The ranks FSDP shards each parameter's rows over: dp*cp, or `fsdp_shard_size` under HSDP; 1 without FSDP."""
    return (p.fsdp_shard_size or (p.dp or 1) * p.cp) if p.fsdp else 1


def fsdp_mesh(mesh: ParallelMesh, shard_size: int | None, device_type: str) -> DeviceMesh:
    """The mesh FSDP shards over: this rank's dp (x cp) ranks, 1-D; or under HSDP (`shard_size` < dp*cp) 2-D,
    (replicate, shard) with shard groups of `shard_size` consecutive ranks of the domain (one node's ranks when
    they are the node's). Collective: every rank builds every HSDP group."""
    dims = mesh.dims
    domain_size = dims.dp * dims.cp
    shard = shard_size or domain_size
    if shard == domain_size:
        if dims.cp == 1:
            return mesh.mesh["dp"]
        return DeviceMesh.from_group(mesh.dp_cp_group, device_type, mesh_dim_names=("dp_cp",))
    replicate_group = shard_group = grid = None
    for pp in range(dims.pp):
        for tp in range(dims.tp):
            domain = dims.domain_ranks(tp, pp)
            rows = [domain[i:i + shard] for i in range(0, domain_size, shard)]
            for ranks in [*rows, *map(list, zip(*rows, strict=True))]:
                group = dist.new_group(ranks)
                if mesh.rank in ranks:
                    shard_group, replicate_group = (group, replicate_group) if ranks in rows else (shard_group, group)
            if mesh.rank in domain:
                grid = rows
    return DeviceMesh.from_group([replicate_group, shard_group], device_type, mesh=torch.tensor(grid),
                                 mesh_dim_names=("replicate", "shard"))


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool, param_dtype: torch.dtype | None,
               reduce_dtype: torch.dtype | None, cpu_offload: bool, expert_mesh: DeviceMesh | None = None
               ) -> list[nn.Module]:
    """fully_shard every transformer block of every chunk, then the chunk (its root: embedding, final norm, head);
    on the meta device or materialised. Gradients are summed, not averaged (megalm's loss is already divided by
    the step's tokens: docs/architecture.md). Returns the FSDP units.

    `expert_mesh` (expert or sequence parallelism): the expert-data-parallel ranks, over which an MoE block's routed
    experts (this rank's expert-parallel slice) are a unit of their own, as TorchTitan shards them: their gradients
    are summed over the ranks that hold the same experts, not over dp x cp (under sequence parallelism the TP ranks
    are among them: each ran the experts on its own tokens)."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype or torch.float32)
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    units = []
    for chunk in model_chunks(model):
        for block in chunk.layers:
            if expert_mesh is not None and isinstance(block.mlp, MoE):
                units.append(fully_shard(block.mlp.experts, mesh=expert_mesh,
                                         reshard_after_forward=reshard_after_forward, mp_policy=policy,
                                         offload_policy=offload))
            units.append(fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy,
                                     offload_policy=offload))
        units.append(fully_shard(chunk, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy,
                                 offload_policy=offload))
    for unit in units:  # a plain SUM (no pre/post division, no PREMUL_SUM, which gloo lacks)
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    experts = "" if expert_mesh is None else f", MoE experts' own over {expert_mesh.size()} expert-data-parallel ranks"
    log.info("FSDP: %d units (one per block, one root per chunk%s) sharded over %s ranks%s; gathered in %s, "
             "gradients reduce-scattered in %s; %s after forward%s", len(units), experts,
             "x".join(map(str, mesh.shape)),
             " (HSDP: replicate x shard)" if mesh.ndim == 2 else "", _name(param_dtype or torch.float32),
             _name(policy.reduce_dtype), "resharded" if reshard_after_forward else "kept gathered",
             "; parameters offloaded to the host between uses" if cpu_offload else "")
    return units


def _name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype))
