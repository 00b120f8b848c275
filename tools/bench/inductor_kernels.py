"""The kernels inductor makes of megalm's compiled blocks, on the device at hand: per graph, each kernel's bytes.

    python tools/bench/inductor_kernels.py model=1.3b model.seq_length=4096 model.num_layers=2 \
        --precisions bf16 fp8_delayed                                    # on a GPU: Triton's kernels
    python tools/bench/inductor_kernels.py --precisions bf16 fp8 --steps 2 --top 3   # tiny model, CPU: C++ kernels

step_cost.py prices compiled blocks from inductor's scheduler on a CPU, whose C++ code generation decides some
fusions differently from Triton's (a concatenation is always its own buffer there, and its loop orders and tilings
are its own), so what a GPU's compiled step moves is for a GPU to say. This trains `--steps` steps of the real
`Trainer.train_step` with `trainer.compile=true` (packed batches, one document filling each sequence, as compare.py
trains) and records every graph
inductor compiles (megalm/measure/compiled_cost.py `inductor_kernels_recorded`): its kernels in order, each with
the bytes inductor's scheduler counts it to read and write, the buffers it reads and writes, and the aten ops fused
into it. Per precision it prints each graph's generated kernels and their bytes, its extern kernels (GEMMs,
attention), and the `--top` generated kernels that move most; `--json` prints every kernel. The blocks share one
code object, so one forward and one backward graph stand for every layer (more where a recipe compiles again:
fp8_delayed's first step scales by the current amax, its next by the history's). Bytes are inductor's count, not a
measurement of the GPU's traffic; the steps' time is throughput.py's to measure.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch._dynamo

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megalm.errors import ConfigError  # noqa: E402
from megalm.measure.compiled_cost import inductor_kernels_recorded  # noqa: E402
from tools.bench.cli import parse_flags_and_overrides, run_main  # noqa: E402
from tools.bench.throughput import compose_config  # noqa: E402


def record(precision: str, overrides: list[str], steps: int) -> dict[str, Any]:
    """Every graph inductor compiles over `steps` training steps of `precision` (dynamo reset first)."""
    from megalm.training.trainer import Trainer

    cfg = compose_config(["data.varlen=true", f"precision={precision}", "trainer.compile=true", *overrides])
    cfg.trainer.max_steps = steps
    cfg.data.synthetic.fixed_doc_length = cfg.model.seq_length + 1  # one document per sequence (throughput.py's)
    torch._dynamo.reset()
    graphs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as run_dir, inductor_kernels_recorded(graphs):
        trainer = Trainer(cfg, run_dir)
        for step in range(steps):
            trainer.train_step(step)
    device = trainer.device
    return {"precision": precision, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "layers": cfg.model.num_layers, "tokens": cfg.trainer.micro_batch_size * cfg.model.seq_length,
            "graphs": graphs}


def graph_summary(graph: dict[str, Any]) -> dict[str, Any]:
    """A graph's generated kernels, their bytes, and its extern kernels by op."""
    generated = [k for k in graph["kernels"] if k["kernel"] == "generated"]
    extern: dict[str, int] = {}
    for kernel in graph["kernels"]:
        if kernel["kernel"] != "generated":
            name = kernel["kernel"].removeprefix("extern ")
            extern[name] = extern.get(name, 0) + 1
    return {"generated_kernels": len(generated), "generated_bytes": sum(k["bytes"] for k in generated),
            "extern": extern}


def print_report(rows: list[dict[str, Any]], top: int) -> None:
    first = rows[0]
    print(f"inductor's kernels on {first['device']}, {first['layers']} layers, {first['tokens']} tokens a micro-batch")
    print("| precision | graph | pass | generated kernels | generated MB | extern kernels |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        for i, graph in enumerate(row["graphs"]):
            s = graph_summary(graph)
            extern = ", ".join(f"{n} x{c}" for n, c in sorted(s["extern"].items())) or "-"
            print(f"| {row['precision']} | {i} | {'backward' if graph['backward'] else 'forward'} | "
                  f"{s['generated_kernels']} | {s['generated_bytes'] / 1e6:.1f} | {extern} |")
    if top:
        for row in rows:
            for i, graph in enumerate(row["graphs"]):
                generated = sorted((k for k in graph["kernels"] if k["kernel"] == "generated"),
                                   key=lambda k: -k["bytes"])[:top]
                print(f"\n{row['precision']}, graph {i}: the {len(generated)} generated kernels that move most")
                for kernel in generated:
                    print(f"  {kernel['bytes'] / 1e6:8.1f} MB  writes {'; '.join(kernel['writes'])}\n"
                          f"               reads {'; '.join(kernel['reads'])}\n"
                          f"               ops {' '.join(kernel['ops'])}")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp8_delayed"],
                        help="the recipes to compile, one after the other")
    parser.add_argument("--steps", type=int, default=3,
                        help="training steps each (fp8_delayed compiles its history-scaled graphs in its second)")
    parser.add_argument("--top", type=int, default=5, help="the generated kernels listed per graph, most bytes first")
    parser.add_argument("--json", action="store_true", help="print every graph's kernels as one JSON list last")
    args, overrides = parse_flags_and_overrides(parser, argv)
    if args.steps < 1 or args.top < 0:
        raise ConfigError(f"--steps {args.steps} must be >= 1 and --top {args.top} >= 0")
    rows = [record(precision, overrides, args.steps) for precision in args.precisions]
    print_report(rows, args.top)
    if args.json:
        print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    run_main(main)
