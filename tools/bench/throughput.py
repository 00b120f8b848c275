"""Training throughput benchmark: tokens/s, MFU and peak memory of the real training step.

    python tools/bench/throughput.py                                   # tiny model, CPU
    python tools/bench/throughput.py model=125m precision=bf16 trainer.micro_batch_size=8 \
        trainer.global_batch_size=8 --steps 30 --warmup 5                # on a GPU

Arguments without dashes are Hydra overrides of configs/config.yaml (data defaults to synthetic).
It times `Trainer.train_step` (forward, backward, clip, AdamW) after `--warmup` steps, reports the
median step and writes nothing but a temporary run dir (deleted afterwards). The learning rate's warm-up is
shortened to the steps run unless `optim.warmup_steps` is given (its schedule does not change a step's time).

`--profile N` then runs N more steps under torch.profiler and prints where their time went
(megalm/measure/kernel_profile.py): on a GPU how long it was busy at all against the wall time (the rest is
waiting on the host), the time per kind of kernel and the kernels that took most; `--profile-trace PATH` also
writes the Chrome trace. The profiled steps are not in the timed figures (the profiler slows the host).

Where the blocks compile (`trainer.compile=true`, or auto on CUDA) it also reports dynamo's own counts over all the
steps it ran: graph breaks and compiled frames (the first graph and every recompile), so a GPU row says whether its
blocks were whole graphs.

`--fp8-columns-apart` (compiled FP8): each column-major FP8 copy, wgrad's operand, is made by a kernel of its own, a
loop over the transposed shape, as before 2026-12-03, not in the kernel of its cast (inductor's layout prim,
`megalm.compat.load_inductor_layout_prim`): the A/B of that choice on a GPU, where Triton writes the copy from a
row-wise kernel uncoalesced (docs/benchmarks.md, "One H100").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from megalm.config.compose import compose_config as compose_megalm_config  # noqa: E402
from megalm.errors import ConfigError  # noqa: E402
from megalm.training.run_dir import check_creatable  # noqa: E402
from tools.bench.cli import parse_flags_and_overrides, run_main  # noqa: E402


def compose_config(overrides: list[str]):
    """megalm's config with `overrides` over synthetic data; a bad override is a one-line ConfigError."""
    base = ["data=synthetic", "trainer.eval_interval=0", "trainer.save_interval=0", "logging.tensorboard=false"]
    return compose_megalm_config(base + overrides)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="then profile N more steps and print where their time went")
    parser.add_argument("--profile-trace", type=Path, metavar="PATH",
                        help="with --profile, also write the profiler's Chrome trace here (.json)")
    parser.add_argument("--fp8-columns-apart", action="store_true",
                        help="compiled FP8: each column-major copy in a kernel of its own, not its cast's")
    args, overrides = parse_flags_and_overrides(parser, argv)
    if args.steps < 1:
        raise ConfigError(f"--steps {args.steps} must be >= 1 (the timed steps)")
    if args.warmup < 0:
        raise ConfigError(f"--warmup {args.warmup} must be >= 0 (the untimed steps first)")
    if args.profile < 0 or (args.profile_trace and not args.profile):
        parser.error("--profile takes a number of steps >= 1; --profile-trace needs --profile")
    if args.profile_trace is not None:  # before the run: the profiler overwrote a file, or failed without a word
        if args.profile_trace.exists():
            raise ConfigError(f"--profile-trace {args.profile_trace} exists; nothing was run: move it or name a new "
                              "file")
        check_creatable(args.profile_trace.parent, f"--profile-trace {args.profile_trace}",
                        "choose a --profile-trace path you may write to")
        args.profile_trace.parent.mkdir(parents=True, exist_ok=True)
    from megalm.training.metrics import peak_memory_gb
    from megalm.training.python_gc import StepBoundaryGC
    from megalm.training.trainer import Trainer

    cfg = compose_config(overrides)
    cfg.trainer.max_steps = args.warmup + args.steps + (args.profile + 1 if args.profile else 0)
    if not any(o.split("=")[0].lstrip("+~") == "optim.warmup_steps" for o in overrides):
        # the learning rate's schedule does not change a step's time: the default's warm-up (20 steps) shortened to
        # these few, where the config check warned that it never ends
        cfg.optim.warmup_steps = min(cfg.optim.warmup_steps, cfg.trainer.max_steps - 1)
    profile = None
    compiled = compile_counts() if cfg.trainer.compile is not False else None  # true, or auto (None)
    with tempfile.TemporaryDirectory() as run_dir, columns_apart(args.fp8_columns_apart):
        trainer = Trainer(cfg, run_dir)
        compiled = compiled if trainer.cfg.trainer.compile else None  # auto resolved: eager here
        device = trainer.device
        times, tokens, flops = [], [], []
        # Python's collector as fit() runs it (trainer.gc_interval): off inside the steps, collected between them
        # (untimed here: a young collection is well under a millisecond; the full ones after the first compiles
        # fall in the warm-up steps)
        with StepBoundaryGC(cfg.trainer.gc_interval) as collector:
            for step in range(args.warmup + args.steps):
                synchronize(device)
                start = time.perf_counter()
                result = trainer.train_step(step)
                synchronize(device)
                if step >= args.warmup:
                    times.append(time.perf_counter() - start)
                    tokens.append(result.tokens)
                    flops.append(result.flops)
                collector.after_step(step + 1)
            if args.profile:  # profiled as the timed steps ran
                from megalm.measure.kernel_profile import profile_steps

                profile = profile_steps(trainer.train_step, args.warmup + args.steps, args.profile, device,
                                        args.profile_trace)
    step_s = statistics.median(times)
    tok_per_step = statistics.median(tokens)
    gpus = trainer.mesh.dims.world_size  # a step's tokens and FLOPs are global: the rates per GPU divide by them all
    report = {
        "model": cfg.model.name,
        "precision": cfg.precision.name,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "params_m": sum(p.numel() for p in trainer.model.parameters()) / 1e6,
        "tokens_per_step": tok_per_step,
        "step_seconds": step_s,
        "world_size": gpus,
        "tokens_per_sec": tok_per_step / step_s,  # the job's
        "tokens_per_sec_per_gpu": tok_per_step / step_s / gpus,
        "tflops_per_sec": statistics.median(flops) / step_s / gpus / 1e12,  # per GPU, as MFU
        "mfu": statistics.median(flops) / step_s / (trainer.peak * gpus) if trainer.peak else None,
        "peak_memory_gib": peak_memory_gb(device),
    }
    if compiled is not None:
        report["compile"] = compiled()
    report["fp8_columns_apart"] = args.fp8_columns_apart
    print(f"{report['model']} {report['precision']} on {report['device']}: {report['params_m']:.1f}M params, "
          f"{tok_per_step:.0f} tokens/step, {step_s * 1e3:.1f} ms/step, {report['tokens_per_sec']:,.0f} tokens/s, "
          + (f"{report['tokens_per_sec_per_gpu']:,.0f} a GPU of {gpus}, " if gpus > 1 else "")
          + f"{report['tflops_per_sec']:.2f} TFLOP/s" + (" a GPU" if gpus > 1 else "")
          + (f", MFU {100 * report['mfu']:.1f}%" if report["mfu"] else ", MFU n/a (no peak for this device)")
          + f", peak memory {report['peak_memory_gib']:.2f} GiB")
    if compiled is not None:
        counts = report["compile"]
        print(f"dynamo over the run: {counts['graph_breaks']} graph breaks, {counts['frames']} frames compiled, "
              f"{counts['failed_frames']} failed (run eager)"
              + "".join(f"\n  break: {reason}" for reason in counts["break_reasons"]))
    if profile is not None:
        from megalm.measure.kernel_profile import format_profile

        profile.unprofiled_ms = step_s * 1e3
        print(format_profile(profile))
        report["profile"] = profile.as_dict()
    if args.json:
        print(json.dumps(report))
    return report


