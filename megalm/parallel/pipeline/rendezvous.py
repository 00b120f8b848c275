"""NCCL's point-to-point rules applied to schedules: sends that wait for their receives.

gloo's sends never block, so on CPU any schedule whose messages pair up runs. NCCL may hold a send
until the peer posts the matching receive, and matches the messages of a rank pair by order. The
pipeline runtime therefore posts each maximal run of communication actions between two compute
actions as one `batch_isend_irecv` (`steps`) and waits for all of it, as Megatron's
send_forward_recv_backward family does. Whether a schedule can run that way is a property of its
action lists, checked here before a step runs (`rendezvous_deadlock`); `post_receives_early` repairs
the schedules that need a receive posted sooner (interleaved 1F1B). `with_comm` inserts a schedule's SEND/RECV
actions, posted that way.
"""

from __future__ import annotations

import dataclasses

from megalm.parallel.pipeline.actions import Action, Schedule


def steps(actions: list[Action]) -> list[Action | tuple[Action, ...]]:
    """A rank's action list as the runtime executes it: each compute action alone, and each maximal run
    of other actions (SEND/RECV, OFFLOAD/RELOAD) between two compute actions as one tuple, whose sends
    and receives are posted together as one batch (the memory actions of the run follow it)."""
    out: list[Action | tuple[Action, ...]] = []
    run: list[Action] = []
    for a in actions:
        if a.is_compute:
            if run:
                out.append(tuple(run))
                run = []
            out.append(a)
        else:
            run.append(a)
    if run:
        out.append(tuple(run))
    return out


def message_key(sched: Schedule, rank: int, a: Action) -> tuple:
    """(kind, micro_batch, source stage, source rank, destination rank) of a SEND or RECV action: the key
    its partner action shares."""
    s = sched.stage_of(rank, a.chunk)
    if a.kind == "SEND_F":
        return "F", a.micro_batch, s, rank, a.peer
    if a.kind == "RECV_F":
        return "F", a.micro_batch, s - 1, a.peer, rank
    if a.kind == "SEND_B":
        return "B", a.micro_batch, s, rank, a.peer
    return "B", a.micro_batch, s + 1, a.peer, rank


def _rendezvous(sched: Schedule) -> tuple[str, list[tuple[int, tuple, int]]] | None:
    """Run every rank's `steps` with rendezvous communication. None if all finish; else a description of
    the stuck ranks and, for each pending send whose receive is not posted, (receiving rank, message, the
    index in the receiver's action list just after the batch it waits in). One phase per batch: the
    runtime knows every message's shape on both sides, so no shape header precedes a payload."""
    batches: list[list[tuple[int, set[tuple]]]] = []  # per rank: (action index after the batch, its messages)
    for r, acts in enumerate(sched.actions):
        rank_batches, n = [], 0
        for step in steps(acts):
            n += len(step) if isinstance(step, tuple) else 1
            if isinstance(step, tuple):
                rank_batches.append((n, {(a.kind.startswith("SEND"), message_key(sched, r, a)) for a in step
                                         if a.kind.startswith(("SEND", "RECV"))}))
        batches.append(rank_batches)
    pos = [0] * len(batches)
    pending = [set(b[0][1]) if b else set() for b in batches]  # the open ops of each rank's current batch
    while any(pos[r] < len(batches[r]) for r in range(len(batches))):
        progressed = False
        for r in range(len(batches)):  # a send and its receive complete together once both are posted
            for is_send, msg in list(pending[r]):
                peer = msg[4] if is_send else msg[3]
                if (not is_send, msg) in pending[peer]:
                    pending[r].discard((is_send, msg))
                    pending[peer].discard((not is_send, msg))
                    progressed = True
        for r in range(len(batches)):
            if pos[r] < len(batches[r]) and not pending[r]:
                pos[r] += 1
                pending[r] = set(batches[r][pos[r]][1]) if pos[r] < len(batches[r]) else set()
                progressed = True
        if not progressed:
            stuck = [r for r in range(len(batches)) if pos[r] < len(batches[r])]
            text = ", ".join(f"rank {r} waits for {sorted(m[:3] for _, m in pending[r])}" for r in stuck)
            missing = [(msg[4], msg, batches[msg[4]][pos[msg[4]]][0]) for r in stuck
                       for is_send, msg in pending[r] if is_send and pos[msg[4]] < len(batches[msg[4]])]
            return f"every rank waits for a partner that is not posted: {text}", missing
    return None


