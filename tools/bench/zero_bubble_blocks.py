"""The zero-bubble schedule's blocks on one device, eager against compiled: what `trainer.compile` buys a ZB run.

    python tools/bench/zero_bubble_blocks.py model=1.3b model.seq_length=4096 model.num_layers=8   # on a GPU
    python tools/bench/zero_bubble_blocks.py model=tiny --iters 2 --warmup 1 --json

One GPU runs no pipeline (NCCL takes one rank per device), so no throughput row can time a ZB step there, and
`trainer.compile=null` (auto) keeps ZB eager until a row shows compiled blocks help (megalm/training/compile.py). This
times what differs: one micro-batch's forward, its B (input gradients, every linear's weight gradient deferred to a
store: megalm/parallel/pipeline/weight_grad.py) and its W (the deferred GEMMs), on the model's blocks in bf16 (bf16
weights, as `precision=bf16` keeps them), `--seqs` documents of `model.seq_length` tokens. Rows:

- `zb_eager`: the deferred linears' autograd functions, eager;
- `zb_compiled`: each block compiled (`compile_blocks`): the deferred linears' GEMMs as opaque ops, and inductor
  without in-place kernels or buffer reuse (megalm/model/deferred_wgrad.py);
- `plain_compiled`: the same blocks compiled with a plain backward (1F1B's), for what the deferral costs a compiled
  block.

Each row's time is the median of `--iters` (tools/bench/timing.py: device events on CUDA), with the peak memory
allocated on CUDA and dynamo's count of graph breaks. On a CPU the compiled rows use the `aot_eager` backend (the
tool checks itself; inductor's CPU kernels would time C++ code no GPU runs), and say so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megalm.config.checks import resolve_model_defaults  # noqa: E402
from megalm.model import GPT, choose_attention_backends, init_weights  # noqa: E402
from megalm.parallel.pipeline.weight_grad import WeightGradStore, defer_weight_grads  # noqa: E402
from megalm.training.compile import compile_blocks  # noqa: E402
from tools.bench.cli import check_counts, parse_flags_and_overrides, run_main  # noqa: E402
from tools.bench.throughput import compose_config  # noqa: E402
from tools.bench.timing import time_calls  # noqa: E402

ROWS = ("zb_eager", "zb_compiled", "plain_compiled")


def build_row(row: str, overrides: list[str], device: torch.device, backend: str
              ) -> tuple[WeightGradStore | None, GPT, Any]:
    """The model of `overrides` in bf16 on `device` set up as `row` says, the store its linears defer to (None for
    a plain backward), and its model config."""
    cfg = resolve_model_defaults(compose_config(overrides).model)
    model = GPT(cfg).to(device)
    init_weights(model, 0)
    model.to(torch.bfloat16)
    store = WeightGradStore() if row.startswith("zb_") else None
    if store is not None:
        defer_weight_grads(model, store)
    choose_attention_backends(model, device, torch.bfloat16)  # before compiling: no selection in the graph
    if row.endswith("_compiled"):
        compile_blocks(model, backend)
    return store, model, cfg


def one_micro_batch(model: GPT, store: WeightGradStore | None, inputs: tuple) -> Callable[[], None]:
    """Forward, B and W of `model` on `inputs` (a plain backward without a store), its gradients then dropped."""

    def step() -> None:
        loss = model(*inputs).float().square().mean()
        if store is None:
            loss.backward()
        else:
            with store.collect(0):  # B
                loss.backward()
            store.apply(0)  # W
        model.zero_grad(set_to_none=True)

    return step


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=2, help="documents of model.seq_length tokens a micro-batch")
    parser.add_argument("--iters", type=int, default=10, help="timed micro-batches (the median is reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed micro-batches first (compiles the blocks)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"which of {', '.join(ROWS)}")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args, overrides = parse_flags_and_overrides(parser, argv)
    check_counts(args, "iters")
    rows = args.rows.split(",")
    if unknown := [r for r in rows if r not in ROWS]:
        parser.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    report: dict = {"device": name, "backend": backend, "rows": {}}
    for row in rows:
        torch._dynamo.reset()
        counters.clear()
        store, model, cfg = build_row(row, overrides, device, backend)
        seq = cfg.seq_length
        tokens = torch.randint(0, cfg.vocab_size, (args.seqs * seq,), device=device)
        positions = torch.arange(seq, device=device).repeat(args.seqs)
        cu_seqlens = torch.arange(0, args.seqs * seq + 1, seq, dtype=torch.int32, device=device)

        step = one_micro_batch(model, store, (tokens, positions, cu_seqlens, seq))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        ms = statistics.median(time_calls(step, device, args.warmup, args.iters))
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        breaks = sum(counters["graph_break"].values())  # a compiled row with breaks would time eager pieces
        report["rows"][row] = {"ms": ms, "peak_gib": peak, "graph_breaks": breaks}
        print(f"  {row:15s} {ms:9.3f} ms" + (f"  {peak:6.2f} GiB peak" if peak is not None else "")
              + (f"  {breaks} graph breaks" if row.endswith("_compiled") else ""))
        del model, store
    print(f"{name}, {args.seqs} x {seq} tokens a micro-batch, compiled rows: {backend}"
          + ("" if device.type == "cuda" else " (a CPU: the tool checks itself; its times are not a GPU's)"))
    measured = report["rows"]
    if "zb_eager" in measured and "zb_compiled" in measured:
        print(f"  zb_compiled against zb_eager: {measured['zb_eager']['ms'] / measured['zb_compiled']['ms']:.2f}x")
    if args.json:
        print(json.dumps(report))
    return report


if __name__ == "__main__":
    run_main(main)
