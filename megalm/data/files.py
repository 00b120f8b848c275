"""What both on-disk dataset formats (megalm's, megalm/data/indexed.py, and Megatron-LM's,
megalm/data/megatron_format.py) share about their files: which names a dataset occupies, durable renames,
and `TokenFileWriter`, the writer both formats' writers build on."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

import numpy as np

from megalm.data.tokenizer import build_tokenizer
from megalm.errors import DataError

SIDECAR_SUFFIX = ".megalm.json"  # next to a Megatron-format dataset: its tokenizer, vocab and eod (megatron_format)


class DatasetExistsError(DataError):
    """The output dataset already exists and overwriting was not asked for."""


def dataset_files(prefix: str) -> list[str]:
    """The files of a dataset (.bin, .idx, a Megatron dataset's sidecar) that exist at `prefix`."""
    return [f"{prefix}{ext}" for ext in (".bin", ".idx", SIDECAR_SUFFIX) if os.path.exists(f"{prefix}{ext}")]


def dataset_exists(prefix: str) -> bool:
    """Whether any file of a dataset (.bin, .idx, or a Megatron dataset's sidecar) is at `prefix`."""
    return bool(dataset_files(prefix))


def exists_error(prefix: str, how: str) -> DatasetExistsError:
    """The refusal to write a dataset over files at `prefix`, naming those that exist (a stale sidecar alone too)."""
    found = dataset_files(prefix)
    return DatasetExistsError(f"{' and '.join(found)} already exist{'s' if len(found) == 1 else ''}; pass {how} "
                              "to replace them, or choose another output prefix")


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


def write_atomically(path: Path, write: Callable[[IO[bytes]], Any]) -> None:
    """`write(file)` into a temporary name (this host's and process's), synced, then renamed to `path`; the
    temporary file is removed whatever happens (a full disk leaves no partial file behind)."""
    tmp = path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


_Writer = TypeVar("_Writer", bound="TokenFileWriter")


def id_outside_vocab(ids: np.ndarray, vocab_size: int) -> int | None:
    """The first of the lowest and the highest of `ids` that lies outside [0, vocab_size), or None: every reader
    and writer of token files checks its ids with it."""
    if not ids.size:
        return None
    lo, hi = int(ids.min()), int(ids.max())
    return lo if lo < 0 else hi if hi >= vocab_size else None


class TokenFileWriter(ABC):
    """Streams documents into PREFIX.bin and the format's other files; nothing is visible under PREFIX until
    `finalize()`.

    What both formats do alike: every document is checked (1-D, integer ids inside the vocab) and written
    to .bin followed by the eod token, so the samplers never need the tokenizer; every file is written under
    a temporary name in PREFIX's directory and moved into place only when complete (`_publish`). A format
    supplies its token dtype and vocab limit, its bookkeeping per document (`_record`) and its other files
    and their order (`_finish`). `eod_id` defaults to the eod of the tokenizer `tokenizer_spec` describes.
    Use as a context manager (or call `abort()`) so that an error leaves no temporary files behind.
    """

    def __init__(self, prefix: str, vocab_size: int, tokenizer_spec: str, eod_id: int | None, overwrite: bool, *,
                 dtype: np.dtype, max_vocab: int, vocab_note: str = "", temporary: tuple[str, ...]) -> None:
        """`max_vocab` is a power of two (the error names it 2**k, then `vocab_note`); `temporary` lists the
        extensions of the files written under temporary names, "bin" among them."""
        self.prefix = os.fspath(prefix)
        if vocab_size <= 0 or vocab_size > max_vocab:
            raise ValueError(f"vocab_size={vocab_size} must be in [1, 2**{max_vocab.bit_length() - 1}]{vocab_note}")
        if eod_id is None:
            eod_id = build_tokenizer(tokenizer_spec).eod_id
        if not 0 <= eod_id < vocab_size:
            raise ValueError(f"eod_id={eod_id} is outside the vocab [0, {vocab_size})")
        self.vocab_size = int(vocab_size)
        self.tokenizer_spec = tokenizer_spec
        self.eod_id = int(eod_id)
        self.overwrite = overwrite
        self.dtype = dtype
        if not overwrite:
            self._check_absent()
        self._directory = os.path.dirname(os.path.abspath(self.prefix))
        os.makedirs(self._directory, exist_ok=True)
        base = os.path.basename(self.prefix)
        tag = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._tmp = {ext: os.path.join(self._directory, f".{base}.{ext}.tmp-{tag}") for ext in temporary}
        self._bin = open(self._tmp["bin"], "wb")  # noqa: SIM115 - closed in finalize/abort
        self._eod = np.array([self.eod_id], dtype=self.dtype).tobytes()
        self._num_docs = 0
        self._num_tokens = 0
        self._done = False

    @property
    def num_docs(self) -> int:
        return self._num_docs

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def _check_absent(self) -> None:
        if dataset_exists(self.prefix):
            raise exists_error(self.prefix, "--overwrite (overwrite=True)")

    def _check_length(self, num_tokens: int) -> None:  # noqa: B027 - optional: no limit unless a format sets one
        """Refuse a document of `num_tokens` tokens (eod not counted) that the format cannot store."""

    @abstractmethod
    def _record(self, length: int) -> None:
        """Note in the index a document of `length` tokens (eod included) just written to .bin."""

    @abstractmethod
    def _finish(self) -> None:
        """Write and fsync the format's other temporary files (.bin is complete), then `_publish` them all."""

    def add_document(self, tokens: list[int] | np.ndarray) -> None:
        """Append one document; the eod token is added after it."""
        if self._done:
            raise RuntimeError("add_document after finalize/abort")
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"a document is a 1-D sequence of token ids, got shape {arr.shape}")
        self._check_length(arr.size)
        if arr.size:
            if not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
            if (bad := id_outside_vocab(arr, self.vocab_size)) is not None:
                raise DataError(f"token id {bad} is outside the vocab [0, {self.vocab_size}) of "
                                f"{self.prefix}; the tokenizer and vocab_size do not match")
            self._bin.write(arr.astype(self.dtype, copy=False).tobytes())
        self._bin.write(self._eod)
        self._num_docs += 1
        self._num_tokens += arr.size + 1
        self._record(arr.size + 1)

    @contextlib.contextmanager
    def _write_temporary(self, ext: str, mode: str = "wb") -> Iterator[IO]:
        """Open the temporary file for `ext`; flush and fsync it when the block ends."""
        with open(self._tmp[ext], mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())

    def finalize(self) -> None:
        """fsync every file and move it into place, the index last (the format's `_finish` gives the order)."""
        if self._done:
            raise RuntimeError("finalize called twice")
        try:
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
            self._finish()
        except BaseException:
            self.abort()
            raise
        self._done = True

    def _publish(self, files: list[tuple[str, str]], stale: tuple[str, ...] = ()) -> None:
        """Move the fsynced (temporary, final) files into place in the given order, remove the `stale` files
        that a replaced dataset may have left, and fsync the directory.

        Each os.replace is atomic and the index comes last, so a reader never sees a half-written dataset.
        Without overwrite, the absence of PREFIX is checked again: another writer may have finished meanwhile.
        """
        if not self.overwrite:
            self._check_absent()
        for tmp, final in files:
            os.replace(tmp, final)
        for path in stale:
            if os.path.exists(path):
                os.remove(path)
        fsync_dir(self._directory)

    def abort(self) -> None:
        """Drop the temporary files (nothing under PREFIX was touched)."""
        self._done = True
        if not self._bin.closed:
            self._bin.close()
        for path in self._tmp.values():
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self: _Writer) -> _Writer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._done:
            self.abort()
