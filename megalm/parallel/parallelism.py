"""The one object the trainer talks to: every layout decision is made here, once, from config + mesh.

`Parallelism` hides which layout runs. It
1. builds and parallelizes the model: meta-device GPT (or this pipeline rank's chunks) -> tensor
   parallelism -> model converters (precision recipes) -> recomputation -> FSDP -> materialize -> init by name
   -> the working dtype (precision=bf16: bf16 copies, the fp32 values handed to the optimizer);
   a zero-bubble pipeline adds its weight-gradient split when its runtime is made;
2. gives each step's samples to the ranks (`share_of_step`): a DP slice of the samples, each micro-batch
   sharded over the CP ring, or the step's HDP plan; then prepares every micro-batch (padding, device,
   the attention context of its ring: carried by the micro-batch, no module state);
3. runs the step's micro-batches (`forward_backward`): the pipeline schedule or the plain loop, with the
   data-parallel reducer armed around them;
4. performs the step's reductions in one place, on the compute device: sums over the ranks that split
   the batch (`sum_over_batch`), the gradient norm and clipping (`clip_grad_norm_`);
5. says what runs (`describe`).
The choices (which split, which runner, which optimizer) are made in `__init__`; the step methods
have no layout branches.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from megalm.config import (
    MegalmConfig,
    ParallelConfig,
    config_to_dict,
    set_away_from_default,
    window_within_samples,
)
from megalm.data.batch import pad_to_multiple
from megalm.data.dataset import SampleDataset
from megalm.errors import ConfigError
from megalm.model.gpt import GPT, init_weights
from megalm.model.moe import set_aux_loss_scale
from megalm.model.naming import canonical_named_parameters, model_chunks
from megalm.model.shard import local_part, shard_specs
from megalm.offload import ActivationStore, LayerOffload, PipelineOffload, unread_offload_settings
from megalm.offload.policy import auto_fraction
from megalm.parallel.collectives import all_reduce_sum
from megalm.parallel.context.attention import RingContext, cp_a2a_size, validate_context
from megalm.parallel.context.split import ContextShards
from megalm.parallel.data_parallel.bucket_adamw import BucketAdamW, forward_owners
from megalm.parallel.data_parallel.fused_wgrad import fuse_weight_grads
from megalm.parallel.data_parallel.layerwise import LayerwiseOptimizer
from megalm.parallel.data_parallel.optimizer_face import fused_adamw_kernel
from megalm.parallel.data_parallel.reducer import GradReducer
from megalm.parallel.data_parallel.slices import DataParallelSlices, validate_data_parallel
from megalm.parallel.dims import ParallelDims, ParallelMesh, build_mesh, check_same_on_all_ranks, resolve_dims
from megalm.parallel.expert import apply_expert_parallel, expert_parameters, validate_experts
from megalm.parallel.fsdp import FsdpGrads, apply_fsdp, fsdp_mesh, fsdp_shard_count, validate_fsdp
from megalm.parallel.fsdp.grads import shard_offset
from megalm.parallel.hdp.split import HdpSplit, hdp_cost_model, validate_hdp
from megalm.parallel.matrices import WholeMatrices, whole_matrices
from megalm.parallel.microbatch import LocalMicroBatch, PaddedContext, Ring, StepShare
from megalm.parallel.norms import NormShare, scaled_share, share_pairs, weighted_sq_norm
from megalm.parallel.pipeline.runtime import PipelineRuntime, tied_embedding_copy
from megalm.parallel.pipeline.schedules import simulated_timeline
from megalm.parallel.pipeline.stages import build_stage_chunks, validate_pipeline
from megalm.parallel.recompute import apply_recompute, stage_mode
from megalm.parallel.runner import LocalRunner, Runner, StepSplit
from megalm.parallel.tensor.apply import (
    apply_tensor_parallel,
    check_tensor_parallel,
    loss_fn_for,
    tp_norm_share,
)
from megalm.parallel.tensor.async_tp import async_tp_inductor_config

log = logging.getLogger("megalm")


class ModelConverter(Protocol):
    """A transform applied to every model chunk from outside (TorchTitan's model converters): precision
    recipes (megalm.precision.Precision). `token_multiple`: micro-batches are padded to a multiple of it;
    `working_dtype`: the dtype the weights train in, behind fp32 main weights the optimizer keeps (None: the
    fp32 parameters are trained directly)."""

    token_multiple: int
    working_dtype: torch.dtype | None
    amax_group: dist.ProcessGroup | None  # set here: the ranks that split the batch (TE's amax reduction)
    noise_rank: int  # set here: the TP rank, by which ranks holding other shards of a layer draw their own noise

    def convert(self, chunk: nn.Module, fsdp_shards: int = 1) -> None: ...

    def forward_context(self) -> contextlib.AbstractContextManager: ...

    def before_forward(self, chunk: nn.Module, step: int, micro_batch: int, shard: int = 0) -> None: ...

    def after_backward(self, model: nn.Module, step: int) -> None: ...  # every rank of amax_group, once a step

    def watch_optimizer(self, optimizer: object) -> None: ...

    def watch_sharded_optimizer(self, optimizer: object, chunks: list[nn.Module]) -> None: ...


def validate_parallel(cfg: MegalmConfig, world_size: int) -> ParallelDims:
    """Every parallel rule, each parallelism checking its own (one-line ConfigErrors, the same on every
    rank); fills `parallel.dp` and `parallel.hdp_capacity`. `cfg.model` must have its defaults resolved."""
    p = cfg.parallel
    dims = resolve_dims(p, world_size)
    check_tensor_parallel(cfg.model, p.tp)
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tp>1; set parallel.tp or turn it off")
    if p.async_tp and not p.sequence_parallel:
        raise ConfigError("parallel.async_tp=true pipelines sequence parallelism's all-gathers and reduce-scatters "
                          "with their GEMMs; set parallel.sequence_parallel=true (and parallel.tp>1) or turn it off")
    validate_context(cfg)
    for key, size in (("pp_schedule", "pp"), ("cp_comm", None if p.hdp else "cp")):  # HDP's rings read cp_comm
        unread = set_away_from_default(p, ParallelConfig, [key]) if size and getattr(p, size) == 1 else []
        if unread:  # a choice nothing will read
            log.warning(f"parallel.{unread[0]} has no effect with parallel.{size}=1")
    validate_hdp(cfg)
    validate_data_parallel(cfg)
    validate_fsdp(cfg)
    validate_pipeline(cfg)
    validate_experts(cfg)
    return dims


def triton_adamw_refusal(fsdp: bool) -> str:
    """Why optim.implementation=triton cannot run here: it steps megalm's buckets (BucketAdamW), which FSDP replaces
    (the fixes for a run without them, bf16 weights or ZeRO-1, do not apply under FSDP: an audit, 2026-12-07)."""
    if fsdp:
        return ("optim.implementation=triton steps megalm's own gradient buckets, which parallel.fsdp=true replaces "
                "(FSDP steps its own shards); use optim.implementation=auto")
    return ("optim.implementation=triton steps fp32 main weights behind bf16 working weights, or ZeRO-1 shards "
            "(BucketAdamW); use precision=bf16 or parallel.zero1=true, or optim.implementation=auto")


def _fused_adamw(optimizer: object) -> bool:
    """Whether `optimizer` steps with torch's fused AdamW kernel, which takes a `grad_scale` (and so do the Muon steps
    of megalm's own optimizers)."""
    if isinstance(optimizer, BucketAdamW | LayerwiseOptimizer):
        return optimizer.fused
    return isinstance(optimizer, torch.optim.AdamW) and bool(optimizer.defaults.get("fused"))


def _reduce_dtype(p) -> torch.dtype | None:  # noqa: ANN001 - a ParallelConfig
    """`parallel.grad_reduce_dtype` as a dtype (None: the gradients' own)."""
    return {"fp32": torch.float32, "bf16": torch.bfloat16}.get(p.grad_reduce_dtype or "")


class Parallelism:
    """The layout of one rank: its model, how it takes its share of a step, how it runs it and reduces it.

    `mesh` forces a layout (tests pass a one-rank mesh for the single-process reference inside a
    distributed job); by default the mesh is built from `cfg.parallel` over the world.
    """

    def __init__(self, cfg: MegalmConfig, device: torch.device, converters: Sequence[ModelConverter] = (),
                 mesh: ParallelMesh | None = None, progress: Callable[[], None] | None = None):
        p = cfg.parallel
        self.cfg, self.device, self.converters = cfg, device, list(converters)
        with unset_fake_temporarily():  # the meshes' own tensors are real under a caller's FakeTensorMode
            self.mesh = mesh or build_mesh(ParallelDims(tp=p.tp, pp=p.pp, cp=p.cp, dp=p.dp, ep=p.ep), device,
                                           experts_over_tp=bool(cfg.model.moe.num_experts) and p.sequence_parallel,
                                           rings_over_dp=p.hdp)
            self.fsdp_mesh = fsdp_mesh(self.mesh, p.fsdp_shard_size, device.type) if p.fsdp else None
        check_same_on_all_ranks(json.dumps(config_to_dict(cfg), sort_keys=True, default=str), self.mesh, device)
        for converter in self.converters:
            converter.amax_group, converter.noise_rank = self.mesh.dp_cp_group, self.mesh.tp_rank
        # bf16 working weights (the bf16 recipe): the model trains bf16 copies of its fp32 initial weights, which the
        # optimizer takes as its fp32 main weights (BucketAdamW); the gradients accumulate over micro-batches in the
        # reducer's fp32 buckets. Under FSDP its MixedPrecisionPolicy does that: the fp32 shards are the main weights.
        recipe_dtype = next((c.working_dtype for c in self.converters if c.working_dtype), None)
        self.model = self._build_model(recipe_dtype, progress)
        self.working_dtype = None if p.fsdp else recipe_dtype
        self._initial_weights = self._to_working_dtype()
        self.loss_fn = loss_fn_for(self.mesh.tp_group, self.cfg.model.vocab_size)
        # what this layout asks of inductor when the blocks compile (megalm/training/compile.py)
        self.inductor_config = async_tp_inductor_config(self.mesh.tp_group) if p.async_tp else {}
        if p.pp > 1:
            sp = p.tp if p.sequence_parallel else 1  # under SP a stage holds its 1/tp of the tokens
            hidden = self.cfg.model.hidden_size
            self.runner: Runner = PipelineRuntime(
                self.model, self.mesh, p.pp_schedule, self.loss_fn, self._forward_context, self._before_forward,
                device, activation_shape=lambda mb: (mb.batch.num_tokens // sp, hidden),
                activation_dtype=recipe_dtype or next(self.model.parameters()).dtype,
                before_backward=self._before_backward)
        else:
            self.runner = LocalRunner(self.model, self.loss_fn, self._forward_context, self._before_forward, device,
                                      self.mesh.progress, self._before_backward)
        self.offload_store = self._attach_offload() if cfg.offload.enabled else None
        self.split: StepSplit = self._build_split()
        self.token_multiple = math.lcm(p.tp if p.sequence_parallel else 1,
                                       *(c.token_multiple for c in self.converters))
        # ZeRO-1 under Muon shards the optimizer by whole matrices (layerwise.py), over whole gradients
        self.layerwise = p.zero1 and cfg.optim.name == "muon"
        # Each CP (or HDP) rank holds the gradient of its tokens only: sum over DP x CP (ZeRO-1 shards over it).
        tied = self.runner.tied_embedding()  # a pipeline's two copies: summed before the DP reduction
        presum = dict([tied]) if tied else None
        if p.fsdp:  # FSDP reduce-scatters into the sharded gradients itself
            self.reducer: GradReducer | FsdpGrads = FsdpGrads(list(self.model.parameters()), self.fsdp_mesh, presum,
                                                              self.mesh.progress, p.fsdp_reduce_each_micro_batch,
                                                              _reduce_dtype(p) or torch.float32)
        else:
            # routed experts: summed over the ranks that hold the same experts only (expert parallelism), and over
            # TP too under sequence parallelism (each TP rank runs them on its own tokens)
            experts = {} if self.mesh.expert_dp_group is None else {
                param: self.mesh.expert_dp_group for param in expert_parameters(self.model)}
            self.reducer = GradReducer(list(self.model.parameters()), self.mesh.dp_cp_group, p.bucket_size_mb,
                                       reduce_dtype=_reduce_dtype(p), zero1=p.zero1 and not self.layerwise,
                                       presum=presum,
                                       progress=self.mesh.progress, accumulate=self.working_dtype is not None,
                                       own_groups=experts)
        if p.gradient_accumulation_fusion:  # validated: bf16 working weights, not FSDP, so the reducer accumulates
            fuse_weight_grads(self.model, self.reducer, device)
        # How to build this layout's optimizer (None: the trainer's own AdamW): over the reducer's buckets for
        # ZeRO-1's shards or for fp32 main weights
        self.optimizer_factory = (self._layerwise_optimizer if self.layerwise else
                                  self._bucket_adamw if p.zero1 or self.working_dtype else None)
        if cfg.optim.implementation == "triton" and self.optimizer_factory is None:
            raise ConfigError(triton_adamw_refusal(p.fsdp))
        self._norm_weights = self._grad_norm_weights(sharded=self.reducer.shard_group is not None or p.fsdp)
        # the weights are whole on every replica but under FSDP (ZeRO-1 shards gradients and main weights only)
        self._weight_norm_weights = self._grad_norm_weights(sharded=cfg.parallel.fsdp)
        recipe = cfg.precision.name
        if cfg.model.moe.num_experts and recipe not in ("bf16", "bf16_autocast", "fp32"):
            experts = "bf16" if cfg.precision.autocast or recipe_dtype else "fp32"
            log.info("precision=%s covers every linear but the MoE experts, whose grouped GEMMs run in %s (no %s "
                     "grouped GEMM yet)", recipe, experts, recipe)

    # ------------------------------------------------------------------ building

    def _build_model(self, recipe_dtype: torch.dtype | None, progress: Callable[[], None] | None) -> nn.Module:
        """Build on the meta device (only this pipeline rank's chunks), shard for TP, convert (precision),
        wrap for recomputation, shard for FSDP, then materialise and initialise: every rank draws its shards of
        the single-process initial weights (`init_weights` + the layers' shard specs, FSDP's chunk of them)."""
        p, mesh = self.cfg.parallel, self.mesh
        # The meta skeleton is built outside a FakeTensorMode the caller may run under (tools/bench/step_cost.py
        # measures one step of any size that way): a parameter made under it is a fake tensor that to_empty
        # cannot swap for its materialised self. Outside one, this is a no-op.
        with unset_fake_temporarily():
            if p.pp > 1:
                model = build_stage_chunks(self.cfg.model, mesh.pp_rank, p.pp, p.vpp,
                                           None if p.layers_per_stage is None else list(p.layers_per_stage))
            else:
                model = GPT(self.cfg.model, device="meta")
            for chunk in model_chunks(model):
                apply_tensor_parallel(chunk, mesh.tp_group, p.sequence_parallel, mesh.progress)
                apply_expert_parallel(chunk, mesh)
                for converter in self.converters:
                    converter.convert(chunk, fsdp_shard_count(p))
                apply_recompute(chunk, stage_mode(p.recompute, mesh.pp_rank, p.pp))
            if p.fsdp:
                experts = None if mesh.expert_dp_group is None else DeviceMesh.from_group(
                    mesh.expert_dp_group, self.device.type, mesh_dim_names=("expert_dp",))
                apply_fsdp(model, self.fsdp_mesh, p.fsdp_reshard_after_forward, recipe_dtype, _reduce_dtype(p),
                           p.fsdp_cpu_offload, experts)
        model.to_empty(device=self.device)
        init_weights(model, self.cfg.seed, progress)  # progress: per parameter drawn (the start-up watchdog's beat)
        return model

    def _to_working_dtype(self) -> dict[int, torch.Tensor] | None:
        """Cast the parameters to the working dtype, if any; returns the fp32 values they were cast from."""
        if self.working_dtype is None:
            return None
        initial = {}
        for param in self.model.parameters():
            initial[id(param)], param.data = param.data, param.data.to(self.working_dtype)
        return initial

    def _bucket_adamw(self, params: list[dict], **hyper) -> BucketAdamW:
        """This layout's optimizer (ZeRO-1's, or fp32 main weights'); the initial fp32 weights go to it, once."""
        initial, self._initial_weights = self._initial_weights, None
        optimizer = BucketAdamW(params, self.reducer, working_dtype=self.working_dtype, initial_weights=initial,
                                kernel=str(self.cfg.optim.implementation), **hyper)
        if self.cfg.parallel.overlap_param_gather and optimizer.overlap_param_gather_with(forward_owners(self.model)):
            log.info("ZeRO-1: the parameter all-gather of %d buckets overlaps the next forward (each waited for "
                     "before the first block that reads it)", len(self.reducer.buckets))
        return optimizer

    def _layerwise_optimizer(self, params: list[dict], matrix_update: Callable[..., None], **hyper
                             ) -> LayerwiseOptimizer:
        """ZeRO-1 under Muon: each replica steps the pieces it owns, whole matrices and blocks of AdamW's
        parameters (layerwise.py)."""
        initial, self._initial_weights = self._initial_weights, None
        optimizer = LayerwiseOptimizer(params, self.reducer, self._replica_groups(), matrix_update,
                                       working_dtype=self.working_dtype, initial_weights=initial,
                                       fused=fused_adamw_kernel(str(self.cfg.optim.implementation), self.device),
                                       **hyper)
        if self.cfg.parallel.overlap_param_gather and optimizer.overlap_param_gather_with(forward_owners(self.model)):
            log.info("ZeRO-1 under optim.name=muon: each parameter's broadcast from its owner overlaps the next "
                     "forward (waited for before the first block that reads it)")
        return optimizer

    def _attach_offload(self) -> ActivationStore:
        """Activation offload on this rank's runner: PipeOffload's actions in the pipeline schedule, or
        layer-wise offload of the transformer blocks without a pipeline (megalm/offload)."""
        o, p = self.cfg.offload, self.cfg.parallel
        if stage_mode(p.recompute, self.mesh.pp_rank, p.pp) == "selective":
            log.info("offload with parallel.recompute=selective: the GEMM and attention outputs selective "
                     "checkpointing keeps stay on the device (it holds them outside saved-tensor hooks); "
                     "each block's inputs are offloaded")
        for note in unread_offload_settings(self.cfg):
            log.warning(note)
        store = ActivationStore(self.device, [*self.model.parameters(), *self.model.buffers()], o.min_tensor_bytes,
                                recompute_cheap=o.recompute_cheap)
        if p.hdp and p.hdp_offload:  # each long document's own r(s) of the blocks, in every chunk it runs
            blocks = [chunk.layers for chunk in self.model] if p.pp > 1 else self.model.layers
            self.runner.memory_hooks = LayerOffload(blocks, store, o.fraction, per_micro_batch=True)
        elif p.pp > 1:
            self.runner.memory_hooks = PipelineOffload(store, o.policy, o.fraction, simulated_timeline,
                                                       self._copy_to_compute())
        else:
            self.runner.memory_hooks = LayerOffload(self.model.layers, store, o.fraction)
        return store

    def _copy_to_compute(self) -> float:
        """PipeOffload's k for one micro-batch of this run, from the cost model (megalm/parallel/hdp/cost.py):
        the one-way copy time of its activations over its forward + backward time, per layer (the ratio does
        not depend on how many layers a chunk holds). Samples of seq_length tokens, micro_batch_size of them."""
        cost = hdp_cost_model(self.cfg)
        if not cost.host_bw or not cost.act_bytes:
            return 0.0
        seq, mbs = self.cfg.model.seq_length, self.cfg.trainer.micro_batch_size
        tokens = seq * mbs
        copy = cost.act_bytes / cost.layers * tokens / cost.host_bw
        return copy / (cost.a * mbs * seq**2 + cost.b * tokens + cost.c)

    def _build_split(self):
        """How this rank takes its share of a step: the HDP plan, or a DP slice (sharded over the CP ring)."""
        p, mesh = self.cfg.parallel, self.mesh
        if p.hdp:
            return HdpSplit.for_config(self.cfg, mesh)
        split = DataParallelSlices(mesh, self.cfg.trainer.micro_batch_size,
                                   partial_last=self.cfg.trainer.tokens_per_step is not None, device=self.device)
        inner = cp_a2a_size(self.cfg) if p.cp_comm == "a2a+p2p" else 1
        return ContextShards(split, Ring(tuple(mesh.cp_ranks), mesh.cp_rank, inner)) if p.cp > 1 else split

    def _grad_norm_weights(self, sharded: bool) -> dict[int, NormShare]:
        """Each parameter's share of the full model's squared gradient norm (or weight norm): a TP shard counts whole,
        a TP-replicated parameter 1/tp, the tied embedding's last-stage copy 0 (the first stage counts it).
        Under expert parallelism the squares are summed over dp x cp (`grad_norm`), so what several of those
        ranks hold counts 1/their number: replicated (`sharded` false) an expert slice 1/(dp·cp/ep), any other
        parameter 1/(dp·cp); sharded (the gradients under ZeRO-1, anything under FSDP) each rank's shard is its own,
        and when the experts' buckets span TP (sequence parallelism) so is each TP rank's shard of them."""
        specs, d = shard_specs(self.model), self.mesh.dims
        tied_copy = tied_embedding_copy(self.model) if self.cfg.parallel.pp > 1 else None
        shares = {id(p): 0.0 if p is tied_copy else tp_norm_share(specs.get(name), d.tp, p.shape)
                  for name, p in canonical_named_parameters(self.model)}
        if sharded and self.cfg.parallel.sequence_parallel and d.tp > 1:
            shares |= {id(p): 1.0 for p in expert_parameters(self.model)}
        if d.ep > 1 and not sharded:
            domain, experts = d.dp * d.cp, {id(p) for p in expert_parameters(self.model)}
            shares = {key: scaled_share(share, (d.ep if key in experts else 1) / domain)
                      for key, share in shares.items()}
        return shares

    def matrices(self) -> dict[int, WholeMatrices]:
        """The transformer blocks' matrices as whole ones, for an optimizer that updates matrices (optim.name=muon):
        TP shards gathered over the TP group, fused projections split (megalm/parallel/matrices.py)."""
        return whole_matrices(self.model, self.cfg.model, self.mesh.tp_group, self._replica_groups())

    def _replica_groups(self) -> dict[int, dist.ProcessGroup | None]:
        """{id(parameter): the data-parallel ranks whose reduced gradients of it are the same}: those the reducer
        sums it over, dp x cp or an expert slice's expert-data-parallel group (not FSDP's: Muon is refused with it)."""
        return {id(p): self.reducer.summed_over(p) for p in self.reducer.params}

    def random_seed(self, seed: int) -> int:
        """The seed of this rank's random streams (dropout): one per pipeline stage, `seed + 100 * pp rank` as
        Megatron's, so that a stage's layers do not repeat another stage's masks (every rank seeded alike, layer i
        and layer i + L/pp dropped the same elements); the same on the ranks of a stage, as TP's must be."""
        return seed + 100 * self.mesh.pp_rank

    def watch_optimizer(self, optimizer: object) -> None:
        """Let the converters cache per optimizer step what depends on the weights only (a recipe's quantized
        weights). Not under FSDP: a layer's weight exists only while its unit is gathered, and a cache kept for the
        step would hold a whole low-precision model on every rank, so the recipes quantize after every gather."""
        if self.cfg.parallel.fsdp:
            if any(getattr(c, "quantizes_weights", False) for c in self.converters):
                log.info("FSDP: the recipe quantizes each weight after every gather (no per-step cache of "
                         "quantized weights, which would hold the whole model per rank)")
            for converter in self.converters:
                converter.watch_sharded_optimizer(optimizer, list(model_chunks(self.model)))
            return
        for converter in self.converters:
            converter.watch_optimizer(optimizer)

    # ------------------------------------------------------------------ around every forward

    def _forward_context(self) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        for converter in self.converters:
            stack.enter_context(converter.forward_context())
        return stack

    def _before_forward(self, chunk: nn.Module, step: int, micro_batch: int, shard: int = 0) -> None:
        for converter in self.converters:
            converter.before_forward(chunk, step, micro_batch, shard)

    def _before_backward(self, chunk: nn.Module, last: bool) -> None:
        self.reducer.before_backward(chunk, last)

    # ------------------------------------------------------------------ one step

    def share_of_step(self, dataset: SampleDataset, sample_ids: range, step: int) -> StepShare:
        """This rank's micro-batches of the step whose global batch is `sample_ids`, ready to run; the host's time
        making them goes with them (a timer: no sync, so copies still in flight are not in it)."""
        began = time.perf_counter()
        micro_batches, loss_tokens = self.split.micro_batches(dataset, sample_ids)
        prepared = [self._prepare(mb) for mb in micro_batches]
        return StepShare(step, prepared, loss_tokens, time.perf_counter() - began)

    def _prepare(self, mb: LocalMicroBatch) -> LocalMicroBatch:
        """Pad (SP splits T over tp, TE's FP8 GEMMs want T % 16 == 0), build the ring's attention context,
        move to the device. A shard's padding is one more even zigzag segment; zigzag padding continues
        each document's positions, so learned position tables get them clamped (padding is masked out of
        the loss and never attended to by real tokens). Only the last pipeline stage counts tokens."""
        batch, ring = mb.batch, mb.ring
        if ring is not None and self.cfg.model.position_embedding == "learned":
            batch.position_ids = batch.position_ids.clamp(max=self.cfg.model.max_position_embeddings - 1)
        padded = pad_to_multiple(batch, self.token_multiple, even=ring is not None)
        attention = None
        if ring is not None:
            a2a = self.cfg.parallel.cp_comm == "a2a"
            moe_over = None
            if self.cfg.model.moe.num_experts and mb.real_tokens is not None:  # the routers' view of the shard
                real = torch.cat([mb.real_tokens, mb.real_tokens.new_zeros(padded.num_tokens - batch.num_tokens)])
                moe_over = (real, None if self.cfg.parallel.hdp else self.mesh.cp_group)  # HDP: over ring.ranks
            attention = RingContext.for_shard(padded, ring, self.device, self.cfg.parallel.cp_comm,
                                              self.mesh.cp_group if a2a else None, self.mesh.progress, moe_over,
                                              window_within_samples(self.cfg.model) is None)
        counted = mb.counted_doc_lengths if self.mesh.is_last_stage else []
        if self.device.type == "cuda":  # pinned host memory: the copies overlap instead of syncing the stream
            moved = padded.pin_memory().to(self.device, non_blocking=True)
        else:
            moved = padded.to(self.device)
        if ring is None and self.cfg.model.moe.num_experts and (padded is not batch or mb.real_tokens is not None):
            real = batch.num_tokens if mb.real_tokens is None else int(mb.real_tokens.sum())  # (HDP's filler: 0)
            attention = PaddedContext(moved, real, self.device)  # the routers must not count the padding
        return LocalMicroBatch(moved, mb.index, ring, counted, attention, mb.offload_fraction)

    def forward_backward(self, share: StepShare) -> torch.Tensor:
        """Gradients of sum(token losses) / (the step's loss tokens) accumulated over this rank's
        micro-batches and reduced over the ranks that split the batch; returns this rank's summed loss."""
        if not self.model.training:  # each module's flag set by a walk of the whole model: only when it changes
            self.model.train()
        self.reducer.start_step(len(share.micro_batches))
        n = share.normaliser  # the balancing losses' gradient gets the loss's 1 / n too
        if self.cfg.model.moe.num_experts:
            set_aux_loss_scale(self.model, 1.0 / n if isinstance(n, int) else 1.0 / n.to(torch.float32))
        loss = self.runner.run_micro_batches(share.micro_batches, share.normaliser, share.step)
        self.reducer.finish()
        for converter in self.converters:  # what the ranks that split the batch agree on (FP8 amax histories)
            converter.after_backward(self.model, share.step)
        return loss

    @torch.no_grad()
    def forward_loss(self, share: StepShare) -> torch.Tensor:
        """This rank's summed token loss of the share, no gradients (evaluation)."""
        self.model.eval()
        loss = self.runner.forward_only(share.micro_batches)
        self.model.train()
        return loss

    # ------------------------------------------------------------------ reductions

    def sum_over_batch(self, values: torch.Tensor) -> torch.Tensor:
        """Sum per-rank values of a step (losses, counted tokens) over the ranks that split its batch:
        DP x CP (or the HDP domain), then the pipeline stages (only the last has losses and counts)."""
        progress = self.mesh.progress
        values = all_reduce_sum(values, self.mesh.dp_cp_group, "step totals", progress)
        return all_reduce_sum(values, self.mesh.pp_group, "step totals", progress)

    def sum_over_sequence_shards(self, values: torch.Tensor) -> torch.Tensor:
        """Sum what each TP rank counted over its own sequence chunk (under SP: an MoE layer's loads, drops and
        balancing losses) over TP, before `sum_over_batch`; the identity otherwise."""
        if not self.cfg.parallel.sequence_parallel or not values.numel():
            return values
        return all_reduce_sum(values, self.mesh.tp_group, "MoE counts over the sequence shards", self.mesh.progress)

    def rank_loads(self, share: StepShare) -> torch.Tensor:
        """Under HDP, the real tokens every rank of this rank's HDP domain ran in the step, in domain order (float64
        [D] on the device; empty without HDP). Counted from the batches each rank ran (their loss positions: every
        input token of a document carries one; zigzag and SP padding and fillers carry none), not from the plan,
        and summed over the domain: what metrics.jsonl reports next to the simulator's `SimResult.tokens`."""
        if not self.cfg.parallel.hdp:
            return torch.zeros(0, dtype=torch.float64, device=self.device)
        loads = torch.zeros(self.split.num_ranks, dtype=torch.float64, device=self.device)
        for mb in share.micro_batches:
            loads[self.split.index] += mb.batch.loss_mask.sum()
        return all_reduce_sum(loads, self.mesh.dp_cp_group, "HDP rank loads", self.mesh.progress)

    def _norm_weight(self, param: nn.Parameter) -> NormShare:
        return self._norm_weights[id(param)]

    def grad_norm(self) -> torch.Tensor:
        """L2 norm of the full model's gradient: squares summed over the reducer's shards (ZeRO-1), TP
        shards and pipeline stages, each element of the full model counted once."""
        # on the run's device: FSDP's host-offloaded gradients (parallel.fsdp_cpu_offload) give a CPU sum, which NCCL
        # cannot reduce and the trainer reads beside its device totals
        sq = self.reducer.local_grad_sq_norm(weight=self._norm_weight).to(self.device)
        # expert slices differ across an EP group: sum over all of dp x cp (`_grad_norm_weights` counts each once)
        shards = self.mesh.dp_cp_group if self.mesh.dims.ep > 1 else self.reducer.shard_group
        for group in (shards, self.mesh.tp_group, self.mesh.pp_group):
            sq = all_reduce_sum(sq, group, "grad norm", self.mesh.progress)
        return sq.sqrt()

    @torch.no_grad()
    def weight_norm(self, optimizer: object | None = None) -> torch.Tensor:
        """L2 norm of the full model's weights (`logging.params_norm`, Megatron's --log-params-norm), each element
        counted once as `grad_norm` counts them, over the parameters the gradient reducer holds (FSDP's shards, even
        where a unit kept its gathered weights after an evaluation's forward): the model's, so bf16 working copies
        under precision=bf16 but FSDP's fp32 shards (Megatron takes its fp32 main weights: they differ by the copies'
        rounding). `optimizer`: its last step's weights are finished first (ZeRO-1's all-gather, overlapped with the
        next forward otherwise)."""
        getattr(optimizer, "finish_param_gather", lambda: None)()
        fsdp, weights = self.cfg.parallel.fsdp, self._weight_norm_weights
        pairs = [pair for p in self.reducer.params for pair in share_pairs(
            local_part(p).reshape(-1), shard_offset(p) if isinstance(p, DTensor) else 0, weights[id(p)])]
        sq = weighted_sq_norm(pairs, pairs[0][0].device if pairs else None).to(self.device)
        shards = self.mesh.dp_cp_group if self.mesh.dims.ep > 1 else self.reducer.shard_group if fsdp else None
        for group in (shards, self.mesh.tp_group, self.mesh.pp_group):
            sq = all_reduce_sum(sq, group, "weight norm", self.mesh.progress)
        return sq.sqrt()

    def clip_grad_norm_(self, max_norm: float, optimizer: object | None = None) -> torch.Tensor:
        """Scale the gradients so their global norm is at most `max_norm` (0: no clipping); returns the norm.

        With `optimizer` a fused AdamW (torch's, or BucketAdamW on its fused kernel) the scale is left to its next
        `step()` instead: `optimizer.grad_scale`, which the fused kernel divides each gradient by as it reads it
        (the attribute torch's GradScaler sets for fused optimizers). That saves a pass over the fp32 gradients,
        one read of them (the kernel writes the scaled gradient back: 4 bytes a parameter, 5.7 GB at 1.4B). The
        caller clears `grad_scale` after the step, or when it skips it. FSDP's DTensor gradients keep the scaling."""
        norm = self.grad_norm()
        if max_norm > 0:
            if optimizer is not None and not self.cfg.parallel.fsdp and _fused_adamw(optimizer):
                optimizer.grad_scale = torch.clamp((norm.float() + 1e-6) / max_norm, min=1.0)
            else:
                self.reducer.scale_grads(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return norm

    # ------------------------------------------------------------------ reporting

    def describe(self) -> str:
        """One line: the layout this rank runs."""
        d, p = self.mesh.dims, self.cfg.parallel
        pipeline = f" ({p.pp_schedule}{f' vpp={p.vpp}' if p.vpp > 1 else ''})" if p.pp > 1 else ""
        if p.hdp:
            groups = self.split.cost.ranks_per_node
            offload = (", selective offload" if p.hdp_offload else "") + (
                f", hierarchical rings (a2a groups of {groups})" if p.cp_comm == "a2a+p2p" else "")
            context = f" cp={p.cp} hdp (C={p.hdp_capacity} tokens, {self.split.cost.name} cost{offload})"
        else:
            context = f" cp={p.cp} ({p.cp_comm})" if p.cp > 1 else ""
        flags = (f" ep={p.ep}" if p.ep > 1 else "") + (" sp" if p.sequence_parallel else "") + (
            " zero1 (layer-wise)" if self.layerwise else " zero1" if p.zero1 else "")
        if p.fsdp:
            shape = ("hsdp " if self.fsdp_mesh.ndim > 1 else "") + "x".join(map(str, self.fsdp_mesh.shape))
            flags += f" fsdp({shape}{'' if p.fsdp_reduce_each_micro_batch else ', reduce-scattered once a step'})"
        o = self.cfg.offload
        if o.enabled:
            share = auto_fraction(self._copy_to_compute()) if o.policy == "auto" else o.fraction  # auto: min(1, 1/k)
            what = f"{o.policy} {share:.3g} of micro-batches" if p.pp > 1 else f"{o.fraction:g} of the blocks"
            what = "r(s) of the blocks of long documents" if p.hdp and p.hdp_offload else what
            flags += f" offload({what})"
        return f"{d.world_size} rank(s): tp={d.tp} pp={d.pp}{pipeline}{context} dp={d.dp}{flags}"
