"""User-facing errors.

Anything the user can fix (a config value, a path, a corrupt file, an incompatible checkpoint) is
raised as `MegalmError` with a one-line message that names the problem and the fix. The CLI entry
points print it as a single line and exit non-zero; with `debug=true` the traceback is kept.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

REQUEUE_EXIT_CODE = 75  # sysexits.h EX_TEMPFAIL, "try again": a preempted run asks its launcher to requeue it


class MegalmError(Exception):
    """An error caused by user input; its message is one line that says what to change."""


class ConfigError(MegalmError):
    """A config value is invalid or inconsistent with another one."""


class DataError(MegalmError):
    """A data file is missing, corrupt, or does not match the model."""


class CheckpointError(MegalmError):
    """A checkpoint is missing, corrupt, or was written by a different model."""


class InteropError(MegalmError):
    """A model or directory that cannot be mapped between megalm and Hugging Face (one line, names why)."""


@contextmanager
def one_line_errors(debug: bool = False) -> Iterator[None]:
    """For CLI entry points: a MegalmError (or an OSError: a path that cannot be written) inside becomes
    `error: <message>` on stderr and exit code 2; `debug` keeps the traceback."""
    try:
        yield
    except (MegalmError, OSError) as e:
        if debug:
            raise
        print(f"error: {os_error_line(e) if isinstance(e, OSError) else e}", file=sys.stderr)
        sys.exit(2)


def os_error_line(e: OSError) -> str:
    """An OSError as one line (an output path under a file, a read-only or full disk): what failed, on which path."""
    paths = " -> ".join(str(p) for p in (e.filename, e.filename2) if p is not None)
    return f"{e.strerror or type(e).__name__}: {paths}; choose a path this user can write to" if paths else str(e)
