"""The baselines HDP is measured against (tools/hdp_sim.py), in the same terms as its plans: `plan_static` (pack to
the context length, shard every packed sequence over a fixed cp group) and `plan_megatron_hybrid` (Megatron-LM's
hybrid CP: power-of-two CP groups, s²/d workload, greedy rounds separated by barriers). Pure Python, no torch."""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence

from megalm.parallel.hdp.cost import CostModel, ring_size
from megalm.parallel.hdp.plan import MicroBatch, Plan, TooFewRanks, packed_micro_batches


def plan_static(lengths: Sequence[int], num_ranks: int, capacity: int, context: int, cost: CostModel,
                balance: bool = True) -> Plan:
    """Static mesh baseline (Megatron/TE CP with THD packing), in its best honest form.

    Assumptions: a fixed cp = the smallest divisor of D with cp·C ≥ context (so no rank idles) and
    dp = D / cp; every micro-batch is one sequence of `context` tokens packed best-fit-decreasing from
    documents, each document padded to a multiple of 2·cp (TransformerEngine's zigzag-per-document
    requirement), the tail padded; each packed sequence is sharded over one cp group and runs ring
    attention with document masking (attention work Σs², but every rank's whole KV chunk travels the
    ring); cp groups are contiguous rank blocks (inside a node when cp fits). In its favour: packed
    sequences go to dp groups by LPT on the true cost (different counts per group are fine with the
    per-token loss), not round-robin (`balance=False`: round-robin, as a data loader deals them: the ablation's
    baseline, which has no time model until its balance step).
    """
    D, C = num_ranks, capacity
    need = ring_size(context, C)
    cp = next((k for k in range(need, D + 1) if D % k == 0), None)
    if cp is None:
        raise TooFewRanks(f"context {context} needs {need} ranks of {C} tokens, more than {D}")
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
    order = sorted(range(len(packs)), key=times.__getitem__, reverse=True) if balance else range(len(packs))
    for n, k in enumerate(order):
        if balance:
            t, g = heapq.heappop(groups)
            heapq.heappush(groups, (t + times[k], g))
        else:
            g = n % (D // cp)
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
        raise TooFewRanks(f"a document of {lengths[remaining[0]]} tokens does not fit on {D} ranks")
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
                mbs = packed_micro_batches(ranks[0], members[g], lengths, C)
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
