"""ByteScale hybrid data parallelism (HDP): which ranks run which documents, decided every step.

ByteScale (Ge et al. 2025, arXiv 2502.21231) merges the DP and CP dimensions into one HDP domain of
D = dp·cp ranks and re-plans the global batch each step. A document of s tokens needs
d(s) = ceil(s / C) ranks, C the per-rank token capacity of one micro-batch (parallel.hdp_capacity):

- documents with s ≤ C are packed best-fit onto single ranks and run with no CP traffic;
- longer ones get a ring of exactly d(s) ranks (any integer, not a power of two), run by CP ring
  attention over that ordered list of global ranks (docs/architecture.md);
- the balance scheduler weighs work with the cost model (cost.py: a·s² + b·s + c per layer plus
  exposed ring traffic) so that ranks finish together: ranks run different numbers of micro-batches,
  which is exact because the loss is a sum over tokens divided by the step's token count;
- with pipeline parallelism each HDP rank is one pipeline; its cost is Σt + (pp−1)·max t (ByteScale's
  PP-balance), so pipelines that hold a long ring get fewer micro-batches.

A `Plan` is data: `micro_batches` (each with its ordered ranks and document indices) and, per rank,
the indices of the micro-batches it runs in order. A ring micro-batch is a collective: it starts when
all its ranks reach it. Rings appear in one global order on every rank, so plans cannot deadlock.

Baselines in the same terms, for tools/hdp_sim.py: `plan_static` (pack to the context length, shard
every packed sequence over a fixed cp group) and `plan_megatron_hybrid` (Megatron-LM's hybrid CP:
power-of-two CP groups, s²/d workload, greedy rounds separated by barriers). Pure Python, no torch.
"""

from __future__ import annotations

import bisect
import gc
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from megalm.parallel.hdp.cost import CostModel, SimResult, check_plan, offload_ring_size, ring_size, simulate

__all__ = [
    "CostModel", "MicroBatch", "Plan", "SimResult", "check_plan", "megatron_cp_size", "plan_hdp",
    "plan_megatron_hybrid", "plan_static", "ring_size", "simulate",
]


class MicroBatch(NamedTuple):
    """One unit of work. len(ranks) == 1: documents packed on one rank; > 1: a ring over `ranks`
    (in ring order); no documents: a barrier over `ranks`. `tokens` counts real tokens, `padding`
    the extra positions computed (the static mesh pads), `sum_sq` is Σs² of the (padded) documents.
    A NamedTuple: immutable and cheap to build (a plan can hold tens of thousands)."""

    ranks: tuple[int, ...]
    seqs: tuple[int, ...]
    tokens: int
    sum_sq: int
    padding: int = 0


@dataclass
class Plan:
    policy: str
    micro_batches: list[MicroBatch]
    per_rank: list[list[int]]  # micro-batch indices, in execution order
    stats: dict = field(default_factory=dict)

    @property
    def num_ranks(self) -> int:
        return len(self.per_rank)


def _local(rank: int, docs: list[int], lengths: Sequence[int]) -> MicroBatch:
    return MicroBatch((rank,), tuple(docs), sum(lengths[i] for i in docs), sum(lengths[i] ** 2 for i in docs))


def _packed_micro_batches(rank: int, docs: list[int], lengths: Sequence[int], capacity: int) -> list[MicroBatch]:
    """Best-fit packing of documents (longest first) into micro-batches of at most `capacity` tokens."""
    if sum(lengths[i] for i in docs) <= capacity:
        return [_local(rank, docs, lengths)]
    free: list[int] = []
    bins: list[list[int]] = []
    for i in docs:
        s = lengths[i]
        fits = [k for k, f in enumerate(free) if f >= s]
        if fits:
            k = min(fits, key=free.__getitem__)
            free[k] -= s
            bins[k].append(i)
        else:
            free.append(capacity - s)
            bins.append([i])
    return [_local(rank, b, lengths) for b in bins]


