"""GPU tier: `profiling.trace` and `profiling.memory_snapshot` on CUDA (megalm/training/profiling.py).

A tiny run profiles its third step: the trace holds that step's CUDA kernels inside its span, the summary counts them
by kind with the GPU busy no longer than the wall, and the allocator's snapshot is the one torch's memory viewer reads
(its segments hold the model's parameters, with the stacks of their allocations); and each metrics record has the
caching allocator's reserved peak and its retry and OOM counts."""

from __future__ import annotations

import gzip
import json
import pickle

import pytest

from megalm.training.metrics import read_metrics
from megalm.training.trainer import Trainer
from tests.conftest import compose_config

pytestmark = pytest.mark.gpu


def test_a_cuda_run_profiles_its_kernels_and_memory(tmp_path):
    cfg = compose_config("trainer.device=cuda", "trainer.max_steps=4", "trainer.eval_interval=0",
                         "logging.tensorboard=false", "profiling.trace=true", "profiling.memory_snapshot=true",
                         "profiling.start_step=2", "profiling.steps=1")
    trainer = Trainer(cfg, tmp_path)
    trainer.fit()
    profile = tmp_path / "profile"
    with gzip.open(profile / "rank0_steps3-3.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert kernels, "no CUDA kernel in the trace"
    summary = json.loads((profile / "rank0_steps3-3_summary.json").read_text())
    assert summary["device"] == "cuda" and summary["kernels"] >= len(kernels)  # copies and fills are kernels too
    assert 0 < summary["busy_ms"] <= summary["wall_ms"]
    assert {"gemm", "attention"} <= set(summary["by_kind"])
    with open(profile / "rank0_memory_steps3-3.pickle", "rb") as f:
        snapshot = pickle.load(f)  # torch's own format (pytorch.org/memory_viz reads it)
    blocks = [b for segment in snapshot["segments"] for b in segment["blocks"] if b["state"] == "active_allocated"]
    parameter_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    assert sum(b["size"] for b in blocks) >= parameter_bytes
    assert any(b.get("frames") for b in blocks), "allocations without their stacks"
    records = read_metrics(tmp_path)  # the allocator's counters in every record (memory_metrics)
    assert records and all(r["peak_reserved_gib"] >= r["peak_memory_gib"] > 0 and r["alloc_retries"] >= 0
                           and r["ooms"] == 0 for r in records)
