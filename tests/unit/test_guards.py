"""The non-finite guard (skip or stop; too many skips in a row stop), the save refusal on non-finite state, and
loss-spike reports."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from megalm.training.checkpoint import latest_checkpoint
from megalm.training.guards import NonFiniteError, SpikeDetector
from megalm.training.trainer import Trainer
from tests.conftest import compose_config


def poison_grads_at(trainer: Trainer, steps: set[int]) -> None:
    """A NaN in one gradient element at these steps (0-based), as an overflow would leave it."""
    forward_backward = trainer.forward_backward

    def wrapped(step: int):
        out = forward_backward(step)
        if step in steps:
            next(p for p in trainer.model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
        return out

    trainer.forward_backward = wrapped


def snapshot(trainer: Trainer) -> tuple[dict, dict]:
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    state = {(id(p), k): v.clone() for p, st in trainer.optimizer.state.items() for k, v in st.items()
             if torch.is_tensor(v)}
    return params, state


def test_a_non_finite_step_skips_its_update_and_the_run_goes_on(tmp_path):
    trainer = Trainer(compose_config("trainer.max_steps=5"), tmp_path)
    poison_grads_at(trainer, {2})
    for step in range(2):
        trainer.train_step(step)
    params, state = snapshot(trainer)
    result = trainer.train_step(2)
    assert result.skipped and result.grad_norm != result.grad_norm  # NaN
    after_params, after_state = snapshot(trainer)
    for name, value in params.items():
        assert torch.equal(after_params[name], value), f"{name} changed in a skipped step"
    assert state.keys() == after_state.keys() and all(torch.equal(state[k], after_state[k]) for k in state)
    good = trainer.train_step(3)
    assert not good.skipped
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert any(not torch.equal(p.detach(), params[n]) for n, p in trainer.model.named_parameters())


def test_fit_logs_the_skips_and_saves_finite_weights(tmp_path):
    trainer = Trainer(compose_config("trainer.max_steps=4"), tmp_path)
    poison_grads_at(trainer, {1})
    summary = trainer.fit()
    assert trainer.nonfinite.skipped_steps == [2] and summary.steps == 4
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("skipped_steps") for r in records if "step" in r][-1] == 1
    assert latest_checkpoint(tmp_path).name == "step_00000004"


def test_a_resume_keeps_the_skips_in_a_row(tmp_path):
    """A run stopped (preempted) inside a run of non-finite steps: the resume continues the count in a row, so that
    max_consecutive_skips still ends it (each requeue gave a fresh budget: 5 in a row at a limit of 3), and the
    skipped steps metrics.jsonl counts."""
    run = ["trainer.max_steps=8", "trainer.save_interval=4", "trainer.max_consecutive_skips=3"]
    first = Trainer(compose_config(*run, "trainer.stop_at_step=4"), tmp_path)
    poison_grads_at(first, {2, 3})  # steps 3 and 4 (1-based)
    first.fit()
    resumed = Trainer(compose_config(*run), tmp_path)
    assert resumed.step == 4 and resumed.nonfinite.consecutive == 2 and resumed.nonfinite.skipped_steps == [3, 4]
    poison_grads_at(resumed, {4})
    with pytest.raises(NonFiniteError, match="at step 5: 3 non-finite steps in a row"):
        resumed.fit()


def test_stop_mode_ends_the_run_naming_the_step(tmp_path):
    trainer = Trainer(compose_config("trainer.max_steps=4", "trainer.nonfinite=stop"), tmp_path)
    poison_grads_at(trainer, {1})
    with pytest.raises(NonFiniteError, match=r"grad norm nan at step 2; stopped \(trainer.nonfinite=stop\)"):
        trainer.fit()


def test_consecutive_skips_end_the_run(tmp_path):
    trainer = Trainer(compose_config("trainer.max_steps=8", "trainer.max_consecutive_skips=3"), tmp_path)
    poison_grads_at(trainer, {1, 2, 3, 4})
    with pytest.raises(NonFiniteError, match=r"at step 4: 3 non-finite steps in a row"):
        trainer.fit()
    assert trainer.step == 3  # steps 2 and 3 were skipped; the third skip in a row stops before step 4 counts


def test_no_checkpoint_from_non_finite_weights(tmp_path):
    trainer = Trainer(compose_config("trainer.max_steps=4"), tmp_path)
    trainer.train_step(0)
    trainer.step = 1
    first = trainer.save()
    with torch.no_grad():
        trainer.model.embedding.weight[0, 0] = float("inf")
    trainer.step = 2
    with pytest.raises(NonFiniteError, match="not finite at step 2: no checkpoint written"):
        trainer.save()
    assert latest_checkpoint(tmp_path) == first
    assert not (tmp_path / "checkpoints" / "step_00000002").exists()


def test_spike_detector():
    spikes = SpikeDetector(window=50, zscore=6.0)
    for i in range(30):
        assert spikes.check(2.0 + 0.01 * (i % 5)) is None
    z = spikes.check(3.0)
    assert z is not None and z > 6
    assert len(spikes.history) == 30, "a spike does not join the history"
    assert spikes.check(2.02) is None and spikes.check(float("nan")) is None
    assert SpikeDetector(window=50, zscore=0).check(100.0) is None


def test_a_loss_that_stays_up_is_a_new_level_not_a_spike_every_step():
    """The history took no spike, so a loss that jumped and stayed (a new data mix, a changed schedule) was reported
    at every later step; from the third spike in a row they join the history, which moves to the new level."""
    spikes = SpikeDetector(window=20, zscore=6.0)
    for i in range(20):
        spikes.check(2.0 + 0.01 * (i % 5))
    reported = [spikes.check(3.0 + 0.01 * (i % 5)) is not None for i in range(40)]
    assert reported[:3] == [True] * 3 and sum(reported) < 10 and not any(reported[20:]), reported
    steady = SpikeDetector(window=20, zscore=6.0)  # no spread at all: the last digit of a loss is no spike
    for _ in range(20):
        steady.check(2.0)
    assert steady.check(2.0001) is None and steady.check(2.5) is not None


def test_a_spike_is_logged_with_its_step_and_samples(tmp_path, caplog):
    trainer = Trainer(compose_config("trainer.max_steps=14", "trainer.spike_window=20"), tmp_path)
    forward_backward = trainer.forward_backward

    def spiking(step: int):
        loss, share = forward_backward(step)
        return (loss * 50 if step == 12 else loss), share  # only the reported value: the update is already made

    trainer.forward_backward = spiking
    with caplog.at_level(logging.WARNING, logger="megalm"):
        trainer.fit()
    spikes = [r.message for r in caplog.records if "loss spike" in r.message]
    assert len(spikes) == 1 and "loss spike at step 13" in spikes[0] and "samples are 96..103" in spikes[0]


def test_a_skipped_step_drops_the_fp32_copies_of_its_bf16_gradient_shards(tmp_path):
    """ZeRO-1 with parallel.grad_reduce_dtype=bf16 casts each gradient shard to fp32 for the optimizer (4 bytes a
    parameter / dp); a step the guard skips drops them too, as a taken one does, not at the next step's end."""
    import gc
    import weakref

    trainer = Trainer(compose_config("data=synthetic", "trainer.device=cpu", "precision=bf16", "parallel.zero1=true",
                                     "parallel.grad_reduce_dtype=bf16"), tmp_path)
    reducer, copies = trainer.parallel.reducer, []
    finish = reducer.finish

    def finish_and_watch(*args, **kwargs):  # noqa: ANN202 - the reducer's own signature
        finish(*args, **kwargs)
        copies.extend(weakref.ref(b.grad_shard) for b in reducer.buckets if b.grad_shard is not b.shard)

    reducer.finish = finish_and_watch
    trainer.nonfinite.should_skip = lambda *_: True
    assert trainer.train_step(0).skipped
    gc.collect()
    assert copies and all(copy() is None for copy in copies), "a skipped step's fp32 gradient shards are alive"