class _Planner:
    """State of `plan_hdp`: per-rank loads on a lazy heap, idle holes left before rings, work lists.

    load[r] is when rank r has finished the work at its tail; key[r] adds the pipeline fill/drain,
    (pp−1)·longest[r]. holes[end][start] lists ranks idle from start to end (waiting for a ring that
    starts at end); later, shorter rings and short documents are backfilled into them (EASY
    backfilling, Lifka 1995), which cannot delay anything already placed.
    """

    def __init__(self, lengths: Sequence[int], num_ranks: int, capacity: int, cost: CostModel, pp: int):
        self.lengths, self.C, self.cost, self.pp = lengths, capacity, cost, pp
        self.load = [0.0] * num_ranks
        self.longest = [0.0] * num_ranks
        self.key = [0.0] * num_ranks
        self.heap = [(0.0, r) for r in range(num_ranks)]
        self.holes: dict[float, list] = {}  # end -> [rank count, {start: ranks}, sorted starts]
        self.min_hole = cost.time(1, 1)
        self.target = 0.0  # estimated step time, set by plan_hdp
        self.sizes: dict[int, int] = {}  # ring size per long document, set by plan_hdp
        self.micro_batches: list[MicroBatch] = []
        self.items: list[list[tuple[float, int]]] = [[] for _ in range(num_ranks)]  # (start, mb)

    def pop(self) -> int:
        while True:
            k, r = heapq.heappop(self.heap)
            if k == self.key[r]:
                return r

    def push(self, r: int) -> None:
        self.key[r] = self.load[r] + (self.pp - 1) * self.longest[r]
        heapq.heappush(self.heap, (self.key[r], r))

    def add_hole(self, start: float, end: float, ranks: list[int]) -> None:
        if ranks and end - start >= self.min_hole:
            group = self.holes.get(end)
            if group is None:
                group = self.holes[end] = [0, {}, []]  # rank count, {start: ranks}, sorted starts
            if start not in group[1]:
                group[1][start] = []
                bisect.insort(group[2], start)
            group[1][start].extend(ranks)
            group[0] += len(ranks)

    def node_local(self, candidates: list[int], d: int) -> list[int] | None:
        per_node = self.cost.ranks_per_node
        by_node: dict[int, list[int]] = {}
        for r in candidates:
            members = by_node.setdefault(r // per_node, [])
            members.append(r)
            if len(members) == d:
                return members
        return None

    def place_ring(self, i: int) -> None:
        """Preference: a hole inside one node; the tail of one node if that ends by the target step
        time (rings that leave a node expose their traffic); any hole; the earliest finish."""
        s = self.lengths[i]
        d = self.sizes[i]
        small = d <= self.cost.ranks_per_node
        placed = self.backfill(d, s, node_local=True) if small else None
        if placed is None:
            popped, options = self.tail_options(d, s)
            if small and options[0][0] and options[0][1] + options[0][2] <= self.target:
                placed = self.take_tail(popped, *options[0])
            else:
                placed = self.backfill(d, s, node_local=False)
                if placed is None:
                    best = min((o for o in options if o[0]), key=lambda o: o[1] + o[2])
                    placed = self.take_tail(popped, *best)
                else:
                    for r in popped:
                        heapq.heappush(self.heap, (self.key[r], r))
        ranks, start, t = placed
        idx = len(self.micro_batches)
        self.micro_batches.append(MicroBatch(tuple(ranks), (i,), s, s * s))
        for r in ranks:
            self.items[r].append((start, idx))
            if t > self.longest[r]:
                self.longest[r] = t
            if self.key[r] != self.load[r] + (self.pp - 1) * self.longest[r]:
                self.push(r)  # a new heap entry; the old one goes stale

    def tail_options(self, d: int, s: int) -> tuple[list[int], list[tuple[list[int], float, float]]]:
        """Pop the ranks that are free earliest. Options (ranks, start, time): the first d of them
        inside one node ([] if none), and the first d overall."""
        per_node = self.cost.ranks_per_node
        popped: list[int] = []
        by_node: dict[int, list[int]] = {}
        node_pick: list[int] = []
        limit = d if d > per_node else min(len(self.load), d + 8 * per_node)
        while len(popped) < limit and self.heap:
            r = self.pop()
            popped.append(r)
            if d <= per_node:
                members = by_node.setdefault(r // per_node, [])
                members.append(r)
                if len(members) == d:
                    node_pick = members
                    break
        if len(popped) < d:
            raise ValueError(f"a ring of {d} ranks does not fit in {len(self.load)} ranks")
        options = []
        for cand in (sorted(node_pick), sorted(popped[:d])):
            start = max((self.load[r] for r in cand), default=0.0)
            options.append((cand, start, self.cost.time(s, s * s, d, self.cost.intra(cand)) if cand else 0.0))
        return popped, options

    def take_tail(self, popped: list[int], ranks: list[int], start: float, t: float) -> tuple[list[int], float, float]:
        """Commit a tail option: members wait (a hole) until all are free, run the ring; the other
        popped ranks go back on the heap."""
        chosen = set(ranks)
        waiting: dict[float, list[int]] = {}
        for r in popped:
            if r in chosen:
                waiting.setdefault(self.load[r], []).append(r)
                self.load[r] = start + t
            else:
                heapq.heappush(self.heap, (self.key[r], r))
        for free_at, members in waiting.items():
            self.add_hole(free_at, start, members)
        return ranks, start, t

    def backfill(self, d: int, s: int, node_local: bool) -> tuple[list[int], float, float] | None:
        """Earliest slot for a ring inside existing holes: d ranks idle over [x, x + t) before the
        ring they wait for (inside one node if `node_local`). None if no hole fits."""
        per_node = self.cost.ranks_per_node
        t_min = self.cost.time(s, s * s, d, d <= per_node)
        options = []
        for end, (count, blocks, starts) in self.holes.items():
            if count < d or end - starts[0] < t_min:
                continue
            acc = 0
            for start in starts:
                acc += len(blocks[start])
                if acc >= d:
                    if start + t_min <= end:
                        options.append((start, end))
                    break
        for x, end in sorted(options):
            group = self.holes[end]
            blocks, starts = group[1], group[2]
            below = starts[: bisect.bisect_right(starts, x)]
            candidates = [r for start in reversed(below) for r in blocks[start]]
            ranks = self.node_local(candidates, d) if d <= per_node else None
            if ranks is None and node_local:
                continue
            ranks = sorted(ranks or candidates[:d])
            t = self.cost.time(s, s * s, d, self.cost.intra(ranks))
            if x + t > end:
                continue
            chosen = set(ranks)
            for start in below:
                used = [r for r in blocks[start] if r in chosen]
                if used:
                    blocks[start] = [r for r in blocks[start] if r not in chosen]
                    group[0] -= len(used)
                    self.add_hole(start, x, used)
                    if not blocks[start]:
                        del blocks[start]
                        starts.remove(start)
            if not group[0]:
                del self.holes[end]
            self.add_hole(x + t, end, ranks)
            return ranks, x, t
        return None

    def place_locals(self, docs: list[int]) -> None:
        """Short documents, longest first: into the largest idle hole they fit (free time), else to
        the rank with the least pipeline cost (LPT), charged its share of the per-micro-batch cost."""
        L, C, cost, pp = self.lengths, self.C, self.cost, self.pp
        key, load, longest = self.key, self.load, self.longest
        heap = self.heap = [(k, r) for r, k in enumerate(key)]  # no stale entries: the top is always valid
        heapq.heapify(heap)
        free = [(start - end, r, start) for end, (_, blocks, _) in self.holes.items()
                for start, ranks in blocks.items() for r in ranks]
        heapq.heapify(free)
        slots: dict[tuple[int, float], list[int]] = {}  # (rank, hole start) -> documents
        tail: list[list[int]] = [[] for _ in load]
        tail_tokens = [0] * len(load)
        overhead, full_mb = cost.layers * cost.c, cost.time(C, 0)
        qa, qb = cost.layers * cost.a, cost.layers * cost.b + cost.head  # cost.time(s, s * s), inlined
        for i in docs:
            s = L[i]
            t = (qa * s + qb) * s + overhead
            if free and -free[0][0] >= t:
                neg, r, start = heapq.heappop(free)
                slots.setdefault((r, start), []).append(i)
                if -neg - t >= self.min_hole:
                    heapq.heappush(free, (neg + t, r, start))
                continue
            r = heap[0][1]
            tail[r].append(i)
            load[r] += t - overhead * (1 - s / C)
            if pp > 1:
                tail_tokens[r] += s
                longest[r] = max(longest[r], full_mb if tail_tokens[r] >= C else cost.time(tail_tokens[r], 0))
            key[r] = load[r] + (pp - 1) * longest[r]
            heapq.heapreplace(heap, (key[r], r))
        mbs, items = self.micro_batches, self.items
        for (r, start), members in slots.items():
            for mb in _packed_micro_batches(r, members, L, C):
                items[r].append((start, len(mbs)))
                mbs.append(mb)
        for r, members in enumerate(tail):
            if len(members) == 1:
                s = L[members[0]]
                items[r].append((math.inf, len(mbs)))
                mbs.append(MicroBatch((r,), (members[0],), s, s * s))
            elif members:
                for mb in _packed_micro_batches(r, members, L, C):
                    items[r].append((math.inf, len(mbs)))
                    mbs.append(mb)


def _widened(s: int, d: int, work: float, cost: CostModel, num_ranks: int, pp: int) -> int:
    """Ring size k ≥ d minimising max(ring time, mean load once the ring's extra rank-time is added):
    more ranks shorten the ring but add exposed traffic and overhead that every rank pays for. With
    pp stages a ring's time is paid in full by its pipeline (t/pp running + (pp−1)·t/pp fill/drain)
    while the mean load shrinks by pp."""
    per_node = cost.ranks_per_node

    def t(k: int) -> float:
        return cost.time(s, s * s, k, k <= per_node)

    base = work - d * t(d)
    best, best_cost, k = d, max(t(d), work / (num_ranks * pp)), d
    while k < num_ranks:
        k = min(num_ranks, k + 1 if k < 2 * d else max(k + 1, int(k * 1.09)))  # every size up to 2d
        tk = t(k)
        step = max(tk, (base + k * tk) / (num_ranks * pp))
        if step < best_cost:
            best, best_cost = k, step
    return best


def plan_hdp(
    lengths: Sequence[int], num_ranks: int, capacity: int, cost: CostModel, pp: int = 1, widen: bool = False,
    offload: bool = False,
) -> Plan:
    """ByteScale HDP plan: minimal rings for long documents, best-fit packing for short ones, balanced
    by time so that ranks (pipelines, if pp > 1) finish together.

    1. Rings, longest time first (LPT for rigid parallel jobs): each goes into the earliest idle hole
       it fits, else onto the d ranks that are free earliest (inside one node when that is faster).
    2. Short documents, longest first: into idle holes, else to the rank with the least pipeline cost.
    3. Per rank, best-fit packing into micro-batches of at most C tokens; every rank runs its work
       in planned start order, which is one global order for rings, so plans cannot deadlock.
    Deterministic (ties broken by index); O(n log n + Σd · log D + rings · holes).

    Rings have the minimal size ceil(s / C); with `offload` (ByteScale's selective offload) the smaller
    ceil((1 − r(s))·s / C) of `cost.offload_ring_size`, the document offloading r(s) of its activations.
    When one document's ring takes longer than the mean
    load, that ring alone sets the step time; `widen=True` (not ByteScale's rule, off by default)
    also plans with such rings widened (`_widened`) and keeps whichever plan has the shorter
    estimated step; with `offload` too, the plan without offload competes as well.
    """
    n, C = len(lengths), capacity
    order = sorted(range(n), key=lengths.__getitem__, reverse=True)
    if order and lengths[order[-1]] <= 0:
        raise ValueError("document lengths must be positive")
    split = bisect.bisect_left([-lengths[i] for i in order], -C)  # order[:split] are longer than C
    longs = order[:split]
    need = (lambda s: offload_ring_size(s, C, cost)) if offload else (lambda s: ring_size(s, C))
    if longs and need(lengths[longs[0]]) > num_ranks:
        raise ValueError(f"a document of {lengths[longs[0]]} tokens needs more than {num_ranks} ranks of {C}")
    per_node = cost.ranks_per_node
    sizes, estimates = {}, {}
    for i in longs:
        s = lengths[i]
        sizes[i] = d = need(s)
        estimates[i] = cost.time(s, s * s, d, d <= per_node)
    work = sum(t * sizes[i] for i, t in estimates.items())
    qa, qb, q0 = cost.layers * cost.a, cost.layers * cost.b + cost.head, cost.layers * cost.c
    work += sum((qa * s + qb) * s + q0 for s in map(lengths.__getitem__, order[split:]))  # cost.time(s, s²)
    plan = _place(lengths, num_ranks, C, cost, pp, order, split, sizes, estimates, work)
    if widen:
        sizes, estimates = dict(sizes), dict(estimates)
        for i in longs:  # longest first; stop at the first ring that is not above the mean load
            if estimates[i] <= work / (num_ranks * pp):
                break
            s, d = lengths[i], sizes[i]
            sizes[i] = k = _widened(s, d, work, cost, num_ranks, pp)
            estimates[i] = cost.time(s, s * s, k, k <= per_node)
            work += k * estimates[i] - d * cost.time(s, s * s, d, d <= per_node)
        wide = _place(lengths, num_ranks, C, cost, pp, order, split, sizes, estimates, work)
        if wide.stats["widened_rings"] and wide.stats["estimated_step"] < plan.stats["estimated_step"]:
            plan = wide
        if offload:  # offload is a choice, not a rule: keep the rings without it where they estimate faster
            plain = plan_hdp(lengths, num_ranks, capacity, cost, pp, widen=True)
            if plain.stats["estimated_step"] < plan.stats["estimated_step"]:
                plan = plain
    return plan


def _place(lengths, num_ranks, C, cost, pp, order, split, sizes, estimates, work) -> Plan:
    """Run the `_Planner` with the given ring sizes; see plan_hdp."""
    planner = _Planner(lengths, num_ranks, C, cost, pp)
    planner.sizes = sizes
    planner.target = max(work / num_ranks, max(estimates.values(), default=0.0))
    longs = order[:split]
    gc_was_on = gc.isenabled()
    gc.disable()  # ~10^5 small acyclic objects: generational GC passes would cost ~20% of the time
    try:
        for i in sorted(longs, key=estimates.__getitem__, reverse=True):
            planner.place_ring(i)
        planner.place_locals(order[split:])
        per_rank = [[k for _, k in sorted(it)] if len(it) > 1 else [k for _, k in it] for it in planner.items]
    finally:
        if gc_was_on:
            gc.enable()
    stats = {
        "rings": len(longs),
        "local_micro_batches": len(planner.micro_batches) - len(longs),
        "largest_ring": max(sizes.values(), default=1),
        "widened_rings": sum(sizes[i] > ring_size(lengths[i], C) for i in longs),
        "offloading_rings": sum(sizes[i] < ring_size(lengths[i], C) for i in longs),
        "estimated_step": max(planner.key, default=0.0) / pp,
    }
    return Plan("hdp", planner.micro_batches, per_rank, stats)


def plan_static(lengths: Sequence[int], num_ranks: int, capacity: int, context: int, cost: CostModel) -> Plan:
    """Static mesh baseline (Megatron/TE CP with THD packing), in its best honest form.

    Assumptions: a fixed cp = the smallest divisor of D with cp·C ≥ context (so no rank idles) and
    dp = D / cp; every micro-batch is one sequence of `context` tokens packed best-fit-decreasing from
    documents, each document padded to a multiple of 2·cp (TransformerEngine's zigzag-per-document
    requirement), the tail padded; each packed sequence is sharded over one cp group and runs ring
    attention with document masking (attention work Σs², but every rank's whole KV chunk travels the
    ring); cp groups are contiguous rank blocks (inside a node when cp fits). In its favour: packed
    sequences go to dp groups by LPT on the true cost (different counts per group are fine with the
    per-token loss), not round-robin.
    """
    D, C = num_ranks, capacity
    need = ring_size(context, C)
    cp = next((k for k in range(need, D + 1) if D % k == 0), None)
    if cp is None:
        raise ValueError(f"context {context} needs {need} ranks of {C} tokens, more than {D}")
    unit = 2 * cp if cp > 1 else 1
    padded = [ring_size(s, unit) * unit for s in lengths]
    seq_len = ring_size(context, unit) * unit
    if max(padded, default=0) > seq_len or seq_len > cp * C:
        raise ValueError("documents must be at most the context length")

    frees: list[tuple[int, int]] = []  # (free tokens, bin id), sorted
    bins: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=padded.__getitem__, reverse=True):
        p = padded[i]
        k = bisect.bisect_left(frees, (p, -1))
        if k == len(frees):
            bins.append([i])
            bisect.insort(frees, (seq_len - p, len(bins) - 1))
        else:
            f, b = frees.pop(k)
            bins[b].append(i)
            bisect.insort(frees, (f - p, b))

    packs = []
    for b in bins:
        tokens = sum(lengths[i] for i in b)
        packs.append((tuple(b), tokens, sum(padded[i] ** 2 for i in b), seq_len - tokens))
    intra = cp <= cost.ranks_per_node and cost.ranks_per_node % cp == 0
    times = [cost.time(seq_len, sq, cp, intra) for _, _, sq, _ in packs]
    groups = [(0.0, g) for g in range(D // cp)]
    micro_batches: list[MicroBatch] = []
    per_rank: list[list[int]] = [[] for _ in range(D)]
    for k in sorted(range(len(packs)), key=times.__getitem__, reverse=True):
        t, g = heapq.heappop(groups)
        heapq.heappush(groups, (t + times[k], g))
        seqs, tokens, sq, pad = packs[k]
        members = tuple(range(g * cp, (g + 1) * cp))
        for r in members:
            per_rank[r].append(len(micro_batches))
        micro_batches.append(MicroBatch(members, seqs, tokens, sq, pad))
    stats = {"cp": cp, "dp": D // cp, "packed_sequences": len(packs), "pad_unit": unit}
    return Plan("static", micro_batches, per_rank, stats)


def megatron_cp_size(s: int, capacity: int, num_ranks: int) -> int:
    """Megatron's gpus_needed: the next power of two ≥ s / C, at most the whole domain."""
    d = 1
    while d * capacity < s:
        d *= 2
    return min(d, num_ranks)


def plan_megatron_hybrid(lengths: Sequence[int], num_ranks: int, capacity: int, delta: float = 0.05) -> Plan:
    """Megatron-LM's hybrid context parallelism (BalancedCPScheduler, megatron/core/pipeline_parallel/
    hybrid_cp_schedule.py, 2025), re-implemented over lengths.

    The rule: a document gets a CP group of d = 2^ceil(log2(s/C)) ranks; its workload estimate is
    s²/d. Documents go longest first, each to a fresh group of free ranks while there are enough, else
    to the least-loaded existing group of its size, else wait for the next round. Once the sizes
    start to shrink, a round closes as soon as all ranks' estimates are within `delta` of each other;
    then the most-loaded group gives back its last document while that reduces the spread, and ranks
    still empty are used by doubling the smallest group (its documents spread wider). Groups are
    contiguous, power-of-two aligned rank blocks; rounds end with a barrier over the domain.
    In its favour: documents that land on the same single rank in a round are packed into micro-batches
    of ≤ C tokens (THD) instead of running one by one.
    """
    D, C = num_ranks, capacity
    remaining = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)
    if remaining and megatron_cp_size(lengths[remaining[0]], C, D) * C < lengths[remaining[0]]:
        raise ValueError(f"a document of {lengths[remaining[0]]} tokens does not fit on {D} ranks")
    micro_batches: list[MicroBatch] = []
    per_rank: list[list[int]] = [[] for _ in range(D)]
    rounds = 0
    while remaining:
        sizes: list[int] = []
        loads: list[float] = []
        members: list[list[int]] = []  # documents per group
        pools: dict[int, list[tuple[float, int]]] = {}  # size -> heap of (load, group)
        all_loads: list[tuple[float, int]] = []  # heap over groups, lazy
        free, peak, prev, check = D, 0.0, None, False
        leftover: list[int] = []
        for pos, i in enumerate(remaining):
            s = lengths[i]
            d = megatron_cp_size(s, C, D)
            if free >= d:
                g = len(sizes)
                sizes.append(d)
                loads.append(0.0)
                members.append([])
                free -= d
            elif pools.get(d):
                g = heapq.heappop(pools[d])[1]
            else:
                leftover.append(i)
                continue
            members[g].append(i)
            loads[g] += s * s / d
            peak = max(peak, loads[g])
            heapq.heappush(pools.setdefault(d, []), (loads[g], g))
            heapq.heappush(all_loads, (loads[g], g))
            check = check or (prev is not None and d < prev)
            prev = d
            if check and free == 0 and pos + 1 < len(remaining):
                while all_loads[0][0] != loads[all_loads[0][1]]:
                    heapq.heappop(all_loads)
                if peak - all_loads[0][0] <= delta * peak:
                    leftover.extend(remaining[pos + 1 :])
                    break
        # trim: the most-loaded group gives back its last document while that narrows the spread
        while free == 0:
            hi = max(range(len(loads)), key=loads.__getitem__)
            lo_load, hi_load = min(loads), loads[hi]
            if hi_load - lo_load <= delta * hi_load or len(members[hi]) <= 1:
                break
            s = lengths[members[hi][-1]]
            trial = loads[:]
            trial[hi] -= s * s / sizes[hi]
            if max(trial) - min(trial) >= hi_load - lo_load:
                break
            loads[hi] = trial[hi]
            leftover.append(members[hi].pop())
        # fill empty ranks by doubling the first smallest group (keeps sizes descending, so aligned)
        while free > 0:
            m = min(sizes)
            g = sizes.index(m)
            grow = min(2 * m, D) - m
            if grow == 0 or grow > free:
                break
            sizes[g] += grow
            free -= grow
        start = 0
        for g, size in enumerate(sizes):
            ranks = tuple(range(start, start + size))
            start += size
            if size == 1:
                mbs = _packed_micro_batches(ranks[0], members[g], lengths, C)
            else:
                mbs = [MicroBatch(ranks, (i,), lengths[i], lengths[i] ** 2) for i in members[g]]
            for mb in mbs:
                for r in ranks:
                    per_rank[r].append(len(micro_batches))
                micro_batches.append(mb)
        rounds += 1
        remaining = sorted(leftover, key=lengths.__getitem__, reverse=True)
        if remaining:
            for r in range(D):
                per_rank[r].append(len(micro_batches))
            micro_batches.append(MicroBatch(tuple(range(D)), (), 0, 0))
    return Plan("megatron_hybrid", micro_batches, per_rank, {"rounds": rounds})