@contextlib.contextmanager
def columns_apart(apart: bool) -> Iterator[None]:
    """With `apart`, compiled FP8 graphs traced inside make their column-major copies without inductor's layout prim
    (`--fp8-columns-apart`): compiling blocks loads it, so it is taken away for as long as the block lasts and then
    restored."""
    from megalm import compat

    if not apart:
        yield
        return
    load = compat.load_inductor_layout_prim
    compat.load_inductor_layout_prim = lambda: None
    saved, compat.inductor_force_strides = compat.inductor_force_strides, None
    try:
        yield
    finally:
        compat.load_inductor_layout_prim, compat.inductor_force_strides = load, saved


def compile_counts():
    """Start counting dynamo's graph breaks and compiled frames over the whole run (its own counters; dynamo is reset
    first, so nothing compiled earlier in the process is reused uncounted); returns what reads them: {"graph_breaks",
    "frames" (compiled), "failed_frames" (dynamo gave up and ran them eager), "break_reasons" (the first line of each
    distinct reason)}. The blocks are most of the frames; on a GPU, FP8's weight casts outside them are another."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    def read() -> dict:
        reasons, frames = counters["graph_break"], counters["frames"]
        return {"graph_breaks": sum(reasons.values()), "frames": frames["ok"],
                "failed_frames": frames["total"] - frames["ok"],
                "break_reasons": sorted({reason.splitlines()[0][:160] for reason in reasons})}
    return read


if __name__ == "__main__":
    run_main(main)
