"""The optimizer step over a model's parameters: torch's fused AdamW plus the working-copy cast, against megalm's
one-pass Triton kernel (`optim.implementation=triton`, megalm/parallel/data_parallel/adamw_kernel.py).

    python tools/bench/adamw_kernels.py model=1.3b                 # on a GPU: the 1.3B model's 1.42B parameters
    python tools/bench/adamw_kernels.py model=tiny --iters 2 --warmup 1 --json

Each parameter of the model (its shapes, built on the meta device) is a segment of flat fp32 main weights,
gradients and moments with a bf16 working copy of its own, as BucketAdamW holds them without ZeRO-1; the clip's
scale is folded into the step. `torch`: torch's fused AdamW over the segments with the scale (it writes the
unscaled gradients back), then `_foreach_copy_` of the main weights into the bf16 copies, as BucketAdamW steps
with `optim.implementation=auto`: 38 bytes a parameter. `triton`: the one pass, 30 bytes. Both are timed from an
idle device (tools/bench/timing.py, median of --iters); GB/s is those bytes over the time, against the HBM peak
(H100 3.35 TB/s, H200 4.8 TB/s). On a CPU without TRITON_INTERPRET=1 the triton row is skipped, saying why (the
interpreter times Python, not the kernel).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from torch.optim.adamw import adamw

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megalm.config.checks import resolve_model_defaults  # noqa: E402
from megalm.model.gpt import GPT  # noqa: E402
from megalm.parallel.data_parallel import adamw_kernel  # noqa: E402
from tools.bench.cli import add_timing_flags, check_counts, parse_flags_and_overrides, run_main  # noqa: E402
from tools.bench.throughput import compose_config  # noqa: E402
from tools.bench.timing import time_calls  # noqa: E402

HYPER = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
BYTES_PER_PARAM = {"torch": 38, "triton": 30}  # module docstring


def segments(overrides: list[str]) -> list[int]:
    """The element counts of the model's parameters (built on the meta device: no memory)."""
    model_cfg = resolve_model_defaults(compose_config(overrides).model)
    with torch.device("meta"):
        model = GPT(model_cfg)
    return [p.numel() for p in model.parameters()]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_flags(parser, "steps", iters=10, warmup=3, warmup_note=" (compiles the kernel)")
    args, overrides = parse_flags_and_overrides(parser, argv)
    check_counts(args, "iters")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes = segments(overrides)
    n = sum(sizes)
    flat = [torch.randn(n, device=device), torch.randn(n, device=device), torch.zeros(n, device=device),
            torch.zeros(n, device=device)]
    parts = [list(t.split(sizes)) for t in flat]  # main, grad, m, v: one view per parameter
    work = [torch.empty(size, dtype=torch.bfloat16, device=device) for size in sizes]
    scale = torch.tensor(1.5, device=device)
    step = [0]

    def torch_step() -> None:
        step[0] += 1
        counters = list(torch.full((len(sizes),), float(step[0] - 1), device=device).unbind())
        adamw(*parts, [], counters, fused=True, grad_scale=scale, amsgrad=False, maximize=False, **HYPER)
        torch._foreach_copy_(work, parts[0])

    def triton_step() -> None:
        step[0] += 1
        for main, grad, m, v, copy in zip(*parts, work, strict=True):
            adamw_kernel.adamw_step_(main, grad, m, v, copy, step=step[0], grad_scale=scale, **HYPER)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{len(sizes)} parameters, {n / 1e6:.1f}M elements, on {name}")
    rows = {}
    for kernel, call in (("torch", torch_step), ("triton", triton_step)):
        if kernel == "triton" and not adamw_kernel.runnable(device):
            rows[kernel] = {"skipped": f"the Triton kernel cannot run on {device.type} (CUDA, or TRITON_INTERPRET=1)"}
            print(f"  {kernel:7s} skipped: {rows[kernel]['skipped']}")
            continue
        ms = statistics.median(time_calls(call, device, args.warmup, args.iters))
        gbps = BYTES_PER_PARAM[kernel] * n / (ms * 1e-3) / 1e9
        rows[kernel] = {"ms": ms, "gbytes_per_s": gbps}
        print(f"  {kernel:7s} {ms:9.3f} ms  {gbps:8.1f} GB/s ({BYTES_PER_PARAM[kernel]} bytes a parameter)")
    if "ms" in rows.get("triton", {}):
        print(f"  triton / torch: {rows['torch']['ms'] / rows['triton']['ms']:.2f}x faster")
    report = {"device": name, "parameters": n, "segments": len(sizes), "rows": rows}
    if args.json:
        print(json.dumps(report))
    return report


if __name__ == "__main__":
    run_main(main)
