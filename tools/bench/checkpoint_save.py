"""Checkpoint save time, synchronous against `trainer.async_save=true`: how long the training loop is blocked, and
how long until the checkpoint is complete (published with `latest`), for the same model in turns (A B A B).

    python tools/bench/checkpoint_save.py                     # the tiny model
    python tools/bench/checkpoint_save.py model=350m --reps 2 # the 350m checkpoint (weights + AdamW: ~4.2 GB)

Arguments without dashes are Hydra overrides. One optimizer step first fills the AdamW moments, so the checkpoint
is the size a run writes. The last line is one JSON object: {"sync": {"blocked_s": [...], "complete_s": [...]},
"async": {...}, "bytes": ...}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from throughput import compose_config  # noqa: E402

from tools.bench.cli import check_counts, parse_flags_and_overrides, run_main  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="saves per mode, in turns (default 3)")
    args, overrides = parse_flags_and_overrides(parser, argv)  # a mistyped flag is an error, not an override
    check_counts(args, "reps")

    from megalm.training import checkpoint as ckpt
    from megalm.training.trainer import Trainer

    root = Path(tempfile.mkdtemp(prefix="megalm-save-bench-"))
    try:
        trainer = Trainer(compose_config(["trainer.keep_last=1", "trainer.compile=false", *overrides]), root / "run")
        trainer.train_step(0)
        results: dict = {mode: {"blocked_s": [], "complete_s": []} for mode in ("sync", "async")}
        size = 0
        for rep in range(args.reps):
            for mode in ("sync", "async"):
                trainer.checkpointer.async_save = mode == "async"  # what save() reads (not the config's copy)
                trainer.step = 2 * rep + (mode == "async") + 1
                start = time.perf_counter()
                path = trainer.save()
                blocked = time.perf_counter() - start
                if (trainer.checkpointer.pending is not None) != (mode == "async"):
                    raise RuntimeError(f"the {mode} row did not save {mode}hronously: it would time the other mode")
                trainer.finish_save()
                complete = time.perf_counter() - start
                results[mode]["blocked_s"].append(round(blocked, 3))
                results[mode]["complete_s"].append(round(complete, 3))
                size = sum(f.stat().st_size for f in path.iterdir())
                assert ckpt.latest_checkpoint(root / "run") == path
                print(f"{mode:5s} rep {rep}: blocked {blocked:.2f} s, complete after {complete:.2f} s "
                      f"({size / 2**30:.2f} GiB)", flush=True)
        for mode in results:
            r = results[mode]
            print(f"{mode:5s}: median blocked {statistics.median(r['blocked_s']):.2f} s, median complete "
                  f"{statistics.median(r['complete_s']):.2f} s")
        results["bytes"] = size
        print(json.dumps(results))
        return results
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    run_main(main)
