"""ByteScale hybrid data parallelism (HDP): which ranks run which documents, decided every step.

ByteScale (Ge et al. 2025, arXiv 2502.21231) merges the DP and CP dimensions into one HDP domain of
D = dp·cp ranks and re-plans the global batch each step. C is the tokens one rank holds in a micro-batch
(parallel.hdp_capacity):

- documents with s ≤ C are packed best-fit onto single ranks and run with no CP traffic (one that alone would
  outlast the step's mean load, as where there are fewer of them than ranks, is sized like a long one);
- longer ones get a ring over an ordered list of global ranks (docs/architecture.md), of at least
  ceil(s / C) ranks (fewer with selective offload), not a power of two (inside a node any size, across
  nodes whole nodes); it is sized
  against the step's makespan (ByteScale's balance scheduler; FlexSP and WLB-LLM state the same
  objective): as small as memory allows unless that ring would outlast the step;
- a ring inside a node runs flat over NVLink (or Ulysses); one that spans nodes takes whole nodes and
  runs hierarchically, an all-to-all inside each node and a ring across them (cost.py);
- the balance scheduler weighs work with the cost model (cost.py: a·s² + b·s + c per layer plus
  exposed ring traffic) so that ranks finish together: ranks run different numbers of micro-batches,
  which is exact because the loss is a sum over tokens divided by the step's token count;
- with pipeline parallelism each HDP rank is one pipeline; its cost is Σt + (pp−1)·max t (ByteScale's
  PP-balance), so pipelines that hold a long ring get fewer micro-batches.

A `Plan` is data: `micro_batches` (each with its ordered ranks and document indices) and, per rank,
the indices of the micro-batches it runs in order. A ring micro-batch is a collective: it starts when
all its ranks reach it. Rings appear in one global order on every rank, so plans cannot deadlock.

The plan's data types are in plan.py; the ring sizes against the makespan in sizing.py; the baselines it is
measured against in baselines.py. Pure Python, no torch.
"""

from __future__ import annotations

import bisect
import gc
import heapq
import math
from collections.abc import Sequence

from megalm.parallel.hdp.cost import CostModel, ring_size, simulate
from megalm.parallel.hdp.plan import MicroBatch, Plan, TooFewRanks, packed_micro_batches
from megalm.parallel.hdp.sizing import RingSizes, ring_sizes_for_makespan