def rendezvous_deadlock(sched: Schedule) -> str | None:
    """None if every rank's communication batches (`steps`) complete when a send waits for its receive
    (NCCL's rule; gloo's sends never block), else a description of the stuck ranks. Compute actions never
    block here: their data dependencies are `_run`'s check."""
    result = _rendezvous(sched)
    return None if result is None else result[0]


def post_receives_early(sched: Schedule) -> Schedule:
    """A copy where each receive that would leave its send waiting forever is posted earlier, at the end of
    the batch its rank is stuck in (a receive may come early: its buffer just lives longer). Only the first
    unmatched message of a rank pair moves, so messages keep their order. Returns the schedule unchanged
    where nothing is stuck (1F1B, ZB-H1) or where moving receives cannot help (`validate` then says why);
    interleaved 1F1B needs it (Megatron posts its next receives with the current sends for the same reason)."""
    actions = [list(acts) for acts in sched.actions]
    while True:
        current = dataclasses.replace(sched, actions=actions)
        result = _rendezvous(current)
        if result is None or not result[1]:
            return current
        moves: dict[int, tuple[int, list[int]]] = {}  # receiver -> (where its stuck batch ends, receives to move)
        for receiver, msg, at in result[1]:
            index = next(i for i, a in enumerate(actions[receiver]) if a.kind.startswith("RECV")
                         and message_key(current, receiver, a) == msg)
            if index < at:  # already posted by then: moving it cannot help
                return current
            moves.setdefault(receiver, (at, []))[1].append(index)
        for receiver, (at, indices) in moves.items():  # keep the moved receives in their own order
            moved = [actions[receiver][i] for i in sorted(indices)]
            kept = [a for i, a in enumerate(actions[receiver]) if i not in set(indices)]
            actions[receiver] = kept[:at] + moved + kept[at:]


def with_comm(sched: Schedule) -> Schedule:
    """A copy of `sched` with SEND/RECV actions around the compute actions that need them.

    RECV_F goes right before an F whose input comes from another rank, SEND_F right after an F
    whose output goes to another rank; RECV_B/SEND_B likewise around B (gradients flow from
    stage s + 1 to stage s). The `chunk` of a communication action is this rank's chunk that
    produces (SEND) or consumes (RECV) the tensor. Hand-offs between two chunks on the same rank
    (p == 1 with vpp > 1) stay local and get no actions. W needs no communication. Receives that
    would leave a send waiting forever under NCCL's rendezvous are then posted earlier
    (`post_receives_early`).
    """
    last = sched.num_virtual_stages - 1
    out: list[list[Action]] = []
    for rank, acts in enumerate(sched.actions):
        new: list[Action] = []
        for a in acts:
            if not a.is_compute:
                new.append(a)
                continue
            s = sched.stage_of(rank, a.chunk)
            before = after = None
            if a.kind == "F":
                if s > 0 and sched.place_of(s - 1)[0] != rank:
                    before = Action("RECV_F", a.micro_batch, a.chunk, sched.place_of(s - 1)[0])
                if s < last and sched.place_of(s + 1)[0] != rank:
                    after = Action("SEND_F", a.micro_batch, a.chunk, sched.place_of(s + 1)[0])
            elif a.kind == "B":
                if s < last and sched.place_of(s + 1)[0] != rank:
                    before = Action("RECV_B", a.micro_batch, a.chunk, sched.place_of(s + 1)[0])
                if s > 0 and sched.place_of(s - 1)[0] != rank:
                    after = Action("SEND_B", a.micro_batch, a.chunk, sched.place_of(s - 1)[0])
            new.extend(x for x in (before, a, after) if x is not None)
        out.append(new)
    return post_receives_early(Schedule(sched.num_stages, sched.num_micro_batches, sched.vpp, sched.name,
                                        sched.split_backward, out))
