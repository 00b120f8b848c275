"""Pipeline schedules as action lists: completeness, deadlock freedom, timing, memory (pure Python)."""

import pytest

from megalm.parallel.pipeline.actions import Action, Schedule
from megalm.parallel.pipeline.rendezvous import rendezvous_deadlock, with_comm
from megalm.parallel.pipeline.schedules import (
    _run,
    comm_mismatches,
    comm_order_mismatches,
    forward_only,
    interleaved_1f1b,
    one_f_one_b,
    peak_in_flight,
    render_text,
    simulate_schedule,
    validate,
    zb_h1,
)


def all_schedules():
    for p in range(1, 6):
        for m in range(1, 10):
            yield one_f_one_b(p, m)
            yield zb_h1(p, m)
            for vpp in (1, 2, 3):
                if vpp == 1 or m % p == 0:
                    yield interleaved_1f1b(p, m, vpp)


def test_all_generators_validate_over_grid():
    n = 0
    for sched in all_schedules():
        validate(sched)
        validate(with_comm(sched))
        n += 1
    assert n > 100


def test_interleaved_rejects_m_not_multiple_of_p():
    with pytest.raises(ValueError, match="multiple of the number of pipeline stages"):
        interleaved_1f1b(4, 6, 2)


def _copy(sched: Schedule, actions) -> Schedule:
    return Schedule(sched.num_stages, sched.num_micro_batches, sched.vpp, sched.name, sched.split_backward, actions)


def test_validate_rejects_missing_backward():
    s = one_f_one_b(3, 4)
    acts = [list(a) for a in s.actions]
    acts[1].remove(Action("B", 2))
    with pytest.raises(ValueError, match=r"rank 1 never runs B2"):
        validate(_copy(s, acts))


def test_validate_rejects_backward_before_forward():
    s = one_f_one_b(2, 2)
    acts = [list(a) for a in s.actions]
    acts[1] = [Action("B", 0), Action("F", 0), Action("F", 1), Action("B", 1)]
    with pytest.raises(ValueError, match=r"rank 1 runs B0 before F0"):
        validate(_copy(s, acts))


def test_validate_rejects_w_before_b_and_duplicates():
    s = zb_h1(2, 2)
    acts = [list(a) for a in s.actions]
    i = acts[0].index(Action("W", 0))
    acts[0].insert(0, acts[0].pop(i))
    with pytest.raises(ValueError, match=r"runs W0 before B0"):
        validate(_copy(s, acts))
    acts = [list(a) for a in s.actions]
    acts[1].append(Action("F", 1))
    with pytest.raises(ValueError, match=r"F1 twice"):
        validate(_copy(s, acts))


