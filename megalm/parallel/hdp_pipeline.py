"""HDP with pipeline parallelism: make a plan safe to run as one pipeline schedule per HDP rank.

With pp > 1 every HDP rank is a pipeline of pp stages, and each pipeline runs its own 1F1B (or ZB)
schedule over its own micro-batches (`plan.per_rank[h]`, ByteScale's PP-balance gives pipelines
different counts). A ring micro-batch couples pipelines: stage s of every member pipeline must run
its F (and later its B) together, because ring attention exchanges K/V between them. Pipeline
schedules interleave F and B by micro-batch *index*, so a ring that sits at index 1 in one pipeline
and index 3 in another can close a cycle of waits (pipeline P's stage 0 waits for Q's ring F while Q
waits for a backward that needs P); `check_pipelined` finds such plans by running the schedules.

`align_rings` removes the cause: every ring gets the same index in all its member pipelines. It walks
the rings in their global order; a member that has fewer micro-batches before the ring than another
first pulls its own later local micro-batches forward, and only when it has none left gets a
*filler*: a micro-batch with no documents, which the trainer runs as one masked token (zero loss,
zero gradient). Aligned plans were deadlock-free in every randomized trial (tests/unit/test_hdp_runtime.py
checks them with `check_pipelined`, and the trainer checks each plan before running it). Pure Python.
"""

from __future__ import annotations

from megalm.parallel.hdp import MicroBatch, Plan
from megalm.parallel.schedules import build_schedule


def _is_ring(mb: MicroBatch) -> bool:
    return len(mb.ranks) > 1


def align_rings(plan: Plan) -> Plan:
    """A copy of `plan` where every ring micro-batch has the same position in each member's list.

    Local micro-batches keep their rank; only their order changes, plus fillers (micro-batches with
    no documents) where no local work can take a slot. `plan.stats["fillers"]` counts those.
    """
    mbs = list(plan.micro_batches)
    queues = [list(todo) for todo in plan.per_rank]
    out: list[list[int]] = [[] for _ in queues]
    fillers = 0
    while True:
        heads = [next((k for k in q if _is_ring(mbs[k])), None) for q in queues]
        ring = next((k for k in heads if k is not None and all(heads[m] == k for m in mbs[k].ranks)), None)
        if ring is None:
            break
        members = mbs[ring].ranks
        before = {m: queues[m].index(ring) for m in members}
        target = max(len(out[m]) + before[m] for m in members)
        for m in members:
            out[m] += queues[m][:before[m]]
            rest = queues[m][before[m] + 1:]
            while len(out[m]) < target:
                # this rank's next local micro-batch before its next ring, if any
                local = next((k for k in rest if not _is_ring(mbs[k])), None)
                if local is not None and not any(_is_ring(mbs[k]) for k in rest[:rest.index(local)]):
                    rest.remove(local)
                    out[m].append(local)
                else:
                    out[m].append(len(mbs))
                    mbs.append(MicroBatch((m,), (), 0, 0))
                    fillers += 1
            out[m].append(ring)
            queues[m] = rest
    if any(_is_ring(mbs[k]) for q in queues for k in q):
        raise ValueError("align_rings: the plan's rings are not in one consistent order on their ranks")
    for m, q in enumerate(queues):
        out[m] += q
    return Plan(plan.policy, mbs, out, dict(plan.stats, fillers=fillers))


def check_pipelined(plan: Plan, pp: int, schedule: str = "1f1b") -> None:
    """Raise ValueError if running `plan` with one `schedule` pipeline of `pp` stages per HDP rank
    can deadlock: each (rank, stage) runs its compute actions in order; F needs the previous stage's
    F, B the next stage's B (the last stage its own F), W its own B; the F or B of a ring needs every
    member pipeline's same stage to be at that same action (sends never block)."""
    lists: dict[tuple[int, int], list[tuple[str, int]]] = {}
    for h, todo in enumerate(plan.per_rank):
        sched = build_schedule(schedule, pp, len(todo)) if todo else None
        for s in range(pp):
            lists[h, s] = [(a.kind, todo[a.micro_batch]) for a in sched.compute_actions(s)] if sched else []
    pos = dict.fromkeys(lists, 0)
    done: set[tuple[str, int, int, int]] = set()

    def ready(h: int, s: int) -> tuple[str, int] | None:
        if pos[h, s] >= len(lists[h, s]):
            return None
        kind, k = lists[h, s][pos[h, s]]
        need = {"F": ("F", k, h, s - 1) if s > 0 else None,
                "B": ("B", k, h, s + 1) if s < pp - 1 else ("F", k, h, s),
                "W": ("B", k, h, s)}[kind]
        return (kind, k) if need is None or need in done else None

    remaining = sum(map(len, lists.values()))
    while remaining:
        progressed = False
        for h, s in lists:
            action = ready(h, s)
            if action is None:
                continue
            kind, k = action
            members = plan.micro_batches[k].ranks if kind in "FB" and _is_ring(plan.micro_batches[k]) else (h,)
            if any(ready(m, s) != action for m in members):
                continue
            for m in members:
                done.add((kind, k, m, s))
                pos[m, s] += 1
                remaining -= 1
            progressed = True
        if not progressed:
            h, s = next(key for key in lists if pos[key] < len(lists[key]))
            kind, k = lists[h, s][pos[h, s]]
            raise ValueError(f"HDP plan deadlocks under pp={pp} {schedule}: pipeline {h} stage {s} waits at {kind} of "
                             f"micro-batch {k} (ring {plan.micro_batches[k].ranks}); align its rings with align_rings")
