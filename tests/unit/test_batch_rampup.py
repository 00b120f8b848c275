"""`trainer.rampup_batch_size`: the global batch ramps up by Megatron-LM's rule, its steps train as the smaller batches
they are, a resume inside the ramp continues it, and a ramp that cannot run is refused in one line.
(tests/dist/test_trainer_parallel.py checks a ramp under dp and pp against one process.)"""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
import torch

from megalm import estimate
from megalm.config import ramp_batch_sizes
from megalm.data.steps import GlobalBatchSteps
from megalm.errors import CheckpointError, ConfigError
from megalm.training.metrics import format_line, read_metrics
from megalm.training.optim import lr_at
from megalm.training.trainer import Trainer
from megalm.training.validation import validate_run
from tests.conftest import compose_config
from tests.unit.test_estimate import SMALL

RAMP = ["trainer.global_batch_size=12", "trainer.micro_batch_size=2", "trainer.rampup_batch_size=[4,4,16]"]


def megatron_batch_sizes(global_batch_size: int, rampup: list[int], steps: int) -> list[int]:
    """Megatron-LM's RampupBatchsizeNumMicroBatchesCalculator stepped one step at a time, its quotient exact: the
    batch of a step that begins after `consumed` samples."""
    start, increment, samples = rampup
    if start == global_batch_size:  # no increment (Megatron divides by zero here; megalm takes the whole batch)
        return [global_batch_size] * steps
    per_increment = Fraction(samples, (global_batch_size - start) // increment)
    sizes, consumed = [], 0
    for _ in range(steps):
        size = global_batch_size if consumed > samples else start + int(consumed / per_increment) * increment
        sizes.append(size)
        consumed += size
    return sizes


@pytest.mark.parametrize("global_batch_size, rampup", [
    (12, [4, 4, 16]),
    (1024, [32, 32, 1000]),  # steps overshoot the boundaries: sizes are skipped
    (96, [16, 16, 50]),
    (10, [1, 1, 7]),  # a ramp-up over fewer samples than increments... (7 samples, 9 increments)
    (64, [16, 8, 10_000]),  # a long one, a quotient that is not an integer
    (8, [8, 4, 100]),  # no increment: the whole batch from the start
])
def test_the_steps_follow_megatrons_rule(global_batch_size, rampup):
    steps = GlobalBatchSteps(global_batch_size, rampup)
    sizes = megatron_batch_sizes(global_batch_size, rampup, 400)
    starts = [sum(sizes[:s]) for s in range(len(sizes))]
    assert [steps.ids(s) for s in range(len(sizes))] == [range(a, a + n) for a, n in zip(starts, sizes, strict=True)]
    assert sizes[-1] == global_batch_size  # each case reaches the whole batch within the steps compared
    far = 10**7  # and any step later is a bisect, not a walk
    assert steps.ids(far) == range(starts[-1] + (far - len(sizes) + 1) * global_batch_size,
                                   starts[-1] + (far - len(sizes) + 2) * global_batch_size)


def test_without_a_ramp_step_s_takes_the_samples_after_s_batches():
    steps = GlobalBatchSteps(12)
    assert [steps.ids(s) for s in (0, 1, 5)] == [range(0, 12), range(12, 24), range(60, 72)]


def test_the_ramp_s_steps_train_as_the_smaller_batches_they_are(tmp_path):
    """Step 1 of the ramp (4 samples of the 12) is step 1 of a run of global batch 4, to the bit: the same samples,
    micro-batches, loss and update (at a constant learning rate: the ramp's schedule counts samples in batches of
    12, test_optim.py)."""
    constant = ["optim.schedule=constant", "optim.warmup_steps=0"]
    ramp = Trainer(compose_config(*RAMP, *constant), tmp_path / "ramp")
    small = Trainer(compose_config(*RAMP[:2], *constant, "trainer.global_batch_size=4"), tmp_path / "small")
    assert ramp.step_sample_ids(0) == small.step_sample_ids(0) == range(0, 4)
    assert [len(ramp.step_sample_ids(s)) for s in range(5)] == [4, 4, 8, 12, 12]
    a, b = ramp.train_step(0), small.train_step(0)
    assert (a.loss, a.grad_norm, a.tokens) == (b.loss, b.grad_norm, b.tokens)
    for p, q in zip(ramp.model.parameters(), small.model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert ramp.step_sample_ids(0, ramp.data.valid) == range(0, 12)  # validation batches are whole


def test_a_resume_inside_the_ramp_continues_it(tmp_path):
    steps = ["trainer.max_steps=5", "trainer.save_interval=2"]
    straight = Trainer(compose_config(*RAMP, *steps), tmp_path / "straight").fit()
    Trainer(compose_config(*RAMP, *steps, "trainer.stop_at_step=2"), tmp_path / "run").fit()
    resumed = Trainer(compose_config(*RAMP, *steps), tmp_path / "run")
    assert resumed.step == 2
    assert resumed.fit().losses == straight.losses[2:]
    assert straight.tokens == (4 + 4 + 8 + 12 + 12) * 32  # five steps' 40 samples of model.seq_length tokens
    records = read_metrics(tmp_path / "straight")
    assert [r["global_batch_size"] for r in records] == [4, 4, 8, 12, 12]
    assert "| batch 8 |" in format_line(records[2], 5)
    # the trainer's schedule counts samples under the ramp (test_optim.py checks that clock against Megatron-Core's)
    cfg, ramp = compose_config(*RAMP, *steps), GlobalBatchSteps(12, [4, 4, 16])
    assert [r["lr"] for r in records] == [lr_at(s, cfg.optim, 5, ramp) for s in range(5)]
    assert [r["lr"] for r in records] != [lr_at(s, cfg.optim, 5) for s in range(5)]


def test_a_resume_with_another_ramp_is_refused(tmp_path):
    Trainer(compose_config(*RAMP, "trainer.max_steps=4", "trainer.stop_at_step=2"), tmp_path).fit()
    with pytest.raises(CheckpointError, match=r"rampup_batch_size=\[4, 4, 16\], this run has \[4, 8, 16\]"):
        Trainer(compose_config(*RAMP, "trainer.max_steps=4", "trainer.rampup_batch_size=[4,8,16]"), tmp_path)


def test_a_checkpoint_from_before_the_ramp_was_recorded_resumes_only_without_one(tmp_path):
    """A checkpoint written before `rampup_batch_size` was part of the data order had none: resuming it with one would
    take other samples from its step on (said by a second reader, 2026-12-07)."""
    Trainer(compose_config(*RAMP[:2], "trainer.max_steps=4", "trainer.stop_at_step=2"), tmp_path).fit()
    state = next(tmp_path.glob("checkpoints/step_*/state.json"))
    saved = json.loads(state.read_text())
    del saved["rampup_batch_size"]
    state.write_text(json.dumps(saved))
    with pytest.raises(CheckpointError, match=r"rampup_batch_size=None, this run has \[4, 4, 16\]"):
        Trainer(compose_config(*RAMP, "trainer.max_steps=4"), tmp_path)
    # a ramp that starts at the whole batch is none: the same steps, resumed, said in the start's line
    resumed = Trainer(compose_config(*RAMP[:2], "trainer.max_steps=4", "trainer.rampup_batch_size=[12,4,16]"), tmp_path)
    assert resumed.step == 2 and "no ramp-up" in resumed.train_steps.describe()


def test_the_sizes_a_ramp_skips_need_not_split():
    """[4, 2, 4] to 12 takes 4, then 12 (its first step overshoots the next three boundaries): micro-batches of 2 over
    dp 2 split both, and the skipped 6, 8 and 10 are not asked to."""
    assert ramp_batch_sizes(12, [4, 2, 4]) == [4, 12]
    validate_run(compose_config(*RAMP[:2], "trainer.rampup_batch_size=[4,2,4]", "parallel.dp=2"), world_size=2)


@pytest.mark.parametrize("overrides, message", [
    (["trainer.rampup_batch_size=[4,4]"], r"must be three integers: \[start batch size"),
    (["trainer.rampup_batch_size=[16,4,16]"], r"starts at 16, which must be in \[1, trainer.global_batch_size=12\]"),
    (["trainer.rampup_batch_size=[4,0,16]"], "the increment and the ramp-up samples must be >= 1"),
    (["trainer.rampup_batch_size=[4,4,0]"], "the increment and the ramp-up samples must be >= 1"),
    (["trainer.rampup_batch_size=[6,4,16]"], "does not reach trainer.global_batch_size=12 from 6 in steps of 4"),
    (["trainer.rampup_batch_size=[2,2,16]", "parallel.dp=2"],
     r"takes a global batch of 2, not divisible by micro_batch_size\*dp=2\*2; make its start and increment "
     "multiples of 4"),
    (["trainer.rampup_batch_size=[2,2,16]", "parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=interleaved",
      "model.num_layers=4", "trainer.global_batch_size=8"],
     r"takes a global batch of 2; make its start and increment multiples of micro_batch_size\*dp\*pp=4"),
    (["trainer.rampup_batch_size=[4,4,16]", "data.varlen=true", "trainer.tokens_per_step=100"],
     "trainer.tokens_per_step replaces; drop one of the two"),
])
def test_a_ramp_that_cannot_run_is_refused_in_one_line(overrides, message):
    world = 2 if "parallel.dp=2" in overrides or "parallel.pp=2" in overrides else 1
    with pytest.raises(ConfigError, match=message) as error:
        validate_run(compose_config(*RAMP, *overrides), world_size=world)
    assert "\n" not in str(error.value)


def test_the_estimate_prices_the_steps_after_the_ramp(capsys):
    """megalm-estimate traces one step: the ramp's first would be 2 samples of the 8 its layout prices."""
    run = [*SMALL, "trainer.global_batch_size=8", "trainer.micro_batch_size=1", "precision=bf16", "--world", "1",
           "--json"]
    assert estimate.main([*run, "trainer.rampup_batch_size=[2,2,100]"]) == 0
    ramped = json.loads(capsys.readouterr().out)
    assert estimate.main(run) == 0
    whole = json.loads(capsys.readouterr().out)
    assert estimate.RAMP_PRICED_WHOLE in ramped["notes"] and estimate.RAMP_PRICED_WHOLE not in whole["notes"]
    assert ramped["layout"]["micro_batches"] == 8
    assert ramped["ranks"][0]["flops"] == whole["ranks"][0]["flops"] and ramped["tokens_per_s"] == whole["tokens_per_s"]
    # the ramp's sizes are checked against the layout first, as megalm-train checks them
    assert estimate.main([*run[:-3], "parallel.dp=4", "--world", "4", "trainer.rampup_batch_size=[2,2,100]"]) == 2
    assert "takes a global batch of 2, not divisible by micro_batch_size*dp=1*4" in capsys.readouterr().err


@pytest.mark.parametrize("rampup", [None, [4, 4, 16], [4, 2, 4], [2, 2, 100]])
def test_train_samples_sets_the_steps_that_consume_them(rampup):
    """trainer.train_samples (Megatron-LM's --train-samples): max_steps becomes the first step count whose samples
    reach it, counted step by step over the ramp; the resolved config passes the check again (a saved one does)."""
    for samples in (1, 11, 12, 13, 40, 41, 500):
        ramp = [f"trainer.rampup_batch_size=[{','.join(map(str, rampup))}]"] if rampup else []
        cfg = validate_run(compose_config(*RAMP[:2], *ramp, f"trainer.train_samples={samples}"))
        steps = GlobalBatchSteps(12, rampup)
        counted = next(n for n in range(1, 1000) if steps.start(n) >= samples)
        assert cfg.trainer.max_steps == counted, (samples, rampup)
        assert validate_run(cfg).trainer.max_steps == counted


def test_train_samples_runs_and_is_refused_beside_another_length(tmp_path, caplog):
    with caplog.at_level("INFO", logger="megalm"):
        summary = Trainer(compose_config(*RAMP, "trainer.train_samples=29"), tmp_path).fit()
    assert summary.steps == 5 and summary.tokens == (4 + 4 + 8 + 12 + 12) * 32  # 28 samples after 4 steps, 40 after 5
    assert "trainer.train_samples=29: 5 steps, 40 samples" in caplog.text
    with pytest.raises(ConfigError, match=r"trainer.train_samples=29 sets the run's length \(5 steps\), and "
                                          r"trainer.max_steps=6 sets it too; drop one of the two"):
        validate_run(compose_config(*RAMP, "trainer.train_samples=29", "trainer.max_steps=6"))
    with pytest.raises(ConfigError, match="trainer.train_samples counts steps of trainer.global_batch_size, which "
                                          "trainer.tokens_per_step replaces"):
        validate_run(compose_config("data.varlen=true", "trainer.tokens_per_step=64", "trainer.train_samples=30"))
    with pytest.raises(ConfigError, match=r"trainer.train_samples=0 must be a finite number > 0"):
        validate_run(compose_config("trainer.train_samples=0"))
