"""`megalm-estimate`: how much memory each rank of a layout takes and how fast its step runs, before renting GPUs;
with `--search`, which layouts fit and which runs fastest.

    megalm-estimate model=8b model.seq_length=8192 parallel.tp=8 parallel.pp=4 parallel.sequence_parallel=true \
        precision=bf16 --world 256 --gpu h100 --json
    megalm-estimate model=70b model.seq_length=8192 trainer.global_batch_size=1024 --world 1024 --gpu h100 --search

rank.py runs one rank of a layout under fake tensors and a fake process group (docs/estimate.md); search.py
enumerates layouts, prices them by a closed form and confirms the best with rank.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import sys
from typing import Any

from megalm.config.checks import DEMO_DATA_WARNING, window_within_samples
from megalm.estimate.layout_search import search, search_table
from megalm.estimate.rank import (
    AUTO_PRECISION,
    BATCH_DEFAULTS,
    GIB,
    HBM_BYTES,
    RAMP_NOT_SEARCHED,
    RAMP_PRICED_WHOLE,
    RankEstimate,
    batch_overrides,
    bubble_factor,
    estimate,
    estimate_rank,
    gpu_precision,
    roles,
    run_step,
    whole_batch,
)
from megalm.measure.op_cost import GPUS

__all__ = ["BATCH_DEFAULTS", "RankEstimate", "batch_overrides", "bubble_factor", "estimate", "estimate_rank", "main",
           "roles", "run_step", "search"]


def _figure(value: float, places: int) -> str:
    """`value` with `places` decimals, or 3 significant digits where those decimals would print a tiny model's
    seconds or TFLOP as 0.000."""
    return f"{value:.{places}f}" if value == 0 or abs(value) >= 10.0 ** (1 - places) else f"{value:.3g}"


def _table(result: dict[str, Any]) -> str:
    gib = lambda b: f"{b / GIB:.2f}"  # noqa: E731
    lines = [f"{result['model']} on {result['world']} x {GPUS[result['gpu']].name} "
             f"({HBM_BYTES[result['gpu']] / GIB:.0f} GiB): {result['layout']}",
             "| role | rank | params | grads | optimizer | activations | host | reserve | peak GiB | TFLOP | "
             "compute s | comm s | hidden comm s |", "| --- " * 13 + "|"]
    for r in result["ranks"]:
        lines.append(f"| {r['role']} | {r['rank']} | {gib(r['param_bytes'])} | {gib(r['grad_bytes'])} | "
                     f"{gib(r['optimizer_bytes'])} | {gib(r['activation_bytes'])} | {gib(r['host_bytes'])} | "
                     f"{gib(r['reserve_bytes'])} | {gib(r['peak_bytes'])} | {_figure(r['flops'] / 1e12, 1)} | "
                     f"{_figure(r['compute_s'], 3)} | {_figure(r['comm_s'], 3)} | {_figure(r['hidden_comm_s'], 3)} |")
    lines.append(f"step {_figure(result['step_time_s'], 3)} s (bubble x{result['bubble_factor']:.2f}), MFU "
                 f"{result['mfu']:.1%}, {result['tokens_per_s']:,.0f} tokens/s; "
                 + ("fits" if result["fits"] else "does NOT fit") + " in device memory")
    return "\n".join(lines)


def no_fit(result: dict[str, Any], world: int, json_printed: bool) -> str:
    """`--search`'s line when layouts were priced and none fits: the counts, and the fixes that apply."""
    fixes = ["add GPUs", "shorten model.seq_length"] + (["lower trainer.micro_batch_size"]
                                                         if result["micro_batch"] > 1 else [])
    notes = f" ({len(result['notes'])} notes: --json lists them)" if result["notes"] and not json_printed else ""
    return (f"none of the {result['confirmed']} layouts the estimator ran (of {result['fit_closed_form']} the closed "
            f"form fits, {result['candidates']} in all) fits {world} GPUs of {result['hbm_bytes'] / GIB:.1f} GiB at "
            f"this batch; {', '.join(fixes[:-1])} or {fixes[-1]}{notes}")


