"""HDP with pipeline or expert parallelism: make a plan safe to run as one pipeline schedule per HDP rank, and in
lockstep where every micro-batch communicates.

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
checks them with `check_pipelined`, and the trainer checks each plan before running it).

Under expert parallelism (ep > 1) every micro-batch's MoE layers all-to-all over their EP group, so every rank must
run the same number of micro-batches, each at the same position as its group's: `in_lockstep` aligns the rings and
pads every rank to the domain's longest list with fillers. Then each rank (each pipeline, with one schedule of the
same length) runs the same sequence of forwards and backwards, so each all-to-all finds its group at the same layer
of the same position, and each ring its members. The price: each micro-batch position waits for its slowest rank
at every MoE layer, so a step costs the sum over positions of the slowest rank's micro-batch, where HDP's planner
balances each rank's total. Pure Python.
"""

from __future__ import annotations

from megalm.parallel.hdp.plan import MicroBatch, Plan
from megalm.parallel.pipeline.rendezvous import steps, with_comm
from megalm.parallel.pipeline.schedules import build_schedule


def _is_ring(mb: MicroBatch) -> bool:
    return len(mb.ranks) > 1


def align_rings(plan: Plan) -> Plan:
    """A copy of `plan` where every ring micro-batch has the same position in each member's list.

    Local micro-batches keep their rank; only their order changes, plus fillers (micro-batches with
    no documents) where no local work can take a slot. `plan.stats["fillers"]` counts those.
    Rings are taken when every member has it next (their global order makes one always ready);
    O(total micro-batches + Σ ring sizes).
    """
    mbs = list(plan.micro_batches)
    queues = [list(todo) for todo in plan.per_rank]
    pos = [0] * len(queues)  # queues[r][:pos[r]] are placed
    out: list[list[int]] = [[] for _ in queues]
    waiting = {}  # ring -> members whose next ring it is
    ready: list[int] = []

    def advance_head(r: int) -> None:
        k = next((k for k in queues[r][pos[r]:] if _is_ring(mbs[k])), None)
        if k is not None:
            waiting[k] = waiting.get(k, 0) + 1
            if waiting[k] == len(mbs[k].ranks):
                ready.append(k)

    for r in range(len(queues)):
        advance_head(r)
    fillers = 0
    while ready:
        ring = ready.pop()
        members = mbs[ring].ranks
        at = {m: queues[m].index(ring, pos[m]) for m in members}
        target = max(len(out[m]) + at[m] - pos[m] for m in members)
        for m in members:
            out[m] += queues[m][pos[m]:at[m]]
            rest = queues[m][at[m] + 1:]
            while len(out[m]) < target:
                # this rank's next local micro-batch before its next ring, if any
                if rest and not _is_ring(mbs[rest[0]]):
                    out[m].append(rest.pop(0))
                else:
                    out[m].append(len(mbs))
                    mbs.append(MicroBatch((m,), (), 0, 0))
                    fillers += 1
            out[m].append(ring)
            queues[m], pos[m] = rest, 0
            advance_head(m)
    if any(_is_ring(mbs[k]) for q, p in zip(queues, pos, strict=True) for k in q[p:]):
        raise ValueError("align_rings: the plan's rings are not in one consistent order on their ranks")
    for m, q in enumerate(queues):
        out[m] += q[pos[m]:]
    return Plan(plan.policy, mbs, out, dict(plan.stats, fillers=fillers))


def in_lockstep(plan: Plan) -> Plan:
    """`align_rings(plan)` with every rank's list padded with fillers to the longest (the module docstring: expert
    parallelism's all-to-alls need every rank at every micro-batch). `stats["fillers"]` counts all of them."""
    plan = align_rings(plan)
    mbs, longest = list(plan.micro_batches), max(map(len, plan.per_rank), default=0)
    per_rank, fillers = [], plan.stats.get("fillers", 0)
    for m, todo in enumerate(plan.per_rank):
        pad = list(range(len(mbs), len(mbs) + longest - len(todo)))
        mbs += [MicroBatch((m,), (), 0, 0)] * len(pad)
        per_rank.append([*todo, *pad])
        fillers += len(pad)
    return Plan(plan.policy, mbs, per_rank, dict(plan.stats, fillers=fillers))


