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
balances each rank's total.

Interleaved pipelines (vpp > 1) run in lockstep too, padded to a multiple of pp (Megatron's interleaved order needs
one). Aligned rings are not enough there: an interleaved schedule's order depends on its micro-batch count (with
m = pp every forward runs first), so pipelines of different counts meet a ring from different places, and 60 of 800
random aligned plans padded only to a multiple of pp deadlocked (`check_pipelined`, which models the chunks). In
lockstep every pipeline runs one schedule, a ring at one index in all of them: none of the same 800 did. Pure Python.
"""

from __future__ import annotations

from megalm.parallel.hdp.plan import MicroBatch, Plan
from megalm.parallel.pipeline.rendezvous import message_key, steps, with_comm
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


def in_lockstep(plan: Plan, multiple: int = 1) -> Plan:
    """`align_rings(plan)` with every rank's list padded with fillers to the longest, rounded up to a multiple of
    `multiple` (the module docstring: expert parallelism's all-to-alls need every rank at every micro-batch; an
    interleaved pipeline's schedule needs a multiple of its ranks). `stats["fillers"]` counts all of them."""
    plan = align_rings(plan)
    mbs, longest = list(plan.micro_batches), max(map(len, plan.per_rank), default=0)
    longest += -longest % multiple
    per_rank, fillers = [], plan.stats.get("fillers", 0)
    for m, todo in enumerate(plan.per_rank):
        pad = list(range(len(mbs), len(mbs) + longest - len(todo)))
        mbs += [MicroBatch((m,), (), 0, 0)] * len(pad)
        per_rank.append([*todo, *pad])
        fillers += len(pad)
    return Plan(plan.policy, mbs, per_rank, dict(plan.stats, fillers=fillers))


def check_pipelined(plan: Plan, pp: int, schedule: str = "1f1b", vpp: int = 1) -> None:
    """Raise ValueError if running `plan` with one `schedule` pipeline of `pp` ranks (`vpp` model chunks each, pp·vpp
    virtual stages) per HDP rank can deadlock (`run_pipelines`). A plan in lockstep whose rings sit at one index in
    all their members (`in_one_schedule`) runs every pipeline through the same actions, each ring's members together,
    so it deadlocks only if one pipeline of its count does alone, which is what is checked: O(pp·m), not the whole
    domain's (3 s a step at 1,024 pipelines, pp 4, vpp 2, until 2026-12-05)."""
    if in_one_schedule(plan):
        count = len(plan.per_rank[0]) if plan.per_rank else 0
        plan = Plan(plan.policy, [MicroBatch((0,), (), 0, 0)] * count, [list(range(count))])
    run_pipelines(plan, pp, schedule, vpp)


def in_one_schedule(plan: Plan) -> bool:
    """Whether every pipeline of `plan` runs one schedule (as many micro-batches) with each micro-batch at one index
    in the lists of its ranks, and of them only (`in_lockstep`'s plans)."""
    if len({len(todo) for todo in plan.per_rank}) > 1:
        return False
    index: dict[int, int] = {}
    holders: dict[int, list[int]] = {}
    for h, todo in enumerate(plan.per_rank):
        for i, k in enumerate(todo):
            if index.setdefault(k, i) != i:
                return False
            holders.setdefault(k, []).append(h)
    return all(sorted(plan.micro_batches[k].ranks) == ranks for k, ranks in holders.items())


def run_pipelines(plan: Plan, pp: int, schedule: str = "1f1b", vpp: int = 1) -> None:
    """Raise ValueError if `plan`'s pipelines deadlock when run together: each (pipeline, rank) runs its compute
    actions in order; F needs the previous virtual stage's F, B the next one's B (the last stage its own F), W its
    own B; the F or B of a ring needs every member pipeline's same rank to be at that same action (sends never
    block); then again with sends and receives as the runtime posts them (`_check_rendezvous`)."""
    lists = _pipelines(plan, pp, schedule, vpp, lambda sched: [
        [(a.kind, a.micro_batch, sched.stage_of(r, a.chunk)) for a in sched.compute_actions(r)] for r in range(pp)])
    last = pp * vpp - 1
    pos = dict.fromkeys(lists, 0)
    done: set[tuple[str, int, int, int]] = set()  # (kind, micro-batch, pipeline, virtual stage)

    def ready(h: int, r: int) -> tuple[str, int, int] | None:
        if pos[h, r] >= len(lists[h, r]):
            return None
        kind, k, v = lists[h, r][pos[h, r]]
        need = {"F": ("F", k, h, v - 1) if v > 0 else None,
                "B": ("B", k, h, v + 1) if v < last else ("F", k, h, v),
                "W": ("B", k, h, v)}[kind]
        return (kind, k, v) if need is None or need in done else None

    todo = list(lists)  # (pipeline, rank) pairs that may be able to move; a worklist, not sweeps
    while todo:
        h, r = todo.pop()
        action = ready(h, r)
        if action is None:
            continue
        kind, k, v = action
        members = plan.micro_batches[k].ranks if kind in "FB" and _is_ring(plan.micro_batches[k]) else (h,)
        if any(ready(m, r) != action for m in members):
            continue  # the last member to arrive runs it
        for m in members:
            done.add((kind, k, m, v))
            pos[m, r] += 1
            todo += [(m, r), *_neighbours(m, r, pp)]
    stuck = next((key for key in lists if pos[key] < len(lists[key])), None)
    if stuck is not None:
        h, r = stuck
        kind, k, v = lists[h, r][pos[h, r]]
        raise ValueError(f"HDP plan deadlocks under pp={pp} {_named(schedule, vpp)}: pipeline {h} rank {r} waits at "
                         f"{kind} of micro-batch {k} on virtual stage {v} (ring {plan.micro_batches[k].ranks}); "
                         f"{_remedy(pp, vpp)}")
    _check_rendezvous(plan, pp, schedule, vpp)


def _neighbours(h: int, r: int, pp: int) -> list[tuple[int, int]]:
    """Pipeline h's ranks holding the virtual stages next to rank r's (r ± 1, around: the last rank's chunk c feeds
    the first rank's chunk c + 1)."""
    return [(h, (r - 1) % pp), (h, (r + 1) % pp)]


def _pipelines(plan: Plan, pp: int, schedule: str, vpp: int, items) -> dict[tuple[int, int], list]:
    """{(pipeline h, rank r): `items(schedule)[r]` of the schedule of h's micro-batch count, its micro-batch indices
    replaced by the plan's ids}: `items` gives each rank's tuples whose second element is a micro-batch index, or
    ("X", [message tuples whose second element is one]) for a batch of sends and receives; once a count."""
    per_count: dict[int, list[list[tuple]]] = {}
    lists: dict[tuple[int, int], list] = {}
    for h, todo in enumerate(plan.per_rank):
        m = len(todo)
        if m and m not in per_count:
            sched = build_schedule(schedule, pp, m, vpp)
            per_count[m] = items(sched)
        for r in range(pp):
            lists[h, r] = [_in_plan(item, todo) for item in per_count[m][r]] if m else []
    return lists


def _in_plan(item: tuple, todo: list[int]) -> tuple:
    """`item` with the schedule's micro-batch indices replaced by the plan's micro-batch ids."""
    if item[0] == "X":
        return "X", [(send, kind, todo[i], *rest) for send, kind, i, *rest in item[1]]
    return (item[0], todo[item[1]], *item[2:])


def _remedy(pp: int, vpp: int) -> str:
    """What makes a plan safe: aligned rings, or for interleaved pipelines (whose order depends on their micro-batch
    count) lockstep."""
    if vpp == 1:
        return "align its rings with align_rings"
    return f"run its pipelines in lockstep with in_lockstep(plan, {pp})"


def _named(schedule: str, vpp: int) -> str:
    return f"{schedule} (vpp={vpp})" if vpp > 1 else schedule


def _check_rendezvous(plan: Plan, pp: int, schedule: str, vpp: int) -> None:
    """The same plan with each pipeline's sends and receives as the runtime posts them (batches of its
    schedule's `with_comm` actions, rendezvous.py): a batch completes once the partner of each of its
    messages is posted by the other rank of the same pipeline, a ring's F or B once every member
    pipeline's rank is at it; compute runs as soon as it is reached (its inputs came with the batches)."""
    def items(sched) -> list[list[tuple]]:
        sched = with_comm(sched)  # once a micro-batch count
        return [[(step.kind, step.micro_batch, sched.stage_of(r, step.chunk)) if not isinstance(step, tuple) else
                 ("X", [(a.kind.startswith("SEND"), *message_key(sched, r, a)) for a in step
                        if a.kind.startswith(("SEND", "RECV"))]) for step in steps(sched.actions[r])]
                for r in range(pp)]

    lists = _pipelines(plan, pp, schedule, vpp, items)
    pos = dict.fromkeys(lists, 0)
    pending: dict[tuple[int, int], set | None] = dict.fromkeys(lists)  # the posted batch's open messages

    def current(h: int, r: int):
        return lists[h, r][pos[h, r]] if pos[h, r] < len(lists[h, r]) else None

    todo = list(lists)
    while todo:
        h, r = todo.pop()
        while (item := current(h, r)) is not None:
            if item[0] != "X":
                kind, k = item[0], item[1]
                mb = plan.micro_batches[k]
                members = mb.ranks if kind in "FB" and _is_ring(mb) else (h,)
                if any(current(m, r) != item for m in members):
                    break  # the last member to arrive runs it
                for m in members:
                    pos[m, r] += 1
                    if m != h:
                        todo.append((m, r))
                continue
            if pending[h, r] is None:  # post the batch: match what the other ranks have posted
                pending[h, r] = set(item[1])
                for op in list(pending[h, r]):
                    send, *message = op  # message: (F|B, micro-batch, source stage, source rank, destination rank)
                    peer = (h, message[4] if send else message[3])
                    partner = (not send, *message)
                    if pending.get(peer) is not None and partner in pending[peer]:
                        pending[h, r].discard(op)
                        pending[peer].discard(partner)
                        todo.append(peer)
            if pending[h, r]:
                break
            pending[h, r] = None
            pos[h, r] += 1
            todo += _neighbours(h, r, pp)
    stuck = next((key for key in lists if pos[key] < len(lists[key])), None)
    if stuck is not None:
        h, r = stuck
        raise ValueError(f"HDP plan deadlocks under pp={pp} {_named(schedule, vpp)} when sends wait for their "
                         f"receives: pipeline {h} rank {r} waits at {current(h, r)}; {_remedy(pp, vpp)}")
