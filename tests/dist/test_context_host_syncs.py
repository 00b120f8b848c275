"""Ulysses' attention copies nothing from the host inside a step: a list index on a device tensor is a pageable
host-to-device copy, which syncs the CUDA stream, and it ran in every attention layer (4 per step of the tiny model;
found by an audit). Counted on CPU with tests/unit/test_host_syncs.py's SyncCounter, over the whole second step."""

from __future__ import annotations

from megalm.training.trainer import Trainer
from tests.conftest import compose_config
from tests.dist.launch import run_distributed
from tests.unit.test_host_syncs import SyncCounter


def count_ulysses_copies(rank: int, world_size: int, tmp: str) -> None:
    trainer = Trainer(compose_config("trainer.max_steps=3", "parallel.cp=2", "parallel.cp_comm=a2a"), tmp)
    trainer.train_step(0)
    with SyncCounter() as counter:
        trainer.train_step(1)
    inside = [sync for sync in counter.syncs if "ulysses.py" in sync]
    assert not inside, f"rank {rank}: host copies in Ulysses' attention: {inside}"
    assert counter.syncs, "the counter saw nothing: it would pass whatever ran"  # the step's one read of its totals


def test_ulysses_attention_reads_nothing_from_the_host(tmp_path):
    run_distributed(count_ulysses_copies, 2, str(tmp_path), timeout=240)
