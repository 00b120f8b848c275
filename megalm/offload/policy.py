"""Which activations to offload: the policies, and the memory they leave on the device, read off the
schedule's action lists (pipeline schedules are data: megalm/parallel/pipeline/schedules.py).

Pipeline (PipeOffload, Wan et al. 2025, arXiv 2503.01328). Under 1F1B a rank holds the activations of up
to p - r micro-batches, each from its forward to its backward; the time between the two (the *lifespan*)
is long for the first micro-batches of the first ranks and short at the end of the step. Offloading a
micro-batch after its forward and reloading it before its backward frees its memory for that span, at
the cost of one round-trip copy that must hide under the compute in between.

- ``uniform``: a fraction of each rank's micro-batches, spread evenly over the step among those whose offload frees
  memory while something computes (every policy skips the others, such as the last stage's, whose F and B touch).
- ``lifespan``: PipeOffload's selective offload: only micro-batches whose lifespan is at least 3x their
  round-trip copy time (shorter ones could not hide the copy), and among those, greedily, the one whose
  offload lowers the rank's peak the most (ties: the longest-lived). Offloading where the peak is, rather
  than evenly, lowers the peak faster than the offloaded volume grows (better than linear);
  `resident_profile` measures it. (Longest lifespan alone is not enough: under 1F1B the warm-up
  micro-batches live longest, but the steady-state ones overlap the peak as well.)
- ``auto``: the fraction from PipeOffload's ratio k = (copy time of one micro-batch's activations, one
  way) / (its forward + backward compute time): all of them when k <= 1 (every copy hides under one
  micro-batch's compute), else 1 / k of them, chosen by lifespan.

Lifespans are read off the schedule's simulated timeline (F = 1, B = 2 or B = W = 1 per micro-batch-chunk):
the time on a rank between the end of an F and the start of its B, waits included.

No pipeline (pp = 1): `layer_groups` picks which transformer blocks' activations go to the host: the first
`fraction` of them (backward reaches the last blocks first, so those stay resident and their backward
starts while the first reloads are in flight).
"""

from __future__ import annotations

import bisect
import math
from typing import Protocol

from megalm.config.choices import OffloadPolicy

POLICIES = OffloadPolicy.names()
COSTS = {"F": 1.0, "B": 2.0, "W": 1.0}
MIN_GAP_ROUND_TRIPS = 3.0  # lifespan: skip a micro-batch whose lifespan is under 3x its round trip


class ScheduleLike(Protocol):
    """What the policies read from a pipeline schedule (megalm.parallel.pipeline.actions.Schedule)."""

    num_stages: int
    num_micro_batches: int
    vpp: int
    split_backward: bool
    actions: list


def share(fraction: float, count: int) -> int:
    """round(fraction * count), at least one of a non-empty `count` when fraction > 0: offload on with a small
    fraction offloaded nothing (0.125 of 4 blocks rounds to 0) while the run said it offloaded."""
    return max(round(fraction * count), 1 if fraction > 0 and count else 0)


def spread(count: int, fraction: float) -> list[int]:
    """share(fraction, count) of range(count), spread evenly (fraction 0.5: every other one)."""
    return evenly(count, share(fraction, count))


def evenly(count: int, chosen: int) -> list[int]:
    """`chosen` of range(count), spread evenly."""
    return sorted({math.floor(i * count / chosen) for i in range(chosen)}) if chosen else []


Timeline = list[list[tuple[object, float, float]]]  # per rank: (compute action, start, end)


def lifespans(timeline: Timeline, rank: int) -> dict[tuple[int, int], float]:
    """{(micro_batch, chunk): time on `rank` between the end of its F and the start of its B}, from the
    schedule's simulated timeline (megalm.parallel.pipeline.schedules.simulate_schedule(...).timeline): waits for
    the backward to come back down the pipeline count, which is what makes the first micro-batches live long."""
    end_f, out = {}, {}
    for a, start, end in timeline[rank]:
        key = (a.micro_batch, a.chunk)
        if a.kind == "F":
            end_f[key] = end
        elif a.kind == "B":
            out[key] = start - end_f[key]
    return out


def auto_fraction(copy_to_compute: float) -> float:
    """PipeOffload's rule: k = one-way copy time / compute time of a micro-batch; offload min(1, 1/k)."""
    if copy_to_compute <= 0:
        return 1.0
    return min(1.0, 1.0 / copy_to_compute)


def _live_intervals(actions: list) -> tuple[dict[tuple[int, int], tuple[int, int, int, int]], int]:
    """{(micro_batch, chunk): (F, last index resident after F, first index resident before B, B)} in a rank's
    action list when offloaded, as `Schedule.with_offload` places the memory actions: OFFLOAD after the F
    (after its SEND_F if there is one), RELOAD before the compute action ahead of the B, or right before the
    B's RECV_B (or the B) when that action is the F itself; and the list's length."""
    first: dict[tuple[int, int], dict[str, int]] = {}
    compute = []
    for i, a in enumerate(actions):
        first.setdefault((a.micro_batch, a.chunk), {}).setdefault(a.kind, i)
        if a.kind in COSTS:
            compute.append(i)
    out = {}
    for key, at in first.items():
        if "F" in at and "B" in at:
            f, b = at["F"], at["B"]
            sent = f + 1 if at.get("SEND_F") == f + 1 else f
            back = min(at.get("RECV_B", b), b)
            ahead = max((j for j in compute if j < back), default=None)
            out[key] = (f, sent, ahead if ahead is not None and ahead > sent else back, b)
    return out, len(actions)