def test_validate_detects_cross_rank_deadlock():
    # Locally fine on every rank, but rank 0 runs B0 (waiting for rank 1's B0) before F1, while rank 1
    # runs F1 (waiting for rank 0's F1) before B0: a cycle under blocking in-order execution.
    s = one_f_one_b(2, 2)
    acts = [
        [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
        [Action("F", 0), Action("F", 1), Action("B", 1), Action("B", 0)],
    ]
    with pytest.raises(ValueError, match=r"deadlock: rank 0 blocks on B0.*waiting for B0 on rank 1"):
        validate(_copy(s, acts))


def test_validate_rejects_unpaired_comm():
    s = with_comm(one_f_one_b(3, 3))
    acts = [list(a) for a in s.actions]
    acts[1].remove(Action("RECV_B", 0, 0, 2))
    with pytest.raises(ValueError, match="unpaired communication"):
        validate(_copy(s, acts))


@pytest.mark.parametrize("p", [1, 2, 4, 5])
@pytest.mark.parametrize("m", [1, 3, 4, 8])
def test_1f1b_peak_in_flight_is_min_p_minus_rank_m(p, m):
    assert peak_in_flight(one_f_one_b(p, m)) == [min(p - r, m) for r in range(p)]


@pytest.mark.parametrize("p", [1, 2, 4, 5])
@pytest.mark.parametrize("m", [1, 3, 4, 8, 9])
def test_zb_h1_memory_matches_1f1b(p, m):
    ref = peak_in_flight(one_f_one_b(p, m))
    zb = zb_h1(p, m)
    assert peak_in_flight(zb) == ref
    # Counting until W (the deferred W keeps the weight-GEMM inputs) no rank exceeds 1F1B's worst rank.
    assert max(peak_in_flight(zb, release="W")) <= max(ref) == min(p, m)


def test_bubble_fractions_p4_m8():
    p, m = 4, 8
    # 1F1B with f=1 and an unsplit backward of b+w=2 (the usual "backward = 2x forward"): the bubble is
    # the same as GPipe's, (p-1)/(m+p-1), because every rank idles (p-1)(f+b+w) of a makespan of
    # (m+p-1)(f+b+w).
    r1 = simulate_schedule(one_f_one_b(p, m), f=1, b=2, w=0)
    assert r1.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert r1.makespan == pytest.approx((m + p - 1) * 3)
    # Interleaved with the same per-action costs: the warm-up/cool-down are made of chunk-sized steps.
    ri = simulate_schedule(interleaved_1f1b(p, m, 2), f=1, b=2, w=0)
    assert ri.bubble_fraction < r1.bubble_fraction
    # Same costs at equal model size (a chunk is half a stage): less makespan than 1F1B too.
    assert simulate_schedule(interleaved_1f1b(p, m, 2), f=0.5, b=1, w=0).makespan < r1.makespan
    # ZB-H1 at f=b=w=1 against 1F1B at the same costs: ZB-H1 idles (p-1)(f+b-w) per rank (the paper's
    # closed form), i.e. makespan 3m + p - 1, vs 1F1B's (p-1)(f+b+w).
    rz = simulate_schedule(zb_h1(p, m), f=1, b=1, w=1)
    r1u = simulate_schedule(one_f_one_b(p, m), f=1, b=1, w=1)
    assert r1u.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert rz.makespan == pytest.approx(3 * m + (p - 1))
    assert rz.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))
    assert rz.bubble_fraction < r1u.bubble_fraction


def test_simulate_accounting():
    r = simulate_schedule(zb_h1(3, 5), f=1, b=2, w=0.5)
    assert r.busy == pytest.approx([5 * 3.5] * 3)
    assert r.bubble_fraction == pytest.approx(1 - sum(r.busy) / (3 * r.makespan))
    for rank_t in r.timeline:
        for (_, _, e0), (_, s1, _) in zip(rank_t[:-1], rank_t[1:], strict=True):
            assert e0 <= s1 + 1e-12  # in order, no overlap on a rank
    # Unsplit backward costs b + w.
    r1 = simulate_schedule(one_f_one_b(1, 2), f=1, b=2, w=0.5)
    assert r1.makespan == pytest.approx(2 * 3.5) and r1.bubble_fraction == pytest.approx(0.0)


@pytest.mark.parametrize(
    "sched", [one_f_one_b(4, 6), interleaved_1f1b(2, 4, 3), zb_h1(5, 3), interleaved_1f1b(1, 3, 2)]
)
def test_with_comm_pairs_every_send_with_one_recv(sched):
    c = with_comm(sched)
    assert comm_mismatches(c) == []
    sends = [(r, a) for r, acts in enumerate(c.actions) for a in acts if a.kind.startswith("SEND")]
    recvs = [(r, a) for r, acts in enumerate(c.actions) for a in acts if a.kind.startswith("RECV")]
    assert len(sends) == len(recvs)
    for r, a in sends:
        assert abs(a.peer - r) in (1, sched.num_stages - 1) and a.peer != r
        direction = a.kind[-1]
        matches = [
            (q, x)
            for q, x in recvs
            if q == a.peer
            and x.peer == r
            and x.kind == "RECV_" + direction
            and x.micro_batch == a.micro_batch
            and c.stage_of(q, x.chunk) == c.stage_of(r, a.chunk) + (1 if direction == "F" else -1)
        ]
        assert len(matches) == 1, (r, a)
    # The compute order is unchanged.
    for r in range(sched.num_stages):
        assert c.compute_actions(r) == sched.actions[r]
    # Expected count: one hop per micro-batch and stage boundary, both directions.
    hops = sched.num_virtual_stages - 1 if sched.num_stages > 1 else 0
    assert len(sends) == 2 * hops * sched.num_micro_batches


