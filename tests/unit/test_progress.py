"""Progress in every logged step: percentage, elapsed time and the estimate of the time left, on the console and
in metrics.jsonl. The rate is measured from the first record, so a resumed run estimates from its own steps."""

from __future__ import annotations

import itertools

from megalm.config import LoggingConfig
from megalm.training import metrics
from megalm.training.metrics import MetricsLogger, clock, format_line, read_metrics


def test_progress_elapsed_and_eta(tmp_path, monkeypatch, caplog):
    times = itertools.chain([100.0, 105.0, 125.0, 145.0])  # created; steps 40, 50 and 60 (2 s a step)
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(times))
    logger = MetricsLogger(tmp_path, LoggingConfig(tensorboard=False), max_steps=100)
    base = {"loss": 1.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_sec": 1000.0}
    with caplog.at_level("INFO", logger="megalm"):
        for step in (40, 50, 60):  # a run resumed at step 39
            logger.log({"step": step, **base})
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
