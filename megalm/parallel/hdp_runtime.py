"""HDP in the trainer: this rank's micro-batches of a step's plan, and attention over each one's ring.

Every rank of the HDP domain (the D = dp·cp ranks that share a TP and PP coordinate) plans the step
itself: the lengths of the global batch are known without reading a token (`VarlenDataset.sample_length`),
the planner is deterministic (hdp.py), so all ranks agree on the plan with no communication. Then
each rank reads only what it runs (`HdpRuntime.micro_batches`):

- a local micro-batch: the whole documents packed on it;
- a ring micro-batch of n ranks: only this rank's two zigzag chunks of the document (context.py),
  plus the one token after each chunk that its last label needs. No token is read twice in the domain
  except those chunk-boundary labels (the TP ranks and pipeline stages of one HDP rank read the same
  data, as under DP);
- a filler (pipelines only, hdp_pipeline.py): one masked token, which adds zero loss and zero gradient.

Which ring a micro-batch runs on is data, not module state: `bind_ring` attaches it to the
micro-batch's `cu_seqlens` tensor, and `hdp_attention` (set as every layer's `attention_fn`) looks it
up per call. The model passes the same `cu_seqlens` object to every layer of a micro-batch, in its
forward, in its recomputation and in any pipeline stage, so interleaved micro-batches on different
rings (1F1B, full recompute) each find their own ring. A ring runs `context_attention` over its ordered
global ranks on the default group (DESIGN.md joint 4: no communicator per ring).

The loss normaliser is the token count of the whole global batch, and gradients are summed over the
HDP domain (`mesh.dp_cp_group`), so the update is the single-process update on the same batch.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from megalm.data.batch import PackedBatch, Sample, pack_samples
from megalm.data.dataset import VarlenDataset
from megalm.errors import MegalmError
from megalm.model.attention import varlen_attention
from megalm.parallel.context import context_attention, shard_batch, zigzag_plan
from megalm.parallel.dims import ParallelMesh
from megalm.parallel.hdp import Plan, plan_hdp
from megalm.parallel.hdp_cost import CostModel
from megalm.parallel.hdp_pipeline import align_rings, check_pipelined


@dataclass(frozen=True)
class Ring:
    """The ordered global ranks a ring micro-batch runs on, and this rank's position in them."""

    ranks: tuple[int, ...]
    index: int


_RINGS: dict[int, tuple[weakref.ref, Ring | None]] = {}  # id(cu_seqlens) -> (its weakref, ring or None: local)


def bind_ring(cu_seqlens: torch.Tensor, ring: Ring | None) -> None:
    """Record that the micro-batch with these `cu_seqlens` runs on `ring` (None: on this rank alone)."""
    for key in [k for k, (ref, _) in _RINGS.items() if ref() is None]:
        del _RINGS[key]
    _RINGS[id(cu_seqlens)] = (weakref.ref(cu_seqlens), ring)


def ring_of(cu_seqlens: torch.Tensor) -> Ring | None:
    entry = _RINGS.get(id(cu_seqlens))
    if entry is None or entry[0]() is not cu_seqlens:
        raise RuntimeError("hdp_attention got a micro-batch no ring was bound to; prepare HDP micro-batches "
                           "with Trainer._prepare (megalm.parallel.hdp_runtime.bind_ring)")
    return entry[1]


def hdp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                  backend: str = "auto", dropout_p: float = 0.0, scale: float | None = None) -> torch.Tensor:
    """`varlen_attention`'s signature: plain attention for a local micro-batch, ring attention over the
    micro-batch's bound ring otherwise."""
    ring = ring_of(cu_seqlens)
    if ring is None:
        return varlen_attention(q, k, v, cu_seqlens, max_seqlen, backend, dropout_p, scale)
    return context_attention(q, k, v, cu_seqlens, max_seqlen, backend, dropout_p, scale, ranks=ring.ranks,
                             rank_index=ring.index, group=None, comm="ring")


def apply_hdp_attention(model: torch.nn.Module) -> None:
    """Every attention layer of `model` (a GPT or a pipeline chunk) dispatches on its micro-batch's ring."""
    for layer in model.layers:
        layer.attention.attention_fn = hdp_attention


@dataclass
class HdpMicroBatch:
    """One entry of this rank's list: the batch as the model takes it (a ring's zigzag shard), its ring,
    its index in the plan (seeds random rounding), and the documents this rank counts for throughput
    (a ring's document is counted by its first rank only)."""

    batch: PackedBatch
    ring: Ring | None
    plan_index: int
    counted_doc_lengths: list[int]