def test_interleaved_wraps_last_rank_to_first():
    c = with_comm(interleaved_1f1b(3, 3, 2))
    assert Action("SEND_F", 0, 0, 0) in c.actions[2]
    assert Action("RECV_F", 0, 1, 2) in c.actions[0]
    assert Action("SEND_B", 0, 1, 2) in c.actions[0]


@pytest.mark.parametrize("sched", [one_f_one_b(3, 4), zb_h1(4, 5), interleaved_1f1b(2, 2, 2)])
def test_render_text_contains_every_action_once(sched):
    text = render_text(sched, f=1, b=1, w=1)
    cells = text.split()
    for r in range(sched.num_stages):
        row = text.splitlines()[1 + r].split()[2:]
        labels = [cell for cell in row if not cell.startswith(("-", "."))]
        assert labels == [str(a) for a in sched.actions[r]]  # each action once, in list order
    assert (
        sum(not c.startswith(("-", ".", "rank")) for c in cells[len(text.splitlines()[0].split()) :])
        == sum(len(a) for a in sched.actions) + sched.num_stages
    )  # + the "N:" of each row


def test_action_str_and_checks():
    assert str(Action("F", 3)) == "F3"
    assert str(Action("B", 3)) == "B3"
    assert str(Action("W", 3)) == "W3"
    assert str(Action("F", 3, 1)) == "F3.c1"
    assert str(Action("SEND_F", 3, 0, 2)) == "SEND_F3->2"
    with pytest.raises(ValueError):
        Action("X", 0)
    with pytest.raises(ValueError):
        Action("SEND_F", 0)
    with pytest.raises(ValueError):
        Action("F", 0, peer=1)


def test_with_offload_places_offload_after_forward_and_reload_before_backward():
    sched = with_comm(zb_h1(4, 8))
    chosen = {(r, mb, 0) for r in range(4) for mb in range(8) if mb % 3 == 0}
    offloaded = sched.with_offload(chosen)
    validate(offloaded)
    for r in range(4):
        acts = offloaded.actions[r]
        kinds = [(a.kind, a.micro_batch) for a in acts]
        for mb in range(8):
            if (r, mb, 0) not in chosen:
                assert ("OFFLOAD", mb) not in kinds and ("RELOAD", mb) not in kinds
                continue
            f, off, rel, b = (kinds.index((k, mb)) for k in ("F", "OFFLOAD", "RELOAD", "B"))
            assert f < off < rel < b
            assert acts[off - 1].kind in ("F", "SEND_F")  # right after the forward (and its send)
            between = [a for a in acts[rel + 1:b] if a.is_compute]
            if between:  # prefetched: one compute action ahead of the backward, right before it
                assert len(between) == 1 and acts[rel + 1].is_compute
            else:  # the action ahead was its own forward: right before the backward (and its receive)
                assert acts[rel + 1].kind in ("B", "RECV_B")
        # compute order and communication unchanged
        assert [a for a in acts if a.kind not in ("OFFLOAD", "RELOAD")] == sched.actions[r]


def test_validate_rejects_misplaced_memory_actions():
    base = one_f_one_b(2, 2)
    bad = Schedule(2, 2, 1, "bad", False, [list(base.actions[0]), list(base.actions[1])])
    bad.actions[0].insert(0, Action("OFFLOAD", 0))
    with pytest.raises(ValueError, match="before F0"):
        validate(bad)
    bad = one_f_one_b(2, 2).with_offload({(0, 0, 0)})
    bad.actions[0] = [a for a in bad.actions[0] if a.kind != "RELOAD"]
    with pytest.raises(ValueError, match="offloaded"):
        validate(bad)


