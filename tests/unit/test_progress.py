"""Progress in every logged step: percentage, elapsed time and the estimate of the time left, on the console and
in metrics.jsonl. The rate is measured from the first record, so a resumed run estimates from its own steps."""

from __future__ import annotations

import itertools
import json

from megalm.config import LoggingConfig
from megalm.training import metrics
from megalm.training.metrics import MetricsLogger, clock, format_line, read_metrics

BASE = {"loss": 1.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_sec": 1000.0}


def test_progress_elapsed_and_eta(tmp_path, monkeypatch, caplog):
    times = itertools.chain([100.0, 105.0, 125.0, 145.0])  # created; steps 40, 50 and 60 (2 s a step)
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(times))
    logger = MetricsLogger(tmp_path, LoggingConfig(tensorboard=False), max_steps=100)
    with caplog.at_level("INFO", logger="megalm"):
        for step in (40, 50, 60):  # a run resumed at step 39
            logger.log({"step": step, **BASE})
    logger.close()
    records = read_metrics(tmp_path)
    assert [r["progress"] for r in records] == [0.4, 0.5, 0.6]
    assert [r["elapsed_sec"] for r in records] == [5.0, 25.0, 45.0]
    assert [r["eta_sec"] for r in records] == [None, 100.0, 80.0]  # 2 s a step since the first record
    assert "step  60/100 (60%)" in caplog.text and "0:00:45 elapsed, eta 0:01:20" in caplog.text


def test_clock_and_a_line_without_timing():
    assert clock(3725.4) == "1:02:05"
    line = format_line({"step": 3, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_sec": 10.0}, 10)
    assert line.startswith("step  3/10 (30%) | loss 2.0000") and "elapsed" not in line


def test_a_resumed_run_starts_after_a_torn_line_and_tensorboard_drops_the_lost_steps(tmp_path):
    """A crash can leave metrics.jsonl's last line half written: the resumed run's first record goes on a line of
    its own (the torn text is kept). TensorBoard forgets the steps logged after the checkpoint resumed from, which
    the new attempt logs again (SummaryWriter's purge_step); without it both attempts' step 5 would be drawn."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsLogger(tmp_path, LoggingConfig(tensorboard=True), max_steps=10)
    for step in range(1, 7):
        first.log({**BASE, "step": step, "loss": 10.0 + step})
    first.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "lo')  # the crash
    resumed = MetricsLogger(tmp_path, LoggingConfig(tensorboard=True), max_steps=10, start_step=4)
    for step in range(5, 9):
        resumed.log({**BASE, "step": step, "loss": float(step)})
    resumed.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert lines[6] == '{"step": 7, "lo' and [json.loads(x)["step"] for x in lines[7:]] == [5, 6, 7, 8]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (1, 11.0), (2, 12.0), (3, 13.0), (4, 14.0), (5, 5.0), (6, 6.0), (7, 7.0), (8, 8.0)]


def test_a_new_step_marks_what_the_last_one_did_as_its():
    """A rank that hangs before its step's first micro-batch must not read as hung inside that step: the notes of
    the step before keep their text, marked as that step's."""
    from megalm.parallel.progress import Progress

    progress = Progress()
    progress.note(step=3)
    progress.note(micro_batch="2 of 2", collective="all_reduce (step totals) over 2 ranks")
    progress.note(step=4)
    report = progress.report()
    assert "step: 4" in report and "micro batch: - (step 3's last: 2 of 2)" in report, report
    assert "collective: - (step 3's last: all_reduce (step totals) over 2 ranks)" in report
    assert "pipeline action: -" in report and "pipeline action: - (" not in report
    progress.note(step=4)  # a beat within the step changes nothing
    progress.note(step=5)  # nor is a mark marked again
    assert "micro batch: - (step 3's last: 2 of 2)" in progress.report()
    progress.note(micro_batch="1 of 2")
    assert "micro batch: 1 of 2" in progress.report()


def test_the_cuda_allocators_retries_are_logged_and_said_as_they_grow(tmp_path, monkeypatch, caplog):
    """memory_metrics on a CUDA device reads the caching allocator's counters (torch.cuda.memory_stats, stood in for
    here: no GPU); the logger warns when the retries grow, not on every record."""
    import torch

    stats = {"reserved_bytes.all.peak": 3 * 2**30, "num_alloc_retries": 0, "num_ooms": 0}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: dict(stats))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 2 * 2**30)
    logger = MetricsLogger(tmp_path, LoggingConfig(tensorboard=False), max_steps=10)
    with caplog.at_level("WARNING", logger="megalm"):
        for step, retries in ((1, 0), (2, 2), (3, 2), (4, 5)):
            stats["num_alloc_retries"] = retries
            logger.log({"step": step, **BASE, **metrics.memory_metrics(torch.device("cuda"))})
    logger.close()
    records = read_metrics(tmp_path)
    assert [(r["peak_memory_gib"], r["peak_reserved_gib"], r["alloc_retries"]) for r in records] == [
        (2.0, 3.0, 0), (2.0, 3.0, 2), (2.0, 3.0, 2), (2.0, 3.0, 5)]
    said = [r.getMessage() for r in caplog.records if "caching allocator" in r.getMessage()]
    assert [line.split(":")[0] for line in said] == ["step 2", "step 4"], said
    assert "retried 5 allocation(s)" in said[-1]
    assert set(metrics.memory_metrics(torch.device("cpu"))) == {"peak_memory_gib"}
