"""HDP in the trainer: this rank's micro-batches of a step's plan, each with the ring it runs on.

Every rank of the HDP domain (the D = dp·cp ranks that share a TP and PP coordinate) plans the step
itself: the lengths of the global batch are known without reading a token (`VarlenDataset.sample_length`),
the planner is deterministic (planner.py), so all ranks agree on the plan with no communication. Then
each rank reads only what it runs (`HdpSplit.micro_batches`):

- a local micro-batch: the whole documents packed on it;
- a ring micro-batch of n ranks: only this rank's two zigzag chunks of the document
  (megalm/parallel/context/zigzag.py), plus the one token after each chunk that its last label needs.
  No token is read twice in the domain except those chunk-boundary labels (the TP ranks and pipeline
  stages of one HDP rank read the same data, as under DP);
- a filler (pipelines and expert parallelism only, pipelined.py): one masked token, which adds zero loss and zero
  gradient.

Which ring a micro-batch runs on is data: each `LocalMicroBatch` carries its `Ring` (ordered global
ranks, this rank's position), from which the parallelism builds the micro-batch's attention context
(megalm/parallel/context/attention.py). A ring runs ring attention over its ordered global ranks on the
default group (docs/architecture.md, "CP rings over explicit rank lists": no communicator per ring).

The loss normaliser is the token count of the whole global batch, and gradients are summed over the
HDP domain (`mesh.dp_cp_group`), so the update is the single-process update on the same batch.
"""

from __future__ import annotations

import logging
import math
import os

import numpy as np
import torch

from megalm.config import MegalmConfig
from megalm.config.checks import moe_layer_ids
from megalm.config.schema import ModelConfig
from megalm.data.batch import PackedBatch, Sample, pack_samples
from megalm.data.dataset import VarlenDataset
from megalm.errors import ConfigError, MegalmError
from megalm.parallel.context.attention import cp_a2a_size
from megalm.parallel.context.zigzag import shard_batch, zigzag_chunks, zigzag_plan
from megalm.parallel.dims import ParallelMesh
from megalm.parallel.hdp.cost import CostModel, ModelShape, load_cost, offload_ratio, preset
from megalm.parallel.hdp.pipelined import align_rings, check_pipelined, in_lockstep
from megalm.parallel.hdp.plan import Plan
from megalm.parallel.hdp.planner import plan_hdp
from megalm.parallel.microbatch import LocalMicroBatch, Ring
from megalm.parallel.pipeline.stages import stage_layer_counts

log = logging.getLogger("megalm")


def filler_batch() -> PackedBatch:
    """One masked token: a pipeline slot with no loss and an exactly zero gradient."""
    zero = torch.zeros(1, dtype=torch.int64)
    return PackedBatch(tokens=zero, labels=zero.clone(), loss_mask=torch.zeros(1), position_ids=zero.clone(),
                       cu_seqlens=torch.tensor([0, 1], dtype=torch.int32), max_seqlen=1, doc_lengths=[1])


