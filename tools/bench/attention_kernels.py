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

`cudnn_ragged` is this tool's own row, not a model backend, run only when named in `--backends`: cuDNN's kernel
on the packed documents themselves (`torch.ops.aten._cudnn_attention_forward` given the cu_seqlens, the
ragged-offset form torch's nested tensors use, and its autograd backward), which torch's varlen function keeps
switched off. If it is correct and as fast on unequal
documents as on equal ones, packed pretraining data could have cuDNN's kernel too; this row is how to find out.
`--layouts N` cycles every backend through N document layouts of the same token count, one a call, as training's
micro-batches do: a kernel that plans per layout (cuDNN builds a graph per document count and longest document)
shows that cost in its time. `cudnn_ragged_bucketed` is the same call with fewer distinct shapes (the document count
padded with empty documents to a multiple of 8, the longest length rounded up to a power of two): whether empty
documents are computed right (its error) and whether bucketing pays for the graphs (its time). In torch 2.11's
source the op's backward sizes a buffer by the head size where it means the longest document (fixed later, in
pytorch/pytorch#186142), which can fault and leave the CUDA context unusable: run these rows in a process of their own,
and `--forward-only` times the forward alone.

Times are the median of `--iters` after `--warmup`, by CUDA events on a GPU (perf_counter on a CPU), of forward and
backward together; TFLOP/s counts the causal (query, key) pairs of each document as megalm/training/flops.py does
(x3 for forward and backward), averaged over the layouts. The kernels that ran are named from torch.profiler on a
GPU: what ran, not what was hoped for. Each row's `error` is the relative Frobenius distance of its output and
q/k/v gradients from the first backend's on the first layout, so that a fast row that computes something else is
seen. Ratios against the first backend listed, measured in one run.
"""

from __future__ import annotations

import argparse
import itertools
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
from tools.bench.cli import add_timing_flags, check_counts, parse_flags_and_overrides, run_main  # noqa: E402
from tools.bench.throughput import compose_config  # noqa: E402
from tools.bench.timing import time_calls  # noqa: E402

BACKENDS = ("torch_varlen", "cudnn", "flash_attn", "sdpa")  # the default rows: the model's backends
# this tool's own rows, asked for by name (--backends) and best in a process of their own: a kernel that writes out of
# bounds leaves the CUDA context unusable for every row after it
RAGGED = ("cudnn_ragged", "cudnn_ragged_bucketed")
DOCUMENT_BUCKET = 8  # cudnn_ragged_bucketed pads the document count to a multiple of this


def document_lengths(model: ModelConfig, seqs: int, ragged: bool, seed: int = 0) -> list[int]:
    """The documents of `seqs` sequences of model.seq_length tokens: one each, or with `ragged` each cut in four at
    random points (`seed`)."""
    rng = random.Random(seed)
    lengths: list[int] = []
    for _ in range(seqs):
        cuts = sorted(rng.sample(range(1, model.seq_length), 3)) if ragged else []
        lengths += [b - a for a, b in zip([0, *cuts], [*cuts, model.seq_length], strict=True)]
    return lengths


def layout(lengths: list[int], device: torch.device) -> tuple[torch.Tensor, int, list[int]]:
    """cu_seqlens int32, the longest document and the lengths themselves."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return cu, max(lengths), lengths


def packed_operands(model: ModelConfig, seqs: int, ragged: bool, dtype: torch.dtype, device: torch.device,
                    seed: int = 0):
    """q [T, Hq, D], k/v [T, Hkv, D] (leaves), an output gradient, cu_seqlens int32, the longest document, and the
    documents' lengths, for `seqs` sequences of model.seq_length tokens."""
    head_dim = model.head_dim or model.hidden_size // model.num_heads
    lengths = document_lengths(model, seqs, ragged, seed)
    total = sum(lengths)
    g = torch.Generator(device="cpu").manual_seed(seed)
    make = lambda heads: torch.randn(total, heads, head_dim, generator=g).to(device, dtype)  # noqa: E731
    q, k, v = make(model.num_heads), make(model.num_kv_heads), make(model.num_kv_heads)
    dout = make(model.num_heads)
    return [t.requires_grad_() for t in (q, k, v)], dout, *layout(lengths, device)


def cudnn_ragged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                           max_seqlen: int) -> torch.Tensor:
    """Causal attention within each packed document by cuDNN's kernel with ragged offsets: torch's private op as its
    nested tensors call it (q [T, Hq, D], k/v [T, Hkv, D]), differentiable through torch's own backward formula."""
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                                   True, 0.0, True, False)[0]