def check_pipelined(plan: Plan, pp: int, schedule: str = "1f1b") -> None:
    """Raise ValueError if running `plan` with one `schedule` pipeline of `pp` stages per HDP rank
    can deadlock: each (rank, stage) runs its compute actions in order; F needs the previous stage's
    F, B the next stage's B (the last stage its own F), W its own B; the F or B of a ring needs every
    member pipeline's same stage to be at that same action (sends never block)."""
    lists: dict[tuple[int, int], list[tuple[str, int]]] = {}
    per_stage: dict[int, list[list[tuple[str, int]]]] = {}  # micro-batch count -> (kind, index) per stage
    for h, todo in enumerate(plan.per_rank):
        m = len(todo)
        if m and m not in per_stage:
            sched = build_schedule(schedule, pp, m)
            per_stage[m] = [[(a.kind, a.micro_batch) for a in sched.compute_actions(s)] for s in range(pp)]
        for s in range(pp):
            lists[h, s] = [(kind, todo[i]) for kind, i in per_stage[m][s]] if m else []
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

    todo = list(lists)  # (rank, stage) pairs that may be able to move; a worklist, not sweeps
    while todo:
        h, s = todo.pop()
        action = ready(h, s)
        if action is None:
            continue
        kind, k = action
        members = plan.micro_batches[k].ranks if kind in "FB" and _is_ring(plan.micro_batches[k]) else (h,)
        if any(ready(m, s) != action for m in members):
            continue  # the last member to arrive runs it
        for m in members:
            done.add((kind, k, m, s))
            pos[m, s] += 1
            todo += [(m, s)] + [(m, t) for t in (s - 1, s + 1) if 0 <= t < pp]
    stuck = next((key for key in lists if pos[key] < len(lists[key])), None)
    if stuck is not None:
        h, s = stuck
        kind, k = lists[h, s][pos[h, s]]
        raise ValueError(f"HDP plan deadlocks under pp={pp} {schedule}: pipeline {h} stage {s} waits at {kind} of "
                         f"micro-batch {k} (ring {plan.micro_batches[k].ranks}); align its rings with align_rings")
    _check_rendezvous(plan, pp, schedule)


def _check_rendezvous(plan: Plan, pp: int, schedule: str) -> None:
    """The same plan with each pipeline's sends and receives as the runtime posts them (batches of its
    schedule's `with_comm` actions, rendezvous.py): a batch completes once the partner of each of its
    messages is posted by the neighbouring stage of the same pipeline, a ring's F or B once every member
    pipeline's stage is at it; compute runs as soon as it is reached (its inputs came with the batches)."""
    per_stage: dict[int, list[list]] = {}  # micro-batch count -> per stage: items with schedule indices
    lists: dict[tuple[int, int], list] = {}
    for h, todo in enumerate(plan.per_rank):
        m = len(todo)
        if m and m not in per_stage:
            sched = with_comm(build_schedule(schedule, pp, m))
            per_stage[m] = [[_item(step, s) for step in steps(sched.actions[s])] for s in range(pp)]
        for s in range(pp):
            lists[h, s] = [_in_plan(item, todo) for item in per_stage[m][s]] if m else []
    pos = dict.fromkeys(lists, 0)
    pending: dict[tuple[int, int], set | None] = dict.fromkeys(lists)  # the posted batch's open messages

    def current(h: int, s: int):
        return lists[h, s][pos[h, s]] if pos[h, s] < len(lists[h, s]) else None

    todo = list(lists)
    while todo:
        h, s = todo.pop()
        while (item := current(h, s)) is not None:
            if item[0] == "C":
                kind, k = item[1], item[2]
                mb = plan.micro_batches[k]
                members = mb.ranks if kind in "FB" and _is_ring(mb) else (h,)
                if any(current(m, s) != item for m in members):
                    break  # the last member to arrive runs it
                for m in members:
                    pos[m, s] += 1
                    if m != h:
                        todo.append((m, s))
                continue
            if pending[h, s] is None:  # post the batch: match what the neighbours have posted
                pending[h, s] = set(item[1])
                for op in list(pending[h, s]):
                    send, kind, k, src, dst = op
                    peer = (h, dst if send else src)
                    partner = (not send, kind, k, src, dst)
                    if pending.get(peer) is not None and partner in pending[peer]:
                        pending[h, s].discard(op)
                        pending[peer].discard(partner)
                        todo.append(peer)
            if pending[h, s]:
                break
            pending[h, s] = None
            pos[h, s] += 1
            todo += [(h, t) for t in (s - 1, s + 1) if 0 <= t < pp]
    stuck = next((key for key in lists if pos[key] < len(lists[key])), None)
    if stuck is not None:
        h, s = stuck
        raise ValueError(f"HDP plan deadlocks under pp={pp} {schedule} when sends wait for their receives: pipeline "
                         f"{h} stage {s} waits at {current(h, s)}; align its rings with align_rings")


def _item(step, s: int) -> tuple:
    """("C", kind, micro-batch index) for a compute action; ("X", [(is_send, F|B, index, source stage,
    destination stage)]) for a batch of sends and receives (memory actions do not wait)."""
    if not isinstance(step, tuple):
        return "C", step.kind, step.micro_batch
    return "X", [(a.kind.startswith("SEND"), a.kind[-1], a.micro_batch, *_stages(a.kind, s)) for a in step
                 if a.kind.startswith(("SEND", "RECV"))]


def _in_plan(item: tuple, todo: list[int]) -> tuple:
    """`item` with the schedule's micro-batch indices replaced by the plan's micro-batch ids."""
    if item[0] == "C":
        return "C", item[1], todo[item[2]]
    return "X", [(send, kind, todo[i], src, dst) for send, kind, i, src, dst in item[1]]


def _stages(kind: str, s: int) -> tuple[int, int]:
    """(source stage, destination stage) of a SEND/RECV action on stage s."""
    return {"SEND_F": (s, s + 1), "RECV_F": (s - 1, s), "SEND_B": (s, s - 1), "RECV_B": (s + 1, s)}[kind]
