"""Cost model for HDP planning and simulation: how long a micro-batch keeps a rank (or a ring) busy.

ByteScale (Ge et al. 2025, arXiv 2502.21231) balances ranks by *time*, not by tokens:
attention is quadratic in the document length, so a rank holding a slice of a 1M-token document is
busy far longer than one holding as many tokens of short documents. Per transformer layer, a
micro-batch of documents s_i (packed, varlen attention that never crosses a document) costs one rank

    T = a·Σ s_i² + b·Σ s_i + c                                    (docs/hdp.md, "Cost model")

with a the causal attention forward+backward (7·h FLOPs per token pair: 2·h in the forward for the
causal half of QKᵀ and PV, ×3.5 with FlashAttention's recomputing backward), b the linear layers
(6 FLOPs per weight per token) and c a fixed cost per micro-batch (launches, syncs).

A document sharded over a ring of d ranks (zigzag, so the causal work is even) costs each member
(a·s² + b·s)/d + c plus the communication its attention does not hide. Ring attention takes d steps;
in each of the d−1 transfers a rank sends its KV chunk (s/d tokens × kv_bytes for K and V, ×3 for
forward KV, backward KV and dKV) while it computes attention on the current chunk (a·s²/d²):

    exposed = (d−1) · max(0, latency + 3·(s/d)·kv_bytes / bw − overlap·a·s²/d²)

bw is the NVLink bandwidth if the ring stays inside a node and the NIC's otherwise (a ring step is as
slow as its slowest edge). overlap < 1 says the overlap is partial (the two streams share SMs and
memory bandwidth). Linear layers are not overlapped with the ring.

Hierarchical CP (`inner` = u > 1, megalm/parallel/context/hierarchical.py): the d ranks are r = d/u groups of u
ranks of one node. An all-to-all inside each group (q, k, v in and the output back, their gradients in the
backward: 2·(qo_bytes + kv_bytes)·(s/d)·(u−1)/u bytes per rank per layer over NVLink) is not overlapped; then a
ring over the r groups, each step moving s/r tokens for H/u heads (passes·(s/d)·kv_bytes per rank over the NIC)
behind a·s²·u/d² of attention:

    exposed = a2a + (r−1) · max(0, latency + 3·(s/d)·kv_bytes / bw_inter − overlap·a·s²·u/d²)

so the NIC bytes fall by u and each step hides u times more. u = d (one group, r = 1) is plain Ulysses.

Until calibrated with measurements on a GPU, the coefficients are derived from first principles,
FLOPs / (peak × efficiency): `preset()` computes them from a model shape, configs/hdp_cost/*.yaml
store them, and the scheduler and the simulator (tools/hdp_sim.py) read the same numbers.
No torch import: the planner runs on every rank's CPU each step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml  # PyYAML comes with omegaconf

from megalm.parallel.hdp.plan import tokens_per_rank

GiB = 2**30


@dataclass(frozen=True)
class CostModel:
    """Seconds per micro-batch; a, b, c are per layer, `head` per token for the whole model."""

    a: float  # s per (token pair) per layer: causal attention fwd+bwd
    b: float  # s per token per layer: linear layers fwd+bwd
    c: float  # s per micro-batch per layer: launch/sync overhead
    layers: int = 1
    head: float = 0.0  # s per token: embedding + LM head + loss, whole model
    kv_bytes: float = 0.0  # bytes per token per layer of K and V (2 · h_kv · 2 bytes in bf16)
    comm_passes: float = 3.0  # KV forward, KV and dKV backward
    bw_intra: float = 3.0e11  # bytes/s per rank inside a node (NVLink, one peer)
    bw_inter: float = 4.0e10  # bytes/s per rank across nodes (400 Gb/s NIC at 80%)
    latency: float = 2.0e-5  # s per ring step per layer (p2p setup, sync)
    overlap: float = 0.8  # fraction of a ring step's attention that hides its transfer
    ranks_per_node: int = 8  # HDP ranks per node (GPUs per node / tp)
    capacity: int = 8192  # default tokens per rank per micro-batch (parallel.hdp_capacity)
    act_bytes: float = 0.0  # e: activation bytes per token kept for the backward, per GPU, all layers
    act_fixed: float = 0.0  # f: model-state bytes per GPU (activation memory A(s) = e·s + f on top)
    host_bw: float = 0.0  # bytes/s per GPU to host memory (activation offload)
    qo_bytes: float = 0.0  # bytes per token per layer of q and the attention output (2 · h · 2 in bf16): all-to-all
    heads: int = 0  # kv heads per HDP rank: an all-to-all group size must divide them (0: no limit)
    chunk_layers: int = 0  # blocks of the pipeline's smallest chunk, which offloads r of its own (0: no pipeline)
    tp: int = 1  # GPUs in one HDP rank (its TP group) that these coefficients describe: `at_tp` rescales them
    source: str = ""  # where the coefficients come from (first principles, the estimator, a GPU calibration)
    name: str = "custom"

    def parts(self, tokens: float, sum_sq: float, d: int = 1, intra: bool = True, inner: int = 1
              ) -> tuple[float, float]:
        """(compute, exposed communication) seconds of one micro-batch on each of its d ranks; `inner` > 1: a
        hierarchical ring of d/inner groups (inner == d: Ulysses inside one node)."""
        compute = self.layers * ((self.a * sum_sq + self.b * tokens) / d + self.c) + self.head * tokens / d
        if d == 1:
            return compute, 0.0
        if inner > 1:
            groups = d // inner
            a2a = 2 * (self.qo_bytes + self.kv_bytes) * tokens / d * (inner - 1) / inner / self.bw_intra
            step_comm = self.latency + self.comm_passes * tokens / d * self.kv_bytes / self.bw_inter
            step_attn = self.a * sum_sq * inner / (d * d)
            ring = (groups - 1) * max(0.0, step_comm - self.overlap * step_attn)
            return compute, self.layers * (a2a + ring)
        bw = self.bw_intra if intra else self.bw_inter
        step_comm = self.latency + self.comm_passes * tokens / d * self.kv_bytes / bw
        step_attn = self.a * sum_sq / (d * d)
        return compute, self.layers * (d - 1) * max(0.0, step_comm - self.overlap * step_attn)

    def time(self, tokens: float, sum_sq: float, d: int = 1, intra: bool = True, inner: int = 1) -> float:
        """Seconds one micro-batch (documents with Σs = tokens, Σs² = sum_sq) keeps each of its d ranks."""
        compute, comm = self.parts(tokens, sum_sq, d, intra, inner)
        return compute + comm

    def ring_bytes(self, tokens: float, d: int, inner: int = 1) -> float:
        """Bytes the d members of a ring send in total for one micro-batch (all layers, fwd + bwd): K/V round the
        ring, plus a hierarchical ring's all-to-alls."""
        if d <= 1:
            return 0.0
        groups = d // inner
        a2a = 2 * (self.qo_bytes + self.kv_bytes) * tokens * (inner - 1) / inner
        return self.layers * (self.comm_passes * (groups - 1) * tokens * self.kv_bytes + a2a)

    def splits_heads(self, u: int) -> bool:
        """Whether an all-to-all group of u ranks can split the kv heads (`heads` 0: no limit)."""
        return self.heads == 0 or self.heads % u == 0

    @property
    def group_size(self) -> int:
        """u, the all-to-all group of a hierarchical ring that spans nodes: a node's ranks, when the kv heads split
        over them (else 1: flat rings only)."""
        u = self.ranks_per_node
        return u if u > 1 and self.splits_heads(u) else 1

    def cp_layout(self, tokens: float, sum_sq: float, d: int, hierarchical: bool = True) -> tuple[int, float]:
        """(inner, seconds) of the fastest way to run a one-document micro-batch on d ranks placed as the planner
        places them: inside one node (d ≤ ranks_per_node) a ring over NVLink or, if the kv heads split, Ulysses;
        across nodes, whole nodes as groups of a hierarchical ring when d is a multiple of `group_size`, else a
        flat ring at NIC speed (also when `hierarchical` is off)."""
        n = self.ranks_per_node
        if d <= n:
            best = (1, self.time(tokens, sum_sq, d, True))
            if d > 1 and hierarchical and self.splits_heads(d):
                a2a = self.time(tokens, sum_sq, d, True, inner=d)
                best = (d, a2a) if a2a < best[1] else best
            return best
        u = self.group_size
        if hierarchical and u > 1 and d % u == 0:
            return u, self.time(tokens, sum_sq, d, False, inner=u)
        return 1, self.time(tokens, sum_sq, d, False)

    def intra(self, ranks: tuple[int, ...] | list[int]) -> bool:
        """True when all ranks sit in one node (ranks are numbered node by node)."""
        n = self.ranks_per_node
        return ranks[0] // n == ranks[-1] // n and all(r // n == ranks[0] // n for r in ranks)

    def replace(self, **changes) -> CostModel:
        return dataclasses.replace(self, **changes)

    def at_tp(self, tp: int) -> CostModel:
        """This model for HDP ranks of `tp` GPUs, by `preset`'s rules: a rank has tp× the FLOPs (90% TP efficiency
        past tp 1) and tp× the links, a node holds gpus_per_node / tp ranks, and the activation and state bytes
        per GPU and the kv heads per rank are 1/tp. The per-micro-batch overhead c stays, and so does `capacity`
        (the trainer plans with its own `parallel.hdp_capacity`); the name says the tp."""
        if tp == self.tp:
            return self
        k = tp / self.tp
        speed = k * _tp_efficiency(tp) / _tp_efficiency(self.tp)
        heads = max(1, self.heads * self.tp // tp) if self.heads else 0
        return self.replace(a=self.a / speed, b=self.b / speed, head=self.head / speed, bw_intra=self.bw_intra * k,
                            bw_inter=self.bw_inter * k, ranks_per_node=max(1, self.ranks_per_node * self.tp // tp),
                            act_bytes=self.act_bytes / k, act_fixed=self.act_fixed / k, heads=heads, tp=tp,
                            name=f"{self.name.split('@tp')[0]}@tp{tp}")

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        """The model a YAML mapping describes, each value converted to its field's type and checked: YAML reads
        `c: 1e-3` (no dot) as a string, which passed and failed mid-training in the planner; a count below 1 divided
        by zero there."""
        if not isinstance(d, dict):
            raise ValueError(f"a cost model is a mapping of coefficients, got {type(d).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(d) - set(fields)
        if unknown:
            raise ValueError(f"unknown cost model keys: {sorted(unknown)}")
        if missing := [n for n, f in fields.items() if f.default is dataclasses.MISSING and n not in d]:
            raise ValueError(f"the cost model lacks {', '.join(missing)}")
        values = {}
        for name, value in d.items():
            kind = {"float": float, "int": int, "str": str}[str(fields[name].type)]
            try:
                if kind is not str and isinstance(value, bool):  # YAML's true is no coefficient
                    raise ValueError
                if kind is int and float(value) != int(float(value)):
                    raise ValueError
                values[name] = kind(float(value)) if kind is int else kind(value)
            except (TypeError, ValueError, OverflowError):  # OverflowError: .inf for a count
                raise ValueError(f"cost model key {name}={value!r} is not a{'n' if kind is int else ''} "
                                 f"{kind.__name__}") from None
            low = 1 if name in ("layers", "ranks_per_node", "capacity", "tp") else 0  # counts, and times or rates
            if kind is not str and not (math.isfinite(values[name]) and values[name] >= low):
                raise ValueError(f"cost model key {name}={value!r} must be a finite number >= {low}")
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | Path) -> CostModel:
        try:
            with open(path) as f:
                data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"cost model {path} is not YAML ({str(e).splitlines()[0]})") from None
        return cls.from_dict(data)


def pipeline_cost(total: float, longest: float, pp: int) -> float:
    """Step time of a pipeline of pp stages running micro-batches of total time `total` (one stage
    holds 1/pp of the layers): Σt/pp + (pp−1)·max(t)/pp, i.e. (m + pp − 1) stage slots for m equal
    micro-batches. ByteScale's PP-balance weighs pipelines by this, not by Σt alone."""
    return (total + (pp - 1) * longest) / pp


# ---------------------------------------------------------------------------------------------
# Execution model: checking and costing a plan (megalm.parallel.hdp.Plan)


def execute(plan, duration) -> tuple[list[float], list[list[tuple[float, float, int]]]]:
    """Run every rank's list in order; a multi-rank micro-batch starts when all its ranks reach it.
    duration(mb_index) gives its time. Returns (finish time per rank, per-rank (start, end, mb)).
    Raises ValueError if some ranks wait on each other forever (inconsistent ring order)."""
    D = plan.num_ranks
    mbs, per_rank = plan.micro_batches, plan.per_rank
    clock = [0.0] * D
    pos = [0] * D
    arrived: dict[int, int] = {}
    ready: dict[int, float] = {}
    timeline: list[list[tuple[float, float, int]]] = [[] for _ in range(D)]
    stack = list(range(D - 1, -1, -1))
    while stack:
        r = stack.pop()
        todo = per_rank[r]
        while pos[r] < len(todo):
            k = todo[pos[r]]
            ranks = mbs[k].ranks
            if len(ranks) == 1:
                t0 = clock[r]
                clock[r] = t0 + duration(k)
                timeline[r].append((t0, clock[r], k))
                pos[r] += 1
                continue
            n = arrived.get(k, 0) + 1
            arrived[k] = n
            ready[k] = max(ready.get(k, 0.0), clock[r])
            if n < len(ranks):
                break
            t0 = ready[k]
            t1 = t0 + duration(k)
            for m in ranks:
                clock[m] = t1
                timeline[m].append((t0, t1, k))
                pos[m] += 1
                if m != r:
                    stack.append(m)
    stuck = [r for r in range(D) if pos[r] < len(per_rank[r])]
    if stuck:
        k = per_rank[stuck[0]][pos[stuck[0]]]
        raise ValueError(f"deadlock: {len(stuck)} ranks wait forever, e.g. rank {stuck[0]} at micro-batch {k} "
                         f"(ranks {mbs[k].ranks[:8]}...): rings are ordered differently on their ranks")
    return clock, timeline


def ring_size(s: int, capacity: int) -> int:
    """Minimal number of ranks for a document of s tokens: ceil(s / C)."""
    return -(-s // capacity)


def offload_ratio(s: int, cost: CostModel) -> float:
    """ByteScale's selective offload (arXiv 2502.21231, communication optimizer): the share r(s) of a document's
    activations that goes to host memory, the largest whose copy hides under the document's forward.

    Per layer, a document of s tokens on d ranks keeps e·s/d activation bytes on each (e = act_bytes / layers)
    and computes for (a·s² + b·s + c)/d seconds, a third of it forward (backward ≈ 2x forward). Offloading r
    of the activations during forward (and reloading them during backward, the other direction of the link)
    is hidden when r·e·s/d / host_bw <= (a·s² + b·s + c) / (3d), so

        r(s) = min(r_max, host_bw · (a·s² + b·s + c) / (3·e·s)),   r_max = 1 − 2 / L,

    independent of d; it grows with s (compute ~s², activations ~s): long documents can offload more.
    r_max keeps two blocks resident (the one computing and the one being reloaded: megalm.offload's
    layer-wise offload offloads the first ceil(r·L) blocks). L is the blocks one offload covers: the model's
    layers, or with a pipeline its smallest chunk's (`chunk_layers`), each chunk offloading r of its own: r_max
    over the whole model offloaded every block of a 4-block chunk of a 32-layer 7B at pp 8, the last one's reload
    then waited for where the model took it as hidden. 0 without a host link or activation sizes in the cost model,
    or under 3 blocks.
    """
    blocks = cost.chunk_layers or cost.layers
    if s <= 0 or cost.host_bw <= 0 or cost.act_bytes <= 0 or blocks < 3:
        return 0.0
    per_layer = cost.act_bytes / cost.layers
    hidden = cost.host_bw * (cost.a * s * s + cost.b * s + cost.c) / (3 * per_layer * s)
    return min(1.0 - 2.0 / blocks, hidden)


def offload_ring_size(s: int, capacity: int, cost: CostModel) -> int:
    """Ranks a document of s tokens needs when it offloads r(s) of its activations: d(s) = ceil((1 − r(s))·s / C)
    (at least 1) instead of ceil(s / C): fewer ring members, less ring traffic."""
    return max(1, math.ceil((1.0 - offload_ratio(s, cost)) * s / capacity - 1e-9))


def fits(tokens: int, d: int, capacity: int, ratio: float = 0.0) -> bool:
    """Whether a micro-batch of `tokens` over d ranks, offloading `ratio` of its activations, keeps each rank
    within `capacity` tokens of resident activations."""
    return (1.0 - ratio) * tokens <= d * capacity + 1e-9 if ratio else ring_size(tokens, d) <= capacity


def check_plan(plan, lengths: Sequence[int], num_ranks: int, capacity: int, offload: CostModel | None = None
               ) -> None:
    """Raise ValueError naming the first violation: every document in exactly one micro-batch, token
    counts right, no rank over `capacity` tokens per micro-batch (of resident activations: with `offload`, the
    cost model of a plan made with selective offload, a one-document micro-batch may offload r(s) of them),
    each micro-batch listed exactly on its ranks, and an execution order without deadlock (rings in a
    consistent order on shared ranks)."""
    if len(plan.per_rank) != num_ranks:
        raise ValueError(f"plan has {len(plan.per_rank)} ranks, expected {num_ranks}")
    seen = [0] * len(lengths)
    for k, mb in enumerate(plan.micro_batches):
        d = len(mb.ranks)
        if d == 0 or len(set(mb.ranks)) != d or not all(0 <= r < num_ranks for r in mb.ranks):
            raise ValueError(f"micro-batch {k}: bad rank list {mb.ranks}")
        for i in mb.seqs:
            seen[i] += 1
        if mb.tokens != sum(lengths[i] for i in mb.seqs):
            raise ValueError(f"micro-batch {k}: tokens {mb.tokens} != sum of its document lengths")
        total = mb.tokens + mb.padding
        ratio = offload_ratio(total, offload) if offload is not None and len(mb.seqs) == 1 else 0.0
        if not fits(total, d, capacity, ratio):
            raise ValueError(f"micro-batch {k}: {total} tokens over {d} ranks exceed capacity {capacity}")
        if mb.inner < 1 or d % mb.inner:
            raise ValueError(f"micro-batch {k}: all-to-all groups of {mb.inner} do not divide its {d} ranks")
    for i, n in enumerate(seen):
        if n != 1:
            raise ValueError(f"document {i} is assigned {n} times")
    listed: dict[int, list[int]] = {}
    for r, todo in enumerate(plan.per_rank):
        for k in todo:
            if not 0 <= k < len(plan.micro_batches):
                raise ValueError(f"rank {r} lists unknown micro-batch {k}")
            listed.setdefault(k, []).append(r)
    for k, mb in enumerate(plan.micro_batches):
        if sorted(listed.get(k, [])) != sorted(mb.ranks):
            raise ValueError(f"micro-batch {k} on ranks {mb.ranks} is listed by ranks {listed.get(k, [])}")
    execute(plan, lambda k: 0.0)


@dataclass
class SimResult:
    step_time: float
    finish: list[float]  # per rank, with the pipeline fill/drain
    compute: list[float]  # per rank, seconds of compute
    comm: list[float]  # per rank, seconds of exposed CP communication
    cp_bytes: float  # bytes sent over CP rings in the step, all ranks
    padding: int  # padded token positions computed
    timeline: list[list[tuple[float, float, int]]]  # per rank (start, end, micro-batch)
    durations: list[tuple[float, float]]  # per micro-batch (compute, exposed comm), per stage
    tokens: list[int] = field(default_factory=list)  # per rank, real tokens run (plan.tokens_per_rank)
    busy: list[float] = field(default_factory=list)  # per rank, its own micro-batches and pipeline fill (no waits)

    @property
    def utilization(self) -> float:
        """Compute seconds / (ranks × step time): idle waiting, exposed comm and bubbles are waste."""
        return sum(self.compute) / (len(self.compute) * self.step_time) if self.step_time else 0.0


def _root(joined: list[int], r: int) -> int:
    """The representative of r's set in the union-find `joined` (parent links, halved on the way)."""
    while joined[r] != r:
        joined[r] = joined[joined[r]]
        r = joined[r]
    return r


def _in_lockstep(plan, duration, ep: int) -> tuple[list[float], list[list[tuple[float, float, int]]]]:
    """`execute` of a plan whose ranks run as many micro-batches, a ring's at one position on all its ranks. At each
    position the ranks that wait for each other (every group of `ep` consecutive ranks, an EP group's all-to-alls,
    and every ring, which joins the groups of its ranks) start when the last of them ends the position before, and
    end with the slowest micro-batch among them."""
    counts = {len(todo) for todo in plan.per_rank}
    if len(counts) > 1:
        raise ValueError(f"a plan in lockstep gives every rank as many micro-batches, not {sorted(counts)}")
    n = plan.num_ranks
    timeline: list[list[tuple[float, float, int]]] = [[] for _ in plan.per_rank]
    end = [0.0] * n
    for index, position in enumerate(zip(*plan.per_rank, strict=True)):
        joined = list(range(n))  # union-find over the ranks that wait for each other at this position
        for r, k in enumerate(position):
            ring = plan.micro_batches[k].ranks
            if any(position[other] != k for other in ring):
                raise ValueError(f"micro-batch {k} of ranks {ring} is not at position {index} on all of them: a plan "
                                 "in lockstep aligns its rings")
            for other in (r - r % ep, *ring):
                joined[_root(joined, r)] = _root(joined, other)
        waiting: dict[int, list[int]] = {}
        for r in range(n):
            waiting.setdefault(_root(joined, r), []).append(r)
        for ranks in waiting.values():
            start = max(end[r] for r in ranks)
            finish = start + max(duration(position[r]) for r in ranks)
            for r in ranks:
                timeline[r].append((start, start + duration(position[r]), position[r]))
                end[r] = finish
    return end, timeline


def simulate(plan, cost: CostModel, pp: int = 1, ep: int = 1) -> SimResult:
    """Simulated step time of a plan: in-order execution, rings wait for all members; with pp > 1
    each rank is a pipeline whose stages take 1/pp of a micro-batch's time, plus a fill/drain of
    (pp−1)·(its longest micro-batch)/pp. With `ep` > 1 (expert parallelism: a plan of `pipelined.in_lockstep`, as
    many micro-batches on every rank) each EP group of ep consecutive ranks waits at every position for its slowest
    rank's micro-batch, as each MoE layer's all-to-all does, and so do the groups a ring there joins (until
    2026-12-05 the whole domain waited for its slowest rank, which over-priced the waits with ep below the domain's
    size). Gradient reduction and the optimizer step are not included."""
    durations = []
    cp_bytes = 0.0
    for mb in plan.micro_batches:
        d = len(mb.ranks)
        if not mb.seqs:
            durations.append((0.0, 0.0))
            continue
        comp, comm = cost.parts(mb.tokens + mb.padding, mb.sum_sq, d, d == 1 or cost.intra(mb.ranks), mb.inner)
        durations.append((comp / pp, comm / pp))
        cp_bytes += cost.ring_bytes(mb.tokens + mb.padding, d, mb.inner)
    if ep > 1:
        clock, timeline = _in_lockstep(plan, lambda k: durations[k][0] + durations[k][1], ep)
    else:
        clock, timeline = execute(plan, lambda k: durations[k][0] + durations[k][1])
    D = plan.num_ranks
    compute, comm, finish, busy = [0.0] * D, [0.0] * D, clock[:], [0.0] * D
    for r, todo in enumerate(plan.per_rank):
        longest = 0.0
        for k in todo:
            c, e = durations[k]
            compute[r] += c
            comm[r] += e
            longest = max(longest, c + e)
        finish[r] += (pp - 1) * longest
        busy[r] = compute[r] + comm[r] + (pp - 1) * longest
    padding = sum(mb.padding for mb in plan.micro_batches)
    return SimResult(max(finish, default=0.0), finish, compute, comm, cp_bytes, padding, timeline, durations,
                     tokens_per_rank(plan), busy)


# ---------------------------------------------------------------------------------------------
# First-principles presets


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int

    @property
    def kv_dim(self) -> int:
        return self.hidden // self.heads * self.kv_heads

    @property
    def attention_params(self) -> int:  # q, o: h²; k, v: h·h_kv
        return 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_dim

    @property
    def layer_params(self) -> int:  # attention and SwiGLU's 3·h·ffn
        return self.attention_params + 3 * self.hidden * self.ffn

    @property
    def params(self) -> int:  # untied embedding and LM head
        return self.layers * self.layer_params + 2 * self.vocab * self.hidden


# 1b and 7b as in configs/model/1.3b.yaml and 7b.yaml; 13b and 70b are the Llama-2 shapes.
SHAPES = {
    "1b": ModelShape(layers=24, hidden=2048, heads=16, kv_heads=16, ffn=5504, vocab=50304),
    "7b": ModelShape(layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000),
    "13b": ModelShape(layers=40, hidden=5120, heads=40, kv_heads=40, ffn=13824, vocab=32000),
    "70b": ModelShape(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000),
}
DEFAULT_TP = {"1b": 1, "7b": 1, "13b": 2, "70b": 8}  # smallest TP whose memory holds ≥ 8K tokens


@dataclass(frozen=True)
class Hardware:
    """One GPU and its links. Defaults: H100 SXM 80 GB, NVLink 4, one 400 Gb/s NIC per GPU."""

    peak_flops: float = 989.4e12  # dense bf16
    hbm_bytes: float = 80 * GiB
    bw_intra: float = 3.0e11  # achievable NVLink p2p to one peer, bytes/s
    bw_inter: float = 4.0e10  # 400 Gb/s NIC at 80%
    gpus_per_node: int = 8
    host_bw: float = 5.0e10  # PCIe Gen5 x16, achievable per direction


H100 = Hardware()


def memory_model(shape: ModelShape, tp: int = 1) -> tuple[float, float]:
    """(e, f): activation bytes per token and model-state bytes, per GPU.

    f: bf16 weights + bf16 gradients, 4 bytes/param / tp; the fp32 master copy and Adam moments
    (12 bytes/param) are ZeRO-1 sharded over the large HDP domain (≈ 0). e: selective recomputation
    with flash attention (Korthikanti et al. 2022, eq. 2 without the 5·a·s/h term): 34·h bytes per
    layer per token / tp, plus the bf16 logits (the loss writes their gradient over them, and the fp32 chunk it
    holds at a time is a fixed quarter GB, inside `memory_capacity`'s workspace: megalm.model.loss).
    """
    return (shape.layers * 34 * shape.hidden + 2 * shape.vocab) / tp, 4 * shape.params / tp


def memory_capacity(shape: ModelShape, tp: int = 1, hw: Hardware = H100) -> int:
    """Tokens one HDP rank (a TP group) holds per micro-batch: (90% of HBM − 4 GiB of workspace − f) / e,
    rounded down to a power of two, which keeps the baselines' CP groups exact (cp = context / C)."""
    e, f = memory_model(shape, tp)
    free = 0.9 * hw.hbm_bytes - f - 4 * GiB
    if free <= e:
        raise ValueError(f"model does not fit: {f / GiB:.1f} GiB of state per GPU at tp={tp}")
    return 2 ** int(math.log2(free / e))


def _tp_efficiency(tp: int) -> float:
    """The share of tp GPUs' FLOPs a TP group delivers (the presets' assumption)."""
    return 0.9 if tp > 1 else 1.0


def preset(
    model: str | ModelShape,
    tp: int | None = None,
    hw: Hardware = H100,
    eff_linear: float = 0.55,
    eff_attn: float = 0.45,
    c: float = 1.0e-4,
    capacity: int | None = None,
) -> CostModel:
    """Cost model for a named shape ("1b", "7b", "13b", "70b") or any `ModelShape`, from
    FLOPs / (peak × efficiency). `capacity`: the tokens a rank holds, when the run sets it (the trainer's
    `parallel.hdp_capacity`); by default what `memory_capacity` gives on `hw`.

    One HDP rank is a TP group of `tp` GPUs: it has tp× the FLOPs (at 90% TP efficiency for tp > 1),
    tp NICs, and gpus_per_node / tp ranks share a node.
    """
    if isinstance(model, ModelShape):
        shape, tp = model, tp or 1
    elif model in SHAPES:
        shape, tp = SHAPES[model], tp or DEFAULT_TP[model]
    else:
        raise ValueError(f"unknown model {model!r}; known: {sorted(SHAPES)}")
    # a named shape's model is not the YAML of its name (configs/hdp_cost/h100_7b.yaml: derived from megalm's block),
    # and says so: both were "h100_7b" in a plan's and the simulator's output
    label = f"{model}_preset" if isinstance(model, str) else f"{shape.layers}L-{shape.hidden}h"
    flops = hw.peak_flops * tp * _tp_efficiency(tp)
    e, f = memory_model(shape, tp)
    return CostModel(
        a=7 * shape.hidden / (flops * eff_attn),
        b=6 * shape.layer_params / (flops * eff_linear),
        c=c,
        layers=shape.layers,
        head=6 * shape.hidden * shape.vocab / (flops * eff_linear),
        kv_bytes=2 * shape.kv_dim * 2,
        bw_intra=hw.bw_intra * tp,
        bw_inter=hw.bw_inter * tp,
        ranks_per_node=max(1, hw.gpus_per_node // tp),
        capacity=memory_capacity(shape, tp, hw) if capacity is None else capacity,
        act_bytes=e,
        act_fixed=f,
        host_bw=hw.host_bw,
        qo_bytes=2 * shape.hidden * 2,
        heads=max(1, shape.kv_heads // tp),
        tp=tp,
        source=f"first principles: FLOPs / (peak x efficiency {eff_linear} linear, {eff_attn} attention)",
        name=f"h100_{label}" if hw == H100 else label,
    )


def load_cost(name_or_path: str) -> CostModel:
    """A preset name ("7b"), a file under configs/hdp_cost ("h100_7b") or a path to a YAML file."""
    if name_or_path in SHAPES:
        return preset(name_or_path)
    path = Path(name_or_path)
    if not path.suffix:
        path = Path(__file__).resolve().parents[3] / "configs" / "hdp_cost" / f"{name_or_path}.yaml"
    if not path.exists():
        raise ValueError(f"no cost model {name_or_path!r}: not a preset {sorted(SHAPES)} and no file {path}")
    return CostModel.from_yaml(path)