@pytest.mark.parametrize("rank, kind, micro_batch, shift, message", [
    (1, "RECV_F", 0, +1, "runs F0 before RECV_F0<-0"),
    (0, "SEND_F", 1, -1, "runs SEND_F1->1 before F1"),
    (0, "RECV_B", 0, +1, "runs B0 before RECV_B0<-1"),
    (1, "SEND_B", 0, -1, "runs SEND_B0->0 before B0"),
])
def test_validate_rejects_communication_on_the_wrong_side_of_its_compute(rank, kind, micro_batch, shift, message):
    """A hand-edited list with a receive after the F/B that reads it, or a send before the F/B that makes its tensor:
    paired and deadlock-free, so validate took it, and the runtime failed mid-step (KeyError)."""
    good = with_comm(one_f_one_b(2, 2))
    validate(good)
    acts = list(good.actions[rank])
    i = next(i for i, a in enumerate(acts) if a.kind == kind and a.micro_batch == micro_batch)
    acts.insert(i + shift, acts.pop(i))
    lists = [list(a) for a in good.actions]
    lists[rank] = acts
    with pytest.raises(ValueError, match=rf"rank {rank} {message}"):
        validate(Schedule(2, 2, 1, "hand-edited", False, lists))


def test_rendezvous_model_finds_what_nccl_would_hang_on(monkeypatch):
    """Sends that wait for their receives: interleaved 1F1B with every receive next to its compute action
    deadlocks (two ranks each hold a send the other only receives later); posting the stuck receives one
    batch earlier fixes it, keeps messages in order, and 1F1B and ZB-H1 need no move."""
    from megalm.parallel.pipeline import rendezvous

    post_receives_early = rendezvous.post_receives_early
    monkeypatch.setattr(rendezvous, "post_receives_early", lambda sched: sched)  # with_comm without the repair
    raw = with_comm(interleaved_1f1b(2, 4, 2))
    monkeypatch.undo()
    assert "waits for a partner" in rendezvous.rendezvous_deadlock(raw)
    with pytest.raises(ValueError, match="deadlock when sends wait for their receives"):
        validate(raw)
    fixed = post_receives_early(raw)
    assert rendezvous.rendezvous_deadlock(fixed) is None and not comm_order_mismatches(fixed)
    validate(fixed)
    for sched in (with_comm(one_f_one_b(4, 8)), with_comm(zb_h1(4, 8))):
        assert rendezvous.post_receives_early(sched).actions == sched.actions


def test_forward_only_pipelines_the_micro_batches():
    """An evaluation's forwards on every p, m, vpp: each micro-batch through each chunk once, paired, in order, free of
    NCCL's rendezvous deadlock, and pipelined: with F = 1/vpp (a chunk is 1/vpp of a rank's layers), the makespan of
    m micro-batches whose groups are whole is m + (p - 1) / vpp, the pipeline's fill. Micro-batch by micro-batch,
    each crossed all p * vpp virtual stages before the next started (21.5 instead of 9.5 at p=4, vpp=2, m=8)."""
    for p in range(1, 6):
        for m in range(1, 11):
            for vpp in (1, 2, 3):
                sched = forward_only(p, m, vpp)
                for rank in range(p):
                    assert sorted((a.micro_batch, a.chunk) for a in sched.compute_actions(rank)) == [
                        (i, c) for i in range(m) for c in range(vpp)]
                timeline = _run(sched, {"F": 1.0 / vpp})
                makespan = max(t[-1][2] for t in timeline)
                if m % p == 0:
                    assert makespan == pytest.approx(m + (p - 1) / vpp), (p, m, vpp)
                sched = with_comm(sched)
                assert not comm_mismatches(sched) and not comm_order_mismatches(sched) and not rendezvous_deadlock(
                    sched), (p, m, vpp)
