"""How many ranks each long document's ring takes in an HDP plan (planner.plan_hdp, step 1), sized against the step's
makespan: as few as memory allows (ceil(s / C), fewer with selective offload), widened only where that ring would
outlast the step. A flat ring's time falls with its size and then rises once its exposed traffic dominates, and a
hierarchical ring takes whole nodes, so sizes are scanned rather than solved for. Pure Python, no torch.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from megalm.parallel.hdp.cost import CostModel, offload_ring_size, ring_size


class RingSizes:
    """Ring sizes a document may take and their times (cost.cp_layout), cached per (document, size)."""

    def __init__(self, lengths: Sequence[int], num_ranks: int, capacity: int, cost: CostModel, hierarchical: bool):
        self.lengths, self.D, self.C, self.cost, self.hierarchical = lengths, num_ranks, capacity, cost, hierarchical
        self.n = cost.ranks_per_node
        self.u = cost.group_size if hierarchical else 1
        self.cache: dict[tuple[int, int], tuple[int, float]] = {}
        self.wider_cache: dict[int, list[int]] = {}
        self.placed_times: dict[tuple[int, int, bool], tuple[int, float]] = {}  # the planner's ring_time, all trials
        self.curves: dict[tuple[int, int], tuple[list[int], list[float]]] = {}  # within's, per (document, d)

    def minimal(self, s: int, offload: bool) -> int:
        """The fewest ranks that hold s tokens (offloading up to r(s) with `offload`), as a placeable size."""
        return self.fit(offload_ring_size(s, self.C, self.cost) if offload else ring_size(s, self.C))

    def fit(self, d: int) -> int:
        """d rounded up to a size the planner places: any d inside a node, whole nodes beyond (hierarchical)."""
        if self.u > 1 and d > self.n:
            whole = -(-d // self.u) * self.u
            return whole if whole <= self.D else d
        return d

    def layout(self, i: int, d: int) -> tuple[int, float]:
        key = (i, d)
        if key not in self.cache:
            s = self.lengths[i]
            self.cache[key] = self.cost.cp_layout(s, s * s, d, self.hierarchical)
        return self.cache[key]

    def fastest(self, i: int, d: int) -> float:
        """The shortest time document i's ring of d ranks can take wherever the planner places it: its layout's
        (`layout`), or, for a ring that fits in a node but lands across nodes (the planner's fallback when no node
        has d ranks free in time), a flat ring at NIC speed where a cost model makes the NIC the faster link."""
        t = self.layout(i, d)[1]
        if d <= self.n and self.cost.bw_inter > self.cost.bw_intra:
            s = self.lengths[i]
            t = min(t, self.cost.time(s, s * s, d, False))
        return t

    def wider(self, d: int) -> list[int]:
        """Placeable sizes above d up to the domain: every size up to twice d, then steps of ~9%."""
        if d in self.wider_cache:
            return self.wider_cache[d]
        out, k = self.wider_cache.setdefault(d, []), d
        while k < self.D:
            k = min(self.D, k + 1 if k < 2 * d else max(k + 1, int(k * 1.09)))
            k = self.fit(k)
            if k <= self.D and (not out or k > out[-1]):
                out.append(k)
        return out

    def within(self, i: int, d: int, target: float) -> int:
        """The smallest size ≥ d whose ring takes at most `target` seconds, else the fastest size. A flat ring's time
        falls with its size, then rises once its exposed traffic dominates, so sizes are scanned upward, and the
        running minimum of the times seen so far is kept per (document, d): later calls bisect it, and scan on
        only past it."""
        t = self.layout(i, d)[1]
        if t <= target:
            return d
        curve = self.curves.get((i, d))
        if curve is None:  # (sizes, -running min of their times), ascending
            curve = self.curves[(i, d)] = ([d], [-t])
        sizes, negated = curve
        at = bisect.bisect_left(negated, -target)
        if at < len(sizes):
            return sizes[at]
        wider = self.wider(d)
        while len(sizes) <= len(wider):
            k = wider[len(sizes) - 1]
            sizes.append(k)
            negated.append(max(negated[-1], -self.layout(i, k)[1]))
            if negated[-1] >= -target:
                return k
        return sizes[negated.index(negated[-1])]  # none within: the fastest


def ring_sizes_for_makespan(sizer: RingSizes, longs: list[int], minimal: dict[int, int], local_work: float,
                            num_ranks: int, pp: int) -> tuple[dict[int, int], float]:
    """Each long document's ring size for the step's makespan, and the step estimate T (planner.plan_hdp, 1.): the
    smallest T whose rings, each the smallest within T, estimate a step of at most T (max(mean load, longest
    ring)). Bisection: the estimate rises as T falls (rings widen and pay more traffic)."""

    def sizes_for(target: float) -> dict[int, int]:
        sizes = dict(minimal)
        for i in wide:  # no other ring is ever widened: its smallest size ends within the lowest target
            sizes[i] = sizer.within(i, minimal[i], target)
        return sizes

    def estimate(sizes: dict[int, int], longest: bool = True) -> float:
        area = local_work + sum(sizes[i] * sizer.layout(i, sizes[i])[1] for i in longs)
        ring = max((sizer.layout(i, sizes[i])[1] for i in longs), default=0.0) if longest else 0.0
        return max(area / (num_ranks * pp), ring)

    low = estimate(minimal, longest=False)  # the mean load with the smallest rings: no step is shorter
    wide = [i for i in longs if sizer.layout(i, minimal[i])[1] > low]
    sizes = sizes_for(low)
    high = estimate(sizes)
    if high <= low * 1.001:
        return sizes, max(low, high)
    best = (high, sizes)
    for _ in range(14):  # to ~0.01% of the bracket
        mid = (low + high) / 2
        trial = sizes_for(mid)
        step = estimate(trial)
        if step <= mid:
            high, best = mid, (step, trial)
        else:
            low = mid
        if high - low <= 1e-3 * high:
            break
    return best[1], best[0]