class _Planner:
    """State of `plan_hdp`: per-rank loads on a lazy heap, idle holes left before rings, work lists.

    load[r] is when rank r has finished the work at its tail; key[r] adds the pipeline fill/drain,
    (pp−1)·longest[r]. holes[end][start] lists ranks idle from start to end (waiting for a ring that
    starts at end); later, shorter rings and short documents are backfilled into them (EASY
    backfilling, Lifka 1995), which cannot delay anything already placed.
    """

    def __init__(self, lengths: Sequence[int], num_ranks: int, capacity: int, cost: CostModel, pp: int,
                 layout_cost: CostModel, hierarchical: bool, sizes: dict[int, int], target: float,
                 times: dict[tuple[int, int, bool], tuple[int, float]]):
        self.lengths, self.C, self.cost, self.pp = lengths, capacity, cost, pp
        # `cost` weighs the placement; `layout_cost` (the true model) picks each ring's CP layout (flat, a2a,
        # hierarchical). They differ only in the ablation's token-balanced planner.
        self.layout_cost, self.hierarchical = layout_cost, hierarchical
        self.sizes = sizes  # ring size per long document
        self.target = target  # the estimated step in load units (× pp, as `key`)
        self.times = times  # ring_time's cache: the same ring on the same kind of ranks costs the same in every trial
        self.load = [0.0] * num_ranks
        self.longest = [0.0] * num_ranks
        self.key = [0.0] * num_ranks
        self.heap = [(0.0, r) for r in range(num_ranks)]
        self.holes: dict[float, list] = {}  # end -> [rank count, {start: ranks}, sorted starts]
        self.min_hole = cost.time(1, 1)
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

    def ring_time(self, s: int, d: int, ranks: Sequence[int] | None) -> tuple[int, float]:
        """(inner, seconds) of document s on d ranks: the layout the true cost model picks for where the ranks sit
        (`ranks` None: inside one node if d fits in one). A ring placed here is not a whole-node ring (those are
        `place_node_rings`'): beyond a node it runs flat, and one of a few ranks that crosses nodes too."""
        per_node = self.cost.ranks_per_node
        intra = d <= per_node if ranks is None else self.cost.intra(ranks)
        key = (s, d, intra)
        if key not in self.times:
            inner = self.layout_cost.cp_layout(s, s * s, d, self.hierarchical)[0] if d <= per_node and intra else 1
            self.times[key] = inner, self.cost.time(s, s * s, d, intra, inner)
        return self.times[key]

    def place_node_rings(self, rings: list[int], inner: dict[int, int]) -> None:
        """Hierarchical rings that span nodes, longest time first, each on the d/n whole nodes (n ranks per node)
        that are free earliest: a node is one all-to-all group over NVLink, the ring runs across the nodes. They
        go first, so every node's ranks are equally loaded while they are placed (kept per node, written to the
        ranks once at the end); the ranks of nodes that wait for the others become holes for later work."""
        n, pp = self.cost.ranks_per_node, self.pp
        count = len(self.load) // n
        load, longest = [self.load[k * n] for k in range(count)], [self.longest[k * n] for k in range(count)]
        items: list[list[tuple[float, int]]] = [[] for _ in range(count)]
        nodes = [(load[k] + (pp - 1) * longest[k], k) for k in range(count)]
        heapq.heapify(nodes)
        for i in rings:
            s, d = self.lengths[i], self.sizes[i]
            picked = sorted(heapq.heappop(nodes)[1] for _ in range(d // n))
            start = max(load[k] for k in picked)
            t = self.cost.time(s, s * s, d, False, inner[i])
            idx = len(self.micro_batches)
            self.micro_batches.append(MicroBatch(tuple(r for k in picked for r in range(k * n, (k + 1) * n)), (i,),
                                                 s, s * s, 0, inner[i]))
            for k in picked:
                self.add_hole(load[k], start, list(range(k * n, (k + 1) * n)))
                load[k], longest[k] = start + t, max(longest[k], t)
                items[k].append((start, idx))
                heapq.heappush(nodes, (load[k] + (pp - 1) * longest[k], k))
        for k in range(count):
            if items[k]:
                for r in range(k * n, (k + 1) * n):
                    self.load[r], self.longest[r] = load[k], longest[k]
                    self.key[r] = load[k] + (pp - 1) * longest[k]
                    self.items[r].extend(items[k])
        self.heap = [(k, r) for r, k in enumerate(self.key)]
        heapq.heapify(self.heap)

    def place_ring(self, i: int) -> float:
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
        self.micro_batches.append(MicroBatch(tuple(ranks), (i,), s, s * s, 0, self.ring_time(s, d, ranks)[0]))
        for r in ranks:
            self.items[r].append((start, idx))
            if t > self.longest[r]:
                self.longest[r] = t
            if self.key[r] != self.load[r] + (self.pp - 1) * self.longest[r]:
                self.push(r)  # a new heap entry; the old one goes stale
        return max(self.key[r] for r in ranks)  # the ring's members' pipeline cost once it is placed

    def tail_options(self, d: int, s: int) -> tuple[list[int], list[tuple[list[int], float, float]]]:
        """Pop the ranks that are free earliest. Options (ranks, start, time): the first d of them
        inside one node ([] if none), and the first d overall."""
        per_node = self.cost.ranks_per_node
        popped: list[int] = []
        by_node: dict[int, list[int]] = {}
        node_pick: list[int] = []
        limit = d if d > per_node else min(len(self.load), d + 2 * per_node)
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
            options.append((cand, start, self.ring_time(s, d, cand)[1] if cand else 0.0))
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
        t_min = self.ring_time(s, d, None)[1]
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
            t = self.ring_time(s, d, ranks)[1]
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
        tail_tokens, tail_sq, tail_top = [0] * len(load), [0] * len(load), [0] * len(load)
        overhead = cost.layers * cost.c
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
            if pp > 1:  # the tail's micro-batches hold at most C tokens, each no longer than its first (longest)
                tail_tokens[r] += s
                tail_sq[r] += s * s
                tail_top[r] = tail_top[r] or s
                tokens = min(tail_tokens[r], C)
                longest[r] = max(longest[r], cost.time(tokens, min(tail_sq[r], tokens * tail_top[r])))
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


def plan_hdp(
    lengths: Sequence[int], num_ranks: int, capacity: int, cost: CostModel, pp: int = 1, offload: bool = False,
    balance: bool = True, hierarchical: bool = True, compete: bool = True,
) -> Plan:
    """ByteScale HDP plan of one step: per document its ring (size d, CP layout, offload ratio) and which ranks run
    what, so that ranks (pipelines, if pp > 1) finish together at the shortest step the cost model sees.

    1. Sizes against the makespan (sizing.py). A document of s tokens needs at least ceil(s / C) ranks, or
       ceil((1 − r(s))·s / C) when it may offload up to r(s) of its activations (`offload`, ByteScale's selective
       offload). The step can be no shorter than the mean load; a ring as small as memory allows that would
       take longer than the step T is widened to the fewest ranks that finish within T, and T is the smallest
       value at which every ring fits, their extra traffic counted (bisection). Rings that span nodes take whole
       nodes, as hierarchical rings (an all-to-all over NVLink inside each node, a ring across them:
       `hierarchical`).
    2. Placement, longest time first: rings over whole nodes on the nodes free earliest; rings inside a node into
       the earliest idle hole they fit, else onto the ranks free earliest (LPT for rigid parallel jobs).
    3. Short documents, longest first: into idle holes, else to the rank with the least pipeline cost; per rank,
       best-fit packing into micro-batches of at most C tokens. Every rank runs its work in planned start order,
       one global order for rings, so plans cannot deadlock.

    With `offload` the plan without offload competes too and the faster estimate wins: offload is a choice, never
    a loss (`compete=False`: the offload plan alone). `balance=False` is ByteScale's HDP before its balance
    scheduler (the ablation's middle rows): minimal rings, documents dealt by tokens rather than time; with
    `offload` a ring shrinks only as far as its time stays within the step the minimal rings bound.
    `hierarchical=False` keeps every ring flat (ring attention over all its ranks, ByteScale's communication).
    Deterministic (ties broken by index); the ring sizes are chosen among a few target durations by placing the
    rings alone (`_best_rings`), then the short documents fill in around the best.
    """
    for name, value in (("num_ranks", num_ranks), ("capacity", capacity), ("pp", pp)):
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    if offload and compete:
        with_offload = _plan(lengths, num_ranks, capacity, cost, pp, True, balance, hierarchical)
        without = _plan(lengths, num_ranks, capacity, cost, pp, False, balance, hierarchical)
        return without if without.stats["estimated_step"] < with_offload.stats["estimated_step"] else with_offload
    return _plan(lengths, num_ranks, capacity, cost, pp, offload, balance, hierarchical)


def _plan(lengths, num_ranks, C, cost, pp, offload, balance, hierarchical) -> Plan:
    n = len(lengths)
    order = sorted(range(n), key=lengths.__getitem__, reverse=True)
    if order and lengths[order[-1]] <= 0:
        raise ValueError("document lengths must be positive")
    sizer = RingSizes(lengths, num_ranks, C, cost, hierarchical)
    if order and sizer.minimal(lengths[order[0]], offload) > num_ranks:
        raise TooFewRanks(f"a document of {lengths[order[0]]} tokens needs more than {num_ranks} ranks of {C}")
    minimal: dict[int, int] = {}
    for i in order[:bisect.bisect_left([-lengths[i] for i in order], -C)]:  # the documents longer than C
        # with offload some fit on one rank, but take long there: they are sized (and widened) like rings
        minimal[i] = sizer.minimal(lengths[i], offload)
    longs = list(minimal)
    locals_ = [i for i in order if i not in minimal]
    qa, qb, q0 = cost.layers * cost.a, cost.layers * cost.b + cost.head, cost.layers * cost.c
    work = lambda s: (qa * s + qb) * s + q0  # cost.time(s, s²)
    local_work = sum(work(s) for s in map(lengths.__getitem__, locals_))
    gc_was_on = gc.isenabled()
    gc.disable()  # ~10^5 small acyclic objects: generational GC passes would cost ~20% of the time
    try:
        if balance and num_ranks > 1:
            for i in _short_rings(sizer, lengths, longs, minimal, locals_, local_work, num_ranks, pp):
                minimal[i] = sizer.minimal(lengths[i], offload)  # 1: any wider ring is the makespan's choice
                longs.append(i)
                locals_.remove(i)
                local_work -= work(lengths[i])
        if balance:
            sizes, target = ring_sizes_for_makespan(sizer, longs, minimal, local_work, num_ranks, pp)
            planner = _best_rings(lengths, num_ranks, C, cost, pp, hierarchical, sizer, longs, minimal, sizes,
                                  target, local_work)
        else:
            sizes = minimal
            if offload:  # selective: shrink a ring only while it stays within the step the minimal rings bound
                plain = {i: sizer.minimal(lengths[i], False) for i in longs}
                bound = ring_sizes_for_makespan(sizer, longs, plain, local_work, num_ranks, pp)[1] if longs else 0.0
                sizes = {i: min(plain[i], sizer.within(i, minimal[i], bound)) for i in longs}
            # deal documents by tokens, not time: a cost model whose only term is the linear one
            place_cost = cost.replace(a=0.0, c=0.0, head=0.0, kv_bytes=0.0, qo_bytes=0.0, latency=0.0)
            planner = _place_rings(lengths, num_ranks, C, place_cost, cost, pp, hierarchical, sizer, longs, sizes,
                                   0.0)
        planner.place_locals(locals_)
        per_rank = [[k for _, k in sorted(it)] if len(it) > 1 else [k for _, k in it] for it in planner.items]
    finally:
        if gc_was_on:
            gc.enable()
    rings = [mb for mb in planner.micro_batches if len(mb.ranks) > 1]
    stats = {
        "rings": len(rings),
        "local_micro_batches": len(planner.micro_batches) - len(rings),
        "largest_ring": max((len(mb.ranks) for mb in rings), default=1),
        "widened_rings": sum(len(mb.ranks) > ring_size(mb.tokens, C) for mb in rings),
        "offloading_rings": sum(mb.tokens > len(mb.ranks) * C for mb in planner.micro_batches),
        "hierarchical_rings": sum(mb.inner > 1 for mb in rings),
        "estimated_step": max(planner.key, default=0.0) / pp,
    }
    plan = Plan("hdp", planner.micro_batches, per_rank, stats)
    if not balance:  # the placement ran on token counts: estimate the step in seconds
        plan.stats["estimated_step"] = simulate(plan, cost, pp).step_time
    return plan


def _short_rings(sizer: RingSizes, lengths: Sequence[int], longs: list[int], minimal: dict[int, int],
                 locals_: list[int], local_work: float, num_ranks: int, pp: int) -> list[int]:
    """The short documents (s ≤ C) that run faster as rings, longest first: each alone outlasts the mean load, and
    the makespan's sizing (`ring_sizes_for_makespan`, as for the long ones) widens it. With fewer short documents
    than ranks (a small token budget against D·C) they were one a rank, the others idle: a step of one 8K document
    on 8 ranks took 6x the ring's time. A large batch leaves every short document under the mean load: none."""
    area = local_work + sum(minimal[i] * sizer.layout(i, minimal[i])[1] for i in longs)
    low = area / (num_ranks * pp)
    outlast = [i for i in locals_ if sizer.layout(i, 1)[1] > low]  # longest first, as locals_
    if not outlast:
        return []
    trial = {**minimal, **dict.fromkeys(outlast, 1)}
    rest = local_work - sum(sizer.layout(i, 1)[1] for i in outlast)
    sizes, _ = ring_sizes_for_makespan(sizer, longs + outlast, trial, rest, num_ranks, pp)
    return [i for i in outlast if sizes[i] > 1]


def _place_rings(lengths, num_ranks, C, place_cost, cost, pp, hierarchical, sizer, longs, sizes, target,
                 bound: float = math.inf) -> _Planner | None:
    """A `_Planner` with the rings placed (plan_hdp, 2.): whole-node rings first, then the others, longest first.
    `target` is the step estimate in seconds. None as soon as some rank's pipeline cost (`key`, load units: the
    step times pp) passes `bound` (a trial that cannot beat the best one so far)."""
    # `key` counts a pipeline's whole work, so the target in its units is the step times pp
    planner = _Planner(lengths, num_ranks, C, place_cost, pp, cost, hierarchical, sizes, target * pp,
                       sizer.placed_times)
    inner = {i: sizer.layout(i, sizes[i])[0] for i in longs}
    whole_nodes = [i for i in longs if sizes[i] > cost.ranks_per_node and inner[i] > 1]
    by_time = lambda i: place_cost.time(lengths[i], lengths[i] ** 2, sizes[i], False, inner[i])
    planner.place_node_rings(sorted(whole_nodes, key=by_time, reverse=True), inner)
    if planner.heap and max(planner.key) > bound:
        return None
    spanning = set(whole_nodes)
    for i in sorted((i for i in longs if i not in spanning), key=by_time, reverse=True):
        if planner.place_ring(i) > bound:
            return None
    return planner


def _step_lower_bound(sizer: RingSizes, longs: list[int], sizes: dict[int, int], area: float, pipelines: int) -> float:
    """No step with these ring sizes is shorter than its longest ring (a ring member's pipeline cost is at least pp
    times the ring's time, wherever it is placed: `RingSizes.fastest`) or its mean load (`area`, all the work in
    rank-seconds, over `pipelines` = ranks × pp)."""
    return max(max((sizer.fastest(i, sizes[i]) for i in longs), default=0.0), area / pipelines)


# Ring durations tried, as fractions of the step estimate T: rings sized to end near T must all run at once, which
# the domain may not hold; shorter rings stack. 0 keeps the smallest rings memory allows.
DURATIONS = (1.0, 0.5, 0.0)


def _best_rings(lengths, num_ranks, C, cost, pp, hierarchical, sizer, longs, minimal, sizes, target, local_work
                ) -> _Planner:
    """The planner with the rings placed, for the ring sizes (aimed at several durations, `DURATIONS` × T) that
    leave the shortest step: max(the latest ring end, (short documents' work + the rings' rank-time) / ranks), the
    short documents filling holes and tails."""
    best, best_step = None, math.inf
    tried: list[dict[int, int]] = []
    for fraction in DURATIONS:
        if fraction == 1.0:
            trial = sizes
        elif fraction == 0.0:
            trial = minimal
        else:
            trial = {i: max(sizes[i], sizer.within(i, minimal[i], fraction * target)) for i in longs}
        if trial in tried:  # short rings: several durations give the same sizes
            continue
        tried.append(trial)
        area = local_work + sum(trial[i] * sizer.layout(i, trial[i])[1] for i in longs)
        if _step_lower_bound(sizer, longs, trial, area, num_ranks * pp) > best_step * 0.999:
            continue  # this trial cannot win: skipped without placing its rings
        planner = _place_rings(lengths, num_ranks, C, cost, cost, pp, hierarchical, sizer, longs, trial, target,
                               best_step * 0.999 * pp)
        if planner is None:
            continue
        step = max(max(planner.key) / pp, area / (num_ranks * pp))  # the step, in seconds
        if best is None or step < best_step * 0.999:
            best, best_step = planner, step
    return best
