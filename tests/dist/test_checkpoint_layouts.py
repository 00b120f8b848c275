"""Checkpoints written by several ranks: a lost rank's file is refused before DCP reads any of it, and a resume into
another layout of the same world size starts every rank's random streams from the run's seed (found by an audit on
2026-12-04)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megalm.errors import CheckpointError
from megalm.model.naming import canonical_named_parameters
from megalm.model.shard import shard_specs
from megalm.training.checkpoint import load_saved_model, resumable_checkpoint
from megalm.training.trainer import Trainer
from tests.conftest import compose_config
from tests.dist.launch import run_distributed

RUN = ["trainer.max_steps=8", "trainer.save_interval=2"]


def _fit(rank: int, world_size: int, overrides: list[str], run_dir: str) -> None:
    Trainer(compose_config(*overrides), run_dir).fit()


def test_a_checkpoint_that_lost_one_ranks_file_is_refused(tmp_path, caplog):
    """DCP's reader indexes the safetensors files it finds: a tp2 checkpoint without rank 0's file loaded rank 1's
    rows and left rank 0's as torch.empty made them (mostly finite garbage), and trainer.resume=auto took it."""
    run_dir = tmp_path / "run"
    run_distributed(_fit, 2, [*RUN, "parallel.tp=2", "trainer.stop_at_step=4"], str(run_dir), timeout=240)
    step4 = run_dir / "checkpoints" / "step_00000004"
    model_files = sorted(step4.glob("shard-*.safetensors"))
    assert len(model_files) == 2  # one per TP rank
    model_files[0].unlink()
    with caplog.at_level(logging.WARNING, logger="megalm"):
        assert resumable_checkpoint(run_dir, "auto").name == "step_00000002"
    assert f"{model_files[0]} is damaged (missing: the save wrote it" in caplog.text
    with pytest.raises(CheckpointError, match="missing: the save wrote it"):
        load_saved_model(step4)


def _resume_as_tp2(rank: int, world_size: int, overrides: list[str], run_dir: str) -> None:
    trainer = Trainer(compose_config(*overrides), run_dir)
    assert trainer.step == 3
    states = [torch.empty_like(torch.get_rng_state()) for _ in range(world_size)]
    dist.all_gather(states, torch.get_rng_state())
    assert torch.equal(states[0], states[1]), "the TP ranks start their random streams apart"
    for step in range(3, 5):
        trainer.train_step(step)
    specs = shard_specs(trainer.model)
    for name, p in canonical_named_parameters(trainer.model):
        if name not in specs:  # replicated over TP: the same dropout masks keep it the same on both ranks
            copies = [torch.empty_like(p.detach()) for _ in range(world_size)]
            dist.all_gather(copies, p.detach().contiguous())
            assert torch.equal(copies[0], copies[1]), f"{name} differs between the TP ranks"


def test_a_resume_into_another_layout_draws_dropout_alike_on_tp_ranks(tmp_path):
    """dp2 with varlen batches (its ranks draw different amounts) resumed as tp2: each rank's saved RNG state was
    restored because the world size matched, so the TP ranks drew different dropout masks on activations they hold
    alike, and their replicated weights drifted apart (1e-3 after 2 steps). A layout change now starts from the
    seed, the same on every rank."""
    common = [*RUN, "model.dropout=0.1", "data.varlen=true"]
    run_dir = str(Path(tmp_path) / "run")
    run_distributed(_fit, 2, [*common, "parallel.dp=2", "trainer.stop_at_step=3"], run_dir, timeout=240)
    run_distributed(_resume_as_tp2, 2, [*common, "parallel.tp=2"], run_dir, timeout=240)


def _publish_on_a_full_disk(rank: int, world_size: int, overrides: list[str], run_dir: str) -> None:
    import errno

    trainer = Trainer(compose_config(*overrides), run_dir)
    trainer.train_step(0)
    trainer.step = 1
    first = trainer.save()
    real = Path.write_text

    def full_disk(self, *args, **kwargs):
        if self.name == "state.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kwargs)

    Path.write_text = full_disk  # rank 0 writes state.json; rank 1 waits for it
    trainer.step = 2
    try:
        with pytest.raises(CheckpointError) as error:
            trainer.save()
    finally:
        Path.write_text = real
    said = str(error.value)
    assert "\n" not in said and "the checkpoints saved before it are kept" in said
    assert ("No space left on device" in said) == (rank == 0), said
    assert resumable_checkpoint(Path(run_dir), "auto") == first

    # rank 1's RNG file: safetensors says a full disk with an error of its own, no OSError
    from safetensors import SafetensorError

    from megalm.training.checkpoint import save as save_module

    real_save_file = save_module.save_file

    def rng_on_a_full_disk(tensors, path):
        if rank == 1:
            raise SafetensorError("Error while serializing: No space left on device (os error 28)")
        real_save_file(tensors, path)

    save_module.save_file = rng_on_a_full_disk
    try:
        with pytest.raises(CheckpointError) as error:
            trainer.save()
    finally:
        save_module.save_file = real_save_file
    assert ("No space left on device" in str(error.value)) == (rank == 1), str(error.value)
    assert resumable_checkpoint(Path(run_dir), "auto") == first


def test_a_full_disk_while_publishing_is_one_line_on_every_rank(tmp_path):
    """Only the tensors' write was caught: a full disk while rank 0 wrote state.json (or config.yaml, a rename) was a
    traceback there while the other ranks waited in the last barrier until the process group's timeout (an audit,
    2026-12-06). Now every rank raises one line and the checkpoint before it stays the latest."""
    run_distributed(_publish_on_a_full_disk, 2, ["parallel.dp=2"], str(tmp_path / "run"), timeout=240)
