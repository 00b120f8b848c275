"""Per-rank static bytes of plain DP, ZeRO-1 and FSDP, measured, beside megalm's closed forms.

    python tools/bench/fsdp_memory.py --dp 4 8 64 --models 8b 70b --estimate-dp 4 8 64

Static bytes: what a rank holds between steps, with precision=bf16 (megalm's recipe): weights, gradient buffers, fp32
main weights and Adam's moments. Each figure is the live-storage probe's (megalm.measure.LiveStorages), nothing read
from the layout's own bookkeeping:
- the tiny model (configs/model/tiny.yaml): a real run of `dp` gloo processes on this machine, real tensors and
  collectives; rank 0's bytes live after its first optimizer step (`megalm.estimate.run_step`);
- 8B and 70B: megalm-estimate's rank 0 under fake tensors (params, gradient buffers, optimizer states and the
  buffers of collectives in flight; it equals a real run to the byte: tests/dist/test_estimate_measured.py).

Closed forms (Ψ parameters, N data-parallel ranks; bf16 working weights, fp32 main weights and gradients, Adam):
- plain DP   2Ψ (bf16 weights) + 4Ψ (fp32 gradient buckets) + 12Ψ (fp32 main weights, two moments) = 18Ψ
- ZeRO-1     2Ψ + 4Ψ + 12Ψ/N (the optimizer's fp32 state sharded) + 4Ψ/N (megalm reduce-scatters each bucket
             into a shard buffer of its own) + 2Ψ + 2Ψ/N (the bf16 all-gather's buffers, in flight into the next
             forward under parallel.overlap_param_gather, the default)                           = 8Ψ + 18Ψ/N
- FSDP       12Ψ/N: the fp32 shard is the main weight, and its moments; no bf16 copy persists (FSDP gathers one per
             unit and frees it). The fp32 gradient shards, 4Ψ/N, live from the step's first backward to zero_grad,
             so 16Ψ/N while a step runs, plus the gathered units (bf16: 2 bytes x the units in flight).
Shards are padded: FSDP chunks each parameter's rows (ceil(rows/N) per rank), ZeRO-1 pads each bucket to a multiple
of N; the closed forms use those padded counts, so they meet the measurement exactly where nothing else is live.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megalm.config.compose import compose_config  # noqa: E402
from megalm.estimate import rank as estimate  # noqa: E402
from megalm.measure import LiveStorages  # noqa: E402
from tools.bench.cli import run_main  # noqa: E402
from tools.bench.ranks import free_port, run_cpu_ranks  # noqa: E402

LAYOUTS = {"plain DP": [], "ZeRO-1": ["parallel.zero1=true"], "FSDP": ["parallel.fsdp=true"]}
COMMON = ["precision=bf16", "trainer.device=cpu", "trainer.micro_batch_size=1", "model.seq_length=64"]


def closed_form(layout: str, shapes: list[torch.Size], n: int) -> int:
    """The layout's static bytes for parameters of `shapes` over `n` data-parallel ranks (module docstring)."""
    psi = sum(math.prod(s) for s in shapes)
    if layout == "plain DP":
        return 18 * psi
    if layout == "ZeRO-1":
        return 8 * psi + 18 * math.ceil(psi / n)
    return 12 * sum(math.ceil(s[0] / n) * math.prod(s[1:]) for s in shapes)


def _measure(rank: int, world: int, port: int, overrides: list[str], out: str) -> None:
    """One rank of the real run: its bytes live after the first optimizer step, and its parameters' shapes."""
    import contextlib

    from megalm.training.trainer import Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        live = LiveStorages()
        with tempfile.TemporaryDirectory() as run_dir:
            with live:
                trainer = Trainer(compose_config(overrides), run_dir)
            estimate.run_step(trainer, 0, contextlib.nullcontext(), live)
            if rank == 0:
                shapes = [list(p.shape) for p in trainer.model.parameters()]
                Path(out).write_text(json.dumps({"static": live.bytes("cpu"), "shapes": shapes}))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def measured_tiny(layout: str, dp: int) -> tuple[int, list[torch.Size]]:
    """Rank 0's static bytes in a real `dp`-rank gloo run of the tiny model, and its parameter shapes."""
    overrides = ["model=tiny", *COMMON, f"parallel.dp={dp}", f"trainer.global_batch_size={dp}", *LAYOUTS[layout]]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        run_cpu_ranks(_measure, dp, dp, free_port(), overrides, out)
        result = json.loads(Path(out).read_text())
    return result["static"], [torch.Size(s) for s in result["shapes"]]


def estimated(model: str, layout: str, dp: int) -> tuple[int, int]:
    """megalm-estimate's rank 0 of `dp` ranks: (static bytes, peak bytes without the reserve)."""
    overrides = [f"model={model}", *COMMON, "model.seq_length=256", f"trainer.global_batch_size={dp}",
                 *LAYOUTS[layout]]
    r = estimate.estimate_rank(overrides, dp, 0, "only stage", "h100")
    return r.param_bytes + r.grad_bytes + r.optimizer_bytes + r.comm_bytes, r.peak_bytes - r.reserve_bytes


def model_shapes(model: str) -> list[torch.Size]:
    from megalm.config import resolve_model_defaults
    from megalm.model import GPT

    cfg = compose_config([f"model={model}"]).model
    resolve_model_defaults(cfg)
    return [p.shape for p in GPT(cfg, device="meta").parameters()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[4, 8], help="real gloo runs of the tiny model")
    parser.add_argument("--models", nargs="*", default=["8b", "70b"], help="estimated under fake tensors")
    parser.add_argument("--estimate-dp", type=int, nargs="+", default=[4, 8, 64])
    args = parser.parse_args()
    gib = 2**30
    print("| model | layout | dp | measured static | closed form | measured / closed | how |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for dp in args.dp:
        for layout in LAYOUTS:
            static, shapes = measured_tiny(layout, dp)
            form = closed_form(layout, shapes, dp)
            print(f"| tiny | {layout} | {dp} | {static / 2**20:.3f} MiB | {form / 2**20:.3f} MiB | "
                  f"{static / form:.4f} | real gloo run |", flush=True)
    for model in args.models:
        shapes = model_shapes(model)
        for dp in args.estimate_dp:
            for layout in LAYOUTS:
                static, peak = estimated(model, layout, dp)
                form = closed_form(layout, shapes, dp)
                print(f"| {model} | {layout} | {dp} | {static / gib:.2f} GiB | {form / gib:.2f} GiB | "
                      f"{static / form:.4f} | megalm-estimate (step peak {peak / gib:.1f} GiB) |", flush=True)


if __name__ == "__main__":
    run_main(main)
