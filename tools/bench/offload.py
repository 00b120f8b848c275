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
same step without offload (time measured in turns with the others, memory by the same probe).
Then, from the schedules alone, the pipeline policies' peak in micro-batch-chunks per rank (p=4, m=8, the
three schedules), which is what the pipeline tests check a real run against. The last line is one JSON
object: {"rows": [{"policy", "fraction", "device_peak_bytes", "baseline_device_peak_bytes", "host_bytes",
"allocator_peak_bytes", "baseline_allocator_peak_bytes", "offloaded_bytes", "reloaded_bytes", "step_s",
"baseline_step_s"}, ...], "pipeline": [...]}. The memory columns are the live-storage probe's measurement of one
counted step (`counted_step`), and on CUDA the allocator's peak beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from throughput import compose_config, synchronize  # noqa: E402

from tools.bench.cli import check_counts, parse_flags_and_overrides, run_main  # noqa: E402


def counted_step(trainer, step: int) -> dict:
    """One training step measured by the live-storage probe (megalm.measure.LiveStorages), not by the offload
    store's counters: the peak bytes of the storages the step creates on the device (activations, logits, stage
    inputs, gradients in flight, communication buffers; the weights, gradient buckets and optimizer states made
    before it are not counted), and the host bytes of the offload pool (its buffers, made in earlier steps, plus
    any it allocates now; on a CPU the pool's allocations are labelled host, the device being the same memory).
    On CUDA the allocator's own peak above the step's start is reported beside it."""
    import torch

    from megalm.measure import LiveStorages

    store, cuda = trainer.parallel.offload_store, trainer.device.type == "cuda"
    synchronize(trainer.device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(trainer.device)
        before = torch.cuda.memory_allocated(trainer.device)
    with LiveStorages() as probe, contextlib.ExitStack() as stack:
        if store is not None:
            with probe.labelled("host"):
                # the pool's buffers from earlier steps: free, and (CUDA) those still waiting on their last copy's
                # event, which the counted step reuses too (only the free ones were tracked: ~0 host bytes on a GPU)
                probe.track([*(buffer for buffers in store.pool.free.values() for buffer in buffers),
                             *(buffer for buffer, _ in store.pool.pending)])
            stack.enter_context(probe.labelling(store.pool, "allocate", "host"))
        trainer.train_step(step)
        synchronize(trainer.device)
    allocator = torch.cuda.max_memory_allocated(trainer.device) - before if cuda else None
    return {"device": probe.peak(trainer.device.type), "host": probe.peak("host"), "allocator": allocator}


def measured_rows(overrides: list[str], variants: list[tuple[str, float]], steps: int, warmup: int) -> list[dict]:
    """Every (policy, fraction) variant and the baseline built side by side, their steps timed in turns
    (A B C A B C) so that the machine's drift hits all alike; then one counted step each. pp = 1 runs
    layer-wise offload (policy "layers"), pp > 1 the pipeline policies; under torch.distributed each rank
    measures its own store and rank 0 reports the largest peak over the ranks (the one that limits)."""
    import torch.distributed as dist

    from megalm.training.trainer import Trainer

    with tempfile.TemporaryDirectory() as run_dir:
        runs = {}
        for variant in [None, *variants]:
            extra = [] if variant is None else ["offload.enabled=true", f"offload.fraction={variant[1]}"] + (
                [] if variant[0] == "layers" else [f"offload.policy={variant[0]}"])
            cfg = compose_config(["trainer.compile=false", *overrides, *extra])  # eager unless asked: offload's bytes
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
        for trainer in runs.values():  # the bytes copied in the counted step alone
            if (store := trainer.parallel.offload_store) is not None:
                store.offloaded_bytes = store.reloaded_bytes = store.sync_reloads = 0
        counted = {variant: counted_step(trainer, warmup + steps) for variant, trainer in runs.items()}
        baseline = counted.pop(None)
        rows = []
        for (policy, fraction), measured in counted.items():
            store = runs[(policy, fraction)].parallel.offload_store
            rows.append({"policy": policy, "fraction": fraction, "device_peak_bytes": measured["device"],
                         "baseline_device_peak_bytes": baseline["device"], "host_bytes": measured["host"],
                         "allocator_peak_bytes": measured["allocator"],
                         "baseline_allocator_peak_bytes": baseline["allocator"],
                         "offloaded_bytes": store.offloaded_bytes, "reloaded_bytes": store.reloaded_bytes,
                         "step_s": statistics.median(times[(policy, fraction)]),
                         "baseline_step_s": statistics.median(times[None]), "sync_reloads": store.sync_reloads})
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, rows)
        for i, row in enumerate(rows):
            per_rank = [r[i] for r in everyone]
            row["device_peak_bytes_per_rank"] = [r["device_peak_bytes"] for r in per_rank]
            row["baseline_device_peak_bytes_per_rank"] = [r["baseline_device_peak_bytes"] for r in per_rank]
            for key in ("device_peak_bytes", "baseline_device_peak_bytes", "host_bytes", "step_s", "baseline_step_s"):
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
    from tools.bench.ranks import free_port, run_cpu_ranks

    variants = [(policy, f) for policy in ("uniform", "lifespan", "auto") for f in fractions]
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/rows.json"
        run_cpu_ranks(_pipeline_worker, pp, pp, free_port(), [*overrides, f"parallel.pp={pp}", "trainer.device=cpu"],
                      variants, steps, warmup, out)
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


