"""The hang watchdog: a rank stuck outside a collective leaves its peer waiting inside it; both ranks' watchdogs
report where they were and exit with HANG_EXIT_CODE instead of waiting for the process group's timeout."""

from __future__ import annotations

import multiprocessing
import re
import time

import pytest
import torch.distributed as dist

from megalm.parallel import flight_recorder
from megalm.training.watchdog import HANG_EXIT_CODE, Watchdog
from tests.dist.launch import free_port


def _hanging_rank(rank: int, world_size: int, port: int, run_dir: str) -> None:
    from megalm.parallel.flight_recorder import record_collectives
    from megalm.training.trainer import Trainer
    from tests.conftest import compose_config

    record_collectives(compose_config().parallel.flight_recorder_entries)  # as init_distributed does, at the default
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    trainer = Trainer(compose_config("parallel.dp=2", "trainer.max_steps=6", "trainer.hang_minutes=0.05",
                                     "trainer.preempt_signals=[]"), run_dir)
    # Rank 0 (waiting inside a collective) fires first: had rank 1 exited first, gloo would end rank 0's wait with
    # "connection closed by peer" (exit 1) before rank 0's own watchdog fired. NCCL keeps waiting; gloo does not.
    trainer.watchdog.timeout_s *= 1 if rank == 0 else 3
    forward_backward = trainer.forward_backward

    def stuck_on_rank_1(step: int):
        if step == 2 and rank == 1:
            time.sleep(120)  # rank 0 meanwhile waits in step 3's first gradient all-reduce
        return forward_backward(step)

    trainer.forward_backward = stuck_on_rank_1
    trainer.fit()


@pytest.mark.timeout(120)
def test_both_ranks_report_where_they_hang_and_exit(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_hanging_rank, args=(rank, 2, port, str(tmp_path))) for rank in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=90)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [HANG_EXIT_CODE] * 2
    reports = {rank: (tmp_path / f"hang-rank{rank}.txt").read_text() for rank in range(2)}
    for rank, report in reports.items():
        assert report.startswith(f"hang: rank {rank} made no progress for") and "step: 3" in report, report
    # rank 0 waits inside step 3's first collective; rank 1 never reached it: its last one closed step 2
    assert "collective: all_reduce (loss-token count) over 2 ranks" in reports[0], reports[0]
    assert "collective: - (step 2's last: all_reduce (step totals) over 2 ranks)" in reports[1], reports[1]
    # torch's flight recorder, dumped by both watchdogs and compared: rank 1 never entered the dp group's collective
    # that rank 0 waits in (its sequence number one past rank 1's last)
    lines = flight_recorder.compare(flight_recorder.read_dumps(tmp_path))
    assert lines[0] == "flight recorder: look at rank(s) [1] (2 rank(s) dumped)", lines
    behind = [line for line in lines if "never entered it" in line]
    assert len(behind) == 1 and "ranks [0] entered #" in behind[0] and "all_reduce" in behind[0], lines
    ahead, short = (int(n) for n in re.findall(r"#(\d+)", behind[0])[:2])
    assert ahead == short + 1 and re.match(r"the [\w=]*\bdp\b[\w=]* group", behind[0]), behind[0]
    assert flight_recorder.main([str(tmp_path)]) == 0


def test_beats_keep_it_quiet_and_silence_fires_once(tmp_path):
    exits: list[int] = []
    with Watchdog(0.3, rank=3, run_dir=tmp_path, exit=exits.append) as watchdog:
        for _ in range(8):
            time.sleep(0.1)
            watchdog.beat()
        assert exits == []
        time.sleep(1.0)
    assert exits == [HANG_EXIT_CODE]
    assert (tmp_path / "hang-rank3.txt").read_text().startswith("hang: rank 3 made no progress for")


def test_off_at_zero(tmp_path):
    exits: list[int] = []
    with Watchdog(0, rank=0, run_dir=tmp_path, exit=exits.append):
        time.sleep(0.2)
    assert exits == [] and not (tmp_path / "hang-rank0.txt").exists()


