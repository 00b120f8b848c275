"""Pipeline schedules as data: one list of actions per pipeline rank; this module generates, validates and times
them (the data types, `Action` and `Schedule`, are in actions.py; SEND/RECV insertion under NCCL's rules in
rendezvous.py).

Why data and not code: the runtime that executes a schedule, the offload feature that inserts
OFFLOAD/RELOAD actions after a forward and before a backward, and the HDP balancer that gives
pipelines different numbers of micro-batches all need to *see* the order of work. A schedule here
is a plain `Schedule` holding `actions[rank]`, a list of `Action`s executed in order by that rank.
Everything below (validation, timing, memory accounting, text rendering) reads those lists; nothing
is hidden in a control loop, so a list can be checked for deadlocks and costed before a single
tensor moves.

Vocabulary. With `p` pipeline ranks and `vpp` model chunks per rank there are `p * vpp` virtual
stages; chunk `c` on rank `r` is virtual stage `c * p + r` (Megatron's layout: the last rank's chunk
`c` feeds the first rank's chunk `c + 1`). Actions:

- ``F mb`` forward of micro-batch ``mb`` through this rank's chunk;
- ``B mb`` backward w.r.t. the chunk's input (the gradient that goes upstream). In a schedule that
  does not split the backward (``split_backward=False``) ``B`` is the *full* backward and there is
  no ``W``;
- ``W mb`` backward w.r.t. the chunk's weights (split schedules only), which nothing downstream
  waits for, so it can be deferred into bubbles;
- ``SEND_F/RECV_F`` activations to/from the next/previous stage, ``SEND_B/RECV_B`` gradients to/from
  the previous/next stage (inserted by `rendezvous.with_comm`);
- ``OFFLOAD mb`` / ``RELOAD mb``: move the micro-batch's saved activations to host memory and back
  (inserted by `with_offload`, between the F and the B of that micro-batch and chunk).

Generators (papers):

- `one_f_one_b`: 1F1B / PipeDream-Flush (Narayanan et al. 2021, "Memory-Efficient
  Pipeline-Parallel DNN Training"): rank ``r`` runs ``min(p - r - 1, m)`` warm-up forwards, then
  alternates one forward and one backward, then drains. Same bubble as GPipe,
  ``(p - 1) / (m + p - 1)`` of the time, but at most ``p - r`` micro-batches in flight instead of
  ``m``.
- `interleaved_1f1b`: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM": each rank holds ``vpp`` chunks; the bubble shrinks by ``vpp`` at the
  price of ``vpp`` times more point-to-point traffic. Megatron's order, which needs ``m % p == 0``.
- `zb_h1`: ZB-H1 from Qi et al. 2024, "Zero Bubble Pipeline Parallelism": backward split into B and
  W; B stays on the critical path in 1F1B order, W is deferred to fill the cool-down bubble. Same
  number of in-flight micro-batches as 1F1B, bubble about ``(p - 1)(f + b - w)`` instead of
  ``(p - 1)(f + b + w)`` per rank.

Execution model used by `validate` and `simulate_schedule`: each rank runs its list in order and blocks on an
action until its inputs exist (F of stage s needs F of stage s - 1 of the same micro-batch; B of
stage s needs B of stage s + 1, and the last stage's B needs its own F; W needs its own B).
Communication follows NCCL's rules, not gloo's: a send may block until its receive is posted, and
messages between two ranks match by order. The runtime therefore posts each maximal run of
communication actions between two compute actions as one batch (`steps`: e.g. SEND_F then RECV_B
is Megatron's send_forward_recv_backward) and waits for all of it; `validate` checks that every rank's
batches find their partners posted (`rendezvous_deadlock`), besides pairing and order. Communication
costs zero in `simulate_schedule`.

Run ``python -m megalm.parallel.pipeline.schedules`` for a table of bubble fraction and peak in-flight
micro-batches at p=4, m=8.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from megalm.config.choices import PipelineScheduleName
from megalm.parallel.pipeline.actions import COMM_KINDS, MEMORY_KINDS, Action, Schedule
from megalm.parallel.pipeline.rendezvous import rendezvous_deadlock

# ---------------------------------------------------------------------------------------------
# Generators
# ---------------------------------------------------------------------------------------------


def _check_pm(p: int, m: int) -> None:
    if p < 1:
        raise ValueError(f"number of pipeline stages must be >= 1, got {p}")
    if m < 1:
        raise ValueError(f"number of micro-batches must be >= 1, got {m}")


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush): warm-up forwards, steady one-forward-one-backward, cool-down backwards."""
    _check_pm(p, m)
    actions = []
    for r in range(p):
        warm = min(p - r - 1, m)
        acts = [Action("F", i) for i in range(warm)]
        for i in range(m - warm):
            acts += [Action("F", warm + i), Action("B", i)]
        acts += [Action("B", i) for i in range(m - warm, m)]
        actions.append(acts)
    return Schedule(p, m, 1, "1f1b", False, actions)


