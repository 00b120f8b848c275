"""Activation offload benchmark: device-resident activation bytes, bytes copied each way, and step time,
per policy and fraction, against no offload, measured on the real training step.

    python tools/bench/offload.py                                        # tiny model, CPU
    python tools/bench/offload.py --pp 2 model.num_layers=8              # a 2-stage pipeline on CPU (gloo)
    python tools/bench/offload.py model=350m model.seq_length=8192 precision=bf16 \
        trainer.micro_batch_size=1 trainer.global_batch_size=4 --fractions 0.25 0.5 1.0   # on a GPU

Arguments without dashes are Hydra overrides (data defaults to synthetic). Without a pipeline (pp = 1, what
one process runs) the rows are layer-wise offload (`policy` "layers") at each fraction; with `--pp N`, N gloo
processes on the CPU run one pipeline and the rows are the pipeline policies (uniform, lifespan, auto) at
each fraction, with the peak of the rank that holds most; the baseline is the
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


def measured_rows(overrides: list[str], variants: list[tuple[str, float]], steps: int, warmup: int) -> list[dict]:
    """Every (policy, fraction) variant and the baseline built side by side, their steps timed in turns
    (A B C A B C) so that the machine's drift hits all alike; then one counted step each. pp = 1 runs
    layer-wise offload (policy "layers"), pp > 1 the pipeline policies; under torch.distributed each rank
    measures its own store and rank 0 reports the largest peak over the ranks (the one that limits)."""
    import torch.distributed as dist

    from megalm.offload import ActivationStore, LayerOffload, PipelineOffload
    from megalm.parallel.pipeline.schedules import simulate_schedule
    from megalm.training.trainer import Trainer

    with tempfile.TemporaryDirectory() as run_dir:
        runs = {}
        for variant in [None, *variants]:
            extra = [] if variant is None else ["offload.enabled=true", f"offload.fraction={variant[1]}"] + (
                [] if variant[0] == "layers" else [f"offload.policy={variant[0]}"])
            cfg = compose_config([*overrides, *extra])
            cfg.trainer.max_steps = warmup + steps + 1
            runs[variant] = Trainer(cfg, f"{run_dir}/{variant}")
        times: dict = {variant: [] for variant in runs}
        for step in range(warmup + steps):
            for variant, trainer in runs.items():
                synchronize(trainer.device)
                start = time.perf_counter()
                trainer.train_step(step)
                synchronize(trainer.device)
                if step >= warmup:
                    times[variant].append(time.perf_counter() - start)
        plain = runs.pop(None)
        # what stays resident without offload: a store that offloads nothing, for one step
        store = ActivationStore(plain.device, [*plain.model.parameters(), *plain.model.buffers()],
                                plain.cfg.offload.min_tensor_bytes)
        if plain.cfg.parallel.pp > 1:
            hooks = PipelineOffload(store, "uniform", 0.0, lambda schedule: simulate_schedule(schedule).timeline)
        else:
            hooks = LayerOffload(plain.model.layers, store, 0.0)
        plain.parallel.runner.memory_hooks = hooks
        plain.train_step(warmup + steps)
        baseline_bytes, baseline_s = store.peak_resident_bytes, statistics.median(times[None])
        rows = []
        for (policy, fraction), run in runs.items():
            store = run.parallel.offload_store
            store.offloaded_bytes = store.reloaded_bytes = store.sync_reloads = 0
            run.train_step(warmup + steps)  # one more step, counted alone
            rows.append({"policy": policy, "fraction": fraction, "resident_bytes": store.peak_resident_bytes,
                         "baseline_resident_bytes": baseline_bytes, "offloaded_bytes": store.offloaded_bytes,
                         "reloaded_bytes": store.reloaded_bytes, "step_s": statistics.median(times[(policy, fraction)]),
                         "baseline_step_s": baseline_s, "sync_reloads": store.sync_reloads})
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, rows)
        for i, row in enumerate(rows):
            per_rank = [r[i] for r in everyone]
            row["resident_bytes_per_rank"] = [r["resident_bytes"] for r in per_rank]
            row["baseline_resident_bytes_per_rank"] = [r["baseline_resident_bytes"] for r in per_rank]
            for key in ("resident_bytes", "baseline_resident_bytes", "step_s", "baseline_step_s"):
                row[key] = max(r[key] for r in per_rank)
            for key in ("offloaded_bytes", "reloaded_bytes", "sync_reloads"):
                row[key] = sum(r[key] for r in per_rank)
    return rows


def _pipeline_worker(rank: int, world: int, port: int, overrides: list[str], variants, steps: int, warmup: int,
                     out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        rows = measured_rows(overrides, variants, steps, warmup)
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def pipeline_measured_rows(overrides: list[str], pp: int, fractions: list[float], steps: int, warmup: int
                           ) -> list[dict]:
    """pp gloo processes on this machine (CPU), one pipeline: every policy at every fraction."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    variants = [(policy, f) for policy in ("uniform", "lifespan", "auto") for f in fractions]
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/rows.json"
        mp.spawn(_pipeline_worker, args=(pp, port, [*overrides, f"parallel.pp={pp}", "trainer.device=cpu"], variants,
                                         steps, warmup, out), nprocs=pp)
        return json.loads(Path(out).read_text())


def pipeline_rows(fractions: list[float], p: int = 4, m: int = 8) -> list[dict]:
    from megalm.offload.policy import resident_profile, select_pipeline
    from megalm.parallel.pipeline.rendezvous import with_comm
    from megalm.parallel.pipeline.schedules import build_schedule, simulate_schedule

    rows = []
    for name, vpp in (("1f1b", 1), ("interleaved", 2), ("zb", 1)):
        sched = with_comm(build_schedule(name, p, m, vpp))
        timeline = simulate_schedule(sched).timeline
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
    parser.add_argument("--pp", type=int, default=1, help="pp > 1: that many gloo processes on the CPU, one "
                        "pipeline, every offload policy (on a GPU machine with one device, use pp = 1)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    argv = sys.argv[1:] if argv is None else argv
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    args = parser.parse_args([a for a in argv if a not in overrides])
    if args.pp > 1:
        rows = pipeline_measured_rows(overrides, args.pp, args.fractions, args.steps, args.warmup)
    else:
        rows = measured_rows(overrides, [("layers", f) for f in args.fractions], args.steps, args.warmup)
    print(f"{'policy':>8} {'fraction':>8} {'resident MiB':>13} {'baseline MiB':>13} {'saved':>6} "
          f"{'D2H MiB':>8} {'H2D MiB':>8} {'step s':>8} {'baseline s':>10} {'cost':>6}")
    for r in rows:
        saved = 1 - r["resident_bytes"] / r["baseline_resident_bytes"]
        cost = r["step_s"] / r["baseline_step_s"] - 1
        print(f"{r['policy']:>8} {r['fraction']:>8g} {r['resident_bytes'] / 2**20:>13.2f} "
              f"{r['baseline_resident_bytes'] / 2**20:>13.2f} {saved:>6.0%} {r['offloaded_bytes'] / 2**20:>8.2f} "
              f"{r['reloaded_bytes'] / 2**20:>8.2f} {r['step_s']:>8.3f} {r['baseline_step_s']:>10.3f} {cost:>+6.0%}"
              + (f"  per rank MiB {[round(b / 2**20, 2) for b in r['resident_bytes_per_rank']]} of "
                 f"{[round(b / 2**20, 2) for b in r['baseline_resident_bytes_per_rank']]}"
                 if "resident_bytes_per_rank" in r else ""))
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
