"""The demo corpus: the running interpreter's own standard library, byte-tokenized.

`megalm-train` with no arguments must work offline on any machine, so the default data is
something every Python install already has: the .py files of its stdlib (about 10 MB of real,
structured text). It is tokenized once and cached under a directory named by the Python version
and a hash of the file list, so later runs open it instantly and a different Python gets its own
copy. Two processes building at once is safe: each writes temporary files and moves them into place
atomically; the loser simply uses the winner's identical result.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import sysconfig
import time
from pathlib import Path

from megalm.data.index_cache import default_cache_dir
from megalm.data.indexed import DatasetExistsError, IndexedDataset, dataset_exists
from megalm.data.preprocess import preprocess
from megalm.data.tokenizer import ByteTokenizer
from megalm.errors import DataError

log = logging.getLogger(__name__)

EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "lib2to3", "__pycache__"})


def demo_source_files(source_dir: str) -> list[Path]:
    """The *.py files under source_dir, outside test/tooling directories, sorted by relative path."""
    root = Path(source_dir)
    found = []
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS and not d.startswith(".")]
        found.extend(Path(dirpath, n) for n in names if n.endswith(".py") and not n.startswith("."))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _try_open(prefix: str) -> bool:
    try:
        IndexedDataset(prefix)
    except DataError:
        return False
    return True


def demo_corpus(cache_dir: str | None = None, source_dir: str | None = None) -> str:
    """The prefix of the cached demo dataset, building it on first use. `source_dir` replaces the
    stdlib (tests use a small fake tree)."""
    source = os.path.abspath(source_dir or sysconfig.get_paths()["stdlib"])
    if not os.path.isdir(source):
        raise DataError(f"demo corpus source {source} is not a directory; use data=synthetic or data=indexed")
    files = demo_source_files(source)
    if not files:
        raise DataError(f"no .py files under {source} for the demo corpus; use data=synthetic or "
                        "data=indexed")
    digest = hashlib.sha256(source.encode())
    for path in files:
        digest.update(f"{path.relative_to(source).as_posix()}\t{path.stat().st_size}\n".encode())
    version = f"py{sys.version_info.major}.{sys.version_info.minor}"
    cache = os.path.expanduser(cache_dir or default_cache_dir())
    directory = os.path.join(cache, f"{version}-{digest.hexdigest()[:12]}")
    prefix = os.path.join(directory, "stdlib")
    if _try_open(prefix):
        return prefix

    log.info("building the demo corpus from %d files under %s into %s (once; later runs reuse it)",
             len(files), source, directory)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create the demo corpus cache {directory} ({e.strerror}); "
                        "set data.cache_dir to a writable directory") from None
    # A leftover (corrupt or half-written) dataset is replaced; a concurrent build of the same files
    # writes identical bytes, so whichever replace lands last changes nothing. DatasetExistsError:
    # another process finished first; wait below until its .idx is in place.
    with contextlib.suppress(DatasetExistsError):
        preprocess(files, prefix, ByteTokenizer(), overwrite=dataset_exists(prefix), show_progress=False)
    deadline = time.monotonic() + 60.0
    while not _try_open(prefix):
        if time.monotonic() > deadline:
            IndexedDataset(prefix)  # raise its error
        time.sleep(0.1)
    return prefix