def _not_the_demo_data_warning(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(DEMO_DATA_WARNING)


WINDOW_PRICED_WHOLE = ("model.sliding_window: priced as the CPU trace runs it, SDPA on blocks of queries against the "
                       "keys their window reaches under a band mask: attention's FLOPs are each block's rectangle, "
                       "about twice the band's from a 64-token window on, and a block's scores count as memory, "
                       "where a GPU's varlen kernel (window_size) computes the band alone and holds no scores, so step "
                       "time and memory are upper bounds; --search prices its context parallelism as Ulysses alone "
                       "(rings refuse a window)")


def main(argv: list[str] | None = None) -> int:
    """megalm-estimate OVERRIDES... --world N --gpu h100 [--json]."""
    parser = argparse.ArgumentParser(prog="megalm-estimate", description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="megalm-train's Hydra overrides (model=8b parallel.tp=8 ...)")
    parser.add_argument("--world", type=int, required=True, help="number of GPUs of the run")
    parser.add_argument("--gpu", default="h100", type=str.lower, help=f"one of {', '.join(sorted(GPUS))}")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--search", action="store_true", help="enumerate the layouts that fit, best tokens/s first "
                        "(the overrides give the model, sequence length, batch and precision)")
    parser.add_argument("--top", type=int, help="--search: how many layouts to confirm and print (default 5)")
    parser.add_argument("--gpu-memory", type=float, help="--search: GiB of device memory per GPU (default: --gpu's)")
    args = parser.parse_intermixed_args(argv)  # overrides before and after the flags
    megalm_log = logging.getLogger("megalm")
    level = megalm_log.level
    megalm_log.setLevel(logging.WARNING)  # the trainers' start-up lines are not the answer
    # nor is the warning that a preset on data=demo trains no language model: the estimate prices its shapes only
    megalm_log.addFilter(_not_the_demo_data_warning)
    try:
        return _answer(args)
    finally:  # a caller in the same process (a test) keeps its logging: the filter had hidden the warning after it
        megalm_log.setLevel(level)
        megalm_log.removeFilter(_not_the_demo_data_warning)


def _answer(args: argparse.Namespace) -> int:
    """main's work on its parsed arguments: print the estimate (or the search) or one error line."""
    from megalm.config.compose import compose_config
    from megalm.errors import ConfigError, MegalmError

    cpu_run = ["trainer.device=cpu", "trainer.hang_minutes=0", "trainer.init_hang_minutes=0",
               "logging.tensorboard=false"]
    unfit = None  # a search's result with no layout: --json prints it beside the error line
    try:
        if args.world < 1:
            raise ConfigError(f"--world {args.world} must be >= 1 (the number of GPUs of the run)")
        if args.top is not None and args.top < 1:
            raise ConfigError(f"--top {args.top} must be >= 1")
        if args.gpu_memory is not None and not 0 < args.gpu_memory < math.inf:  # (NaN fails both)
            raise ConfigError(f"--gpu-memory {args.gpu_memory} must be a finite number > 0 GiB (or left out for "
                              "--gpu's)")
        unread = [flag for flag, value in (("--top", args.top), ("--gpu-memory", args.gpu_memory))
                  if value is not None and not args.search]
        if unread:
            verb, them = ("apply", "them") if len(unread) > 1 else ("applies", "it")
            raise ConfigError(f"{' and '.join(unread)} {verb} to --search; add --search, or drop {them}")
        given = gpu_precision(args.overrides)
        whole = whole_batch(given, None if args.search else args.world)
        with contextlib.redirect_stdout(sys.stderr):
            if args.search:
                memory = int(args.gpu_memory * GIB) if args.gpu_memory else None
                result = search([*whole, *cpu_run], args.world, args.gpu, args.top or 5, memory_bytes=memory)
                if not result["layouts"]:
                    unfit = result
                    raise ConfigError(result["why_none"] or no_fit(result, args.world, bool(args.json)))
                text = search_table(result)
            else:
                overrides = batch_overrides(whole, args.world)
                result = estimate([*overrides, *cpu_run], args.world, args.gpu)
                if overrides is not whole:
                    result["notes"].append(f"batch not given: {BATCH_DEFAULTS}")
                text = _table(result)
        if given is not args.overrides:
            result["notes"].append(AUTO_PRECISION)
        if whole is not given:
            result["notes"].append(RAMP_NOT_SEARCHED if args.search else RAMP_PRICED_WHOLE)
        # a window of at least the sequence is priced as full attention
        if window_within_samples(compose_config(given).model) is not None:
            result["notes"].append(WINDOW_PRICED_WHOLE)
    except MegalmError as error:  # a config's, and the data's or a checkpoint's the estimated step reads
        if unfit is not None and args.json:  # the search's counts and notes, for a script
            print(json.dumps(unfit, indent=1))
        print(f"error: {error}", file=sys.stderr)  # megalm-train's form
        return 2
    print(json.dumps(result, indent=1) if args.json else "\n".join([text, *result["notes"]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
