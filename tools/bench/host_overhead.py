"""Host time of a training step: what Python and the dispatcher cost per step, apart from the kernels.

    python tools/bench/host_overhead.py model=1.3b --precisions bf16 fp8 --cuda-paths
    python tools/bench/host_overhead.py model=1.3b --precisions bf16 fp8 fp8+torchao --cuda-paths

A GPU runs a step no faster than the host can launch it. This times the real `Trainer.train_step` of a model with
the overrides' layer count but a width of 64 and 128 tokens (model.* overrides after the flags change the shape),
on the CPU, where every kernel is then tiny: the step's time is nearly all host work (Python, autograd, the
dispatcher), the part a GPU's faster kernels cannot hide. It prints the median over `--steps` per precision and each
one's ratio to the first. Each sequence is one synthetic document: a GPU's varlen attention is one kernel call
whatever the documents, where the CPU's loops over them in Python, and under `trainer.compile=true` breaks the
block's graph there (since 2026-11-29; before, the rows below that date read the default data's documents).

`--cuda-paths` runs the FP8 recipes' CUDA code on the CPU: casts as the compiled functions CUDA calls
(`fp8._quantize_fused`) and GEMMs through `torch._scaled_mm` (in compiled blocks, as ops of the graph), instead of the
CPU's eager emulation. The CPU's `torch._scaled_mm` kernel is slow at any size (a library call with set-up): while
the tool runs, that kernel and its `.out` form (what a compiled graph calls) are replaced by a timed fp32 emulation
whose time is reported apart (`in _scaled_mm`) and left out of `host ms`; the call's dispatch (about a GPU launch's
host cost) stays in. The CPU's attention kernels are not tiny at this size (flash attention's backward, about 1 ms a
call): their time stays in both precisions' figures. Not a GPU measurement: how these figures compare with a GPU's
host depends on the two CPUs; the ratios between precisions are what carries over.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.bench.cli import check_counts, parse_flags_and_overrides, run_main  # noqa: E402
from tools.bench.throughput import compose_config  # noqa: E402

NARROW = ["model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=4", "model.ffn_hidden_size=128",
          "model.vocab_size=256", "model.seq_length=128", "trainer.global_batch_size=1", "trainer.micro_batch_size=1",
          "trainer.device=cpu"]


@contextlib.contextmanager
def fp8_cuda_code_on_cpu() -> Iterator[None]:
    """FP8 recipes on real CPU tensors as a GPU from sm89 runs them: casts through the compiled functions CUDA calls,
    GEMMs through torch._scaled_mm (in the CPU's kernel), in eager layers and compiled blocks alike."""
    from megalm import compat
    from megalm.precision import fp8

    with compat.fp8_traced_as_gpu((9, 0)), mock.patch.object(fp8, "runs_fused", lambda x: not compat.is_fake(x)), \
            mock.patch.object(fp8, "_scaled_mm_available", fp8.scaled_mm_takes):
        yield


@contextlib.contextmanager
def scaled_mm_emulated(gemm_seconds: list[float] | None = None) -> Iterator[None]:
    """While inside, torch._scaled_mm's CPU kernels (the op, and the `.out` form a compiled graph calls) are an fp32
    emulation, after the op's meta kernel has checked the call: the CPU's kernel takes tens of milliseconds a call at
    any size (46 of a 48 s test's seconds, 2026-12-03), and it takes what CUDA's refuses (a row-major second operand,
    dimensions not multiples of 16), where the meta kernel checks them as CUDA does. Each call's time, check and
    emulation, is appended to `gemm_seconds` when given."""
    def emulated(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,  # noqa: ANN001, ANN202
                 use_fast_accum=False):  # noqa: ANN001 - aten::_scaled_mm's schema
        start = time.perf_counter()
        on_meta = [None if t is None else t.to("meta") for t in (a, b, scale_a, scale_b, bias, scale_result)]
        torch.ops.aten._scaled_mm(*on_meta, out_dtype, use_fast_accum)  # CUDA's rules, or its error
        out = (a.float() * scale_a.float()) @ (b.float() * scale_b.float())
        out = (out if bias is None else out + bias.float()).to(out_dtype or a.dtype)
        if gemm_seconds is not None:
            gemm_seconds.append(time.perf_counter() - start)
        return out

    def emulated_out(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,  # noqa: ANN001, ANN202
                     use_fast_accum=False, *, out):  # noqa: ANN001
        return out.copy_(emulated(a, b, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum))

    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Oo]verrid")  # replacing the CPU kernels is the point
        library.impl("_scaled_mm", emulated, "CPU")
        library.impl("_scaled_mm.out", emulated_out, "CPU")
    try:
        yield
    finally:
        library._destroy()


