"""How much memory each rank of a layout takes, and how fast its step runs (`estimate`), one rank at a time
(`estimate_rank`).

For each distinct rank role of the layout (the first, a middle and the last pipeline stage) this process becomes
that rank of a fake process group of the whole world (torch's `fake` backend: collectives return at once), builds
the real trainer (model chunk, parallel layers, reducer, optimizer) under `FakeTensorMode` (sizes, no data), and
runs a real training step of that rank: the pipeline schedule's micro-batches, forward and backward, gradient
reduction, the gradient norm and clip, the optimizer step, with the offload hooks and recomputation the config asks
for. Nothing is modelled by a formula: the bytes are those of the storages the step creates and frees, counted by
the live-storage probe (megalm.measure.LiveStorages), the FLOPs and the roofline time of every op those of the
step-cost trace (megalm.measure.op_cost), the collectives' bytes those the step hands to torch.distributed.

Per rank it reports (bytes): parameters, gradients (the data-parallel gradient buckets), optimizer states (fp32
main weights under bf16, Adam's moments), activations (the step's peak above the static bytes: saved activations,
logits, gradients in flight, communication buffers), offloaded host bytes, a reserve for what fake tensors cannot
see, and the peak total; the step's FLOPs. The reserve (`RESERVE`): the CUDA context and cuBLAS workspaces
(~0.6 GiB on Hopper, measured by PyTorch users with `nvidia-smi` against `torch.cuda.memory_reserved`), NCCL's
buffers (NCCL_BUFFSIZE 4 MiB x 2 directions x up to 32 channels per communicator in use, ~0.25 GiB each), and
the caching allocator's fragmentation (10% of the peak, PyTorch's documented `expandable_segments` motivation).

Step time: the rank's roofline time for compute (max(FLOPs / peak, bytes / HBM bandwidth) per op), stretched by the
pipeline's bubble (the schedule the runtime runs, simulated: (m + p - 1) / m micro-batch slots for 1F1B), plus
its collectives at the link's bandwidth: the groups inside a node of 8 GPUs (tp <= 8, tp x cp <= 8, data-parallel
ones when tp x cp x dp <= 8, a pipeline's when the whole world is one node: `inside_node`) over NVLink, the groups
that span nodes over InfiniBand (`LINKS`).
A collective the step leaves in flight (tensor parallelism's backward collectives in eager blocks:
megalm.parallel.tensor.comm.Pending) is hidden behind the roofline time of the ops the rank runs before it waits
for it, up to its own time (`hidden_comm_s`); so is (n - 1)/n of the shorter of the transfer and the GEMM of each
collective GEMM async TP fuses in compiled blocks (`parallel.async_tp`, over n TP ranks); every other collective is
counted as not hidden. Under Muon (`optim.name=muon`) each matrix's Newton-Schulz iterations run on one replica and
are broadcast: the step waits for the busiest replica's, whose excess over the rank's own is added to its optimizer
step (`muon_wait_s`; megalm/estimate/muon_form.py). MFU is
6·N·T (plus attention) FLOPs of the global step over (world x peak x step time); tokens/s the global batch's
tokens over the step time.

`trainer.compile=true` is priced as inductor compiles the blocks (`megalm.measure.compiled_cost.InductorCosts`: its
generated kernels by the bytes its scheduler counts, the GEMMs and attention it calls as extern kernels), and the
memory is what the compiled graphs keep for the backward. Per-tensor FP8 (`precision=fp8`) casts in the graph and
runs its GEMMs as `torch._scaled_mm` ops of the graph where the GPU has FP8 GEMMs (sm89 on), from the weights' FP8
copies made before each block runs, once per step; below sm89 as opaque ops priced by their FLOPs, with the copies
they make inside (megalm/measure/op_cost.py). Under the other FP8/MX recipes, whose linears compiled blocks run as
opaque ops with their casts inside (under fake tensors only their shapes run), the blocks are priced eager, and the
notes say so.
"""

from __future__ import annotations

import contextlib
import functools
import math
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megalm import compat
from megalm.config import is_hsdp, zero_bubble
from megalm.estimate import muon_form
from megalm.estimate.collectives import GPUS_PER_NODE, LINKS, Collectives, InFlight, comm_seconds, inside_node
from megalm.measure import LiveStorages, storage_bytes
from megalm.measure.compiled_cost import InductorCosts
from megalm.measure.op_cost import GPUS, Gpu, OpCosts

GIB = 2**30


HBM_BYTES = {"h100": 80 * GIB, "h200": 141 * GIB, "a100": 80 * GIB, "b200": 180 * GIB}
RESERVE_CONTEXT = int(0.6 * GIB)  # CUDA context + cuBLAS workspaces
RESERVE_PER_COMMUNICATOR = int(0.25 * GIB)  # NCCL buffers
FRAGMENTATION = 0.10  # of the peak


