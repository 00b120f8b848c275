"""A transformer layer's GEMMs at a model's shapes, bf16 against FP8 (torch._scaled_mm) with and without fast
accumulation: how much of the 2x the FP8 tensor cores promise a layer's GEMMs get, and what fast accumulation adds.

    python tools/bench/fp8_gemms.py model=1.3b model.seq_length=4096 trainer.micro_batch_size=2   # on an H100/H200
    python tools/bench/fp8_gemms.py model=tiny --iters 2 --warmup 1 --json

Each linear layer of one transformer block (its weight shapes, from the model built on the meta device: the fused
q/k/v, the attention output, the fused gate/up, the down projection) at T = seq_length x micro_batch_size tokens runs
its three GEMMs in the layouts megalm's FP8 linears give torch._scaled_mm (megalm/precision/compiled_linear.py):

    fprop  y  = x W^T    x [T, in] E4M3 row-major, W's row-major copy read as [in, out] column-major
    dgrad  dx = dy W     dy [T, out] E5M2, W's column-major copy
    wgrad  dW = dy^T x   dy written column-major and x column-major (the cast writes both layouts)

in bf16 (torch.mm), and in FP8 with every GEMM promoting its partial sums to fp32 (`promote`: megalm's fp8 recipes
before 2026-12-03), with fast accumulation in fprop only (`megalm`: the fp8 recipes now, as Transformer Engine's and
torchao's float8: megalm/precision/fp8.py), and in all three (`fast`: a bound, not a recipe). Each GEMM is timed from
an idle device (tools/bench/timing.py, median of --iters); TFLOP/s against the dense peaks (bf16 989, FP8 1,979 on
H100/H200). The block's total times the layers is the step's share of these GEMMs (the output head, bf16 in the fp8
recipes, apart). On a CPU the times are the CPU's (torch's _scaled_mm CPU kernel, where torch has one), not a GPU's:
the dry run of the tool.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megalm.config.checks import resolve_model_defaults  # noqa: E402
from megalm.model.gpt import GPT  # noqa: E402
from megalm.model.linear import Linear  # noqa: E402
from megalm.precision.fp8 import column_major  # noqa: E402
from megalm.training.flops import peak_flops  # noqa: E402
from tools.bench.cli import add_timing_flags, check_counts, parse_flags_and_overrides, run_main  # noqa: E402
from tools.bench.throughput import compose_config  # noqa: E402
from tools.bench.timing import time_calls  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
GEMMS = ("fprop", "dgrad", "wgrad")
# which GEMMs accumulate fast in each FP8 setting (module docstring)
SETTINGS = {"promote": (), "megalm": ("fprop",), "fast": GEMMS}


def block_linears(overrides: list[str]) -> tuple[list[tuple[str, int, int]], int, int]:
    """([(name, out, in)] of one transformer block's linear layers, the model's layer count, T tokens)."""
    cfg = compose_config(overrides)
    model_cfg = resolve_model_defaults(cfg.model)
    with torch.device("meta"):
        model = GPT(model_cfg)
    linears = [(name, *m.weight.shape) for name, m in model.layers[0].named_modules() if isinstance(m, Linear)]
    return linears, model_cfg.num_layers, model_cfg.seq_length * cfg.trainer.micro_batch_size


def operands(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> dict[str, dict[str, tuple]]:
    """{"bf16" | "fp8": {gemm: (a, b)}} of a layer with input x [T, in], weight w [out, in] and output gradient
    dy [T, out]: a [M, K] row-major and b [K, N] column-major, as the layer's GEMMs take them (unit scales)."""
    bf16 = {"fprop": (x, w.t()), "dgrad": (dy, w), "wgrad": (dy.t(), x)}
    bf16 = {gemm: (a.bfloat16().contiguous(), column_major(b.bfloat16())) for gemm, (a, b) in bf16.items()}
    fp8 = {"fprop": (x.to(E4M3), w.to(E4M3).t()), "dgrad": (dy.to(E5M2), column_major(w.to(E4M3))),
           "wgrad": (column_major(dy.to(E5M2)).t(), column_major(x.to(E4M3)))}
    return {"bf16": bf16, "fp8": fp8}


