"""Does a precision recipe train as well as fp32? The default demo run, once per recipe, side by side.

    python tools/bench/precision_convergence.py                       # fp32 fp8 mxfp8 mxfp4 mxfp4_rtn, 300 steps
    python tools/bench/precision_convergence.py --recipes fp32 mxfp4 --steps 100 trainer.eval_iters=4

Each recipe trains the tiny model on the stdlib demo corpus with the same seed and data (`megalm-train`
in-process, run dirs under a temporary directory), then the final validation loss is compared with
the first recipe's (fp32 by default). Prints a markdown table; `--json` adds one JSON line at the end.
Arguments without dashes are Hydra overrides applied to every run.
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

DEFAULT_RECIPES = ["fp32", "fp8", "mxfp8", "mxfp4", "mxfp4_rtn"]


def train(recipe: str, steps: int, overrides: list[str], root: Path) -> dict:
    cfg = compose_config([f"precision={recipe}", f"trainer.max_steps={steps}", f"trainer.eval_interval={steps}",
                          "trainer.save_interval=0", "logging.tensorboard=false",
                          "trainer.compile=false", *overrides])  # eager unless asked: recipes, not compiles
    start = time.perf_counter()
    summary = Trainer(cfg, root / recipe).fit()
    return {"recipe": recipe, "val_loss": summary.val_loss, "train_loss": summary.last_loss,
            "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=DEFAULT_RECIPES)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", action="store_true")
    args, overrides = parse_flags_and_overrides(parser, argv)
    with tempfile.TemporaryDirectory(prefix="megalm-precision-") as tmp:
        rows = [train(r, args.steps, overrides, Path(tmp)) for r in args.recipes]
    base = rows[0]["val_loss"]
    print(f"| recipe | final val loss | vs {rows[0]['recipe']} | final train loss | wall s |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        row["relative"] = row["val_loss"] / base - 1.0
        print(f"| {row['recipe']} | {row['val_loss']:.4f} | {row['relative']:+.2%} | {row['train_loss']:.4f} | "
              f"{row['seconds']:.0f} |")
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    run_main(main)
