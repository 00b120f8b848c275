"""Does aux-loss-free balancing even out the experts' load? The MoE demo model, once per balancing method, side by side.

    python tools/bench/moe_balance.py                    # none, aux_loss_free, aux_loss: 200 steps of model=moe_tiny
    python tools/bench/moe_balance.py --methods none aux_loss_free --steps 100 model.seq_length=128

Each method trains `model=moe_tiny` on the stdlib demo corpus with the same seed and data (`megalm-train`
in-process, run dirs under a temporary directory) with only that balancing on: `none` (no loss, no bias),
`aux_loss_free` (DeepSeek-V3's bias, `model.moe.bias_update_rate=0.01`: ten times its rate, for a run this short),
`aux_loss` (the switch loss, 0.01), `seq_aux_loss` (0.01), `z_loss` (0.001). The load is metrics.jsonl's
`moe_load` (max / mean tokens per expert of each MoE layer, counted from each step's routing:
megalm/training/expert_load.py), averaged over the layers, at the first step and over the last tenth of the run.
Prints a markdown table; arguments without dashes are Hydra overrides applied to every run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from megalm.config.compose import compose_config  # noqa: E402
from megalm.training.trainer import Trainer  # noqa: E402
from tools.bench.cli import parse_flags_and_overrides, run_main  # noqa: E402

OFF = ["model.moe.aux_loss_coeff=0", "model.moe.seq_aux_loss_coeff=0", "model.moe.z_loss_coeff=0",
       "model.moe.bias_update_rate=0"]
METHODS = {"none": [], "aux_loss_free": ["model.moe.bias_update_rate=0.01"],
           "aux_loss": ["model.moe.aux_loss_coeff=0.01"], "seq_aux_loss": ["model.moe.seq_aux_loss_coeff=0.01"],
           "z_loss": ["model.moe.z_loss_coeff=0.001"]}


def train(method: str, steps: int, overrides: list[str], root: Path) -> dict:
    cfg = compose_config(["model=moe_tiny", *OFF, *METHODS[method], f"trainer.max_steps={steps}",
                          "trainer.log_interval=1", "trainer.eval_interval=0", "trainer.save_interval=0",
                          "logging.tensorboard=false", *overrides])
    start = time.perf_counter()
    summary = Trainer(cfg, root / method).fit()
    records = [json.loads(line) for line in (root / method / "metrics.jsonl").read_text().splitlines()]
    load = [sum(r["moe_load"]) / len(r["moe_load"]) for r in records]
    tail = load[-max(1, len(load) // 10):]
    return {"method": method, "load_first": load[0], "load_last": sum(tail) / len(tail),
            "train_loss": summary.last_loss, "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=["none", "aux_loss_free", "aux_loss"], choices=list(METHODS))
    parser.add_argument("--steps", type=int, default=200)
    args, overrides = parse_flags_and_overrides(parser, argv)
    with tempfile.TemporaryDirectory(prefix="megalm-moe-balance-") as tmp:
        rows = [train(m, args.steps, overrides, Path(tmp)) for m in args.methods]
    print(f"| balancing | max/mean load, step 1 | max/mean load, last {max(1, args.steps // 10)} steps | "
          "final train loss | wall s |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['method']} | {r['load_first']:.3f} | {r['load_last']:.3f} | {r['train_loss']:.4f} | "
              f"{r['seconds']:.0f} |")


if __name__ == "__main__":
    run_main(main)