def _frees_memory(actions: list) -> set[tuple[int, int]]:
    """The (micro_batch, chunk) whose offload frees device memory while some compute action runs: with none between
    its OFFLOAD and its RELOAD (the last stage's F and B side by side, a warm-up's last F before its B) the copy goes
    out and straight back, freeing nothing, and the B waits for both copies."""
    spans, _ = _live_intervals(actions)
    compute = [i for i, a in enumerate(actions) if a.kind in COSTS]
    return {key for key, (_, sent, back, _) in spans.items()
            if bisect.bisect_right(compute, sent) < bisect.bisect_left(compute, back)}


def _greedy_peak_cut(actions: list, candidates: list[tuple[int, int]], budget: int) -> list[tuple[int, int]]:
    """Up to `budget` of `candidates` (in preference order), each time the one whose offload lowers the rank's
    peak the most, or else the number of places where the peak is reached (then the longest-lived, then the
    earlier candidate). An offloaded micro-batch-chunk is resident from its F to its OFFLOAD and from its
    RELOAD to its B, instead of from its F to its B."""
    spans, n = _live_intervals(actions)
    live = [0] * n
    for f, _, _, b in spans.values():
        for i in range(f, b + 1):
            live[i] += 1
    picked: list[tuple[int, int]] = []
    remaining = list(candidates)
    for _ in range(min(budget, len(remaining))):
        best = None
        for order, key in enumerate(remaining):
            f, sent, back, b = spans[key]
            trial = live[:sent + 1] + [v - 1 for v in live[sent + 1:back]] + live[back:]
            top = max(trial)
            score = (top, trial.count(top), -(b - f), order)
            if best is None or score < best[0]:
                best = (score, key, trial)
        _, key, live = best
        picked.append(key)
        remaining.remove(key)
    return picked


def select_pipeline(schedule: ScheduleLike, timeline: Timeline, policy: str, fraction: float,
                    copy_to_compute: float = 0.0) -> set[tuple[int, int, int]]:
    """The (rank, micro_batch, chunk) whose activations are offloaded under `policy`.

    timeline: the schedule's simulated timeline with F = 1 per micro-batch-chunk (and B = 2 unsplit, or
    B = W = 1). copy_to_compute: k above, one-way copy time over F + B time (0: copies are free): it sets
    auto's fraction, and lifespan's minimum gap of 3 round trips, 3 * 2k * (F + B) = 18k time units.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown offload policy {policy!r}; expected one of {', '.join(POLICIES)}")
    if policy == "auto":
        fraction = auto_fraction(copy_to_compute)
    min_gap = MIN_GAP_ROUND_TRIPS * 2 * copy_to_compute * (COSTS["F"] + COSTS["B"])
    chosen: set[tuple[int, int, int]] = set()
    for rank in range(schedule.num_stages):
        spans = lifespans(timeline, rank)
        keys = sorted(spans)  # (micro_batch, chunk) in order
        budget = share(fraction, len(keys))
        frees = _frees_memory(schedule.actions[rank])
        if policy == "uniform":  # the budget spread evenly over the micro-batches whose offload frees memory
            useful = [k for k in keys if k in frees]
            picked = [useful[i] for i in evenly(len(useful), min(budget, len(useful)))]
        else:
            worth = [k for k in sorted(keys, key=lambda k: (-spans[k], k))
                     if spans[k] > 0 and spans[k] >= min_gap and k in frees]
            picked = _greedy_peak_cut(schedule.actions[rank], worth, budget)
        chosen.update((rank, mb, chunk) for mb, chunk in picked)
    return chosen


def resident_profile(schedule: ScheduleLike, rank: int, weights: dict[tuple[int, int], int] | None = None
                     ) -> list[int]:
    """Activations on the device after each of `rank`'s actions, for a schedule with its memory actions in
    place (`Schedule.with_offload`): an F adds its micro-batch-chunk's, an OFFLOAD removes them, a RELOAD
    adds them back, its B removes them (a W keeps only its weight GEMMs' inputs: not counted). `weights`:
    {(micro_batch, chunk): bytes}; without them each counts 1, and max() is the rank's peak in units of one
    micro-batch-chunk's activations."""
    sign = {"F": 1, "RELOAD": 1, "OFFLOAD": -1, "B": -1}
    live, out = 0, []
    for a in schedule.actions[rank]:
        if a.kind in sign:
            live += sign[a.kind] * (1 if weights is None else weights[(a.micro_batch, a.chunk)])
        out.append(live)
    return out


def layer_groups(num_layers: int, fraction: float, round_up: bool = False) -> list[int]:
    """The transformer blocks offloaded without a pipeline: the first share(fraction, num_layers) (ceil with
    `round_up`: a share of the activations that must leave the device)."""
    count = math.ceil(fraction * num_layers - 1e-9) if round_up else share(fraction, num_layers)
    return list(range(count))


def layer_resident_profile(num_blocks: int, offloaded: set[int] | list[int]) -> list[int]:
    """Blocks whose activations are on the device after each event of a pp = 1 micro-batch under
    `LayerOffload`: forward adds each block's and takes the offloaded ones away right after; backward, from
    the last block, reloads a block still on the host on the spot, prefetches the block before it when
    its backward starts, and frees each block's once its backward has run. max() is the peak in units of
    one block's activations."""
    offloaded, live, out, on_host = set(offloaded), 0, [], set()
    for i in range(num_blocks):
        live += 1
        out.append(live)
        if i in offloaded:
            live -= 1
            on_host.add(i)
            out.append(live)
    for i in reversed(range(num_blocks)):
        if i in on_host:  # not prefetched: reloaded when its backward needs it
            live += 1
            on_host.discard(i)
            out.append(live)
        if i - 1 in on_host:  # prefetch one block ahead
            live += 1
            on_host.discard(i - 1)
            out.append(live)
        live -= 1
        out.append(live)
    return out
