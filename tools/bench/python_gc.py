"""Python's garbage collector in a training run: what a collection costs, and how many land inside steps.

    python tools/bench/python_gc.py model=1.3b --steps 100
    python tools/bench/python_gc.py model=1.3b --steps 100 trainer.compile=true

Runs `Trainer.fit` on the same config with `trainer.gc_interval` 0 (Python's automatic collection), 1 (megalm's
default), 50 (TorchTitan's) and the config's own, and reports for each: the collections that ran inside a step, by
generation, and the time they paused it, timed by `gc.callbacks` around each collection (not by megalm's own
bookkeeping), and the collections between steps. Then, on the trained process, how many objects the collector tracks
and what a full collection takes (median of 5). The model keeps the overrides' layer count at a width of 64 and 128
tokens (as tools/bench/host_overhead.py): the objects Python tracks and allocates per step follow the layers and
modules, not the width. Under `trainer.compile=true` each run compiles afresh (dynamo reset), so its first steps
hold the compilation and what it allocates, as a run's first steps do. A CPU's figures, not a GPU host's: the pause
of a full collection scales with the objects tracked on either.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.bench.cli import check_counts, parse_flags_and_overrides, run_main  # noqa: E402
from tools.bench.host_overhead import NARROW  # noqa: E402
from tools.bench.throughput import compose_config  # noqa: E402


@contextlib.contextmanager
def timed_collections(trainer) -> Iterator[list[tuple[int, bool, bool, float]]]:  # noqa: ANN001
    """(generation, inside a step, automatic: the collector on, seconds) of each collection while inside."""
    seen: list[tuple[int, bool, bool, float]] = []
    inside, started = [False], [0.0, True]
    train_step = trainer.train_step

    def flagged_step(step: int):  # noqa: ANN202
        inside[0] = True
        try:
            return train_step(step)
        finally:
            inside[0] = False

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            started[:] = [time.perf_counter(), gc.isenabled()]
        else:
            seen.append((info["generation"], inside[0], started[1], time.perf_counter() - started[0]))

    trainer.train_step = flagged_step
    gc.callbacks.append(record)
    try:
        yield seen
    finally:
        gc.callbacks.remove(record)
        trainer.train_step = train_step


def collection_ms(generation: int, repeats: int = 5) -> float:
    """Median ms of `repeats` collections of generations 0 to `generation`."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        gc.collect(generation)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def run(overrides: list[str], steps: int, interval: int) -> dict:
    """One fit of `steps` steps at gc_interval `interval`: the collections inside and between its steps."""
    from megalm.training.trainer import Trainer

    cfg = compose_config(NARROW + ["data=synthetic", "trainer.eval_interval=0", "trainer.save_interval=0",
                                   "trainer.log_interval=1000000"] + overrides)
    cfg.trainer.max_steps, cfg.trainer.gc_interval = steps, interval
    torch._dynamo.reset()  # trainer.compile=true: each run compiles its blocks afresh, as a new process would
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(cfg, run_dir)
        with timed_collections(trainer) as seen:
            start = time.perf_counter()
            trainer.fit()
            seconds = time.perf_counter() - start
        row = {"gc_interval": interval, "steps": steps, "ms_per_step": 1e3 * seconds / steps}
        for where, in_step in (("in_steps", True), ("between_steps", False)):
            mine = [(g, s) for g, i, _, s in seen if i == in_step]
            row[where] = {"by_generation": {g: sum(1 for h, _ in mine if h == g) for g in (0, 1, 2)},
                          "ms": 1e3 * sum(s for _, s in mine), "longest_ms": 1e3 * max((s for _, s in mine), default=0)}
        gc.collect()
        row["tracked_objects"] = len(gc.get_objects())
        row["full_collection_ms"] = collection_ms(2)
        del trainer
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="training steps per run")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON list last")
    args, overrides = parse_flags_and_overrides(parser, argv)
    check_counts(args, "steps")
    configured = compose_config(NARROW + overrides).trainer.gc_interval
    rows = [run(overrides, args.steps, interval) for interval in dict.fromkeys([0, 1, 50, configured])]
    print(f"{args.steps} steps of {' '.join(overrides) or 'the default config'} (width 64, 128 tokens); a full "
          f"collection of the trained process's {rows[0]['tracked_objects']:,} tracked objects takes "
          f"{rows[0]['full_collection_ms']:.1f} ms")
    print(f"{'gc_interval':<12} {'ms/step':>8} {'in steps: gen 0/1/2':>20} {'ms':>8} {'longest':>8} "
          f"{'between: gen 0/1/2':>19} {'ms':>8}")
    for r in rows:
        inside, between = r["in_steps"], r["between_steps"]
        counts = lambda part: "/".join(str(part["by_generation"][g]) for g in (0, 1, 2))  # noqa: E731
        print(f"{r['gc_interval']:<12} {r['ms_per_step']:>8.1f} {counts(inside):>20} {inside['ms']:>8.1f} "
              f"{inside['longest_ms']:>8.1f} {counts(between):>19} {between['ms']:>8.1f}")
    if args.json:
        print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    run_main(main)