def read_ring_shard(dataset: VarlenDataset, k: int, n: int, index: int, inner: int = 1
                    ) -> tuple[PackedBatch, torch.Tensor]:
    """Rank `index`'s zigzag shard over a ring of `n` of sample k, reading only its chunks' tokens, and which of
    its tokens are real (bool [T]; the rest is zigzag padding, which an MoE router must not count).

    The sample's L inputs are padded to 2n chunks of c = ceil(L / 2n); the rank holds input positions
    [index·c, (index+1)·c) and [(2n−1−index)·c, (2n−index)·c) (a hierarchical ring, `inner` > 1: its own
    back chunk, `zigzag_chunks`), so it reads those tokens and the next one (the last label). Unread tokens
    stay 0 in a host buffer that `shard_batch` never gathers from.
    """
    length = dataset.sample_length(k)
    inputs = length - 1
    c = -(-inputs // (2 * n))
    tokens = np.zeros(length, dtype=np.int64)
    for chunk in zigzag_chunks(n, index, inner):
        start = min(chunk * c, inputs)
        stop = min((chunk + 1) * c, inputs) + 1  # + the label of the chunk's last input
        if stop - 1 > start:
            tokens[start:stop] = dataset.read(k, start, stop - start)
    full = pack_samples([Sample(tokens, (length,))])
    plan = zigzag_plan(full.cu_seqlens, n, inner)
    return shard_batch(full, plan, index), plan.local_source(index) >= 0


class HdpSplit:
    """Plans each step over the HDP domain and builds this rank's micro-batches.

    `capacity` (parallel.hdp_capacity) is C in tokens; `pp`/`schedule`/`vpp` make pipelined plans aligned and
    checked; in lockstep (expert parallelism, `lockstep`, or interleaved pipelines) every rank's micro-batches are as
    many and aligned, a multiple of pp when interleaved (pipelined.py). The
    domain index of a rank is h = dp_rank·cp + cp_rank; `domain[h]` its global rank at this rank's TP and PP
    coordinates.
    """

    def __init__(self, mesh: ParallelMesh, capacity: int, cost: CostModel, pp: int = 1, schedule: str = "1f1b",
                 offload: bool = False, hierarchical: bool = False, lockstep: bool = False, vpp: int = 1):
        d = mesh.dims
        self.mesh, self.capacity, self.cost, self.pp, self.schedule = mesh, capacity, cost, pp, schedule
        self.vpp = vpp
        # cp_comm=a2a+p2p: rings that span nodes are hierarchical (cost.ranks_per_node HDP ranks a group), those
        # inside one may be Ulysses; cp_comm=ring: every ring flat
        self.hierarchical = hierarchical
        self.offload = offload  # ByteScale's selective offload: rings of d(s) = ceil((1 - r(s)) s / C) ranks
        self.interleaved = schedule == "interleaved" and pp > 1
        self.lockstep = lockstep or self.interleaved
        self.domain = d.domain_ranks(mesh.tp_rank, mesh.pp_rank)
        self.num_ranks = len(self.domain)
        self.index = mesh.dp_rank * d.cp + mesh.cp_rank
        self.last_plan: Plan | None = None

    @classmethod
    def for_config(cls, cfg: MegalmConfig, mesh: ParallelMesh) -> HdpSplit:
        """The split a run of `cfg` uses (the trainer's and tools/hdp_plan.py's)."""
        p = cfg.parallel
        return cls(mesh, p.hdp_capacity, hdp_cost_model(cfg), p.pp, p.pp_schedule, p.hdp_offload,
                   hierarchical=p.cp_comm == "a2a+p2p", lockstep=p.ep > 1, vpp=p.vpp)

    def plan(self, lengths: list[int]) -> Plan:
        """The step's plan over input lengths; with pp > 1, rings aligned and checked deadlock-free; in lockstep,
        as many micro-batches on every rank, rings aligned."""
        # with selective offload the narrower rings are a choice: the plan without them competes
        plan = plan_hdp(lengths, self.num_ranks, self.capacity, self.cost, pp=self.pp, offload=self.offload,
                        hierarchical=self.hierarchical)
        if self.lockstep:
            plan = in_lockstep(plan, self.pp if self.interleaved else 1)
        elif self.pp > 1:
            plan = align_rings(plan)
        if self.pp > 1:
            try:
                check_pipelined(plan, self.pp, self.schedule, self.vpp)
            except ValueError as e:  # not seen in randomized tests; stop rather than hang every rank
                raise MegalmError(f"{e}. This is a megalm bug (please report it with the step); meanwhile try "
                                  "parallel.pp_schedule=1f1b or another parallel.hdp_capacity") from None
        self.last_plan = plan
        return plan

    def micro_batches(self, dataset: VarlenDataset, ids: range) -> tuple[list[LocalMicroBatch], int]:
        """This rank's micro-batches of the global batch of samples `ids`, in plan order (on the host, the
        ring shards already cut), and the batch's loss-token count (one document per sample: every input
        token carries a loss). A ring's document is counted by its first rank only."""
        lengths = [dataset.sample_length(k) - 1 for k in ids]
        plan = self.plan(lengths)
        return self.micro_batches_of(plan, self.index, dataset, ids, lengths), sum(lengths)

    def micro_batches_of(self, plan: Plan, index: int, dataset: VarlenDataset, ids: range,
                         lengths: list[int]) -> list[LocalMicroBatch]:
        """Domain rank `index`'s micro-batches of `plan` over the samples `ids` of input `lengths`
        (megalm-estimate reads every rank's, from one plan)."""
        out = []
        for k in plan.per_rank[index]:
            mb = plan.micro_batches[k]
            offload = self.offload_fraction(mb.tokens, len(mb.ranks))  # a ring planned smaller: offloads r(s)
            if not mb.seqs:  # its one token is padding to an MoE router too
                out.append(LocalMicroBatch(filler_batch(), k, real_tokens=torch.zeros(1, dtype=torch.bool)))
            elif len(mb.ranks) == 1:
                samples = [dataset[ids[i]] for i in mb.seqs]
                counted = [lengths[i] for i in mb.seqs]
                out.append(LocalMicroBatch(pack_samples(samples), k, counted_doc_lengths=counted,
                                           offload_fraction=offload))
            else:
                (i,) = mb.seqs
                position = mb.ranks.index(index)
                ring = Ring(tuple(self.domain[h] for h in mb.ranks), position, mb.inner)
                shard, real = read_ring_shard(dataset, ids[i], len(mb.ranks), position, mb.inner)
                counted = [lengths[i]] if position == 0 else []
                out.append(LocalMicroBatch(shard, k, ring=ring, counted_doc_lengths=counted,
                                           offload_fraction=offload, real_tokens=real))
        return out

    def offload_fraction(self, tokens: int, d: int) -> float:
        """The share of its activations a micro-batch of `tokens` on d ranks offloads: r(s) for a document
        whose ring is smaller than ceil(s / C) (planned with selective offload), else 0."""
        if not self.offload or tokens <= d * self.capacity:
            return 0.0
        return offload_ratio(tokens, self.cost)


def hdp_cost_model(cfg: MegalmConfig) -> CostModel:
    """`parallel.hdp_cost`: a preset or YAML (cost.load_cost) at the run's tp (`CostModel.at_tp`); unset, the
    first-principles model of this model's shape on H100s, one HDP rank = one TP group (only the balance depends on
    it). Under
    `parallel.cp_comm=a2a+p2p` a node holds `parallel.cp_a2a_size` HDP ranks (the all-to-all groups), and the kv
    heads are the model's."""
    if cfg.parallel.hdp_cost:
        # a YAML or preset describes HDP ranks of its own tp (1 unless it says): rescaled to the run's, where a node
        # holds gpus_per_node / tp ranks (a ring of 5 to 8 ranks at tp 2 crosses nodes)
        cost = load_cost(cfg.parallel.hdp_cost).at_tp(cfg.parallel.tp)
    else:
        m = cfg.model
        shape = ModelShape(layers=m.num_layers, hidden=m.hidden_size, heads=m.num_heads, kv_heads=m.num_kv_heads,
                           ffn=active_ffn(m), vocab=m.padded_vocab_size or m.vocab_size)
        # the run's own capacity (validate_hdp fills it under HDP; outside it, for PipeOffload's copy ratio, what a
        # micro-batch holds): the preset's H100 memory model may find no room at this tp for a model the run's
        # memory holds, and the times are all the trainer takes from this model
        capacity = cfg.parallel.hdp_capacity or cfg.model.seq_length * cfg.trainer.micro_batch_size
        cost = preset(shape, tp=cfg.parallel.tp, capacity=capacity)
    if cfg.parallel.cp_comm == "a2a+p2p":
        kv_heads = max(1, cfg.model.num_kv_heads // cfg.parallel.tp)
        heads = math.gcd(kv_heads, cfg.model.num_heads // cfg.parallel.tp)
        cost = cost.replace(ranks_per_node=cp_a2a_size(cfg), heads=heads)
    # selective offload works per chunk (the whole model without a pipeline), its r(s) capped to keep two blocks of
    # the smallest one resident: the model's own count, which a cost model's YAML may not share
    return cost.replace(chunk_layers=min(n for n in stage_layer_counts(cfg) if n))


def active_ffn(model: ModelConfig) -> int:
    """The MLP width a token runs through, a mean over the blocks: the dense FFN's, or in a block with experts its k
    routed experts' and the shared experts' (the cost model's per-token GEMM time; until 2026-12-05 an MoE model was
    priced at its dense blocks' width in every block)."""
    moe = model.moe
    if not moe.num_experts:
        return model.ffn_hidden_size
    shared = (moe.shared_ffn_hidden_size or 0) if moe.num_shared_experts else 0
    routed = moe.top_k * moe.expert_ffn_hidden_size + shared
    experts = len(moe_layer_ids(model))
    return round((experts * routed + (model.num_layers - experts) * model.ffn_hidden_size) / model.num_layers)


def validate_hdp(cfg: MegalmConfig) -> None:
    """HDP rules: documents as samples, the capacity, and what ring micro-batches need (ring CP rules).
    Fills `parallel.hdp_capacity` when unset (the static CP share of a sample: ceil(seq_length / cp))."""
    p, m = cfg.parallel, cfg.model
    if not p.hdp:
        for key in ("hdp_capacity", "hdp_cost"):
            if getattr(p, key) is not None:
                raise ConfigError(f"parallel.{key} is set but parallel.hdp=false; set parallel.hdp=true or remove it")
        if p.hdp_offload:
            raise ConfigError("parallel.hdp_offload=true is HDP's selective offload; set parallel.hdp=true or drop it")
        return
    if p.hdp_offload and not cfg.offload.enabled:
        raise ConfigError("parallel.hdp_offload=true plans rings that hold only 1 - r(s) of a long document's "
                          "activations; set offload.enabled=true so that the rest goes to host memory")
    if not cfg.data.varlen:
        raise ConfigError("parallel.hdp=true balances documents of different lengths; set data.varlen=true")
    if p.hdp_capacity is None:
        p.hdp_capacity = -(-m.seq_length // p.cp)
    if p.hdp_capacity < 1:
        raise ConfigError(f"parallel.hdp_capacity={p.hdp_capacity} must be >= 1 (tokens per rank per micro-batch)")
    domain = p.dp * p.cp
    widest = -(-m.seq_length // p.hdp_capacity)
    if widest > domain:
        raise ConfigError(f"a sample of model.seq_length={m.seq_length} tokens needs {widest} ranks of "
                          f"parallel.hdp_capacity={p.hdp_capacity}, but the HDP domain dp*cp has {domain}; raise "
                          f"parallel.hdp_capacity to >= {-(-m.seq_length // domain)} or use more ranks")
    if p.hdp_cost is not None:
        try:
            load_cost(p.hdp_cost)
        except Exception as e:  # a missing file, bad YAML, missing or mistyped keys
            raise ConfigError(f"parallel.hdp_cost={p.hdp_cost} cannot be loaded ({type(e).__name__}: {e}); "
                              "give a preset (7b) or a YAML like configs/hdp_cost/h100_7b.yaml") from None
    if p.hdp_offload and offload_ratio(m.seq_length, cost := hdp_cost_model(cfg)) == 0.0:
        blocks = cost.chunk_layers  # the model's, set by hdp_cost_model
        why = (f"{blocks} {'blocks of a pipeline chunk' if p.pp * p.vpp > 1 else 'layers'} keep 2 resident "
               f"(r_max = 1 - 2/{blocks})" if blocks < 3 else
               "the cost model has no host link or activation sizes (host_bw, act_bytes)")
        log.warning(f"parallel.hdp_offload=true offloads nothing here: r(s) is 0 for every document ({why}); the "
                    "rings are planned as without it (docs/hdp.md)")
    if p.cp_comm == "a2a":
        raise ConfigError("parallel.hdp=true forms rings of any size over rank lists, which Ulysses' fixed groups "
                          "cannot; set parallel.cp_comm=ring or a2a+p2p (hierarchical rings)")
    # a document of any length may run on a ring: a long one, and a short one that would outlast the step's mean
    # load alone (the planner widens it); a capacity of seq_length had let dropout through to fail on that step
    if domain > 1 and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        log.warning("CUDA_DEVICE_MAX_CONNECTIONS=1 under parallel.hdp=true: the GPU then runs the rings' and the "
                    "gradient reductions' communicators in issue order, which can hang a rank whose last micro-batch "
                    "is a ring (docs/hdp.md); unset it")
    if domain > 1 and m.attention_dropout > 0:
        raise ConfigError("parallel.hdp=true may run any document with ring attention over several ranks (a long "
                          "one, or a short one that outlasts the step's mean load), which has no attention dropout; "
                          "set model.attention_dropout=0")