RESIDENT_NOTE = """\
device MiB: the step's peak of live device storages, measured by the live-storage probe (its own count of the
storages the step creates, not the offload store's counters), logits, stage inputs and gradients in flight
included; the weights, gradient buckets and optimizer states, made before the step, are not in it. What stays
on the device with offload, and why: the blocks not chosen (layer offload keeps the last ones: their backward
comes first), a pipeline stage's received input (the runtime holds it to send its gradient back), the batch's
integer tensors (token ids, positions: the micro-batch holds them all step), tensors under
offload.min_tensor_bytes, the logits and the loss's buffers (after the last block), and the gradients of the
backward in flight. host MiB: the offload pool's buffers (kept and reused across steps)."""


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    parser.add_argument("--pp", type=int, default=1, help="pp > 1: that many gloo processes on the CPU, one "
                        "pipeline, every offload policy (on a GPU machine with one device, use pp = 1)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    args, overrides = parse_flags_and_overrides(parser, argv)
    check_counts(args, "steps")
    if args.pp > 1:
        rows = pipeline_measured_rows(overrides, args.pp, args.fractions, args.steps, args.warmup)
    else:
        rows = measured_rows(overrides, [("layers", f) for f in args.fractions], args.steps, args.warmup)
    print(f"{'policy':>8} {'fraction':>8} {'device MiB':>11} {'baseline MiB':>13} {'saved':>6} {'host MiB':>9} "
          f"{'D2H MiB':>8} {'H2D MiB':>8} {'step s':>8} {'baseline s':>10} {'cost':>6}")
    for r in rows:
        saved = 1 - r["device_peak_bytes"] / r["baseline_device_peak_bytes"]
        cost = r["step_s"] / r["baseline_step_s"] - 1
        print(f"{r['policy']:>8} {r['fraction']:>8g} {r['device_peak_bytes'] / 2**20:>11.2f} "
              f"{r['baseline_device_peak_bytes'] / 2**20:>13.2f} {saved:>6.0%} {r['host_bytes'] / 2**20:>9.2f} "
              f"{r['offloaded_bytes'] / 2**20:>8.2f} {r['reloaded_bytes'] / 2**20:>8.2f} {r['step_s']:>8.3f} "
              f"{r['baseline_step_s']:>10.3f} {cost:>+6.0%}"
              + (f"  per rank MiB {[round(b / 2**20, 2) for b in r['device_peak_bytes_per_rank']]} of "
                 f"{[round(b / 2**20, 2) for b in r['baseline_device_peak_bytes_per_rank']]}"
                 if "device_peak_bytes_per_rank" in r else ""))
    print(RESIDENT_NOTE)
    pipeline = pipeline_rows(sorted({0.25, 0.375, 0.5, 1.0} | set(args.fractions)))
    print("\npipeline peaks (micro-batch-chunks per rank, p=4, m=8; from the schedules):")
    for r in pipeline:
        print(f"  {r['schedule']:>11} {r['policy']:>8} {r['fraction']:>6g}: {r['peak_units']} "
              f"(no offload {r['baseline_peak_units']})")
    result = {"rows": rows, "pipeline": pipeline}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    run_main(main)
