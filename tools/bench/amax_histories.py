"""Host time of delayed scaling's amax histories between micro-batches and at a step's start.

    python tools/bench/amax_histories.py model=1.3b --reps 200

Under `precision=fp8_delayed` every FP8 linear keeps three amax histories (x, w, dy:
`megalm.precision.amax_history.AmaxHistory`). Before each micro-batch the trainer calls `set_precision_step`, which
compacts the amaxes each history collected in the micro-batches so far (their max), and at a new step pushes that
max into the history's ring. This times that call with a timer around it, on the model of the overrides (its layer
count, at the width 64 of `host_overhead.py`), every history holding two amaxes (a second micro-batch's) before the
compaction and one more before the roll: the median over `--reps` of each. What it costs a GPU step is the host time
times the micro-batches a step, plus the launches of the small kernels it makes
(`tests/unit/test_precision_fp8_casts.py` counts those).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.bench.cli import check_counts, parse_flags_and_overrides, run_main  # noqa: E402
from tools.bench.host_overhead import NARROW  # noqa: E402
from tools.bench.throughput import compose_config  # noqa: E402


def measure(overrides: list[str], reps: int) -> dict:
    """Median ms of `set_precision_step` compacting and rolling every history of the model of `overrides`."""
    from megalm.precision.install import _layer_states, set_precision_step
    from megalm.training.trainer import Trainer

    cfg = compose_config(NARROW + ["precision=fp8_delayed", "data=synthetic"] + overrides)
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(cfg, run_dir)
        trainer.train_step(0)  # every history used once
        histories = [h for state, _ in _layer_states(trainer.model) for h in state.amax.values()]
        set_precision_step(trainer.model, 1)  # the first step's rings allocated: what every later step finds
        device = next(trainer.model.parameters()).device  # where the layers' amaxes are
        compact, roll = [], []
        for step in range(2, 2 + reps):
            for history in histories:
                history.pending = [torch.rand((), device=device) for _ in range(2)]
            start = time.perf_counter()
            set_precision_step(trainer.model, step - 1, micro_batch=1)
            compact.append(time.perf_counter() - start)
            for history in histories:
                history.pending.append(torch.rand((), device=device))
            start = time.perf_counter()
            set_precision_step(trainer.model, step)
            roll.append(time.perf_counter() - start)
    return {"layers": cfg.model.num_layers, "histories": len(histories),
            "compact_ms": 1e3 * statistics.median(compact), "roll_ms": 1e3 * statistics.median(roll)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200, help="timed compactions and rolls")
    args, overrides = parse_flags_and_overrides(parser, argv)
    check_counts(args, "reps")
    torch.set_num_threads(1)  # one thread, as a training process's host loop runs
    row = measure(overrides, args.reps)
    print(f"{row['layers']} layers, {row['histories']} amax histories: between micro-batches "
          f"{row['compact_ms']:.2f} ms, at a step's start {row['roll_ms']:.2f} ms (medians of {args.reps})")
    return row


if __name__ == "__main__":
    run_main(main)
