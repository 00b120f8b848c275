"""Samplers' index arrays on disk, memory-mapped: built once per machine and shared by every rank on it.

A sampler's arrays grow with the corpus: the split's document ids, their lengths, and per epoch the document order,
the stream's offsets and the sample permutation (PackedDataset: about 40 bytes a document and 8 a sample; 1.1 GB at
20M documents, 31B tokens). Every rank draws any sample itself (the global batch is a function of (seed, step)), so
every rank held every array: eight copies on a node of eight GPUs, 55 GB each at a billion documents.

Megatron-LM builds its document, sample and shuffle indices once and memory-maps them; megalm does the same. The
first process that needs an array builds it under a file lock (`fcntl.flock`) and writes it as .npy (numpy's format,
renamed into place once complete); every other process waits on the lock and maps the file read-only. A machine then
holds one copy, in its page cache (file-backed pages the kernel may evict), and the ranks skip the build. Arrays
under `MIN_BYTES` stay in memory (a file is not worth it); a directory that cannot be written or locked is said in
one log line, and the arrays are then built in each process's memory, as before.

Files are named by a digest of everything their values are a function of (the documents' lengths, the split, the
sampler, seq_length, seed, epoch and `FORMAT`): a changed dataset or config reads new files, never stale ones.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from megalm.data.files import write_atomically

log = logging.getLogger(__name__)

FORMAT = 1  # bump when what an array holds changes: old files are then never read
MIN_BYTES = 16 << 20  # smaller arrays stay in memory: a file and a lock cost more than they save


def default_cache_dir() -> str:
    """Where data.cache_dir=null keeps the demo corpus and the sampler index files: $XDG_CACHE_HOME/megalm, else
    ~/.cache/megalm."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megalm")


class IndexFiles:
    """The arrays of one sampler (or one split), named by `key`: everything their values depend on. `directory`
    None keeps every array in memory (a sampler made outside a run's config: tests, tools)."""

    def __init__(self, directory: str | Path | None, key: tuple, min_bytes: int = MIN_BYTES) -> None:
        self.directory = None if directory is None else Path(directory).expanduser()
        self.digest = hashlib.blake2b(repr((FORMAT, *key)).encode(), digest_size=12).hexdigest()
        self.min_bytes = min_bytes

    def arrays(self, name: str, nbytes: int, build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """`build()`'s arrays: mapped from this machine's files when an earlier process (or this one) wrote them,
        else built and, past `min_bytes` (`nbytes`: their size, known before building), written for the others."""
        if self.directory is None or nbytes < self.min_bytes:
            return build()
        stem = self.directory / f"{self.digest}-{name}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            found = _mapped(stem, nbytes)
            if found is not None:
                return found
            with open(f"{stem}.lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                found = _mapped(stem, nbytes)  # another process built them while this one waited
                if found is not None:
                    return found
                built = build()
                size = sum(a.nbytes for a in built.values())
                if size != nbytes:  # the caller's size is what a reader checks the files against
                    raise RuntimeError(f"sampler index {name}: {size} bytes built, {nbytes} announced")
                try:
                    _write(stem, built)
                except OSError as e:  # a full disk or quota: this process keeps what it built
                    _say_unusable(str(self.directory), str(e.strerror or e))
                    return built
                log.info("sampler index %s (%.1f MB) written to %s for the other processes to map", name, size / 1e6,
                         self.directory)
                found = _mapped(stem, nbytes)
                return built if found is None else found  # mapped: the built copy goes
        except OSError as e:  # no directory, no lock (a filesystem without flock)
            _say_unusable(str(self.directory), str(e.strerror or e))
            return build()


@functools.cache  # one line for each directory (and reason), however many arrays meet it
def _say_unusable(directory: str, why: str) -> None:
    log.warning("data.cache_dir %s cannot hold the sampler's index files (%s): every process builds them in its own "
                "memory; set data.cache_dir to a writable local directory", directory, why)


def _listing(stem: Path) -> Path:
    return stem.with_name(f"{stem.name}.fields")


def _mapped(stem: Path, nbytes: int) -> dict[str, np.ndarray] | None:
    """The arrays at `stem`, memory-mapped read-only, or None when they are not all there and whole: `nbytes` in all
    (a damaged file, an empty one that a crash left before its data reached the disk, is built and written again)."""
    listing = _listing(stem)
    if not listing.is_file():
        return None
    try:
        fields = listing.read_text().split()
        arrays = {field: np.load(f"{stem}.{field}.npy", mmap_mode="r") for field in fields}
        if sum(a.nbytes for a in arrays.values()) != nbytes:
            raise ValueError(f"{sum(a.nbytes for a in arrays.values())} bytes, {nbytes} expected")
        return arrays
    except (OSError, ValueError, EOFError) as e:  # a truncated .npy: its header promises more than the file holds
        log.warning("sampler index %s is damaged (%s); building it again", stem, e)
        listing.unlink(missing_ok=True)
        return None


def _write(stem: Path, arrays: dict[str, np.ndarray]) -> None:
    """Each array as .npy, then the listing of their names: each file is on the disk before it is renamed into
    place, and the listing goes last, so a reader that finds the listing finds every array whole."""
    for field, array in arrays.items():
        write_atomically(Path(f"{stem}.{field}.npy"), lambda f, array=array: np.save(f, array))
    write_atomically(_listing(stem), lambda f: f.write(" ".join(arrays).encode()))
