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
    # trainer.resume=never, or a PATH: each attempt starts as a new run would, in its own dir
    assert first_attempt_run_dir(second, "never") == second
    assert first_attempt_run_dir(second, str(tmp_path / "elsewhere")) == second


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
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        log_in(first, own)
        logger = logging.getLogger("megalm")
        level = logger.level
        logger.setLevel(logging.INFO)
        logger.info("the restart's line")
        logger.setLevel(level)
        handler.flush()
    finally:
        root.removeHandler(handler)
        handler.close()
    assert (first / "train.log").read_text() == "the first attempt's lines\nthe restart's line\n"
    remove_unused_run_dir(own)
    assert not own.exists()
