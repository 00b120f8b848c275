"""profiling.*: a run profiles the steps and ranks asked, writes torch's trace and its summary, and refuses a window it
cannot reach; the CUDA memory snapshot's wiring (its files on a GPU: tests/gpu/test_gpu_profiling.py)."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path
from unittest import mock

import pytest
import torch

from megalm.errors import ConfigError
from megalm.measure.kernel_profile import STEP_SPAN
from megalm.training.profiling import StepProfiler
from megalm.training.trainer import Trainer
from tests.conftest import compose_config
from tests.dist.launch import run_distributed

TRACE = ["profiling.trace=true", "trainer.eval_interval=0", "logging.tensorboard=false"]


def trace_events(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def step_spans(events: list[dict]) -> dict[str, tuple[float, float]]:
    """{span name: (start, end) µs} of the trace's `megalm step N` spans."""
    return {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name", "").startswith("megalm step ")}


def test_a_run_traces_the_steps_asked_and_sums_them(tmp_path, caplog):
    """Steps 3 and 4 (two after this process's first two): their spans, every GEMM of theirs, and a summary over those
    two; none of the warm-up step's ops (the trace starts recording at step 3)."""
    cfg = compose_config(*TRACE, "trainer.max_steps=5", "profiling.start_step=2", "profiling.steps=2")
    with caplog.at_level(logging.INFO, logger="megalm"):
        Trainer(cfg, tmp_path).fit()
    profile = tmp_path / "profile"
    assert sorted(p.name for p in profile.iterdir()) == ["rank0_steps3-4.json.gz", "rank0_steps3-4_summary.json"]
    events = trace_events(profile / "rank0_steps3-4.json.gz")
    spans = step_spans(events)
    assert sorted(spans) == ["megalm step 3", "megalm step 4"]
    assert sum(e.get("name") == STEP_SPAN for e in events) == 2
    gemms = [e["ts"] for e in events if e.get("name") == "aten::mm"]
    assert gemms and all(any(a <= ts <= b for a, b in spans.values()) for ts in gemms), "ops outside the steps"
    per_step = [sum(a <= ts <= b for ts in gemms) for a, b in spans.values()]
    assert per_step[0] == per_step[1] > 0, "each step's GEMMs, and only its own"
    summary = json.loads((profile / "rank0_steps3-4_summary.json").read_text())
    assert summary["steps"] == 2 and summary["device"] == "cpu"
    calls = dict((name, n) for name, n, _ in summary["top"])
    assert calls["aten::mm"] == per_step[0], "the summary counts per step what the trace holds"
    assert any("profiling rank 0, steps 3 to 4" in r.getMessage() for r in caplog.records)


def test_a_resumed_run_counts_its_window_from_the_resume(tmp_path):
    common = [*TRACE, "trainer.max_steps=4", "profiling.start_step=1", "profiling.steps=1"]
    Trainer(compose_config(*common, "trainer.stop_at_step=2"), tmp_path).fit()
    assert [p.name for p in (tmp_path / "profile").glob("*.json.gz")] == ["rank0_steps2-2.json.gz"]
    Trainer(compose_config(*common), tmp_path).fit()  # resumes after step 2
    assert sorted(p.name for p in (tmp_path / "profile").glob("*.json.gz")) == ["rank0_steps2-2.json.gz",
                                                                                 "rank0_steps4-4.json.gz"]


def test_a_process_that_stops_before_its_window_says_so(tmp_path, caplog):
    """A resumed job with fewer steps left than its window: nothing written, and one line that says it."""
    common = [*TRACE, "trainer.max_steps=4", "profiling.start_step=2", "profiling.steps=1"]
    Trainer(compose_config(*common, "trainer.stop_at_step=3"), tmp_path).fit()
    with caplog.at_level(logging.WARNING, logger="megalm"):
        Trainer(compose_config(*common), tmp_path).fit()  # steps 4 only: its window would be step 6
    assert sorted(p.name for p in (tmp_path / "profile").glob("*.json.gz")) == ["rank0_steps3-3.json.gz"]
    assert any("stopped after step 4, before its profiled steps 6 to 6" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("overrides, message", [
    (["profiling.start_step=0"], "profiling.start_step=0 must be >= 1"),
    (["profiling.steps=0"], "profiling.steps=0 must be >= 1"),
    (["trainer.max_steps=10", "profiling.trace=true"], "go past the run's 10 steps (trainer.max_steps)"),
    (["profiling.memory_snapshot=true", "trainer.stop_at_step=5", "profiling.start_step=4"],
     "go past the run's 5 steps (trainer.stop_at_step)"),
    (["profiling.trace=true", "profiling.ranks=[1]"], "profiling.ranks=[1]: this job has 1 rank(s), 0 to 0"),
    (["profiling.trace=true", "profiling.ranks=[]"], "profiling.ranks=[]"),
])
def test_a_window_or_rank_the_run_cannot_profile_fails_as_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")) as error:
        Trainer(compose_config(*overrides), tmp_path)
    assert "\n" not in str(error.value)


def _ranks(rank: int, world_size: int, tmp: str) -> None:
    Trainer(compose_config(*TRACE, "trainer.max_steps=3", "profiling.start_step=1", "profiling.steps=1",
                           "profiling.ranks=[1]"), tmp).fit()


def test_only_the_ranks_asked_profile(tmp_path):
    run_distributed(_ranks, 2, str(tmp_path), timeout=180)
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["rank1_steps2-2.json.gz",
                                                                          "rank1_steps2-2_summary.json"]


def test_a_memory_snapshot_on_a_cpu_is_said_and_not_written(tmp_path, caplog):
    cfg = compose_config(*TRACE[1:], "trainer.max_steps=3", "profiling.memory_snapshot=true",
                         "profiling.start_step=1", "profiling.steps=1")
    with caplog.at_level(logging.WARNING, logger="megalm"):
        Trainer(cfg, tmp_path).fit()
    assert not (tmp_path / "profile").exists()
    said = [r.getMessage() for r in caplog.records if "profiling.memory_snapshot" in r.getMessage()]
    assert len(said) == 1 and "this run is on cpu" in said[0]


class FakeAllocator:
    """torch.cuda.memory's recording switches, as calls: what a CUDA run's profiler asks of the allocator."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def record(self, enabled: str | None = "all", **kwargs) -> None:
        self.calls.append(("record", enabled))
        assert enabled is None or kwargs.get("stacks") == "python", "C++ stacks slow every step until the dump"

    def dump(self, path: str) -> None:
        self.calls.append(("dump", Path(path).name))
        Path(path).write_bytes(b"snapshot")


@pytest.fixture
def allocator():
    fake = FakeAllocator()
    with mock.patch.object(torch.cuda.memory, "_record_memory_history", fake.record), \
            mock.patch.object(torch.cuda.memory, "_dump_snapshot", fake.dump):
        yield fake


def memory_profiler(tmp_path: Path) -> StepProfiler:
    cfg = compose_config("profiling.memory_snapshot=true", "profiling.start_step=2", "profiling.steps=2")
    return StepProfiler(cfg, tmp_path, 0, torch.device("cuda"), first_step=0)


def test_the_memory_snapshot_records_from_the_start_to_the_window_end(tmp_path, allocator):
    with memory_profiler(tmp_path) as profiler:
        for index in range(6):
            profiler.before_step(index)
            profiler.after_step(index)
            if index == 3:
                assert allocator.calls == [("record", "all"), ("dump", "rank0_memory_steps3-4.pickle"),
                                           ("record", None)], "dumped after step 4 and stopped"
    assert len(allocator.calls) == 3


def test_a_run_stopped_inside_the_window_leaves_the_snapshot_of_its_steps(tmp_path, allocator):
    with memory_profiler(tmp_path) as profiler:  # steps 3 and 4 asked; the loop stops after step 3
        for index in range(3):
            profiler.before_step(index)
            profiler.after_step(index)
    assert allocator.calls == [("record", "all"), ("dump", "rank0_memory_steps3-3.pickle"), ("record", None)]


def test_an_out_of_memory_error_leaves_its_snapshot(tmp_path, allocator):
    with pytest.raises(torch.OutOfMemoryError), memory_profiler(tmp_path) as profiler:
        profiler.before_step(0)
        profiler.after_step(0)
        profiler.before_step(1)
        raise torch.OutOfMemoryError("CUDA out of memory")
    assert allocator.calls == [("record", "all"), ("dump", "rank0_memory_oom_step2.pickle"), ("record", None)]
    assert (tmp_path / "profile" / "rank0_memory_oom_step2.pickle").exists()


def test_an_error_inside_the_window_leaves_the_profiler_stopped(tmp_path):
    """The run's error is the run's: the profiler stops (another profile in the process works), nothing half-written."""
    cfg = compose_config(*TRACE, "trainer.max_steps=4", "profiling.start_step=1", "profiling.steps=2")
    trainer = Trainer(cfg, tmp_path / "failed")
    train_step = trainer.train_step
    trainer.train_step = lambda step: (_ for _ in ()).throw(RuntimeError("boom")) if step == 2 else train_step(step)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit()
    assert not torch.autograd.profiler._is_profiler_enabled
    assert not (tmp_path / "failed" / "profile").exists()
    Trainer(cfg, tmp_path / "next").fit()
    assert (tmp_path / "next" / "profile" / "rank0_steps2-3.json.gz").exists()


def test_a_run_stopped_inside_the_window_keeps_the_steps_it_profiled(tmp_path, caplog):
    """A preemption (here: asked for after step 3) ends the loop inside the window: the trace and summary of the
    profiled steps it ran are written, and a line says the window was cut."""
    cfg = compose_config(*TRACE, "trainer.max_steps=6", "profiling.start_step=2", "profiling.steps=3")
    trainer = Trainer(cfg, tmp_path)
    trainer.preemption.requested = lambda *_: trainer.step == 4
    with caplog.at_level(logging.INFO, logger="megalm"):
        trainer.fit()
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["rank0_steps3-4.json.gz",
                                                                          "rank0_steps3-4_summary.json"]
    assert sorted(step_spans(trace_events(tmp_path / "profile" / "rank0_steps3-4.json.gz"))) == [
        "megalm step 3", "megalm step 4"]
    assert json.loads((tmp_path / "profile" / "rank0_steps3-4_summary.json").read_text())["steps"] == 2
    assert any("stopped inside the profiled steps; the trace holds steps 3 to 4" in r.getMessage()
               for r in caplog.records)


def test_a_profile_that_cannot_be_written_does_not_stop_training(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", lambda *a, **k: (_ for _ in ()).throw(
        OSError("No space left on device")))
    cfg = compose_config(*TRACE, "trainer.max_steps=4", "profiling.start_step=1", "profiling.steps=1")
    with caplog.at_level(logging.WARNING, logger="megalm"):
        summary = Trainer(cfg, tmp_path).fit()
    assert summary.steps == 4
    assert any("could not be written (OSError: No space left on device); training goes on" in r.getMessage()
               for r in caplog.records)


def test_an_evaluation_inside_the_window_is_said_and_kept_off_the_wall(tmp_path, caplog):
    """The loop evaluates between steps 3 and 4 (trainer.eval_interval=3): recorded with them, so said; the summary's
    wall is the two steps' own (their spans' length, within the timer's reach), not the evaluation's."""
    cfg = compose_config("profiling.trace=true", "logging.tensorboard=false", "trainer.max_steps=5",
                         "trainer.eval_interval=3", "trainer.eval_iters=20", "profiling.start_step=2",
                         "profiling.steps=2")
    with caplog.at_level(logging.INFO, logger="megalm"):
        Trainer(cfg, tmp_path).fit()
    assert any("evaluates or saves after step(s) [3], inside the profiled steps 3 to 4" in r.getMessage()
               for r in caplog.records)
    spans = step_spans(trace_events(tmp_path / "profile" / "rank0_steps3-4.json.gz"))
    steps_ms = sum(end - start for start, end in spans.values()) / 1e3
    summary = json.loads((tmp_path / "profile" / "rank0_steps3-4_summary.json").read_text())
    gap_ms = (spans["megalm step 4"][0] - spans["megalm step 3"][1]) / 1e3  # the evaluation of 20 batches
    assert gap_ms > steps_ms / 2, "the evaluation should take a while for the test to mean anything"
    # a step's wall is its span and ~0.1 ms of syncs here (the evaluation would add ~470 ms): 20 ms of slack is a
    # loaded machine's stall, not the evaluation
    assert steps_ms / 2 <= summary["wall_ms"] <= steps_ms / 2 + 20


def test_the_default_window_is_steps_11_and_12(tmp_path):
    """At the defaults (profiling.start_step=10, steps=2, ranks=[0]): the two steps after the first ten."""
    Trainer(compose_config(*TRACE, "trainer.max_steps=12"), tmp_path).fit()
    assert sorted(step_spans(trace_events(tmp_path / "profile" / "rank0_steps11-12.json.gz"))) == [
        "megalm step 11", "megalm step 12"]
