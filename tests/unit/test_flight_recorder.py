"""The flight recorder's comparison of the ranks' dumps (megalm/parallel/flight_recorder.py) on dumps shaped as torch
writes them; tests/dist/test_watchdog.py compares real ones, written by the watchdogs of a hung gloo run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megalm.parallel import flight_recorder
from megalm.parallel.dims import init_distributed

GROUPS = {"0": {"role": "world", "ranks": [0, 1, 2, 3]}, "3": {"role": "tp", "ranks": [0, 1]},
          "4": {"role": "tp", "ranks": [2, 3]}}


def entry(group: str, seq: int, op: str = "all_reduce", sizes=((4,),), retired: bool = True, p2p: int = 0) -> dict:
    return {"process_group": [group, "undefined"], "collective_seq_id": 0 if p2p else seq, "p2p_seq_id": p2p,
            "is_p2p": bool(p2p), "profiling_name": f"nccl:{op}", "input_sizes": [list(s) for s in sizes],
            "retired": retired}


def dump(rank: int, *entries: dict) -> dict:
    return {"rank": rank, "groups": GROUPS, "entries": list(entries)}


def test_the_rank_that_never_entered_the_collective_is_named():
    ahead = [entry("0", 1), entry("0", 2, retired=False)]
    dumps = {0: dump(0, *ahead), 1: dump(1, entry("0", 1)), 2: dump(2, *ahead), 3: dump(3, *ahead)}
    lines = flight_recorder.compare(dumps)
    assert lines == ["flight recorder: look at rank(s) [1] (4 rank(s) dumped)",
                     "the world group 0 (ranks [0, 1, 2, 3]): ranks [0, 2, 3] entered #2, all_reduce [[4]], and wait "
                     "in it; rank 1 at #1 (all_reduce [[4]]) never entered it"]


def test_a_desync_and_a_stuck_collective_and_a_missing_dump_are_said():
    dumps = {0: dump(0, entry("3", 1), entry("3", 2, "all_gather", retired=False), entry("0", 5, retired=False)),
             1: dump(1, entry("3", 1), entry("3", 2, "reduce_scatter", retired=False), entry("0", 5, retired=False)),
             2: dump(2, entry("0", 5, retired=False))}
    lines = flight_recorder.compare(dumps)
    assert lines[0] == "flight recorder: look at rank(s) [0, 1] (3 rank(s) dumped)"
    assert ("the tp group 3 (ranks [0, 1]): #2 differs between ranks (rank 0: all_gather [[4]]; rank 1: "
            "reduce_scatter [[4]]): the ranks call different collectives (a desync)") in lines
    assert ("the world group 0 (ranks [0, 1, 2, 3]): every rank entered #5, all_reduce [[4]], and it did not "
            "complete (the collective itself hangs: the network or the communication library)") in lines
    assert any(line.startswith("the world group 0 (ranks [0, 1, 2, 3]): no flight recorder file from ranks [3]")
               for line in lines)


def test_entries_the_ring_dropped_name_no_one_and_a_desync_is_not_also_a_stuck_collective():
    """A rank whose ring of entries dropped a group's collectives is not behind: torch's counter of the group
    (`pg_status`) says how far it got, and a last collective that completed (retired) hangs no one. A desync's ranks
    wait forever too, but the finding is the desync, said once (a second reader's cases, 2026-12-07)."""
    evicted = {0: {**dump(0, {**entry("3", 1), "pg_id": 1}, entry("0", 9, retired=False)),
                   "pg_status": {"1": {"last_enqueued_collective": "1"}}},
               1: {**dump(1, entry("0", 9, retired=False)), "pg_status": {"1": {"last_enqueued_collective": "1"}}}}
    lines = flight_recorder.compare(evicted)
    assert lines[0] == "flight recorder: no rank stopped short of a collective its group waits in (2 rank(s) dumped)"
    assert not any("tp group" in line for line in lines), lines
    desync = {0: dump(0, entry("3", 4, "all_reduce", retired=False)),
              1: dump(1, entry("3", 4, "broadcast", retired=False))}
    lines = flight_recorder.compare(desync)
    assert lines[0] == "flight recorder: look at rank(s) [0, 1] (2 rank(s) dumped)"
    assert lines[1:] == ["the tp group 3 (ranks [0, 1]): #4 differs between ranks (rank 0: all_reduce [[4]]; rank 1: "
                         "broadcast [[4]]): the ranks call different collectives (a desync)"]


def test_a_pending_point_to_point_op_is_said():
    dumps = {0: dump(0, entry("0", 0, "send", p2p=7, retired=False)), 1: dump(1, entry("0", 0, "recv", p2p=6))}
    lines = flight_recorder.compare(dumps)
    assert lines[0] == "flight recorder: no rank stopped short of a collective its group waits in (2 rank(s) dumped)"
    assert lines[1:] == ["rank 0 waits in send [[4]] (point-to-point #7 of the world group 0 (ranks [0, 1, 2, 3]))"]


def test_the_command_reads_a_run_dir_and_refuses_one_without_dumps(tmp_path, capsys):
    assert flight_recorder.main([str(tmp_path)]) == 2
    assert "error: no hang-rank*.flight.json in" in capsys.readouterr().err
    for rank, d in {0: dump(0, entry("3", 3, retired=False)), 1: dump(1, entry("3", 2))}.items():
        (tmp_path / f"hang-rank{rank}.flight.json").write_text(json.dumps(d))
    assert flight_recorder.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("flight recorder: look at rank(s) [1] (2 rank(s) dumped)\n")
    (tmp_path / "hang-rank1.flight.json").write_text("{not json")
    assert flight_recorder.main([str(tmp_path)]) == 2
    assert "error: cannot read the flight recorder files in" in capsys.readouterr().err


@pytest.mark.parametrize("exported", [None, ("TORCH_FR_BUFFER_SIZE", "7"), ("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")])
def test_joining_the_job_turns_the_recorder_on_unless_the_environment_says(monkeypatch, exported):
    """parallel.flight_recorder_entries sets TORCH_FR_BUFFER_SIZE before the group is made, which is when torch reads
    it; a value exported by the user under either name wins (torch reads the new name first: setting it beside an
    exported TORCH_NCCL_TRACE_BUFFER_SIZE=0 turned the recorder back on; setting the old name too made torch warn on
    every rank that it is deprecated)."""
    from megalm.parallel import dims

    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        monkeypatch.delenv(name, raising=False)
    if exported:
        monkeypatch.setenv(*exported)
    seen = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dims.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dims.dist, "init_process_group", lambda **kwargs: seen.update(
        buffer=dims.os.environ.get("TORCH_FR_BUFFER_SIZE"), old=dims.os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE")))
    monkeypatch.setattr(dims.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dims.dist, "get_world_size", lambda: 2)
    import torch

    init_distributed(torch.device("cpu"), 35, flight_recorder_entries=20000)
    if exported is None:
        assert seen == {"buffer": "20000", "old": None}
    else:
        assert seen == {"buffer": "7", "old": None} if exported[0] == "TORCH_FR_BUFFER_SIZE" else {"buffer": None,
                                                                                                  "old": "0"}


def _collectives_then_dump(rank: int, port: int, run_dir: str) -> None:
    import torch
    import torch.distributed as dist

    flight_recorder.record_collectives(100)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    pair = dist.new_group([0, 1])
    for _ in range(3):
        dist.all_reduce(torch.ones(4))
    dist.broadcast(torch.ones(2, 3), 0, group=pair)
    groups = flight_recorder.group_names({"tp": pair, "dp": None})
    flight_recorder.dump(Path(run_dir) / f"hang-rank{rank}.flight.json", rank, groups)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_torch_s_record_is_dumped_with_megalm_s_group_names(tmp_path):
    """The dump reads torch's recorder (a private API that moves across torch releases: this runs on every torch leg)
    for gloo: each rank's collectives, numbered per group, under the group's megalm role."""
    import multiprocessing

    from tests.dist.launch import free_port

    ctx, port = multiprocessing.get_context("spawn"), free_port()
    procs = [ctx.Process(target=_collectives_then_dump, args=(rank, port, str(tmp_path))) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=90)
    assert [p.exitcode for p in procs] == [0, 0]
    dumps = flight_recorder.read_dumps(tmp_path)
    for d in dumps.values():
        calls = [(e["process_group"][0], e["collective_seq_id"], e["profiling_name"], e["input_sizes"])
                 for e in d["entries"] if not e["is_p2p"]]
        tp = next(name for name, group in d["groups"].items() if group["role"] == "tp")
        assert d["groups"][tp]["ranks"] == [0, 1] and d["groups"]["0"]["role"] == "world"
        assert [c for c in calls if c[0] == tp] == [(tp, 1, "gloo:broadcast", [[2, 3]])]
        assert [c[1:] for c in calls if c[0] == "0"][-3:] == [(n, "gloo:all_reduce", [[4]]) for n in (1, 2, 3)]
    assert flight_recorder.compare(dumps)[0] == ("flight recorder: no rank stopped short of a collective its group "
                                                  "waits in (2 rank(s) dumped)")