def filler_batch() -> PackedBatch:
    """One masked token: a pipeline slot with no loss and an exactly zero gradient."""
    zero = torch.zeros(1, dtype=torch.int64)
    return PackedBatch(tokens=zero, labels=zero.clone(), loss_mask=torch.zeros(1), position_ids=zero.clone(),
                       cu_seqlens=torch.tensor([0, 1], dtype=torch.int32), max_seqlen=1, doc_lengths=[1])


def read_ring_shard(dataset: VarlenDataset, k: int, n: int, index: int) -> PackedBatch:
    """Rank `index`'s zigzag shard over a ring of `n` of sample k, reading only its chunks' tokens.

    The sample's L inputs are padded to 2n chunks of c = ceil(L / 2n); the rank holds input positions
    [index·c, (index+1)·c) and [(2n−1−index)·c, (2n−index)·c), so it reads those tokens and the next one
    (the last label). Unread tokens stay 0 in a host buffer that `shard_batch` never gathers from.
    """
    length = dataset.sample_length(k)
    inputs = length - 1
    c = -(-inputs // (2 * n))
    tokens = np.zeros(length, dtype=np.int64)
    for chunk in (index, 2 * n - 1 - index):
        start = min(chunk * c, inputs)
        stop = min((chunk + 1) * c, inputs) + 1  # + the label of the chunk's last input
        if stop - 1 > start:
            tokens[start:stop] = dataset.read(k, start, stop - start)
    full = pack_samples([Sample(tokens, (length,))])
    return shard_batch(full, zigzag_plan(full.cu_seqlens, n), index)


class HdpRuntime:
    """Plans each step over the HDP domain and builds this rank's micro-batches.

    `capacity` (parallel.hdp_capacity) is C in tokens; `pp`/`schedule` make pipelined plans aligned and
    checked (hdp_pipeline.py). The domain index of a rank is h = dp_rank·cp + cp_rank.
    """

    def __init__(self, mesh: ParallelMesh, capacity: int, cost: CostModel, pp: int = 1, schedule: str = "1f1b"):
        d = mesh.dims
        self.mesh, self.capacity, self.cost, self.pp, self.schedule = mesh, capacity, cost, pp, schedule
        self.num_ranks = d.dp * d.cp
        self.index = mesh.dp_rank * d.cp + mesh.cp_rank
        self.last_plan: Plan | None = None

    def global_rank(self, h: int) -> int:
        """Global rank of HDP index h at this rank's TP and PP coordinates (rank order tp, cp, dp, pp)."""
        return (self.mesh.pp_rank * self.num_ranks + h) * self.mesh.dims.tp + self.mesh.tp_rank

    def plan(self, lengths: list[int]) -> Plan:
        """The step's plan over input lengths; with pp > 1, rings aligned and checked deadlock-free."""
        plan = plan_hdp(lengths, self.num_ranks, self.capacity, self.cost, pp=self.pp)
        if self.pp > 1:
            plan = align_rings(plan)
            try:
                check_pipelined(plan, self.pp, self.schedule)
            except ValueError as e:  # not seen in randomized tests; stop rather than hang every rank
                raise MegalmError(f"{e}. This is a megalm bug (please report it with the step); meanwhile try "
                                  "parallel.pp_schedule=1f1b or another parallel.hdp_capacity") from None
        self.last_plan = plan
        return plan

    def micro_batches(self, dataset: VarlenDataset, ids: range) -> tuple[list[HdpMicroBatch], int]:
        """This rank's micro-batches of the global batch of samples `ids`, in plan order, and the batch's
        loss-token count (one document per sample: every input token carries a loss)."""
        lengths = [dataset.sample_length(k) - 1 for k in ids]
        plan = self.plan(lengths)
        out = []
        for k in plan.per_rank[self.index]:
            mb = plan.micro_batches[k]
            if not mb.seqs:
                out.append(HdpMicroBatch(filler_batch(), None, k, []))
            elif len(mb.ranks) == 1:
                samples = [dataset[ids[i]] for i in mb.seqs]
                out.append(HdpMicroBatch(pack_samples(samples), None, k, [lengths[i] for i in mb.seqs]))
            else:
                (i,) = mb.seqs
                position = mb.ranks.index(self.index)
                ring = Ring(tuple(self.global_rank(h) for h in mb.ranks), position)
                shard = read_ring_shard(dataset, ids[i], len(mb.ranks), position)
                out.append(HdpMicroBatch(shard, ring, k, [lengths[i]] if position == 0 else []))
        return out, sum(lengths)
