"""megalm-train's run dir under torchrun's restarts: a restarted attempt continues in the first attempt's dir (Hydra's
default is a new outputs/DATE/TIME per process, where trainer.resume=auto found nothing to resume), and rank 0's
train.log follows it there. The whole restart, killed and resumed from the default run dir: tests/e2e/test_restarts.py.
"""

from __future__ import annotations

import logging

import pytest
import torch.distributed as dist

from megalm.training.run_dir import first_attempt_run_dir, log_in, remove_unused_run_dir
from tests.dist.launch import free_port


@pytest.fixture
def agent_store(monkeypatch):
    """torchrun's agent store, as its workers see it (TORCHELASTIC_USE_AGENT_STORE, MASTER_ADDR/PORT)."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    yield store


def test_a_restarted_attempt_continues_in_the_first_attempt_s_run_dir(agent_store, monkeypatch, tmp_path, caplog):
    first, second, third = (tmp_path / "outputs" / name for name in ("10-00-00", "10-05-00", "10-09-00"))
    for path in (first, second, third):
        path.mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert first_attempt_run_dir(first, "auto") == first
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with caplog.at_level(logging.INFO, logger="megalm"):
        assert first_attempt_run_dir(second, "auto") == first
    assert f"torchrun's restart 1: continuing in the first attempt's run dir {first}" in caplog.text
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert first_attempt_run_dir(third, "auto") == first  # every restart: the first attempt's, not the one before
    # a PATH: the run continues from its own checkpoints once it has some, so in the first dir too
    assert first_attempt_run_dir(second, str(tmp_path / "elsewhere")) == first
    # trainer.resume=never: each attempt starts as a new run would, in its own dir
    assert first_attempt_run_dir(second, "never") == second


def test_each_job_of_a_sweep_continues_in_its_own_first_dir(agent_store, monkeypatch, tmp_path):
    """A sweep (-m) under torchrun runs its jobs one after the other in the same processes, and a restart runs them
    all again: job k continues in job k's dir, not in the last job's (which has another config)."""
    dirs = {(attempt, job): tmp_path / f"attempt{attempt}" / str(job) for attempt in (0, 1) for job in (0, 1)}
    for path in dirs.values():
        path.mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    for job in (0, 1):
        assert first_attempt_run_dir(dirs[0, job], "auto", sweep_job=job) == dirs[0, job]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    for job in (0, 1):
        assert first_attempt_run_dir(dirs[1, job], "auto", sweep_job=job) == dirs[0, job]


def test_a_restart_whose_first_dir_is_unknown_says_so(agent_store, monkeypatch, tmp_path, caplog):
    """A restart without the store's record (an elastic job whose first node left) starts afresh in its own dir, and
    says how to resume instead; the next restart continues in that dir."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    with caplog.at_level(logging.WARNING, logger="megalm"):
        assert first_attempt_run_dir(tmp_path / "a", "auto") == tmp_path / "a"
    assert "torchrun's restart 2: the first attempt's run dir is unknown here" in caplog.text
    assert "(hydra.run.dir=PATH) to resume" in caplog.text
    (tmp_path / "a").mkdir()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    assert first_attempt_run_dir(tmp_path / "b", "auto") == tmp_path / "a"
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")  # no store at all; a dir named for every attempt resumes
    caplog.clear()
    from megalm.training.checkpoint.layout import FILES

    step = tmp_path / "named" / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    for name in (*FILES, "shard-00000.safetensors"):  # what a complete checkpoint's dir holds, by name
        (step / name).write_text("")
    with caplog.at_level(logging.WARNING, logger="megalm"):
        assert first_attempt_run_dir(tmp_path / "named", "auto") == tmp_path / "named"
    assert "unknown here" not in caplog.text


def test_outside_torchrun_the_run_keeps_its_own_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert first_attempt_run_dir(tmp_path, "auto") == tmp_path


def test_rank_0_s_log_follows_it_into_the_first_attempt_s_dir(tmp_path):
    """Hydra opened train.log in the restarted attempt's own dir; its lines go to the first attempt's train.log,
    after that attempt's own, and the attempt's own dir (Hydra's files only) is removed."""
    first, own = tmp_path / "first", tmp_path / "own"
    first.mkdir()
    (own / ".hydra").mkdir(parents=True)
    (first / "train.log").write_text("the first attempt's lines\n")
    handler = logging.FileHandler(own / "train.log")
    handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
    root = logging.getLogger()
    before = list(root.handlers)
    root.addHandler(handler)
    try:
        log_in(first, own)
        logger = logging.getLogger("megalm")
        level = logger.level
        logger.setLevel(logging.INFO)
        logger.info("the restart's line")
        logger.setLevel(level)
    finally:
        for added in [h for h in root.handlers if h not in before]:
            root.removeHandler(added)
            added.close()
    assert handler not in root.handlers
    assert (first / "train.log").read_text() == "the first attempt's lines\n[megalm] the restart's line\n"
    remove_unused_run_dir(own)
    assert not own.exists()
