"""megalm-estimate at Llama-3 8B and 70B against the closed forms: static bytes (exact) and activations (Korthikanti).

    python tools/bench/estimate_vs_formula.py                       # 8B and 70B, recompute none/selective/full
    python tools/bench/estimate_vs_formula.py --models 8b --recompute none

For each model and recompute mode the estimator runs the first pipeline stage's rank of its layout (the stage that
holds the most: pp micro-batches in flight under 1F1B), and the table sets its measured bytes beside:
- parameters, gradients and optimizer states from the closed form of the mixed-precision recipe (2, 4 and 12 bytes
  per parameter of the rank, no ZeRO-1), the rank's parameters counted from the shapes by the search's closed form
  (layout_search.stage_parameters): the layers of the stage sharded over tp (norms replicated), the embedding's
  rows over tp, Megatron's padded vocabulary;
- activations: Korthikanti et al. (2022) per layer and micro-batch with sequence parallelism and flash attention,
  34·s·h/t without recompute (their selective recompute removes only the attention matrices, which flash attention
  never stores: 34 too) and 2·s·h/t with full recompute (the layer's input), times the layers of the stage and the pp
  micro-batches in flight. megalm's `selective` recomputes the elementwise ops and keeps GEMM, attention and
  collective outputs, which is not Korthikanti's selective. `offload`: no recompute with activation offload
  (offload.enabled=true), against the formula times the share of micro-batches not offloaded (1 - fraction).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from megalm import estimate  # noqa: E402
from megalm.errors import ConfigError  # noqa: E402
from megalm.estimate import layout_search  # noqa: E402
from megalm.estimate.layout_search import Layout  # noqa: E402
from tools.bench.cli import run_main  # noqa: E402

LAYOUTS = {  # model -> (overrides, world): TP within a node, PP across nodes, dp 8
    "8b": (["model=8b", "parallel.tp=8", "parallel.pp=4", "parallel.sequence_parallel=true"], 256),
    "70b": (["model=70b", "parallel.tp=8", "parallel.pp=8", "parallel.sequence_parallel=true"], 512),
}
GIB = 2**30


def main(argv: list[str] | None = None) -> int:
    from megalm.train import compose_config

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(LAYOUTS), help=f"of {', '.join(LAYOUTS)}")
    p.add_argument("--recompute", nargs="+", default=["none", "selective", "full", "offload"],
                   help="recompute modes; 'offload': none, with activation offload (offload.enabled=true)")
    p.add_argument("--num-layers", type=int, help="fewer layers, for a quick run (the per-layer figures hold)")
    args = p.parse_args(argv)
    unknown = sorted(set(args.models) - set(LAYOUTS))
    if unknown:
        raise ConfigError(f"--models {' '.join(unknown)}: not one of {', '.join(LAYOUTS)}")
    depth = [f"model.num_layers={args.num_layers}"] if args.num_layers else []
    print("| model | recompute | params GiB | grads GiB | optimizer GiB | activations GiB | Korthikanti | ratio | "
          "host GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for model in args.models:
        layout, world = LAYOUTS[model]
        for mode in args.recompute:
            recompute = ["parallel.recompute=none", "offload.enabled=true"] if mode == "offload" else \
                [f"parallel.recompute={mode}"]
            overrides = estimate.batch_overrides([*layout, *depth, "precision=bf16", *recompute], world)
            cfg = compose_config(overrides)
            tp, pp = cfg.parallel.tp, cfg.parallel.pp
            shape = layout_search.search_shape(overrides, world)[0]
            n, _ = layout_search.stage_parameters(shape, Layout(tp, pp, 1, 1, world // (tp * pp), False, "none",
                                                                False, False))
            rank = estimate.estimate([*overrides, "trainer.device=cpu", "logging.tensorboard=false"], world,
                                     "h100")["ranks"][0]
            s, h = cfg.model.seq_length, cfg.model.hidden_size
            per_layer = (2 if mode == "full" else 34) * s * h / tp
            formula = per_layer * cfg.model.num_layers // pp * pp
            if mode == "offload":  # the offloaded share of the micro-batches in flight lives on the host
                formula *= 1 - cfg.offload.fraction
            closed = (2 * n, 4 * n, 12 * n)
            measured = (rank["param_bytes"], rank["grad_bytes"], rank["optimizer_bytes"])
            cells = [f"{m / GIB:.3f} ({'= closed form' if m == c else f'closed form {m - c:+,} bytes'})"
                     for m, c in zip(measured, closed, strict=True)]  # the optimizer's: + AdamW's step counters
            print(f"| {model} | {mode} | {' | '.join(cells)} | {rank['activation_bytes'] / GIB:.2f} | "
                  f"{formula / GIB:.2f} | {rank['activation_bytes'] / formula:.2f} | {rank['host_bytes'] / GIB:.2f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    run_main(main)