@pytest.mark.timeout(120)
def test_a_rank_stuck_joining_the_job_is_reported_within_init_hang_minutes(tmp_path):
    """Rank 0 of two starts alone (its peer never comes) and waits in init_process_group's rendezvous: the init
    watchdog reports where it waits and exits with HANG_EXIT_CODE after trainer.init_hang_minutes, not at the
    process group's timeout (35 minutes by default)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.conftest import TINY

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "megalm.train", *TINY, "trainer.init_hang_minutes=0.05",
                           f"hydra.run.dir={tmp_path}"], env=env, capture_output=True, text=True, timeout=100)
    elapsed = time.monotonic() - start
    assert proc.returncode == HANG_EXIT_CODE, proc.stderr[-3000:]
    report = (tmp_path / "hang-rank0.txt").read_text()
    assert report.startswith("hang: rank 0 made no progress for") and "(trainer.init_hang_minutes=0.05)" in report
    assert "collective: init_process_group (world size 2, store 127.0.0.1:" in report, report
    assert elapsed < 60, f"{elapsed:.0f} s: the watchdog fires 3 s after the start"


def test_drawing_the_initial_weights_is_progress_to_the_start_up_watchdog(tmp_path):
    """Every rank draws its stage's full tensors on one CPU thread (minutes at 70B): with no beat while it drew, the
    start-up watchdog reported a hang and exited 124 (an audit, 2026-12-04). Each drawn parameter is progress now:
    weights that take ~1.5x the limit to draw, 0.35 s each, finish. (A limit of 1.2 s fired on a loaded 2-core machine
    before the first weight was drawn, while the model was built: 6 s leaves that phase room.)"""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.conftest import TINY

    root = Path(__file__).resolve().parents[2]
    script = ("import sys, time\nimport megalm.model.gpt as gpt\ndraw = gpt.initial_value\n"
              "def slow(*args, **kwargs):\n    time.sleep(0.35)\n    return draw(*args, **kwargs)\n"
              "gpt.initial_value = slow\nfrom megalm.train import main\n"
              f"sys.argv = ['megalm-train', *{[*TINY, 'trainer.max_steps=1', 'trainer.init_hang_minutes=0.1']!r}, "
              f"'hydra.run.dir={tmp_path}']\nmain()\n")
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "hang-rank0.txt").exists()


def test_the_collective_timeout_outlasts_the_watchdog(monkeypatch):
    import datetime

    from megalm.config import process_group_minutes, validate
    from megalm.errors import ConfigError
    from megalm.parallel import dims
    from tests.conftest import compose_config

    assert process_group_minutes(compose_config()) == 35  # hang_minutes 30 + 5: the watchdog reports first
    assert compose_config().trainer.init_hang_minutes < 35  # and a stuck init is reported before it too
    assert process_group_minutes(compose_config("parallel.timeout_minutes=60")) == 60
    assert process_group_minutes(compose_config("trainer.hang_minutes=0", "trainer.init_hang_minutes=0")) is None
    # the joining watchdog's longer limit: the rendezvous timed out first (a traceback, exit 1, not the report and 124)
    assert process_group_minutes(compose_config("trainer.hang_minutes=2", "trainer.init_hang_minutes=10")) == 15
    assert process_group_minutes(compose_config("trainer.hang_minutes=0")) == 15  # init_hang_minutes 10 + 5
    with pytest.raises(ConfigError, match="parallel.timeout_minutes=20.0 must exceed trainer.hang_minutes=30.0"):
        validate(compose_config("parallel.timeout_minutes=20"))
    with pytest.raises(ConfigError, match="must exceed trainer.init_hang_minutes=40.0"):
        validate(compose_config("parallel.timeout_minutes=36", "trainer.init_hang_minutes=40"))

    seen = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dims.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dims.dist, "init_process_group", lambda **kwargs: seen.update(kwargs))
    monkeypatch.setattr(dims.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dims.dist, "get_world_size", lambda: 2)
    import torch

    dims.init_distributed(torch.device("cpu"), 35)
    assert seen == {"backend": "gloo", "timeout": datetime.timedelta(minutes=35)}
