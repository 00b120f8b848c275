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

The plan's data types are in plan.py; the baselines it is measured against in baselines.py. Pure Python, no
torch.
"""

from __future__ import annotations

import bisect
import gc
import heapq
import math
from collections.abc import Sequence

from megalm.parallel.hdp.cost import CostModel, offload_ring_size, ring_size
from megalm.parallel.hdp.plan import MicroBatch, Plan, packed_micro_batches


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
            for mb in packed_micro_batches(r, members, L, C):
                items[r].append((start, len(mbs)))
                mbs.append(mb)
        for r, members in enumerate(tail):
            if len(members) == 1:
                s = L[members[0]]
                items[r].append((math.inf, len(mbs)))
                mbs.append(MicroBatch((r,), (members[0],), s, s * s))
            elif members:
                for mb in packed_micro_batches(r, members, L, C):
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
