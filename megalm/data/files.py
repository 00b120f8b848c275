"""What both on-disk dataset formats (megalm's, megalm/data/indexed.py, and Megatron-LM's,
megalm/data/megatron_format.py) share about their files: which names a dataset occupies, and durable renames."""

from __future__ import annotations

import os

from megalm.errors import DataError

SIDECAR_SUFFIX = ".megalm.json"  # next to a Megatron-format dataset: its tokenizer, vocab and eod (megatron_format)


class DatasetExistsError(DataError):
    """The output dataset already exists and overwriting was not asked for."""


def dataset_exists(prefix: str) -> bool:
    """Whether any file of a dataset (.bin, .idx, or a Megatron dataset's sidecar) is at `prefix`."""
    return any(os.path.exists(f"{prefix}{ext}") for ext in (".bin", ".idx", SIDECAR_SUFFIX))


def fsync_dir(directory: str) -> None:
    """Make the renames inside `directory` durable (best effort: some filesystems refuse directory fsync)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
