"""MX quantization bandwidth: the fused Triton kernel against the PyTorch reference, on a GPU.

    python tools/bench/mx_quantize_bandwidth.py                       # [8192, 8192] bf16, all cases
    python tools/bench/mx_quantize_bandwidth.py --m 4096 --k 16384 --json

Cases: the mxfp4 recipe's operand quantization (E2M1, floor scales, RHT of 64, stochastic rounding) to
the dequantized bf16 tensor that the emulated GEMM reads and to the packed form (FP4 codes two per byte,
E8M0 scales); E2M1 round-to-nearest without RHT; MXFP8 (E4M3, ceil scales). Each case is timed with CUDA
events (median of --iters after --warmup), and reports achieved GB/s = (bytes read + bytes written) / time
against the device's HBM bandwidth (H100 SXM ~3.35 TB/s, H200 ~4.8 TB/s; --peak-gbps overrides). The
input is larger than L2, so every iteration streams from HBM. The reference is `hadamard.rht` +
`mx.mx_quantize_dequantize` / `mx.mx_quantize`; its bytes are counted the same way (its real traffic is
many times more, which is the point). Round-to-nearest cases are also checked against the reference
(mismatching elements; 0 expected without RHT, a handful at most with it: summation order).

On a machine without CUDA it prints that it needs a GPU and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megalm.precision.hadamard import random_signs, rht  # noqa: E402
from megalm.precision.mx import mx_quantize, mx_quantize_dequantize  # noqa: E402
from tools.bench.cli import check_counts, run_main  # noqa: E402
from tools.bench.timing import time_calls  # noqa: E402

# HBM bandwidth in GB/s by device-name substring, most specific first
PEAK_GBPS = [("H100 PCIe", 2000.0), ("H100 NVL", 3900.0), ("H100", 3350.0), ("H200", 4800.0), ("GH200", 4000.0),
             ("B200", 8000.0), ("B100", 8000.0), ("A100-SXM4-80GB", 2039.0), ("A100", 1555.0)]

# name, fmt, rounding, scale_mode, rht, packed
CASES = [
    ("mxfp4 SR+RHT -> bf16", "e2m1", "stochastic", "floor", True, False),
    ("mxfp4 SR+RHT -> packed", "e2m1", "stochastic", "floor", True, True),
    ("mxfp4 RTN -> bf16", "e2m1", "nearest", "floor", False, False),
    ("mxfp4 RTN+RHT -> packed", "e2m1", "nearest", "floor", True, True),
    ("mxfp8 ceil -> bf16", "e4m3", "nearest", "ceil", False, False),
    ("mxfp8 ceil -> packed", "e4m3", "nearest", "ceil", False, True),
]
CONFIGS = [(16, 4), (32, 4), (64, 4), (64, 8), (128, 8)]  # (block_m, num_warps) swept for the best


def peak_gbps(name: str) -> float | None:
    return next((gbps for key, gbps in PEAK_GBPS if key in name), None)


def time_ms(fn, warmup: int, iters: int) -> float:
    return statistics.median(time_calls(fn, torch.device("cuda", torch.cuda.current_device()), warmup, iters))


def nbytes(out) -> int:
    if isinstance(out, torch.Tensor):
        return out.numel() * out.element_size()
    return out.codes.numel() + out.scales.numel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=8192)
    parser.add_argument("--k", type=int, default=8192)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--peak-gbps", type=float, default=None, help="HBM bandwidth to compare with, GB/s")
    parser.add_argument("--no-reference", action="store_true", help="skip timing the PyTorch reference")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args(argv)
    check_counts(args, "iters")

    if not torch.cuda.is_available():
        print("mx_quantize_bandwidth: needs a CUDA GPU (the Triton kernel's CPU interpreter is for tests, "
              "not timing); nothing to do.")
        return 0
    from megalm.precision.kernels.mx_triton import mx_quantize_triton, native_mx_scaled_mm_available

    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    peak = args.peak_gbps or peak_gbps(name)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(args.m, args.k, device=device, dtype=dtype, generator=gen)
    signs = random_signs(64, gen)
    in_bytes = x.numel() * x.element_size()
    print(f"device: {name}, HBM peak: {peak or 'unknown'} GB/s; x [{args.m}, {args.k}] {args.dtype}; "
          f"native MX scaled_mm: mxfp8 {native_mx_scaled_mm_available(device, 'e4m3')}, "
          f"mxfp4 {native_mx_scaled_mm_available(device, 'e2m1')}")
    results = []
    for case, fmt, rounding, scale_mode, use_rht, packed in CASES:
        s = signs if use_rht else None

        def kernel(block_m=None, num_warps=None, fmt=fmt, rounding=rounding, scale_mode=scale_mode, s=s,
                   packed=packed):
            return mx_quantize_triton(x, fmt, rounding, scale_mode, rht_signs=s, seed=1, packed=packed,
                                      out_dtype=None if packed else dtype, block_m=block_m, num_warps=num_warps)

        def reference(fmt=fmt, rounding=rounding, scale_mode=scale_mode, use_rht=use_rht, packed=packed):
            xr = rht(x, signs) if use_rht else x
            quantize = mx_quantize if packed else mx_quantize_dequantize
            return quantize(xr, fmt, rounding=rounding, scale_mode=scale_mode, generator=gen)

        sweep = {}
        for block_m, num_warps in CONFIGS:
            try:
                sweep[(block_m, num_warps)] = time_ms(lambda b=block_m, w=num_warps: kernel(b, w), args.warmup,
                                                      args.iters)
            except Exception as e:  # e.g. out of resources for one config
                print(f"  {case}: block_m={block_m} num_warps={num_warps} failed: {type(e).__name__}: {e}")
        best = min(sweep, key=sweep.get)
        ms = sweep[best]
        moved = in_bytes + nbytes(kernel(*best))
        row = {"case": case, "kernel_ms": ms, "kernel_gbps": moved / ms / 1e6, "best_config": list(best),
               "sweep_ms": {f"{b}x{w}": t for (b, w), t in sweep.items()}}
        if peak:
            row["fraction_of_peak"] = row["kernel_gbps"] / peak
        if not args.no_reference:
            ref_out = reference()
            row["reference_ms"] = time_ms(reference, 2, max(3, args.iters // 5))
            row["reference_gbps"] = (in_bytes + nbytes(ref_out)) / row["reference_ms"] / 1e6
            row["speedup"] = row["reference_ms"] / ms
            if rounding == "nearest":
                out = kernel(*best)
                if packed:
                    row["mismatches"] = int((out.codes != ref_out.codes).sum() + (out.scales != ref_out.scales).sum())
                else:
                    ref_cmp = ref_out.to(out.dtype)
                    same = (out == ref_cmp) | (out.isnan() & ref_cmp.isnan())
                    row["mismatches"] = int((~same).sum())
        results.append(row)
        line = f"{case:26s} {ms * 1e3:8.1f} us  {row['kernel_gbps']:7.0f} GB/s"
        if peak:
            line += f" ({100 * row['fraction_of_peak']:4.1f}% of peak)"
        line += f"  best block_m x warps {best[0]}x{best[1]}"
        if "reference_ms" in row:
            line += f"  | reference {row['reference_ms'] * 1e3:9.1f} us, {row['speedup']:5.1f}x"
        if "mismatches" in row:
            line += f", mismatches vs reference: {row['mismatches']}"
        print(line)
    if args.json:
        print(json.dumps({"device": name, "peak_gbps": peak, "m": args.m, "k": args.k, "dtype": args.dtype,
                          "results": results}))
    return 0


if __name__ == "__main__":
    run_main(main)
