"""The command line the benchmark tools share: flags for argparse, key=value Hydra overrides anywhere among them."""

from __future__ import annotations

import argparse
import sys


def parse_flags_and_overrides(parser: argparse.ArgumentParser,
                              argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """`parser`'s flags from `argv` (default: the command line) and the Hydra overrides (key=value) among them, set
    aside first: an override may follow a list flag (--seq 1024 2048 model=125m), which would otherwise take it."""
    argv = sys.argv[1:] if argv is None else argv
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    return parser.parse_args([a for a in argv if a not in overrides]), overrides