@contextlib.contextmanager
def cuda_paths(gemm_seconds: list[float]) -> Iterator[None]:
    """The FP8 recipes' CUDA code on CPU tensors (module docstring), torch._scaled_mm emulated (`scaled_mm_emulated`)
    with the time inside it appended to `gemm_seconds`, so that eager calls and compiled graphs' calls are both
    timed."""
    with scaled_mm_emulated(gemm_seconds), fp8_cuda_code_on_cpu():
        yield


def measure(overrides: list[str], steps: int, warmup: int, on_cuda_paths: bool) -> dict:
    """Median host ms per step (and ms inside torch._scaled_mm, left out of it) of one precision."""
    from megalm.training.trainer import Trainer

    cfg = compose_config(NARROW + ["data=synthetic", "data.varlen=true"] + overrides)
    cfg.trainer.max_steps = warmup + steps
    cfg.data.synthetic.fixed_doc_length = cfg.model.seq_length + 1  # one document per sequence (docstring)
    gemm: list[float] = []
    times, in_gemm = [], []
    with tempfile.TemporaryDirectory() as run_dir, cuda_paths(gemm) if on_cuda_paths else contextlib.nullcontext():
        trainer = Trainer(cfg, run_dir)
        for step in range(warmup + steps):
            gemm.clear()
            start = time.perf_counter()
            trainer.train_step(step)
            elapsed = time.perf_counter() - start
            if step >= warmup:
                times.append(elapsed - sum(gemm))
                in_gemm.append(sum(gemm))
    return {"layers": cfg.model.num_layers, "hidden": cfg.model.hidden_size,
            "tokens": cfg.trainer.micro_batch_size * cfg.model.seq_length, "host_ms": 1e3 * statistics.median(times),
            "scaled_mm_ms": 1e3 * statistics.median(in_gemm)}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp8"],
                        help="recipes to time, in turn; RECIPE+BACKEND sets precision.backend (fp8+torchao)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per precision")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compiles, caches)")
    parser.add_argument("--cuda-paths", action="store_true", help="run the FP8 recipes' CUDA code on the CPU")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON list last")
    args, overrides = parse_flags_and_overrides(parser, argv)
    check_counts(args, "steps")
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps takes 1 or more, --warmup 0 or more")
    torch.set_num_threads(1)  # one thread, as a training process's host loop runs
    rows = []
    for precision in args.precisions:
        name, _, backend = precision.partition("+")
        recipe = [f"precision={name}"] + ([f"precision.backend={backend}"] if backend else [])
        row = {"precision": precision, **measure([*recipe, *overrides], args.steps, args.warmup, args.cuda_paths)}
        rows.append(row)
    print(f"host time per step, {rows[0]['layers']} layers at width {rows[0]['hidden']}, {rows[0]['tokens']} tokens, "
          "one micro-batch"
          + (" (FP8 on its CUDA code paths)" if args.cuda_paths else "") + ":")
    print("| precision | host ms | per layer ms | vs first | in _scaled_mm ms (left out) |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['precision']} | {row['host_ms']:.1f} | {row['host_ms'] / row['layers']:.2f} | "
              f"{row['host_ms'] / rows[0]['host_ms']:.2f}x | {row['scaled_mm_ms']:.1f} |")
    if args.json:
        print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    run_main(main)
