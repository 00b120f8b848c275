"""Attention kernels side by side: each backend's forward and backward at one model's attention shape.

    python tools/bench/attention_kernels.py model=1.3b model.seq_length=4096           # 2 sequences of one document
    python tools/bench/attention_kernels.py model=1.3b model.seq_length=4096 --ragged  # documents of unequal lengths
    python tools/bench/attention_kernels.py --iters 3 --warmup 1                       # tiny model (CPU: sdpa only)

Arguments without dashes are Hydra overrides of configs/config.yaml; the shape is the model's (query and kv heads,
head_dim, seq_length), one layer's attention. Each backend that can run here in the compute dtype (bf16 on a GPU,
fp32 on a CPU) runs `megalm.model.varlen_attention` as the model calls it, on packed [T, H, D] q/k/v of `--seqs`
sequences: by default one document per sequence (all of one length: the cudnn backend's one batched SDPA call, as
compare.py's rows and `data.synthetic.fixed_doc_length` runs train), with `--ragged` each sequence cut into documents
of unequal lengths (cudnn then runs torch_varlen, the same kernel). Why: on Hopper torch's SDPA runs cuDNN's kernel,
reported up to 1.7-2.3x faster than the flash kernel torch's varlen function runs (megalm/model/attention.py), and
`auto` picks cudnn there on that report; this measures it on the GPU at hand.

Times are the median of `--iters` after `--warmup`, by CUDA events on a GPU (perf_counter on a CPU), of forward and
backward together; TFLOP/s counts the causal (query, key) pairs of each document as megalm/training/flops.py does
(x3 for forward and backward). The kernels that ran are named from torch.profiler on a GPU: what ran, not what was
hoped for. Ratios against the first backend listed, measured in one run.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megalm.config import ModelConfig  # noqa: E402
from megalm.config.checks import resolve_model_defaults  # noqa: E402
from megalm.errors import ConfigError  # noqa: E402
from megalm.measure.kernel_profile import summarize  # noqa: E402
from megalm.model.attention import select_attention_backend, varlen_attention  # noqa: E402
from tools.bench.cli import parse_flags_and_overrides  # noqa: E402
from tools.bench.throughput import compose_config  # noqa: E402
from tools.bench.timing import time_calls  # noqa: E402

BACKENDS = ("torch_varlen", "cudnn", "flash_attn", "sdpa")


def packed_operands(model: ModelConfig, seqs: int, ragged: bool, dtype: torch.dtype, device: torch.device,
                    seed: int = 0):
    """q [T, Hq, D], k/v [T, Hkv, D] (leaves), an output gradient, cu_seqlens int32, the longest document, and the
    documents' lengths, for `seqs` sequences of model.seq_length tokens."""
    head_dim = model.head_dim or model.hidden_size // model.num_heads
    rng = random.Random(seed)
    lengths: list[int] = []
    for _ in range(seqs):
        cuts = sorted(rng.sample(range(1, model.seq_length), 3)) if ragged else []
        lengths += [b - a for a, b in zip([0, *cuts], [*cuts, model.seq_length], strict=True)]
    total = sum(lengths)
    g = torch.Generator(device="cpu").manual_seed(seed)
    make = lambda heads: torch.randn(total, heads, head_dim, generator=g).to(device, dtype)  # noqa: E731
    q, k, v = make(model.num_heads), make(model.num_kv_heads), make(model.num_kv_heads)
    dout = make(model.num_heads)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return [t.requires_grad_() for t in (q, k, v)], dout, cu, max(lengths), lengths


def attention_tflop(model: ModelConfig, lengths: list[int]) -> float:
    """Forward and backward FLOPs of one layer's causal attention over these documents (flops.py's term, x3)."""
    head_dim = model.head_dim or model.hidden_size // model.num_heads
    return 3 * 2.0 * model.num_heads * head_dim * sum(s * (s + 1) for s in lengths) / 1e12


def time_ms(step, device: torch.device, warmup: int, iters: int) -> float:
    return statistics.median(time_calls(step, device, warmup, iters))


def kernels_that_ran(step, device: torch.device) -> list[str]:
    """The distinct CUDA kernels one call of `step` launched, longest first (empty on a CPU), as throughput.py's
    profile sums them (megalm/measure/kernel_profile.py)."""
    if device.type != "cuda":
        return []
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(device)
    return [name for name, _, _ in summarize(prof.events(), steps=1, wall_s=0.0).top]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=2, help="sequences of model.seq_length tokens (default 2)")
    parser.add_argument("--ragged", action="store_true", help="cut each sequence into documents of unequal lengths")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated (default: %(default)s)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON list last")
    args, overrides = parse_flags_and_overrides(parser, argv)
    model = resolve_model_defaults(compose_config(overrides).model)  # kv heads and head_dim where the config omits them
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    leaves, dout, cu, max_len, lengths = packed_operands(model, args.seqs, args.ragged, dtype, device)
    tflop = attention_tflop(model, lengths)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{model.name}: {len(lengths)} documents in {args.seqs} x {model.seq_length} tokens "
          f"({'unequal' if args.ragged else 'equal'} lengths), {model.num_heads} query / {model.num_kv_heads} kv "
          f"heads, {str(dtype).removeprefix('torch.')} on {where}")
    rows = []
    for backend in args.backends.split(","):
        try:
            select_attention_backend(backend, device, dtype)
        except ConfigError as e:
            print(f"  {backend:<13} skipped: {e}")
            continue

        def step(backend=backend):
            for t in leaves:
                t.grad = None
            varlen_attention(*leaves, cu, max_len, backend).backward(dout)

        ms = time_ms(step, device, args.warmup, args.iters)
        kernels = kernels_that_ran(step, device)
        rows.append({"backend": backend, "ms": ms, "tflops_per_sec": tflop / (ms / 1e3), "kernels": kernels[:4]})
        ratio = rows[0]["ms"] / ms
        print(f"  {backend:<13} {ms:9.3f} ms forward+backward  {tflop / (ms / 1e3):7.1f} TFLOP/s  "
              f"{ratio:.2f}x of {rows[0]['backend']}" + (f"  kernels: {'; '.join(k[:70] for k in kernels[:3])}"
                                                         if kernels else ""))
    if args.json:
        print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
