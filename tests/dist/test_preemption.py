"""Preemption under data parallelism: a signal that reaches one rank only (or a time limit that passes on one rank's
clock) stops every rank after the same step, with one complete checkpoint, and the resumed run repeats the
uninterrupted losses."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from megalm.training.checkpoint import latest_checkpoint
from megalm.training.trainer import Trainer
from tests.conftest import compose_config
from tests.dist.launch import run_distributed

LAYOUT = ["parallel.dp=2", "trainer.max_steps=6"]


def _train(rank: int, world_size: int, run_dir: str, out: str, signal_rank: int | None, late: bool = False) -> None:
    """`signal_rank` gets SIGUSR1 during step 3, or, with `late`, sees trainer.exit_duration_minutes pass then."""
    trainer = Trainer(compose_config(*LAYOUT, *(["trainer.exit_duration_minutes=30"] if late else [])), run_dir)
    if signal_rank == rank:
        train_step = trainer.train_step

        def signalled(step: int):
            if step == 2 and late:
                trainer.preemption.started -= 3600  # this rank's clock only: an hour on
            elif step == 2:
                os.kill(os.getpid(), signal.SIGUSR1)  # this rank only; the other learns it from the all-reduce
            return train_step(step)

        trainer.train_step = signalled
    summary = trainer.fit()
    Path(f"{out}.rank{rank}").write_text(json.dumps({"steps": summary.steps, "preempted": summary.preempted,
                                                     "losses": summary.losses}))


def _read(out: Path, rank: int) -> dict:
    return json.loads(Path(f"{out}.rank{rank}").read_text())


def test_a_signal_on_one_rank_stops_all_ranks_after_the_same_step(tmp_path):
    run_distributed(_train, 2, str(tmp_path / "straight"), str(tmp_path / "straight"), None, timeout=240)
    run_distributed(_train, 2, str(tmp_path / "run"), str(tmp_path / "first"), 1, timeout=240)
    first = [_read(tmp_path / "first", r) for r in range(2)]
    assert [f["preempted"] for f in first] == [True, True] and [f["steps"] for f in first] == [3, 3]
    assert latest_checkpoint(tmp_path / "run").name == "step_00000003"
    run_distributed(_train, 2, str(tmp_path / "run"), str(tmp_path / "resumed"), None, timeout=240)
    straight, resumed = _read(tmp_path / "straight", 0), _read(tmp_path / "resumed", 0)
    assert first[0]["losses"] + resumed["losses"] == straight["losses"]


def test_a_time_limit_on_one_rank_s_clock_stops_all_ranks_after_the_same_step(tmp_path):
    """trainer.exit_duration_minutes rides on the same agreed flag: ranks' clocks differ, and the first to pass the
    limit stops every rank after the same step, with one complete checkpoint."""
    run_distributed(_train, 2, str(tmp_path / "run"), str(tmp_path / "first"), 1, True, timeout=240)
    first = [_read(tmp_path / "first", r) for r in range(2)]
    assert [f["preempted"] for f in first] == [True, True] and [f["steps"] for f in first] == [3, 3]
    assert latest_checkpoint(tmp_path / "run").name == "step_00000003"
