"""Checkpoints damaged after they were written: a one-line error naming the file for an explicit
trainer.resume=PATH, a fall-back to the previous complete checkpoint (with a warning) under trainer.resume=auto."""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from megalm.errors import CheckpointError
from megalm.training.trainer import Trainer
from tests.conftest import TINY, compose_config

RUN = ["trainer.max_steps=4", "trainer.save_interval=2", "trainer.keep_last=3"]


def truncate(file):
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def not_safetensors(file):
    file.write_text("this is not a safetensors file\n")


def garbage_json(file):
    file.write_text("{\"step\": 4, \"consumed")


def add_a_copy(file):
    """A safetensors file the save did not write (DCP's reader would index it too): the copy is what is named."""
    extra = file.with_name("shard-00009-model-00009-of-00009.safetensors")
    extra.write_bytes(file.read_bytes())
    return extra


DAMAGE = {  # (file in step_00000004, how (returning the file the message names, if not that one), what it says)
    "truncated shard": ("shard-*.safetensors", truncate, "truncated"),
    "foreign shard": ("shard-*.safetensors", not_safetensors, "not a safetensors file"),
    "truncated rng": ("rng-rank00000.safetensors", truncate, "truncated"),
    "broken state": ("state.json", garbage_json, "JSONDecodeError"),
    "state not a mapping": ("state.json", lambda f: f.write_text("[1, 2]"), "a JSON list, not a checkpoint's state"),
    "config not a run's": ("config.yaml", lambda f: f.write_text("junk\n"), "no model section"),
    # a lost rank's file: DCP's reader indexes the files it finds, and a tp2 checkpoint without rank 0's loaded
    # rank 1's rows and left rank 0's uninitialised (torch.empty) without a word (one process's only shard gone:
    # test_a_checkpoint_without_shards_is_said)
    "missing rng": ("rng-rank00000.safetensors", lambda f: f.unlink(), "missing: the save wrote it"),
    "shard added": ("shard-*.safetensors", add_a_copy, "not written by this checkpoint's save"),
    "shard replaced": ("shard-*.safetensors", lambda f: save_file({"x": torch.zeros(1)}, f), "the save wrote"),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    Trainer(compose_config(*RUN), run).fit()
    return run


def damaged_copy(trained, tmp_path, case: str):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    pattern, damage, _ = DAMAGE[case]
    file = next((run / "checkpoints" / "step_00000004").glob(pattern))
    named = damage(file)
    return run, named if isinstance(named, pathlib.Path) else file


@pytest.mark.parametrize("case", list(DAMAGE))
def test_auto_falls_back_to_the_previous_checkpoint(trained, tmp_path, caplog, case):
    run, file = damaged_copy(trained, tmp_path, case)
    with caplog.at_level(logging.WARNING, logger="megalm"):
        trainer = Trainer(compose_config(*RUN), run)
    assert trainer.step == 2 and trainer.resumed_from.name == "step_00000002"
    warnings = [r.message for r in caplog.records if "falls back" in r.message]
    assert len(warnings) == 1 and str(file) in warnings[0] and DAMAGE[case][2] in warnings[0]


@pytest.mark.parametrize("case", list(DAMAGE))
def test_an_explicit_path_stops_naming_the_file(trained, tmp_path, case):
    run, file = damaged_copy(trained, tmp_path, case)
    with pytest.raises(CheckpointError, match=rf"^checkpoint file {file} is damaged \(.*{DAMAGE[case][2]}"):
        Trainer(compose_config(*RUN, f"trainer.resume={run / 'checkpoints' / 'step_00000004'}"), tmp_path / "new")


def test_every_checkpoint_damaged_is_an_error(trained, tmp_path):
    run, _ = damaged_copy(trained, tmp_path, "truncated shard")
    truncate(next((run / "checkpoints" / "step_00000002").glob("shard-*.safetensors")))
    with pytest.raises(CheckpointError, match="every checkpoint in .* is damaged"):
        Trainer(compose_config(*RUN), run)


def test_the_cli_says_one_line_and_exits_2(trained, tmp_path):
    run, file = damaged_copy(trained, tmp_path, "foreign shard")
    command = [sys.executable, "-m", "megalm.train", *TINY, *RUN, f"hydra.run.dir={tmp_path / 'new'}",
               f"trainer.resume={run / 'checkpoints' / 'step_00000004'}"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ,
                                                                                     "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    step = run / "checkpoints" / "step_00000004"
    assert errors == [f"error: checkpoint file {file} is damaged (not a safetensors file); use another checkpoint "
                      f"(an earlier step_* dir beside {step})"], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_a_damaged_checkpoint_outside_a_run_names_no_step_dirs(trained, tmp_path):
    """An imported or init_from checkpoint has no earlier step_* dirs beside it: the fix does not send the user
    looking for them."""
    from megalm.training.checkpoint.verify import verify_checkpoint

    run, file = damaged_copy(trained, tmp_path, "foreign shard")
    imported = tmp_path / "imported"
    (run / "checkpoints" / "step_00000004").rename(imported)
    with pytest.raises(CheckpointError) as refused:
        verify_checkpoint(imported)
    assert str(refused.value).endswith("is damaged (not a safetensors file); use another checkpoint"), refused.value


@pytest.mark.parametrize("case", ["truncated shard", "state not a mapping", "config not a run's"])
def test_generate_and_export_name_the_damaged_file_in_one_line(trained, tmp_path, case, capsys):
    """megalm-generate and megalm-export read a checkpoint's headers before torch.distributed.checkpoint reads its
    tensors: a damaged file is one line naming it, not DCP's traceback (or a KeyError)."""
    from megalm.generate import main as generate
    from megalm.interop.export import main as export

    run, file = damaged_copy(trained, tmp_path, case)
    step = str(run / "checkpoints" / "step_00000004")
    for cli, argv in ((generate, [step, "--max-new-tokens", "1", "--device", "cpu", "--prompt", "a"]),
                      (export, [step, "--format", "hf", "--out", str(tmp_path / "hf")])):
        with pytest.raises(SystemExit) as e:
            cli(argv)
        err = capsys.readouterr().err.strip()
        assert e.value.code != 0 and "\n" not in err and f"checkpoint file {file} is damaged" in err, err


@pytest.mark.parametrize("case", ["missing rng", "truncated shard", "shard replaced"])
def test_init_from_names_the_damaged_file_in_one_line(trained, tmp_path, case):
    """model.init_from reads a checkpoint as a resume does (DCP, into the parameters) and checks its files first, as
    a resume does: a lost rank's file had left that rank's rows at the run's initial values without a word (a second
    reader found it)."""
    run, file = damaged_copy(trained, tmp_path, case)
    step = run / "checkpoints" / "step_00000004"
    with pytest.raises(CheckpointError, match=f"checkpoint file {file} is damaged") as refused:
        Trainer(compose_config(f"model.init_from={step}"), tmp_path / "started")
    assert "\n" not in str(refused.value)


def test_the_save_after_a_fall_back_survives_pruning(trained, tmp_path):
    """keep_last=1 after falling back from a damaged step 4 to step 2: the new step 3 is what `latest` names and
    what pruning keeps (the damaged, newer step 4 is left for inspection, not counted)."""
    run, _ = damaged_copy(trained, tmp_path, "truncated shard")
    summary = Trainer(compose_config(*RUN, "trainer.keep_last=1", "trainer.stop_at_step=3"), run).fit()
    assert summary.checkpoint.name == "step_00000003" and summary.checkpoint.is_dir()
    names = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert names == ["step_00000003", "step_00000004"]
    assert Trainer(compose_config(*RUN, "trainer.keep_last=1"), run).step == 3


def test_a_damaged_checkpoint_saved_again_is_kept_for_inspection(trained, tmp_path, caplog):
    """Falling back from a damaged step 4 to step 2 and training to step 4 again saves step 4 anew; the damaged one
    it replaces is moved aside, named in a warning, not deleted (until 2026-12-04 the save removed it, an audit
    found). Pruning leaves it alone."""
    run, file = damaged_copy(trained, tmp_path, "truncated shard")
    damaged = file.read_bytes()
    with caplog.at_level(logging.WARNING, logger="megalm"):
        Trainer(compose_config(*RUN, "trainer.keep_last=1"), run).fit()
    kept = list((run / "checkpoints").glob("replaced-step_00000004-*"))
    assert len(kept) == 1 and (kept[0] / file.name).read_bytes() == damaged
    assert any(str(kept[0]) in r.getMessage() for r in caplog.records)
    assert Trainer(compose_config(*RUN), run).step == 4  # the new step 4 is intact and resumed


def test_a_requeued_job_with_its_resume_path_continues_past_its_own_damaged_checkpoint(tmp_path):
    """A job started with trainer.resume=PATH (another run's checkpoint) and requeued with the same command goes on
    from its own checkpoints, as trainer.resume=auto does, falling back past a damaged latest one. Until 2026-12-04
    it was refused as an explicit resume of an earlier step over the run's later checkpoints (an audit found it)."""
    run = ["trainer.max_steps=8", "trainer.save_interval=2", "trainer.keep_last=10"]
    Trainer(compose_config(*run, "trainer.stop_at_step=2"), tmp_path / "source").fit()
    start = f"trainer.resume={tmp_path / 'source' / 'checkpoints' / 'step_00000002'}"
    Trainer(compose_config(*run, "trainer.stop_at_step=6", start), tmp_path / "run").fit()
    truncate(next((tmp_path / "run" / "checkpoints" / "step_00000006").glob("shard-*.safetensors")))
    assert Trainer(compose_config(*run, start), tmp_path / "run").resumed_from.name == "step_00000004"
    # naming an earlier checkpoint of the run itself is still refused: its later checkpoints would be replaced
    with pytest.raises(CheckpointError, match="which this run would overwrite"):
        Trainer(compose_config(*run, f"trainer.resume={tmp_path / 'run' / 'checkpoints' / 'step_00000004'}"),
                tmp_path / "run")


def test_a_checkpoint_without_shards_is_said(trained, tmp_path, caplog):
    """The checkpoint `latest` names lost every shard file (one process writes one): it no longer counts as
    complete, and auto falls back with a warning naming it; with no other checkpoint, an error (it started over
    from step 0 without a word)."""
    run = tmp_path / "run"
    import shutil

    shutil.copytree(trained, run)
    for shard in (run / "checkpoints" / "step_00000004").glob("shard-*"):
        shard.unlink()
    with caplog.at_level(logging.WARNING, logger="megalm"):
        trainer = Trainer(compose_config(*RUN), run)
    assert trainer.step == 2
    assert [r.message for r in caplog.records if "step_00000004" in r.message and "falls back" in r.message]
    shutil.rmtree(run / "checkpoints" / "step_00000002")
    with pytest.raises(CheckpointError, match="is incomplete .* and the run dir has no other"):
        Trainer(compose_config(*RUN), run)