def scaled_mm_runs(device: torch.device) -> str | None:
    """Why torch._scaled_mm cannot run here, or None."""
    one, q = torch.ones((), device=device), torch.zeros(16, 16, dtype=E4M3, device=device)
    try:
        torch._scaled_mm(q, q.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except (AttributeError, NotImplementedError, RuntimeError) as error:
        return str(error).splitlines()[0]
    return None


def peak(device: torch.device, kind: str) -> float | None:
    """Dense peak FLOP/s of this GPU for bf16 or fp8 (twice bf16 on Hopper), None on a CPU or unknown GPU."""
    bf16 = peak_flops(device, "bf16")
    return None if bf16 is None else bf16 * (2 if kind == "fp8" else 1)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_flags(parser, "calls of each GEMM", iters=20, warmup=5)
    parser.add_argument("--back-to-back", type=int, default=10,
                        help="GEMMs launched back to back in one timed call, its time divided among them (default "
                             "10): one GEMM of a 1.3b block is tens of microseconds, which the host's launch work "
                             "before it would otherwise add to")
    args, overrides = parse_flags_and_overrides(parser, argv)
    check_counts(args, "iters")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    linears, layers, tokens = block_linears(overrides)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    no_fp8 = scaled_mm_runs(device)
    print(f"{len(linears)} linear layers a block, {layers} blocks, {tokens} tokens a micro-batch, on {name}"
          + (f"; FP8 skipped: torch._scaled_mm does not run here ({no_fp8})" if no_fp8 else ""))
    one = torch.ones((), device=device)
    rows, block_ms = [], dict.fromkeys(("bf16", *SETTINGS), 0.0)
    for layer, out, inp in linears:
        ops = operands(*(torch.randn(*shape, device=device) for shape in ((tokens, inp), (out, inp), (tokens, out))))
        flops = 2 * tokens * out * inp
        row = {"layer": layer, "shape": [tokens, out, inp]}
        def ms_each(gemm_call) -> float:  # noqa: ANN001 - a GEMM's call
            repeated = lambda: [gemm_call() for _ in range(args.back_to_back)]  # noqa: E731
            return statistics.median(time_calls(repeated, device, args.warmup, args.iters)) / args.back_to_back

        for gemm in GEMMS:
            a, b = ops["bf16"][gemm]
            times = {"bf16": ms_each(lambda a=a, b=b: torch.mm(a, b))}
            if not no_fp8:
                qa, qb = ops["fp8"][gemm]
                for fast in (False, True):
                    times[f"fp8_fast={fast}"] = ms_each(lambda qa=qa, qb=qb, fast=fast: torch._scaled_mm(
                        qa, qb, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=fast))
            row[gemm] = {kind: {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12} for kind, ms in times.items()}
            block_ms["bf16"] += times["bf16"]
            if not no_fp8:
                for setting, fast_gemms in SETTINGS.items():
                    block_ms[setting] += times[f"fp8_fast={gemm in fast_gemms}"]
        rows.append(row)
        cells = "  ".join(f"{gemm} " + " / ".join(f"{v['tflops']:6.1f}" for v in row[gemm].values()) for gemm in GEMMS)
        print(f"  {layer:18s} [{tokens}x{out}x{inp}]  TFLOP/s bf16 / fp8 / fp8 fast:  {cells}")
    peaks = {kind: peak(device, kind) for kind in ("bf16", "fp8")}
    flops_block = sum(3 * 2 * tokens * out * inp for _, out, inp in linears)
    summary = {}
    for setting, ms in block_ms.items():
        if setting != "bf16" and no_fp8:
            continue
        tflops = flops_block / (ms * 1e-3) / 1e12
        kind = "bf16" if setting == "bf16" else "fp8"
        summary[setting] = {"block_ms": ms, "step_ms": ms * layers, "tflops": tflops,
                            "of_peak": None if peaks[kind] is None else tflops * 1e12 / peaks[kind],
                            "vs_bf16": block_ms["bf16"] / ms}
        share = "" if peaks[kind] is None else f", {summary[setting]['of_peak']:.0%} of the {kind} peak"
        print(f"  {setting:8s} {ms:8.3f} ms a block, {ms * layers:8.2f} ms the {layers} blocks: {tflops:6.1f} TFLOP/s"
              f"{share}, {summary[setting]['vs_bf16']:.2f}x bf16")
    report = {"device": name, "tokens": tokens, "layers": layers, "fp8_skipped": no_fp8, "rows": rows,
              "summary": summary}
    if args.json:
        print(json.dumps(report))
    return report


if __name__ == "__main__":
    run_main(main)