def interleaved_1f1b(p: int, m: int, vpp: int) -> Schedule:
    """Megatron's interleaved 1F1B with `vpp` model chunks per rank (requires m % p == 0).

    Micro-batches go through the chunks in groups of p: forward k (k = 0 .. m*vpp - 1) is micro-batch
    (k // (p*vpp)) * p + k % p on chunk (k // p) % vpp; backward k is the same micro-batch on chunk
    vpp - 1 - (k // p) % vpp. Rank r runs (p - r - 1) * 2 + (vpp - 1) * p warm-up forwards (all of
    them when m == p, as Megatron does), then alternates, then drains. vpp == 1 is plain 1F1B.
    """
    _check_pm(p, m)
    if vpp < 1:
        raise ValueError(f"vpp must be >= 1, got {vpp}")
    if vpp == 1:
        sched = one_f_one_b(p, m)
        sched.name = "interleaved_1f1b(vpp=1)"
        return sched
    if m % p != 0:
        raise ValueError(
            f"interleaved 1F1B needs the number of micro-batches ({m}) to be a multiple of the number of "
            f"pipeline stages ({p}); use m in {{{p}, {2 * p}, ...}} or vpp=1"
        )
    total = m * vpp
    group = p * vpp

    def mb(k: int) -> int:
        return (k // group) * p + k % p

    def chunk(k: int, forward: bool) -> int:
        c = (k % group) // p
        return c if forward else vpp - 1 - c

    actions = []
    for r in range(p):
        warm = total if m == p else min((p - r - 1) * 2 + (vpp - 1) * p, total)
        acts = [Action("F", mb(k), chunk(k, True)) for k in range(warm)]
        for k in range(total - warm):
            acts += [Action("F", mb(warm + k), chunk(warm + k, True)), Action("B", mb(k), chunk(k, False))]
        acts += [Action("B", mb(k), chunk(k, False)) for k in range(total - warm, total)]
        actions.append(acts)
    return Schedule(p, m, vpp, f"interleaved_1f1b(vpp={vpp})", False, actions)


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1: 1F1B order of F and B (same in-flight count), with W deferred.

    Rank r keeps 1F1B's min(p - r - 1, m) warm-up forwards and its F/B alternation; B is only the
    input gradient, so the backward wave crosses the pipeline in (p - 1) * b instead of (p - 1) * (b + w).
    In the steady phase rank r runs W of micro-batch i - r after B i: downstream ranks hold more W's
    back (rank 0 none), so the last B's reach rank 0 earlier; in the cool-down each B is followed by
    one pending W, and the rest close the list, filling the gaps where 1F1B waits for gradients. With
    f = b = w the makespan is 3m + p - 1 (bubble (p - 1)(f + b - w) per rank, as in the paper) and,
    counting a micro-batch until its W, every rank holds at most min(p, m), 1F1B's peak.
    """
    _check_pm(p, m)
    actions = []
    for r in range(p):
        warm = min(p - r - 1, m)
        lag = r
        acts = [Action("F", i) for i in range(warm)]
        next_w = 0
        for i in range(m - warm):
            acts += [Action("F", warm + i), Action("B", i)]
            if i - lag >= next_w:
                acts.append(Action("W", next_w))
                next_w += 1
        for i in range(m - warm, m):
            acts.append(Action("B", i))
            if next_w <= i:
                acts.append(Action("W", next_w))
                next_w += 1
        acts += [Action("W", i) for i in range(next_w, m)]
        actions.append(acts)
    return Schedule(p, m, 1, "zb_h1", True, actions)


SCHEDULES = PipelineScheduleName.names()


def forward_only(p: int, m: int, vpp: int = 1) -> Schedule:
    """An evaluation's forwards: interleaved 1F1B's forward order (Megatron's forward-only pass), micro-batches in
    groups of p through each chunk in turn, the last group holding what is left. Micro-batch by micro-batch instead,
    rank 0 waited for each one to cross all p * vpp virtual stages before starting the next (2.3x the makespan at
    p=4, vpp=2, m=8). The same list on every rank; no backward, so `validate` does not apply (its F checks do:
    tests/unit/test_schedules.py)."""
    _check_pm(p, m)
    order = [Action("F", i, c) for first in range(0, m, p) for c in range(vpp) for i in range(first, min(first + p, m))]
    return Schedule(p, m, vpp, "forward_only", False, [list(order) for _ in range(p)])


def build_schedule(name: str, p: int, m: int, vpp: int = 1) -> Schedule:
    """The schedule `parallel.pp_schedule=name` runs for p stages and m micro-batches, validated."""
    if name == "1f1b":
        sched = one_f_one_b(p, m)
    elif name == "interleaved":
        sched = interleaved_1f1b(p, m, vpp)
    elif name == "zb":
        sched = zb_h1(p, m)
    else:
        raise ValueError(f"unknown pipeline schedule {name!r}; expected one of {SCHEDULES}")
    if name != "interleaved" and vpp != 1:
        raise ValueError(f"pipeline schedule {name!r} runs one model chunk per rank; set vpp=1 or use 'interleaved'")
    validate(sched)
    return sched


# ---------------------------------------------------------------------------------------------
# Checks, timing, memory, rendering
# ---------------------------------------------------------------------------------------------


def _deps(sched: Schedule, rank: int, a: Action) -> list[tuple[str, int, int]]:
    """The (kind, micro_batch, virtual stage) compute actions `a` on `rank` must wait for."""
    s = sched.stage_of(rank, a.chunk)
    if a.kind == "F":
        return [("F", a.micro_batch, s - 1)] if s > 0 else []
    if a.kind == "B":
        deps = [("F", a.micro_batch, s)]
        if s < sched.num_virtual_stages - 1:
            deps.append(("B", a.micro_batch, s + 1))
        return deps
    return [("B", a.micro_batch, s)]  # W


def _check_memory_actions(sched: Schedule) -> None:
    """Each OFFLOAD comes after its F, each RELOAD after its OFFLOAD and before its B, at most once; each SEND after
    the F or B that makes its tensor, each RECV a rank has before the F or B that takes it (the runtime reads the
    received tensor there: a RECV after it failed mid-step, not here)."""
    for rank, acts in enumerate(sched.actions):
        done: set[tuple[str, int, int]] = set()
        receives = {(a.kind, a.micro_batch, a.chunk): a for a in acts if a.kind in ("RECV_F", "RECV_B")}
        for a in acts:
            key = (a.micro_batch, a.chunk)
            need = {"OFFLOAD": ("F",), "RELOAD": ("OFFLOAD",), "B": (), "SEND_F": ("F",), "SEND_B": ("B",)}.get(a.kind)
            received = {"F": "RECV_F", "B": "RECV_B"}.get(a.kind)
            if received is not None and (received, *key) in receives and (received, *key) not in done:
                raise ValueError(f"{sched.name}: rank {rank} runs {a} before {receives[(received, *key)]}, which "
                                 "brings its input")
            if a.kind == "B" and ("OFFLOAD", *key) in done and ("RELOAD", *key) not in done:
                raise ValueError(f"{sched.name}: rank {rank} runs {a} while its activations are offloaded "
                                 "(RELOAD missing before it)")
            for prev in need or ():
                if (prev, *key) not in done:
                    raise ValueError(f"{sched.name}: rank {rank} runs {a} before {Action(prev, *key)}")
            if a.kind in MEMORY_KINDS and (a.kind, *key) in done:
                raise ValueError(f"{sched.name}: rank {rank} runs {a} twice")
            done.add((a.kind, *key))


def _check_local(sched: Schedule) -> None:
    p, m, v = sched.num_stages, sched.num_micro_batches, sched.vpp
    if len(sched.actions) != p:
        raise ValueError(f"{sched.name}: {len(sched.actions)} action lists for {p} pipeline ranks")
    kinds = ("F", "B", "W") if sched.split_backward else ("F", "B")
    for rank in range(p):
        seen: dict[tuple[str, int, int], int] = {}
        for pos, a in enumerate(sched.compute_actions(rank)):
            if a.kind not in kinds:
                raise ValueError(f"{sched.name}: rank {rank} has {a} but this schedule does not split backward")
            if not (0 <= a.micro_batch < m and 0 <= a.chunk < v):
                raise ValueError(f"{sched.name}: rank {rank} action {a} out of range (m={m}, vpp={v})")
            key = (a.kind, a.micro_batch, a.chunk)
            if key in seen:
                raise ValueError(f"{sched.name}: rank {rank} runs {a} twice (positions {seen[key]} and {pos})")
            prev = {"B": "F", "W": "B"}.get(a.kind)
            if prev is not None and (prev, a.micro_batch, a.chunk) not in seen:
                raise ValueError(f"{sched.name}: rank {rank} runs {a} before {Action(prev, a.micro_batch, a.chunk)}")
            seen[key] = pos
        for kind in kinds:
            for c in range(v):
                for i in range(m):
                    if (kind, i, c) not in seen:
                        raise ValueError(f"{sched.name}: rank {rank} never runs {Action(kind, i, c)}")


def comm_mismatches(sched: Schedule) -> list[str]:
    """Communication actions without exactly one matching partner on the peer rank (empty if paired).

    SEND_F of micro-batch i from chunk c on rank r pairs with the RECV_F of i on rank `peer`, peer r,
    whose chunk is the next virtual stage; SEND_B pairs with RECV_B on the previous virtual stage.
    """
    sends: Counter[tuple] = Counter()
    recvs: Counter[tuple] = Counter()
    for rank, acts in enumerate(sched.actions):
        for a in acts:
            if a.kind not in COMM_KINDS:
                continue
            s = sched.stage_of(rank, a.chunk)
            if a.kind == "SEND_F":
                sends[("F", a.micro_batch, s, s + 1, rank, a.peer)] += 1
            elif a.kind == "RECV_F":
                recvs[("F", a.micro_batch, s - 1, s, a.peer, rank)] += 1
            elif a.kind == "SEND_B":
                sends[("B", a.micro_batch, s, s - 1, rank, a.peer)] += 1
            else:
                recvs[("B", a.micro_batch, s + 1, s, a.peer, rank)] += 1
    nstages = sched.num_virtual_stages
    bad = []
    for key in sorted(set(sends) | set(recvs)):
        kind, i, src, dst, r_src, r_dst = key
        n_send, n_recv = sends[key], recvs[key]
        if not (0 <= src < nstages and 0 <= dst < nstages):
            bad.append(f"{kind} mb {i}: no virtual stage {src if not 0 <= src < nstages else dst}")
        elif sched.place_of(src)[0] != r_src or sched.place_of(dst)[0] != r_dst:
            bad.append(f"{kind} mb {i} stage {src}->{dst} between ranks {r_src}->{r_dst}: peer is not the neighbour")
        elif n_send != 1 or n_recv != 1:
            bad.append(
                f"{kind} mb {i} stage {src}->{dst}: {n_send} SEND(s) on rank {r_src} and {n_recv} RECV(s) on "
                f"rank {r_dst}, expected one of each"
            )
    return bad


def comm_order_mismatches(sched: Schedule) -> list[str]:
    """Directed rank pairs whose messages would be received in another order than they were sent.

    The runtime matches messages between two ranks by order alone (that is all NCCL offers: no
    tags), so for every (src, dst) the sequence of SEND actions on src must equal the sequence of
    RECV actions on dst. Empty if that holds.
    """
    bad = []
    p = sched.num_stages
    for src in range(p):
        for dst in range(p):
            sent = [(a.kind[5:], a.micro_batch, sched.stage_of(src, a.chunk)) for a in sched.actions[src]
                    if a.kind.startswith("SEND") and a.peer == dst]
            received = [(a.kind[5:], a.micro_batch, sched.stage_of(dst, a.chunk) + (-1 if a.kind == "RECV_F" else 1))
                        for a in sched.actions[dst] if a.kind.startswith("RECV") and a.peer == src]
            if sent != received:
                pairs = enumerate(zip(sent, received, strict=False))
                first = next((i for i, (x, y) in pairs if x != y), min(len(sent), len(received)))
                bad.append(f"rank {src} -> rank {dst}: message {first} is sent as {sent[first:first + 1]} but "
                           f"received as {received[first:first + 1]}")
    return bad


def _run(sched: Schedule, cost: dict[str, float] | None) -> list[list[tuple[Action, float, float]]]:
    """Blocking in-order execution of the compute actions; raises on deadlock. Returns timelines."""
    p = sched.num_stages
    lists = [sched.compute_actions(r) for r in range(p)]
    pos = [0] * p
    clock = [0.0] * p
    end: dict[tuple[str, int, int], float] = {}
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    remaining = sum(len(x) for x in lists)
    while remaining:
        progressed = False
        for r in range(p):
            while pos[r] < len(lists[r]):
                a = lists[r][pos[r]]
                deps = _deps(sched, r, a)
                if any(d not in end for d in deps):
                    break
                start = max([clock[r]] + [end[d] for d in deps])
                dur = cost[a.kind] if cost else 0.0
                clock[r] = start + dur
                end[(a.kind, a.micro_batch, sched.stage_of(r, a.chunk))] = clock[r]
                timeline[r].append((a, start, clock[r]))
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            for r in range(p):
                if pos[r] < len(lists[r]):
                    a = lists[r][pos[r]]
                    missing = [d for d in _deps(sched, r, a) if d not in end][0]
                    rank, chunk = sched.place_of(missing[2])
                    raise ValueError(
                        f"{sched.name}: deadlock: rank {r} blocks on {a} (action {pos[r]}), waiting for "
                        f"{Action(missing[0], missing[1], chunk)} on rank {rank}, which never runs first"
                    )
    return timeline


def validate(sched: Schedule) -> None:
    """Raise ValueError naming the first violation; return None if `sched` is complete and deadlock-free.

    Checks: every rank runs each F and B (and W if split) of every micro-batch and chunk exactly once,
    F before B before W locally; communication actions (if any) are paired, received in the order they
    are sent between every pair of ranks, and complete when each batch's sends wait for their receives
    (rendezvous, as NCCL may); and blocking in-order execution of all ranks finishes (see the module
    docstring for the dependency model).
    """
    _check_local(sched)
    _check_memory_actions(sched)
    bad = comm_mismatches(sched)
    if bad:
        raise ValueError(f"{sched.name}: unpaired communication: {bad[0]}")
    bad = comm_order_mismatches(sched)
    if bad:
        raise ValueError(f"{sched.name}: messages out of order: {bad[0]}")
    stuck = rendezvous_deadlock(sched)
    if stuck:
        raise ValueError(f"{sched.name}: deadlock when sends wait for their receives: {stuck}")
    _run(sched, None)


@dataclass
class ScheduleTimeline:
    makespan: float
    busy: list[float]  # per rank
    bubble_fraction: float  # 1 - sum(busy) / (p * makespan)
    timeline: list[list[tuple[Action, float, float]]]  # per rank: (action, start, end)


def simulate_schedule(sched: Schedule, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> ScheduleTimeline:
    """Event-driven timing of blocking in-order execution with per-action costs.

    f, b, w are the costs of one action (one micro-batch through one model chunk); for a schedule that
    does not split the backward a B costs b + w. Communication costs zero. For an interleaved schedule
    a chunk holds 1/vpp of the rank's layers: pass f/vpp etc. to compare makespans with a
    non-interleaved schedule of the same model (the bubble fraction does not depend on that scale).
    """
    validate(sched)
    cost = {"F": f, "B": b if sched.split_backward else b + w, "W": w}
    timeline = _run(sched, cost)
    makespan = max((t[-1][2] for t in timeline if t), default=0.0)
    busy = [sum(e - s for _, s, e in t) for t in timeline]
    bubble = 1.0 - sum(busy) / (sched.num_stages * makespan) if makespan > 0 else 0.0
    return ScheduleTimeline(makespan, busy, bubble, timeline)


def simulated_timeline(sched: Schedule) -> list[list[tuple[Action, float, float]]]:
    """`simulate_schedule(sched).timeline` at the default costs: what PipeOffload's policies choose from, in the
    trainer (Parallelism) and in megalm-plot schedule alike."""
    return simulate_schedule(sched).timeline


def peak_in_flight(sched: Schedule, release: str = "B") -> list[int]:
    """Per rank, the most micro-batch-chunks whose F has run and whose backward has not.

    This is the activation-memory accounting: an F stores its activations, the input-gradient B
    consumes most of them. By default (release="B") a micro-batch leaves flight at its B; the W of a
    split schedule keeps only the inputs of the weight GEMMs, which we do not count. release="W"
    counts until W instead (an upper bound for split schedules; same as "B" for unsplit ones).
    """
    if release not in ("B", "W"):
        raise ValueError(f"release must be 'B' or 'W', got {release!r}")
    freer = "W" if release == "W" and sched.split_backward else "B"
    peaks = []
    for rank in range(sched.num_stages):
        live = peak = 0
        for a in sched.compute_actions(rank):
            if a.kind == "F":
                live += 1
                peak = max(peak, live)
            elif a.kind == freer:
                live -= 1
        peaks.append(peak)
    return peaks


def render_text(sched: Schedule, f: float = 1.0, b: float = 1.0, w: float = 1.0, unit: float = 1.0) -> str:
    """Text timeline: one row per rank, one column per `unit` of time.

    An action's label ("F3", "B3", "W3", "F3.c1") sits in its first column, "--" marks the rest of a
    longer action, dots mark idle time. Costs must be multiples of `unit`.
    """
    res = simulate_schedule(sched, f, b, w)

    def col(t: float) -> int:
        c = round(t / unit)
        if abs(c * unit - t) > 1e-9:
            raise ValueError(f"time {t} is not a multiple of unit={unit}; pass a smaller unit")
        return c

    ncols = col(res.makespan)
    width = max([2] + [len(str(a)) for t in res.timeline for a, _, _ in t])
    lines = [f"{sched.name}  p={sched.num_stages} m={sched.num_micro_batches}  f={f} b={b} w={w}"]
    for rank, t in enumerate(res.timeline):
        cells = ["." * width] * ncols
        for a, s, e in t:
            c0, c1 = col(s), col(e)
            for c in range(c0, c1):
                cells[c] = (str(a) if c == c0 else "-" * width).ljust(width)
        lines.append(f"rank {rank}: " + " ".join(cells))
    return "\n".join(lines)


def summary_table(p: int = 4, m: int = 8, vpp: int = 2) -> str:
    """Bubble fraction and peak in-flight micro-batches of each generator, with the cost model used."""
    rows = [
        (one_f_one_b(p, m), (1.0, 2.0, 0.0), "f=1, full backward b+w=2"),
        (interleaved_1f1b(p, m, vpp), (1.0, 2.0, 0.0), "f=1, full backward b+w=2 per chunk"),
        (one_f_one_b(p, m), (1.0, 1.0, 1.0), "f=b=w=1, full backward b+w=2"),
        (zb_h1(p, m), (1.0, 1.0, 1.0), "f=b=w=1, B and W split"),
    ]
    out = [f"p={p} m={m}; costs per action (one micro-batch through one chunk), communication free"]
    out.append(f"{'schedule':<26} {'cost model':<36} {'bubble':>7} {'makespan':>9}  peak in-flight per rank")
    for sched, (f, b, w), model in rows:
        res = simulate_schedule(sched, f, b, w)
        out.append(
            f"{sched.name:<26} {model:<36} {res.bubble_fraction:>7.3f} {res.makespan:>9.1f}  {peak_in_flight(sched)}"
        )
    return "\n".join(out)


if __name__ == "__main__":
    print(summary_table())
    print()
    print(render_text(zb_h1(4, 8)))