@dataclass
class RankEstimate:
    role: str
    rank: int
    peak_bytes: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    comm_bytes: int  # buffers kept between steps for collectives (ZeRO-1's all-gather outputs)
    host_bytes: int
    reserve_bytes: int
    flops: float
    compute_s: float
    comm_s: float
    collective_bytes: dict[str, int]  # what the step's collectives move through the rank's link, by mesh dimension
    tokens: int  # real tokens (loss positions) this rank ran in the measured step
    optimizer_s: float  # of compute_s, the gradient norm, clip and optimizer step's (once a step, whatever the
    # micro-batches)
    domain: dict[str, Any] | None = None  # HDP: every domain rank's load of the step (`hdp_loads`)
    step_collective_bytes: dict[str, int] = field(default_factory=dict)  # of collective_bytes, the clip's and step's
    hidden_comm_s: float = 0.0  # the collectives' time hidden behind compute (in flight), already out of comm_s
    # the step's documents (all ranks', as the trainer's MFU counts them: `step_documents`) and its sequences
    documents: list[int] = field(default_factory=list)
    sequences: int = 0
    optimizer_flops: float = 0.0  # of flops, the once-a-step part's (Muon's Newton-Schulz iterations)
    # of optimizer_s (and compute_s), Muon's wait for the busiest replica's iterations past this rank's own
    # (megalm/estimate/muon_form.py `replica_seconds`)
    muon_wait_s: float = 0.0


class OnceAStep:
    """Around the part of a step that runs once whatever the micro-batches (the gradient norm, the clip, the optimizer
    step): the roofline milliseconds and FLOPs `costs` priced in it (`ms`, `flops`), and `comms` counts its
    collectives apart."""

    def __init__(self, costs: OpCosts, comms: Collectives) -> None:
        self.costs, self.comms, self.ms, self.flops = costs, comms, 0.0, 0.0

    def __enter__(self) -> OnceAStep:
        self._before = self.costs.total()
        self.comms.once_a_step = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.comms.once_a_step = False
        after = self.costs.total()
        self.ms += after.ms - self._before.ms
        self.flops += after.flops - self._before.flops