def bucketed(cu_seqlens: torch.Tensor, max_seqlen: int) -> tuple[torch.Tensor, int]:
    """The same documents described with fewer distinct shapes: the count padded with empty documents to a multiple of
    DOCUMENT_BUCKET, the longest length rounded up to a power of two (a bound, not a length)."""
    documents = cu_seqlens.numel() - 1
    pad = -documents % DOCUMENT_BUCKET
    return torch.cat([cu_seqlens, cu_seqlens[-1:].expand(pad)]), 1 << (max_seqlen - 1).bit_length()


def run_backend(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                max_seqlen: int) -> torch.Tensor:
    if backend == "cudnn_ragged":
        return cudnn_ragged_attention(q, k, v, cu_seqlens, max_seqlen)
    if backend == "cudnn_ragged_bucketed":
        return cudnn_ragged_attention(q, k, v, *bucketed(cu_seqlens, max_seqlen))
    return varlen_attention(q, k, v, cu_seqlens, max_seqlen, backend)


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The largest relative Frobenius distance ||got - want|| / ||want|| over pairs of tensors, in fp32."""
    return max(((g.float() - w.float()).norm() / w.float().norm().clamp_min(1e-30)).item()
               for g, w in zip(got, want, strict=True))


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
    parser.add_argument("--layouts", type=int, default=1,
                        help="document layouts (with --ragged: random cuts) cycled through, one a call (default 1)")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help=f"comma-separated (default: %(default)s; also {', '.join(RAGGED)})")
    parser.add_argument("--forward-only", action="store_true",
                        help="time the forward alone (values: the output only)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_timing_flags(parser, "calls of each backend (forward and backward)", iters=20, warmup=5)
    args, overrides = parse_flags_and_overrides(parser, argv)
    check_counts(args, "iters")
    model = resolve_model_defaults(compose_config(overrides).model)  # kv heads and head_dim where the config omits them
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.layouts < 1:
        raise SystemExit(f"--layouts {args.layouts}: give 1 or more")
    leaves, dout, *first = packed_operands(model, args.seqs, args.ragged, dtype, device)
    layouts = [tuple(first)] + [layout(document_lengths(model, args.seqs, args.ragged, seed), device)
                                for seed in range(1, args.layouts)]
    passes = 1 / 3 if args.forward_only else 1  # the forward is a third of attention_tflop's forward and backward
    tflop = statistics.fmean(attention_tflop(model, lengths) for _, _, lengths in layouts) * passes
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    documents = statistics.fmean(len(lengths) for _, _, lengths in layouts)
    print(f"{model.name}: {documents:g} documents in {args.seqs} x {model.seq_length} tokens "
          f"({'unequal' if args.ragged else 'equal'} lengths, {args.layouts} layout(s) cycled), {model.num_heads} "
          f"query / {model.num_kv_heads} kv heads, {str(dtype).removeprefix('torch.')} on {where}")
    rows, first_values = [], None
    for backend in args.backends.split(","):
        try:  # cudnn_ragged can run where the cudnn backend can
            select_attention_backend("cudnn" if backend in RAGGED else backend, device, dtype)
        except ConfigError as e:
            print(f"  {backend:<21} skipped: {'as cudnn would be: ' if backend in RAGGED else ''}{e}")
            continue
        calls = itertools.count()

        def step(backend=backend, calls=calls):
            for t in leaves:
                t.grad = None
            cu, max_len, _ = layouts[next(calls) % len(layouts)]
            if args.forward_only:
                with torch.no_grad():
                    return run_backend(backend, *leaves, cu, max_len)
            out = run_backend(backend, *leaves, cu, max_len)
            out.backward(dout)
            return out

        try:
            for t in leaves:  # the values on the first layout, before any timing
                t.grad = None
            if args.forward_only:
                with torch.no_grad():
                    values = [run_backend(backend, *leaves, *layouts[0][:2])]
            else:
                out = run_backend(backend, *leaves, *layouts[0][:2])
                out.backward(dout)
                values = [out.detach(), *(t.grad.detach().clone() for t in leaves)]
            ms = time_ms(step, device, args.warmup, args.iters)
            kernels = kernels_that_ran(step, device)
        except RuntimeError as e:  # a kernel that refuses this shape (cudnn_ragged's private op): the other rows stand
            print(f"  {backend:<21} failed: {str(e).strip().splitlines()[0][:200]}")
            continue
        first_values = first_values or values
        error = relative_error(values, first_values)
        rows.append({"backend": backend, "ms": ms, "tflops_per_sec": tflop / (ms / 1e3), "error": error,
                     "kernels": kernels[:4]})
        ratio = rows[0]["ms"] / ms
        timed = "forward" if args.forward_only else "forward+backward"
        print(f"  {backend:<21} {ms:9.3f} ms {timed}  {tflop / (ms / 1e3):7.1f} TFLOP/s  "
              f"{ratio:.2f}x of {rows[0]['backend']}  error {error:.1e}"
              + (f"  kernels: {'; '.join(k[:70] for k in kernels[:3])}" if kernels else ""))
    if args.json:
        print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    run_main(main)
