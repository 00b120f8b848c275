"""trainer.async_save: checkpoints written in the background while training goes on, published (state.json, rename,
`latest`) only once complete, and resumed bit-exactly."""

from __future__ import annotations

from megalm.training import checkpoint as ckpt
from megalm.training.trainer import Trainer
from tests.conftest import compose_config

RUN = ["trainer.max_steps=6", "trainer.save_interval=2", "trainer.keep_last=5"]


def test_async_checkpoints_resume_bit_exactly(tmp_path):
    straight = Trainer(compose_config(*RUN), tmp_path / "straight").fit()
    first = Trainer(compose_config(*RUN, "trainer.async_save=true", "trainer.stop_at_step=4"), tmp_path / "run").fit()
    assert first.checkpoint.name == "step_00000004" and ckpt.is_complete(first.checkpoint)
    kept = ckpt.layout.step_dirs(tmp_path / "run" / "checkpoints")
    assert [p.name for p in kept] == ["step_00000002", "step_00000004"]
    resumed = Trainer(compose_config(*RUN, "trainer.async_save=true"), tmp_path / "run")
    assert resumed.step == 4
    rest = resumed.fit()
    assert first.losses + rest.losses == straight.losses


def test_nothing_is_published_before_the_write_completes(tmp_path):
    trainer = Trainer(compose_config(*RUN, "trainer.async_save=true"), tmp_path)
    trainer.train_step(0)
    trainer.step = 1
    path = trainer.save()
    assert trainer.checkpointer.pending is not None and not path.exists()
    assert ckpt.latest_checkpoint(tmp_path) is None, "latest points at nothing until the save completes"
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train_step(1)  # the weights move on while the checkpoint holds step 1's
    trainer.finish_save()
    assert ckpt.latest_checkpoint(tmp_path) == path and trainer.checkpointer.pending is None
    import torch

    from megalm.model import GPT

    model = GPT(trainer.cfg.model)
    ckpt.load_model_weights(path, model)
    for name, p in model.named_parameters():
        assert torch.equal(p, weights[name]), f"{name}: the checkpoint must hold the weights of the step it names"


def test_a_written_save_is_published_at_the_next_step_boundary(tmp_path):
    """Published only at the next save or the end, a run that died between two saves lost the checkpoint its thread
    had finished writing. Now the first step boundary after the write ends publishes it (`latest` names it)."""
    trainer = Trainer(compose_config(*RUN, "trainer.save_interval=4", "trainer.max_steps=6"), tmp_path)
    trainer.checkpointer.async_save = True
    train_step, latest_before = trainer.train_step, {}

    def watched(step: int):
        latest_before[step] = ckpt.latest_checkpoint(tmp_path)
        if trainer.checkpointer.pending is not None:
            trainer.checkpointer.pending._future.result()  # written before this step's boundary, whatever the disk
        return train_step(step)

    trainer.train_step = watched
    trainer.fit()
    assert latest_before[4] is None  # saved after step 4: in flight while step 5 runs
    assert latest_before[5] == tmp_path / "checkpoints" / "step_00000004", latest_before