def roles(pp: int) -> list[tuple[str, int]]:
    """(role, pipeline stage) of each distinct rank role: the first, a middle and the last stage."""
    if pp == 1:
        return [("only stage", 0)]
    out = [("first stage", 0)]
    if pp > 2:
        out.append(("middle stage", pp // 2))
    return out + [("last stage", pp - 1)]


def estimate_rank(overrides: list[str], world: int, stage: int, role: str, gpu: str, domain_index: int = 0,
                  ) -> RankEstimate:
    """One rank of `stage` of a `world`-rank run, built and stepped under fake tensors: tensor-parallel coordinate 0,
    data/context coordinates those of `domain_index` (dp_rank·cp + cp_rank, the HDP domain's order)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megalm.config.compose import compose_config
    from megalm.parallel.dims import ParallelDims
    from megalm.training.trainer import Trainer

    cfg = compose_config(overrides)
    trace_compiled_blocks(cfg)
    p = cfg.parallel
    if p.fsdp_cpu_offload:  # the trace runs on the CPU, where the trainer refuses it as already there
        from megalm.errors import ConfigError

        raise ConfigError("megalm-estimate does not price parallel.fsdp_cpu_offload (FSDP's shards in host memory, "
                          "moved each step); estimate without it: the device then holds the shards it would not")
    dims = ParallelDims(tp=p.tp, pp=p.pp, cp=p.cp, dp=world // (p.tp * p.pp * p.cp), ep=p.ep)
    rank = dims.rank_of(pp=stage, dp=domain_index // p.cp, cp=domain_index % p.cp)
    fake, live = FakeTensorMode(allow_non_fake_inputs=True), LiveStorages()
    compat.init_fake_process_group(rank, world)
    try:  # FP8 recipes as this GPU runs them (compiled casts; torch._scaled_mm from 8.9), not as the CPU emulates
        with (tempfile.TemporaryDirectory() as run_dir, compat.fp8_traced_as_gpu(GPUS[gpu].capability),
              async_tp_traced_as_gpu() if p.async_tp else contextlib.nullcontext()):
            with fake, live:
                trainer = Trainer(cfg, run_dir)
                make_compiled_weight_copies(trainer)
            check_grouped_gemms(trainer.cfg)
            if isinstance(backend := trainer.cfg.trainer.compile_backend, InductorCosts):  # the layout's own passes
                backend.options = {**(backend.options or {}), **trainer.parallel.inductor_config}  # (async TP's)
            params = storage_bytes(trainer.model.parameters())
            # the optimizer's states and the step's lasting buffers are made in a first step; pp micro-batches (an
            # interleaved schedule's smallest count) make them all, and the step's peak is step 1's
            run_step(trainer, 0, fake, live, first=cfg.parallel.pp)
            device = trainer.device.type  # the offload pool's host buffers are counted apart, as "host"
            static = live.bytes(device)
            grads = storage_bytes(_grad_buffers(trainer))
            comm = storage_bytes(getattr(trainer.optimizer, "gather_buffers", list)())  # none held past this line
            live.mark_peak()
            hsdp = is_hsdp(trainer.cfg.parallel)  # (the run's own config: `p.dp` may be unresolved)
            links = LINKS[gpu]
            inside = inside_node(p.tp, p.cp, p.ep, dims.dp, p.pp, p.fsdp_shard_size if hsdp else 0)
            costs, comms = OpCosts(GPUS[gpu], cfg.precision.tf32), Collectives(_group_names(trainer), inside)
            once = OnceAStep(costs, comms)
            with InFlight(costs, comms, links, inside) as in_flight:
                tokens = run_step(trainer, 1, fake, live, costs, comms, once=once)
            peak = live.peak(device)
            own, busiest = muon_form.replica_seconds(trainer.optimizer, functools.partial(
                newton_schulz_seconds, GPUS[gpu], cfg.precision.tf32, cfg.optim.muon_ns_steps, fake))
            wait = busiest - own
            domain = hdp_loads(trainer, 1)
            documents, sequences = step_documents(trainer, 1)
    finally:
        dist.destroy_process_group()
    moe = bool(cfg.model.moe.num_experts)
    reserve = reserve_bytes(peak, communicators(dims.tp, dims.pp, dims.cp, dims.dp, dims.ep if moe else 1,
                                                moe and p.sequence_parallel, hsdp))
    summary = costs.summary()
    return RankEstimate(role, rank, peak + reserve, params, grads, static - params - grads - comm, peak - static,
                        comm, live.peak("host"), reserve, summary["tflop"] * 1e12, summary["roofline_ms"] / 1e3 + wait,
                        comm_seconds(comms.bytes, links, inside) - in_flight.hidden_s, dict(comms.bytes),
                        tokens, once.ms / 1e3 + wait, domain, dict(comms.step_bytes), in_flight.hidden_s, documents,
                        sequences, once.flops, wait)


@contextlib.contextmanager
def async_tp_traced_as_gpu() -> Iterator[None]:
    """While inside, torch says NCCL is built in, as a GPU build does: inductor's async TP pass
    (megalm/parallel/tensor/async_tp.py) fuses nothing where it is not, which a CPU wheel's trace would price. The
    pass's warning for a graph without TP collectives is muted: the loss's chunk kernels, compiled by the trace's
    one backend (`InductorCosts`), get the blocks' options too."""
    import logging

    import torch.distributed as dist

    built_in, pass_log = dist.is_nccl_available, logging.getLogger("torch._inductor.fx_passes.micro_pipeline_tp")
    level = pass_log.level
    dist.is_nccl_available = lambda: True
    pass_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        dist.is_nccl_available = built_in
        pass_log.setLevel(level)


def make_compiled_weight_copies(trainer: Any) -> None:
    """Compiled `fp8` blocks below sm89 run their GEMMs as ops whose fake kernels compute nothing (compiled_linear.py;
    from sm89 the copies are made before each block runs, as on the GPU, where this makes them first), so the
    FP8 weight copies the ops keep in their layers' caches on a GPU (about 2 bytes per weight: fprop's, and dgrad's
    column-major one) are made here, under the trace, for its storage probe to count as the eager trace does."""
    from megalm.model.linear import linear_modules
    from megalm.precision.linear import RecipeGemms

    if not trainer.cfg.trainer.compile:
        return
    for module in linear_modules(trainer.model):
        gemms = module.gemm_recipe
        if isinstance(gemms, RecipeGemms) and gemms.recipe.casts_in_graph:
            gemms.make_weight_copies()


def check_grouped_gemms(cfg: Any) -> None:
    """The experts' torch._grouped_mm, as fake tensors trace it (`grouped_gemm_refusal`): anything it cannot take
    failed mid-trace with a torch traceback; one line instead."""
    from megalm.errors import ConfigError
    from megalm.precision import grouped_gemm_refusal

    if refusal := grouped_gemm_refusal(cfg):
        raise ConfigError(f"megalm-estimate traces {refusal[0]}; {refusal[1]}")


def communicators(tp: int, pp: int, cp: int, dp: int, ep: int = 1, experts_over_tp: bool = False,
                  hsdp: bool = False) -> int:
    """The parallel dimensions a rank talks over, each a communicator of NCCL buffers: tp, pp, cp and dp when
    larger than 1, expert parallelism's all-to-all group, the expert-data-parallel group of the routed experts'
    gradients (under sequence parallelism it spans the TP ranks, ep = 1 included), and HSDP's replicate group."""
    expert_dp = dp * cp // ep * (tp if experts_over_tp else 1)
    return (sum(size > 1 for size in (tp, pp, cp, dp)) + (ep > 1)
            + ((ep > 1 or experts_over_tp) and expert_dp > 1) + hsdp)


def reserve_bytes(peak: int, communicators: int) -> int:
    """What fake tensors cannot see, for a device peak of `peak` bytes and `communicators` parallel dimensions in
    use: the CUDA context, NCCL's buffers, the allocator's fragmentation (the module docstring's `RESERVE`)."""
    return RESERVE_CONTEXT + int(FRAGMENTATION * peak) + RESERVE_PER_COMMUNICATOR * communicators


def newton_schulz_seconds(gpu: Gpu, tf32: bool, steps: int, fake: Any, shape: tuple[int, ...]) -> float:
    """The roofline seconds of Muon's iterations on one matrix of `shape` (megalm/training/muon.py `orthogonalise`,
    traced on a fake tensor as the rank's own step traces them)."""
    from megalm.training.muon import orthogonalise

    costs = OpCosts(gpu, tf32)
    with fake:
        matrix = torch.empty(shape)
        with costs:
            orthogonalise(matrix, steps)
    return costs.total().ms / 1e3


def run_step(trainer: Any, step: int, fake: Any, live: LiveStorages, *traces: TorchDispatchMode,
             first: int | None = None, once: OnceAStep | None = None) -> int:
    """One training step of this rank: the step's data plan on the host, outside fake mode (it reads the documents'
    lengths), then forward, backward, gradient reduction, clipping and the optimizer step under `fake`
    (FakeTensorMode; a null context runs it on real tensors, which is how tests/dist/test_estimate_measured.py
    measures a real run with the same probe), with the probe `live` and the traces on; `first`: only the step's first
    micro-batches (a warm-up step, which makes the lasting state in a fraction of the time). Returns the real tokens
    the rank ran."""
    share = trainer.parallel.share_of_step(trainer.data.train, trainer.step_sample_ids(step), step)
    if first is not None:
        share = replace(share, micro_batches=share.micro_batches[:first])
    tokens = _real_tokens(share.micro_batches)
    store = trainer.parallel.offload_store
    with fake, live, contextlib.ExitStack() as stack:
        if store is not None:  # its pinned host buffers are host memory, not the device's
            stack.enter_context(live.labelling(store.pool, "allocate", "host"))
        for trace in traces:
            stack.enter_context(trace)
        trainer.parallel.forward_backward(share)
        # as Trainer.train_step: the gradient norm, the clip (folded into a fused AdamW's step), the step; `once`
        # prices them apart (they run once a step, whatever the micro-batches)
        with once or contextlib.nullcontext():
            trainer.parallel.clip_grad_norm_(trainer.cfg.trainer.grad_clip, trainer.optimizer)
            trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.optimizer.grad_scale = None
    return tokens


def step_documents(trainer: Any, step: int) -> tuple[list[int], int]:
    """(the input lengths of every document of `step`'s global batch, as its packed batches split them, which is
    what the trainer's MFU counts attention over; the step's sequences). Host work on the step's samples."""
    from megalm.data.batch import pack_samples

    ids, data = trainer.step_sample_ids(step), trainer.data.train
    return [n for k in ids for n in pack_samples([data[k]]).doc_lengths], len(ids)


def _real_tokens(micro_batches: list[Any]) -> int:
    """Positions with a loss (padding and pipeline fillers have none), read from the batches themselves."""
    return sum(int(mb.batch.loss_mask.sum()) for mb in micro_batches)


def hdp_loads(trainer: Any, step: int) -> dict[str, Any] | None:
    """Under HDP, every domain rank's share of `step` as the trainer's split builds it on the host: the real tokens
    each runs (`tokens`) and the largest ring it joins (`ring`, 1 when it runs only packed documents); plus the
    step's document lengths (`lengths`), from which tools/hdp_sim.py's planner and simulator derive their loads.
    Under expert parallelism, `lockstep` per domain rank: the step's time in lockstep (each micro-batch position
    waiting for the slowest rank of its EP group and of the groups a ring there joins, at the all-to-alls; the step
    ends with the slowest rank) over the rank's own time (its micro-batches and the pipeline's fill), both from HDP's
    cost model on the step's plan (the trace measures two ranks, not every rank's micro-batch at every position); 1
    otherwise."""
    from megalm.parallel.hdp.cost import simulate
    from megalm.parallel.hdp.split import HdpSplit

    split, data = trainer.parallel.split, trainer.data.train
    if not isinstance(split, HdpSplit):
        return None
    ids = trainer.step_sample_ids(step)
    lengths = [data.sample_length(k) - 1 for k in ids]
    plan = split.plan(lengths)  # planned once, each rank's batches built from it
    tokens = [_real_tokens(split.micro_batches_of(plan, h, data, ids, lengths)) for h in range(split.num_ranks)]
    ring = [max((len(plan.micro_batches[k].ranks) for k in todo if plan.micro_batches[k].seqs), default=1)
            for todo in plan.per_rank]
    lockstep = [1.0] * split.num_ranks
    if trainer.cfg.parallel.ep > 1:
        sim = simulate(plan, split.cost, split.pp, ep=trainer.cfg.parallel.ep)
        lockstep = [sim.step_time / own if own else 1.0 for own in sim.busy]
    return {"tokens": tokens, "ring": ring, "lengths": lengths, "lockstep": lockstep}


def _grad_buffers(trainer: Any) -> list[torch.Tensor]:
    """The data-parallel gradient buckets (and ZeRO-1's shards) the reducer keeps between steps."""
    return [t for bucket in trainer.parallel.reducer.buckets for t in (bucket.buffer, bucket.shard) if t is not None]


def _group_names(trainer: Any) -> dict[str, str]:
    """{process group name: its mesh dimension} of this rank's groups, HSDP's two among them (FSDP's own groups,
    which had been priced as `other`, across nodes, the shard group's gathers within a node included)."""
    mesh, names = trainer.parallel.mesh, {}
    for dim in ("dp_cp", "tp", "cp", "dp", "pp", "embedding", "ep", "expert_dp"):  # dp_cp: dp's own when cp = 1
        group = getattr(mesh, f"{dim}_group", None)
        if group is not None:
            names[group.group_name] = dim
    fsdp = getattr(trainer.parallel, "fsdp_mesh", None)
    if fsdp is not None and fsdp.ndim == 2:  # (replicate, shard)
        names[fsdp.get_group(0).group_name], names[fsdp.get_group(1).group_name] = "fsdp_replicate", "fsdp_shard"
    return names


# ------------------------------------------------------------------------------------------------ the whole layout

BATCH_DEFAULTS = "trainer.micro_batch_size=1, trainer.global_batch_size=4 x pp x dp (4·pp micro-batches per pipeline)"


AUTO_PRECISION = "precision not given: precision=auto is bf16 on every --gpu (compute capability 8.0 and newer)"


def gpu_precision(overrides: list[str]) -> list[str]:
    """`precision=auto` (the default) resolved as on the GPU rather than on this CPU (where it means fp32)."""
    from megalm.config.compose import compose_config

    if str(compose_config(overrides).precision.name) != "auto":
        return overrides
    return [*overrides, "precision=bf16"]


RAMP_PRICED_WHOLE = ("trainer.rampup_batch_size: priced at the whole trainer.global_batch_size, where the ramp "
                     "ends; its earlier steps run fewer micro-batches (a larger pipeline bubble)")
RAMP_NOT_SEARCHED = ("trainer.rampup_batch_size: the layouts were searched at the whole trainer.global_batch_size; "
                     "megalm-train checks that each of the ramp's sizes splits over the chosen layout's micro-batches")


def whole_batch(overrides: list[str], world: int | None) -> list[str]:
    """The run's steps once a batch ramp-up is over (`trainer.rampup_batch_size` dropped): the step the estimate
    prices, and the one most of a run takes. With `world` (not a search, whose layouts vary), the ramp's sizes are
    first checked against the layout's micro-batches, as megalm-train checks them."""
    from megalm.config.compose import compose_config
    from megalm.parallel.data_parallel.slices import validate_data_parallel
    from megalm.parallel.pipeline.stages import validate_pipeline

    cfg = compose_config(overrides)
    if cfg.trainer.rampup_batch_size is None:
        return overrides
    if world is not None:
        p = cfg.parallel
        p.dp = max(world // (p.tp * p.pp * p.cp), 1)
        validate_data_parallel(cfg)
        validate_pipeline(cfg)
    return [*overrides, "trainer.rampup_batch_size=null"]


def override_keys(overrides: list[str]) -> set[str]:
    """The config keys a command's overrides set (`+key=value` too)."""
    return {o.split("=", 1)[0].lstrip("+") for o in overrides}


def batch_overrides(overrides: list[str], world: int) -> list[str]:
    """The estimator's batch when the command line sets none (megalm-train's defaults are for the tiny CPU model):
    one sequence per micro-batch and 4·pp micro-batches per step, so the pipeline's bubble is (pp - 1) / (5·pp - 1)."""
    from megalm.config.compose import compose_config

    if {"trainer.micro_batch_size", "trainer.global_batch_size", "trainer.tokens_per_step"} & override_keys(overrides):
        return overrides
    p = compose_config(overrides).parallel
    dp = world // (p.tp * p.pp * p.cp)
    return [*overrides, "trainer.micro_batch_size=1", f"trainer.global_batch_size={4 * p.pp * dp}"]


def bubble_factor(pp: int, micro_batches: int, schedule: str, vpp: int) -> float:
    """Step time over a rank's compute time, from the schedule the runtime runs, simulated with a backward twice a
    forward (megalm.parallel.pipeline.schedules): (m + p - 1) / m for 1F1B, less for interleaved and zero-bubble
    schedules (Narayanan et al. 2021; Qi et al. 2023)."""
    from megalm.parallel.pipeline.schedules import build_schedule, simulate_schedule

    if pp == 1:
        return 1.0
    timeline = simulate_schedule(build_schedule(schedule, pp, micro_batches, vpp), f=1.0, b=1.0, w=1.0)
    return timeline.makespan / max(timeline.busy)


def check_gpu(gpu: str) -> None:
    """A ConfigError naming the GPUs the estimator knows, for any other `--gpu`."""
    from megalm.errors import ConfigError

    if gpu not in GPUS:
        raise ConfigError(f"--gpu {gpu}: unknown GPU; expected one of {', '.join(sorted(GPUS))}")


def fp8_notes(precision: Any, gpu: str) -> list[str]:
    """What the estimate of an FP8 recipe's step traces that the GPU runs otherwise (one line, none for others)."""
    from megalm.precision import has_fp8_gemms

    if not has_fp8_gemms(precision):
        return []
    if getattr(precision, "backend", "native") == "torchao":  # torchao's Float8Linear, traced as it runs
        return [f"precision={precision.name} on torchao's Float8Linear: its casts and GEMMs traced as its eager ops "
                "(compiled blocks: as inductor fuses them), dequantized where the GPU has no FP8 tensor cores"]
    gemms = ("the GPU's torch._scaled_mm" if GPUS[gpu].fp8_tflops
             else f"megalm runs them on {gpu}, which has no FP8 tensor cores: dequantized to fp32 GEMMs")
    return [f"precision={precision.name}: FP8 GEMMs traced as {gemms}; each cast to FP8 as the GPU's one compiled "
            "kernel (priced by its bytes; the eager twin's fp32 temporaries count in the peak)"]


def prices_compiled_blocks(cfg: Any) -> bool:
    """Whether the estimate traces `trainer.compile=true` compiled (module docstring): not under a recipe whose
    linears compiled blocks run as opaque ops with their casts inside (per-tensor FP8's casts are in the graph, and
    its GEMM ops are priced by their FLOPs: megalm/measure/op_cost.py), nor on a torch that cannot compile over fake
    tensors."""
    from megalm.precision import compiles_in_sight

    return (cfg.trainer.compile and compiles_in_sight(cfg.precision) and compat.compiles_over_fake_tensors()
            and not zero_bubble(cfg.parallel))  # its compiled linears' ops: `compile_notes`


def trace_compiled_blocks(cfg: Any) -> None:
    """Set `cfg`'s `trainer.compile` up for a trainer traced under fake tensors (module docstring): inductor's
    backend swapped for `InductorCosts` (inductor's own kernels cannot run on fake tensors), and compile off under
    a recipe whose linears compiled blocks run as opaque ops with their casts inside (`prices_compiled_blocks`),
    once the config has passed the checks
    `trainer.compile=true` makes in training. Resets dynamo (torch._dynamo.reset: every compiled function of the
    process is dropped), so that each traced rank compiles afresh under its own fake mode and no search of many
    layouts reaches dynamo's recompile limit, past which it would run the blocks eager."""
    from megalm.precision import validate_precision
    from megalm.training.compile import inductor_options
    from megalm.training.device import resolve_auto_precision

    asked = cfg.trainer.compile  # None: auto, which a CUDA run may resolve to compiled blocks
    if asked:
        resolve_auto_precision(cfg, torch.device("cpu"))  # as the fake trainer, on the CPU, would
        validate_precision(cfg)
        torch._dynamo.reset()
        cfg.trainer.compile = prices_compiled_blocks(cfg)
        if cfg.trainer.compile_backend == "inductor":  # an object in a str field: a traced trainer saves no config
            cfg.trainer.compile_backend = InductorCosts(inductor_options())  # megalm's blocks' inductor config
    # priced without async TP, as `compile_notes` says, where a run would run it (or turn it off itself) but the
    # trace cannot; not where every run refuses it (trainer.compile=false, no sequence parallelism), which the
    # trainer's checks then say as megalm-train does
    if cfg.parallel.async_tp and cfg.parallel.sequence_parallel and (
            cfg.parallel.tp > GPUS_PER_NODE or asked is None or (asked and not cfg.trainer.compile)):
        cfg.parallel.async_tp = False


def async_tp_unpriced(cfg: Any) -> str | None:
    """Why `parallel.async_tp=true` is left out of the trace (None: priced, or not asked for): blocks priced eager
    (`trainer.compile` null, or false after `trace_compiled_blocks`), or a TP group wider than a node, which a run
    refuses (megalm/parallel/tensor/async_tp.py)."""
    if not cfg.parallel.async_tp:
        return None
    if cfg.parallel.tp > GPUS_PER_NODE:
        return f"parallel.tp={cfg.parallel.tp} spans nodes, where a run turns it off (symmetric memory joins one node)"
    if not cfg.trainer.compile or not prices_compiled_blocks(cfg):
        return "it fuses compiled blocks' collectives, and the blocks are priced eager"
    return None


def compile_notes(cfg: Any, graph_breaks: int = 0) -> list[str]:
    """What the estimate of compiled blocks traces that the GPU runs otherwise (a line each, none otherwise);
    `graph_breaks`: dynamo's count over the traced steps."""
    unpriced = async_tp_unpriced(cfg)
    return [*([f"parallel.async_tp=true: not priced ({unpriced})"] if unpriced else []),
            *_compiled_block_notes(cfg, graph_breaks)]


def _compiled_block_notes(cfg: Any, graph_breaks: int) -> list[str]:
    from megalm.training.compile import auto_compile

    if cfg.trainer.compile is None:  # auto: priced eager, as the trace's CPU trainer resolves it
        if not auto_compile(cfg, torch.device("cuda"))[0]:  # the trace runs on the CPU; the estimate is of a GPU
            return []
        hidden = ("; the TP collectives it hides behind the GEMMs are eager's, which compiled blocks run "
                  "synchronously" if cfg.parallel.tp > 1 else "")
        return ["trainer.compile left at null (auto): blocks priced eager, where a CUDA run of this config compiles "
                f"them; trainer.compile=true prices them compiled{hidden}"]
    if not cfg.trainer.compile:
        return []
    if not compat.compiles_over_fake_tensors():
        return [f"trainer.compile=true: blocks priced eager (torch {torch.__version__} cannot compile over the "
                "trace's fake tensors; torch 2.11 and later can)"]
    if zero_bubble(cfg.parallel):
        return ["trainer.compile=true, parallel.pp_schedule=zb: blocks priced eager (compiled zero-bubble blocks run "
                "their linears' GEMMs as opaque ops that hand dW to the W action, which a trace under fake tensors "
                "does not run)"]
    if not prices_compiled_blocks(cfg):
        return [f"trainer.compile=true, precision={cfg.precision.name}: blocks priced eager (compiled blocks run its "
                "linears as opaque ops with their casts inside, which a trace under fake tensors does not run)"]
    if graph_breaks:  # the CPU's attention over unequal documents: one SDPA call per document, read on the host
        return [f"trainer.compile=true: {graph_breaks} graph breaks in the blocks over this CPU trace's ranks (on "
                "unequal documents a CPU's attention runs per document; CUDA's varlen kernel compiles whole): what "
                "they cut out, a recomputed block's whole region under selective or full recompute, is priced eager"]
    return []


def step_seconds(rank: RankEstimate, stretch: float) -> float:
    """A rank's step: its micro-batches' compute stretched by `stretch` (the pipeline's bubble, HDP's lockstep waits),
    its optimizer step's (once a step, after the micro-batches: stretched by neither; it was until 2026-12-05), its
    exposed collectives."""
    return (rank.compute_s - rank.optimizer_s) * stretch + rank.optimizer_s + rank.comm_s


def lockstep_notes(cfg: Any, lockstep: dict[int, float]) -> list[str]:
    """HDP under expert parallelism runs every rank's micro-batches in lockstep (megalm/parallel/hdp/pipelined.py):
    each measured rank's micro-batch compute is scaled by its factor (`hdp_loads`; `lockstep`: {domain rank:
    factor}) for the waits, which the note says."""
    p = cfg.parallel
    if not (p.hdp and p.ep > 1):
        return []
    factors = ", ".join(f"x{f:.3f} (domain rank {h})" for h, f in sorted(lockstep.items()))
    return [f"parallel.hdp=true with parallel.ep={p.ep}: every micro-batch waits for the slowest rank of its EP group "
            f"(and of the groups a ring joins) at each MoE layer's all-to-all (ranks run in lockstep); the measured "
            f"ranks' micro-batch compute is priced {factors} for those waits, from HDP's cost model on the step's plan "
            "(tools/hdp_plan.py), not from the trace"]


def estimate(overrides: list[str], world: int, gpu: str) -> dict[str, Any]:
    """Every rank role of the layout, and the step's time, MFU and tokens/s (see the module docstring)."""
    from megalm.config.checks import resolve_model_defaults
    from megalm.config.compose import compose_config
    from megalm.errors import ConfigError
    from megalm.training.flops import training_flops

    check_gpu(gpu)
    cfg = compose_config(overrides)
    p = cfg.parallel
    per_replica = p.tp * p.pp * p.cp
    if world < per_replica or world % per_replica:
        raise ConfigError(f"--world {world} is not a multiple of tp x pp x cp = {per_replica}; change --world or the "
                          "layout")
    dp = world // per_replica
    # the run's own check names torchrun's process count, which here is --world (below 1: its own rule says so)
    if p.dp is not None and p.dp >= 1 and p.dp != dp:
        raise ConfigError(f"parallel.dp={p.dp} with tp x pp x cp = {per_replica} makes {p.dp * per_replica} GPUs, not "
                          f"--world {world}; set --world {p.dp * per_replica}, or drop parallel.dp (it follows "
                          "--world)")
    from torch._dynamo.utils import counters  # trainer.compile=true: dynamo counts its breaks over the traced ranks

    breaks_before = sum(counters["graph_break"].values())
    ranks = [estimate_rank(overrides, world, stage, role, gpu) for role, stage in roles(p.pp)]
    indices = [0] * len(ranks)  # each measured rank's index in the HDP domain
    hdp = ranks[0].domain
    if hdp is not None:  # HDP: also the rank of the step's largest ring (the most tokens among equals), first stage
        h = max(range(len(hdp["tokens"])), key=lambda i: (hdp["ring"][i], hdp["tokens"][i]))
        if h == 0:
            ranks[0].role += ", largest ring"
        else:
            ranks.insert(1, estimate_rank(overrides, world, 0, f"largest ring ({hdp['ring'][h]} ranks), "
                                          f"{ranks[0].role}", gpu, h))
            indices.insert(1, h)
    if cfg.trainer.tokens_per_step is None:
        micro_batches = cfg.trainer.global_batch_size // (cfg.trainer.micro_batch_size * dp)
        tokens = cfg.trainer.global_batch_size * cfg.model.seq_length
    else:  # a token budget: the traced step's sequences and tokens (global_batch_size is not read)
        micro_batches = max(1, math.ceil(ranks[0].sequences / (cfg.trainer.micro_batch_size * dp)))
        tokens = sum(ranks[0].documents)
    factor = bubble_factor(p.pp, micro_batches, str(p.pp_schedule.value), p.vpp)
    # the waits of HDP's lockstep under EP (`hdp_loads`), per measured rank
    lockstep = {h: hdp["lockstep"][h] if hdp is not None else 1.0 for h in indices}
    step_time = max(step_seconds(r, factor * lockstep[h]) for r, h in zip(ranks, indices, strict=True))
    # the step's own documents (until 2026-12-05 one of model.seq_length a sequence: packed documents shorter than
    # that made the MFU too high, over 100% at 128K)
    flops = training_flops(resolve_model_defaults(cfg.model, p.tp), ranks[0].documents)
    mfu = flops / (world * GPUS[gpu].bf16_tflops * 1e12 * step_time)
    fits = all(r.peak_bytes <= HBM_BYTES[gpu] for r in ranks)
    graph_breaks = sum(counters["graph_break"].values()) - breaks_before
    return {"model": cfg.model.name, "world": world, "gpu": gpu, "hbm_bytes": HBM_BYTES[gpu], "fits": fits,
            "layout": {"tp": p.tp, "pp": p.pp, "cp": p.cp, "dp": dp, **({"ep": p.ep} if p.ep > 1 else {}),
                       "vpp": p.vpp, "schedule": str(p.pp_schedule.value),
                       "micro_batches": micro_batches, "sequence_parallel": p.sequence_parallel,
                       "zero1": p.zero1, "recompute": str(p.recompute), "precision": str(cfg.precision.name),
                       **({"compile": True} if cfg.trainer.compile else {})},
            "ranks": [{k: v for k, v in asdict(r).items() if k not in ("domain", "documents")} for r in ranks],
            "step_time_s": step_time, "bubble_factor": factor, "mfu": mfu, "tokens_per_s": tokens / step_time,
            "global_flops": flops,
            "notes": fp8_notes(cfg.precision, gpu) + compile_notes(cfg, graph_breaks) + lockstep_notes(cfg, lockstep),
            **({"hdp": {"tokens_per_rank": hdp["tokens"], "largest_ring": hdp["ring"], "lengths": hdp["lengths"],
                        "lockstep_factors": hdp["lockstep"]}}
               if hdp else {})}
