"""Training throughput benchmark: tokens/s, MFU and peak memory of the real training step.

    python tools/bench/throughput.py                                   # tiny model, CPU
    python tools/bench/throughput.py model=125m precision=bf16 trainer.micro_batch_size=8 \
        trainer.global_batch_size=8 --steps 30 --warmup 5                # on a GPU

Arguments without dashes are Hydra overrides of configs/config.yaml (data defaults to synthetic).
It times `Trainer.train_step` (forward, backward, clip, AdamW) after `--warmup` steps, reports the
median step and writes nothing but a temporary run dir (deleted afterwards).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megalm.config import register_schema, to_dataclass  # noqa: E402
from megalm.train import CONFIG_DIR  # noqa: E402


def compose_config(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    register_schema()
    base = ["data=synthetic", "trainer.eval_interval=0", "trainer.save_interval=0", "logging.tensorboard=false"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return to_dataclass(compose(config_name="config", overrides=base + overrides))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    argv = sys.argv[1:] if argv is None else argv
    # Hydra overrides (key=value) may follow a list flag (--seq 1024 2048 model=125m): set them aside first.
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    args = parser.parse_args([a for a in argv if a not in overrides])
    from megalm.training.metrics import peak_memory_gb
    from megalm.training.trainer import Trainer

    cfg = compose_config(overrides)
    cfg.trainer.max_steps = args.warmup + args.steps
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(cfg, run_dir)
        device = trainer.device
        times, tokens, flops = [], [], []
        for step in range(args.warmup + args.steps):
            synchronize(device)
            start = time.perf_counter()
            result = trainer.train_step(step)
            synchronize(device)
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
                tokens.append(result.tokens)
                flops.append(result.flops)
    step_s = statistics.median(times)
    tok_per_step = statistics.median(tokens)
    report = {
        "model": cfg.model.name,
        "precision": cfg.precision.name,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "params_m": sum(p.numel() for p in trainer.model.parameters()) / 1e6,
        "tokens_per_step": tok_per_step,
        "step_seconds": step_s,
        "tokens_per_sec": tok_per_step / step_s,
        "tflops_per_sec": statistics.median(flops) / step_s / 1e12,
        "mfu": statistics.median(flops) / step_s / trainer.peak if trainer.peak else None,
        "peak_memory_gib": peak_memory_gb(device),
    }
    print(f"{report['model']} {report['precision']} on {report['device']}: {report['params_m']:.1f}M params, "
          f"{tok_per_step:.0f} tokens/step, {step_s * 1e3:.1f} ms/step, {report['tokens_per_sec']:,.0f} tokens/s, "
          f"{report['tflops_per_sec']:.2f} TFLOP/s"
          + (f", MFU {100 * report['mfu']:.1f}%" if report["mfu"] else ", MFU n/a (no peak for this device)")
          + f", peak memory {report['peak_memory_gib']:.2f} GiB")
    if args.json:
        print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
