"""Activation offload benchmark: device-resident activation bytes, bytes copied each way, and step time,
per policy and fraction, against no offload, measured on the real training step.

    python tools/bench/offload.py                                        # tiny model, CPU
    python tools/bench/offload.py model=350m model.seq_length=8192 precision=bf16 \
        trainer.micro_batch_size=1 trainer.global_batch_size=4 --fractions 0.25 0.5 1.0   # on a GPU

Arguments without dashes are Hydra overrides (data defaults to synthetic). Without a pipeline (pp = 1, what
one process runs) the rows are layer-wise offload (`policy` "layers") at each fraction; the baseline is the
same step without offload (time, measured in turns with the others) and with nothing offloaded (a store
measuring what stays resident).
Then, from the schedules alone, the pipeline policies' peak in micro-batch-chunks per rank (p=4, m=8, the
three schedules), which is what the pipeline tests check a real run against. The last line is one JSON
object: {"rows": [{"policy", "fraction", "resident_bytes", "baseline_resident_bytes", "offloaded_bytes",
"reloaded_bytes", "step_s", "baseline_step_s"}, ...], "pipeline": [...]}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from throughput import compose_config, synchronize  # noqa: E402


def layer_rows(overrides: list[str], fractions: list[float], steps: int, warmup: int) -> list[dict]:
    """pp = 1: every fraction and the baseline built side by side, their steps timed in turns (A B C A B C),
    so that the machine's drift hits all alike; then one counted step each."""
    from megalm.offload import ActivationStore, LayerOffload
    from megalm.training.trainer import Trainer

    with tempfile.TemporaryDirectory() as run_dir:
        runs = {}
        for fraction in [None, *fractions]:
            extra = [] if fraction is None else ["offload.enabled=true", f"offload.fraction={fraction}"]
            cfg = compose_config([*overrides, *extra])
            cfg.trainer.max_steps = warmup + steps + 1
            runs[fraction] = Trainer(cfg, f"{run_dir}/{fraction}")
        times: dict = {fraction: [] for fraction in runs}
        for step in range(warmup + steps):
            for fraction, trainer in runs.items():
                synchronize(trainer.device)
                start = time.perf_counter()
                trainer.train_step(step)
                synchronize(trainer.device)
                if step >= warmup:
                    times[fraction].append(time.perf_counter() - start)
        plain = runs.pop(None)
        # what stays resident without offload: a store that offloads nothing, for one step
        store = ActivationStore(plain.device, plain.model.parameters(), plain.cfg.offload.min_tensor_bytes)
        plain.parallel.runner.memory_hooks = LayerOffload(plain.model.layers, store, 0.0)
        plain.train_step(warmup + steps)
        baseline_bytes, baseline_s = store.peak_resident_bytes, statistics.median(times[None])
        rows = []
        for fraction, run in runs.items():
            store = run.parallel.offload_store
            store.offloaded_bytes = store.reloaded_bytes = store.sync_reloads = 0
            run.train_step(warmup + steps)  # one more step, counted alone
            rows.append({"policy": "layers", "fraction": fraction, "resident_bytes": store.peak_resident_bytes,
                         "baseline_resident_bytes": baseline_bytes, "offloaded_bytes": store.offloaded_bytes,
                         "reloaded_bytes": store.reloaded_bytes, "step_s": statistics.median(times[fraction]),
                         "baseline_step_s": baseline_s, "sync_reloads": store.sync_reloads})
    return rows


def pipeline_rows(fractions: list[float], p: int = 4, m: int = 8) -> list[dict]:
    from megalm.offload.policy import resident_profile, select_pipeline
    from megalm.parallel.pipeline.schedules import build_schedule, simulate

    rows = []
    for name, vpp in (("1f1b", 1), ("interleaved", 2), ("zb", 1)):
        sched = build_schedule(name, p, m, vpp).with_comm()
        timeline = simulate(sched).timeline
        base = [max(resident_profile(sched, r)) for r in range(p)]
        for policy in ("uniform", "lifespan"):
            for fraction in fractions:
                chosen = select_pipeline(sched, timeline, policy, fraction)
                peaks = [max(resident_profile(sched.with_offload(chosen), r)) for r in range(p)]
                rows.append({"schedule": name, "policy": policy, "fraction": fraction, "peak_units": peaks,
                             "baseline_peak_units": base})
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    argv = sys.argv[1:] if argv is None else argv
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    args = parser.parse_args([a for a in argv if a not in overrides])
    rows = layer_rows(overrides, args.fractions, args.steps, args.warmup)
    print(f"{'policy':>8} {'fraction':>8} {'resident MiB':>13} {'baseline MiB':>13} {'saved':>6} "
          f"{'D2H MiB':>8} {'H2D MiB':>8} {'step s':>8} {'baseline s':>10} {'cost':>6}")
    for r in rows:
        saved = 1 - r["resident_bytes"] / r["baseline_resident_bytes"]
        cost = r["step_s"] / r["baseline_step_s"] - 1
        print(f"{r['policy']:>8} {r['fraction']:>8g} {r['resident_bytes'] / 2**20:>13.2f} "
              f"{r['baseline_resident_bytes'] / 2**20:>13.2f} {saved:>6.0%} {r['offloaded_bytes'] / 2**20:>8.2f} "
              f"{r['reloaded_bytes'] / 2**20:>8.2f} {r['step_s']:>8.3f} {r['baseline_step_s']:>10.3f} {cost:>+6.0%}")
    pipeline = pipeline_rows(sorted({0.25, 0.375, 0.5, 1.0} | set(args.fractions)))
    print("\npipeline peaks (micro-batch-chunks per rank, p=4, m=8; from the schedules):")
    for r in pipeline:
        print(f"  {r['schedule']:>11} {r['policy']:>8} {r['fraction']:>6g}: {r['peak_units']} "
              f"(no offload {r['baseline_peak_units']})")
    result = {"rows": rows, "pipeline": pipeline}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
