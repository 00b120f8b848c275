"""Wall and CPU time of the HDP planner (megalm.parallel.hdp.plan_hdp) for one global batch.

    python tools/bench/hdp_plan_time.py                       # 12,288 ranks, 32M tokens, several distributions
    python tools/bench/hdp_plan_time.py --ranks 1024 --reps 21 --json

The planner runs on the CPU of every rank each step, so it must be cheap: the target is 100 ms for a
32M-token batch on 12,288 ranks on one core. The process is pinned to one core (where the OS allows);
each case is planned --reps times on the same batch; we report min and median wall time and the
median CPU time (process time, which excludes time the OS gave to other processes on a busy
machine). The garbage collector stays on, as in training.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from hdp_sim import global_batch, model_cost, parse_size, size  # noqa: E402

from megalm.errors import ConfigError  # noqa: E402
from megalm.parallel.hdp import plan_hdp  # noqa: E402
from tools.bench.cli import check_counts, run_main  # noqa: E402

SAMPLE = ROOT / "tools/data/seqlen/prolong_lengths.json"  # from any working directory


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=12288, help="HDP domain size (default 12,288)")
    p.add_argument("--global-tokens", type=size, default=33554432, help="tokens in one global batch (default 32M)")
    p.add_argument("--model", default="7b", help="the HDP cost model's preset: 1b, 7b, 13b or 70b (default 7b)")
    p.add_argument("--capacity", type=size, default=None, help="tokens per rank per micro-batch (default: the "
                   "cost model's)")
    p.add_argument("--lengths", default=str(SAMPLE), help="JSON list of document lengths (skipped if missing)")
    p.add_argument("--reps", type=int, default=11, help="plans of each case; min and median reported (default 11)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages per HDP rank (default 1)")
    p.add_argument("--budget-ms", type=float, default=100.0, help="the CPU time a plan may take (default 100 ms)")
    p.add_argument("--offload", action="store_true", help="plan with selective offload (two plans compete)")
    p.add_argument("--flat", action="store_true", help="flat rings only (parallel.cp_comm=ring)")
    p.add_argument("--json", action="store_true", help="also print the results as one JSON object, last")
    args = p.parse_args()
    check_counts(args, "ranks", "reps", "pp")

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    cost = model_cost(args.model)
    capacity = args.capacity or cost.capacity
    cases = [("longtail", "256K"), ("longtail", "2M")]
    if Path(args.lengths).exists():
        cases = [(args.lengths, "128K"), (args.lengths, "256K")] + cases
    # a context past the domain's tokens per micro-batch has documents no ring of these ranks holds
    fits = [case for case in cases if parse_size(case[1]) <= args.ranks * capacity]
    if not fits:
        raise ConfigError(f"--ranks {args.ranks} x capacity {capacity} holds {args.ranks * capacity} tokens, less "
                          f"than every case's context ({', '.join(sorted({c for _, c in cases}))}); raise --ranks "
                          "or --capacity")
    for source, context in (case for case in cases if case not in fits):
        print(f"skipped {Path(source).name} at {context}: longer than --ranks {args.ranks} x capacity {capacity}")
    cases = fits
    rows = []
    for source, context in cases:
        src = source if source == "longtail" else np.asarray(json.loads(Path(source).read_text()))
        lengths = global_batch(src, parse_size(context), args.global_tokens, np.random.default_rng(0))
        walls, cpus = [], []
        for _ in range(args.reps):
            w0, c0 = time.perf_counter(), time.process_time()
            plan = plan_hdp(lengths, args.ranks, capacity, cost, pp=args.pp, offload=args.offload,
                            hierarchical=not args.flat)
            walls.append(time.perf_counter() - w0)
            cpus.append(time.process_time() - c0)
        rows.append({
            "lengths": Path(source).name, "context": context, "documents": len(lengths),
            "rings": plan.stats["rings"], "micro_batches": len(plan.micro_batches),
            "wall_ms_min": 1e3 * min(walls), "wall_ms_median": 1e3 * statistics.median(walls),
            "cpu_ms_median": 1e3 * statistics.median(cpus),
        })
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    print(f"plan_hdp: {args.ranks} ranks, {args.global_tokens} tokens, capacity {capacity}, pp {args.pp}, "
          f"{'offload, ' if args.offload else ''}{'flat rings, ' if args.flat else ''}"
          f"{args.reps} reps, Python {platform.python_version()}, {platform.machine()}{load}")
    print(f"{'lengths':<24} {'context':>7} {'docs':>6} {'rings':>6} {'mbs':>6} {'wall min':>9} {'wall med':>9} "
          f"{'cpu med':>8}")
    for r in rows:
        print(f"{r['lengths']:<24} {r['context']:>7} {r['documents']:>6} {r['rings']:>6} {r['micro_batches']:>6} "
              f"{r['wall_ms_min']:>7.1f}ms {r['wall_ms_median']:>7.1f}ms {r['cpu_ms_median']:>6.1f}ms")
    worst = max(r["cpu_ms_median"] for r in rows)
    print(f"worst median CPU time {worst:.1f} ms: {'within' if worst <= args.budget_ms else 'OVER'} "
          f"the {args.budget_ms:.0f} ms budget")
    if args.json:
        print(json.dumps({"ranks": args.ranks, "global_tokens": args.global_tokens, "cases": rows}))


if __name__ == "__main__":
    run_main(main)
