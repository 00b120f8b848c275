"""The command line the benchmark tools share: flags for argparse, key=value Hydra overrides anywhere among them."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def parse_flags_and_overrides(parser: argparse.ArgumentParser,
                              argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """`parser`'s flags from `argv` (default: the command line) and the Hydra overrides (key=value) among them, set
    aside first: an override may follow a list flag (--seq 1024 2048 model=125m), which would otherwise take it."""
    argv = sys.argv[1:] if argv is None else argv
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    return parser.parse_args([a for a in argv if a not in overrides]), overrides


def add_timing_flags(parser: argparse.ArgumentParser, what: str, iters: int, warmup: int,
                     warmup_note: str = "") -> None:
    """--iters, --warmup and --json, as the kernel benchmarks take them: `what` names one timed call."""
    parser.add_argument("--iters", type=int, default=iters, help=f"timed {what} (the median is reported)")
    parser.add_argument("--warmup", type=int, default=warmup, help=f"untimed {what} first{warmup_note}")
    parser.add_argument("--json", action="store_true", help="print the results as JSON last")


def check_counts(args: argparse.Namespace, *flags: str) -> None:
    """One-line errors (under `run_main`) for count flags below 1 (--reps, --iters, --steps: 0 left nothing to take
    a median of, or a plan to time)."""
    from megalm.errors import ConfigError

    for flag in flags:
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} {value} must be >= 1")


def run_main(main: Callable[[], object]) -> None:
    """A tool's `main` as megalm-train runs: a user error (a bad override or flag value, a MegalmError, a path that
    cannot be written) prints one `error:` line and exits 2, not a traceback; a `main` that returns an int exit
    status exits with it."""
    from megalm.errors import one_line_errors

    with one_line_errors():
        status = main()
    if isinstance(status, int) and not isinstance(status, bool):
        sys.exit(status)
