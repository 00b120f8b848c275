"""The on-disk token dataset: PREFIX.bin (all tokens) + PREFIX.idx (header and document offsets).

Pretraining corpora are far larger than memory, so tokens live in one flat file that is memory-
mapped and read by slicing: a document is `tokens[offsets[i]:offsets[i + 1]]`. The writer appends
the end-of-document token to every document, so the samplers never need the tokenizer. The .idx
also records the vocab size and the tokenizer spec, so a run can check the model's vocab and
rebuild the tokenizer the data was made with.

.idx layout (little-endian): the header struct below, the tokenizer spec (utf-8, length given in
the header), then int64 offsets[num_docs + 1] with offsets[0] == 0 and offsets[-1] == num_tokens.
Both files are written under temporary names, fsynced and moved into place with os.replace, .idx
last, so a reader never sees a half-written dataset.

`IndexedDataset` also reads Megatron-LM's MMIDIDX files as they are (megalm/data/megatron_format.py);
the .idx's magic bytes say which format a prefix holds.
"""

from __future__ import annotations

import os
import struct
from array import array

import numpy as np

from megalm.data.files import SIDECAR_SUFFIX, TokenFileWriter, id_outside_vocab
from megalm.data.files import DatasetExistsError as DatasetExistsError  # re-exported: preprocess, demo
from megalm.data.files import dataset_exists as dataset_exists  # re-exported: preprocess, demo
from megalm.data.tokenizer import Tokenizer
from megalm.errors import DataError

MAGIC = b"MEGALMDS"
VERSION = 1
# magic, version, dtype code, num_docs, num_tokens, vocab_size, eod_id, spec length (bytes)
_HEADER = struct.Struct("<8sIIQQQqI")
_DTYPE_CODES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    return _DTYPE_CODES[1] if vocab_size <= 65536 else _DTYPE_CODES[2]


class IndexedDatasetWriter(TokenFileWriter):
    """Streams documents into PREFIX.bin/.idx; nothing is visible under PREFIX until `finalize()`.

    `eod_id` defaults to the eod of the tokenizer `tokenizer_spec` describes. Use as a context manager
    (or call `abort()`) so that an error leaves no temporary files behind.
    """

    def __init__(self, prefix: str, vocab_size: int, tokenizer_spec: str, eod_id: int | None = None,
                 overwrite: bool = False) -> None:
        super().__init__(prefix, vocab_size, tokenizer_spec, eod_id, overwrite, dtype=token_dtype(vocab_size),
                         max_vocab=2**32, temporary=("bin", "idx"))
        self._offsets = array("q", [0])

    def _record(self, length: int) -> None:
        self._offsets.append(self._offsets[-1] + length)

    def _finish(self) -> None:
        """Write the .idx, then move .bin and .idx into place (.bin first, .idx last)."""
        spec = self.tokenizer_spec.encode("utf-8")
        header = _HEADER.pack(MAGIC, VERSION, 1 if self.dtype == _DTYPE_CODES[1] else 2, self.num_docs,
                              self.num_tokens, self.vocab_size, self.eod_id, len(spec))
        with self._write_temporary("idx") as f:
            f.write(header)
            f.write(spec)
            f.write(np.frombuffer(self._offsets, dtype=np.int64).astype("<i8", copy=False).tobytes())
        self._publish([(self._tmp["bin"], f"{self.prefix}.bin"), (self._tmp["idx"], f"{self.prefix}.idx")],
                      stale=(f"{self.prefix}{SIDECAR_SUFFIX}",))  # left by a Megatron-format dataset replaced here


def missing_dataset(prefix: str, tokenizer: Tokenizer | str | None = None, key: str = "data.path"
                    ) -> DataError | None:
    """Why `prefix` (expanded) names no PREFIX.bin/PREFIX.idx pair, a hint for the likely slip (a .bin named, a text
    file, a directory holding datasets) told to `key`, the setting that named it; None when both files are there."""
    idx_path, bin_path = f"{prefix}.idx", f"{prefix}.bin"

    def named(value: str) -> str:
        return f"{key}={value}" if key == "data.path" else f"{key} {value}"

    for path in (idx_path, bin_path):
        if os.path.isfile(path):
            continue
        if prefix.endswith((".bin", ".idx")) and os.path.isfile(prefix):
            return DataError(f"{named(prefix)} names a file; it is the prefix of PREFIX.bin/PREFIX.idx: write "
                             f"{named(prefix[:-4])}")
        if os.path.isfile(prefix):  # text itself (docs.jsonl): the tokenized files are made from it first
            stem = os.path.splitext(prefix)[0]
            spec = tokenizer if isinstance(tokenizer, str) or tokenizer is None else tokenizer.spec
            with_tokenizer = f" --tokenizer {spec}" if spec not in (None, "byte") else ""  # data.tokenizer's
            return DataError(f"{named(prefix)} is a file, not a tokenized corpus: tokenize it with "
                             f"megalm-preprocess --input {prefix} --output-prefix {stem}{with_tokenizer}, then "
                             f"write {named(stem)}")
        if os.path.exists(path):
            return DataError(f"{named(prefix)}: {path} is not a file; point {key} at the prefix "
                             "megalm-preprocess wrote")
        if os.path.isdir(prefix):  # a directory holding a dataset: the prefix is one of its files' stems
            held = sorted(name[:-4] for name in os.listdir(prefix) if name.endswith(".idx"))
            some = ", ".join(os.path.join(prefix, h) for h in held[:3]) + (f" and {len(held) - 3} more"
                                                                          if len(held) > 3 else "")
            inside = (f"it holds {some}: write {named(os.path.join(prefix, held[0]))}" if held else
                      f"it holds no .idx file: point {key} at the prefix megalm-preprocess wrote "
                      "(PREFIX.bin/PREFIX.idx)")
            return DataError(f"{named(prefix)} is a directory, not a dataset's prefix; {inside}")
        return DataError(f"{named(prefix)}: {path} not found; build it with "
                        f"megalm-preprocess --input ... --output-prefix {prefix}")
    return None


class IndexedDataset:
    """Read-only, memory-mapped view of PREFIX.bin/.idx, megalm's format or Megatron-LM's; validated when opened.

    The .idx's magic bytes pick the format (`self.format`: "megalm" or "megatron"). `tokenizer` (a spec
    such as "byte" or a tokenizer.json path, or a Tokenizer) is used only for a Megatron-LM dataset
    without megalm's sidecar PREFIX.megalm.json: Megatron's files do not record vocab, eod or
    tokenizer, so they come from there. Megatron documents that do not end with eod read as if they
    did (one eod appended virtually), so every document of either format ends with eod.
    """

    def __init__(self, prefix: str, tokenizer: Tokenizer | str | None = None) -> None:
        self.prefix = prefix = os.path.expanduser(os.fspath(prefix))  # as blend prefixes and data.tokenizer
        idx_path, bin_path = f"{prefix}.idx", f"{prefix}.bin"
        if (missing := missing_dataset(prefix, tokenizer)) is not None:
            raise missing
        with open(idx_path, "rb") as f:
            head = f.read(16)
        from megalm.data import megatron_format  # imports this module: not at the top

        self._add_eod: np.ndarray | None = None  # per document: append eod virtually (Megatron data only)
        if head.startswith(megatron_format.MAGIC) or (len(head) < len(megatron_format.MAGIC)
                                                      and head.startswith(b"MM")):
            m = megatron_format.open_megatron(prefix, tokenizer)
            self.format = "megatron"
            self.dtype = m.tokens.dtype
            self._tokens, self._offsets, self._add_eod = m.tokens, m.offsets, m.add_eod
            self._num_docs = len(m.offsets) - 1
            self._vocab_size, self._eod_id, self._spec = m.vocab_size, m.eod_id, m.tokenizer_spec
            self._num_tokens = int(m.offsets[-1]) + (int(m.add_eod.sum()) if m.add_eod is not None else 0)
            self._vocab_claimed = m.vocab_claimed
        else:
            self._vocab_claimed = False
            self.format = "megalm"
            self._open_megalm(prefix, idx_path, bin_path)
        # get() returns this dtype: the stored one, or int64 if a virtual eod would not fit in it
        fits = np.can_cast(np.min_scalar_type(self._eod_id), self.dtype)
        self._out_dtype = self.dtype if self._add_eod is None or fits else np.dtype(np.int64)
        # Every read is checked against the vocab (a max over the slice, microseconds) unless the dtype cannot
        # hold an id outside it: an out-of-range id would otherwise reach the embedding, where a GPU reports
        # only "device-side assert triggered" (a Megatron file's vocab is the sidecar's or the tokenizer's
        # claim, probed on its first tokens only; a damaged megalm file was checked when written, not since).
        info = np.iinfo(self.dtype)
        self._ids_checked = info.min < 0 or info.max >= self._vocab_size

    def _open_megalm(self, prefix: str, idx_path: str, bin_path: str) -> None:
        def corrupt(why: str) -> DataError:
            return DataError(f"dataset {prefix} is corrupt ({why}); re-run megalm-preprocess --input ... "
                             f"--output-prefix {prefix} --overwrite")

        idx_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            head = f.read(_HEADER.size)
            if len(head) < _HEADER.size:
                raise corrupt(f"{idx_path} is truncated: {idx_size} bytes, shorter than its header")
            magic, version, code, num_docs, num_tokens, vocab_size, eod_id, spec_len = _HEADER.unpack(head)
            if magic != MAGIC:
                raise corrupt(f"{idx_path} is neither a megalm (MEGALMDS) nor a Megatron-LM (MMIDIDX) index: "
                              "bad magic bytes")
            if version != VERSION:
                raise corrupt(f"{idx_path} has format version {version}, this megalm reads {VERSION}")
            if code not in _DTYPE_CODES:
                raise corrupt(f"{idx_path} has unknown dtype code {code}")
            expected = _HEADER.size + spec_len + 8 * (num_docs + 1)
            if idx_size != expected:
                raise corrupt(f"{idx_path} has {idx_size} bytes, its header implies {expected}")
            try:
                spec = f.read(spec_len).decode("utf-8")
            except UnicodeDecodeError:
                raise corrupt(f"{idx_path} has an undecodable tokenizer spec") from None
        self.dtype = _DTYPE_CODES[code]
        if self.dtype != token_dtype(vocab_size):
            raise corrupt(f"dtype {self.dtype} does not match vocab_size={vocab_size}")
        if not 0 <= eod_id < vocab_size:
            raise corrupt(f"eod id {eod_id} outside the vocab [0, {vocab_size})")
        bin_size = os.path.getsize(bin_path)
        if bin_size != num_tokens * self.dtype.itemsize:
            raise corrupt(f"{bin_path} has {bin_size} bytes, the index expects "
                          f"{num_tokens} tokens * {self.dtype.itemsize} bytes")
        self._offsets = np.memmap(idx_path, dtype="<i8", mode="r", offset=_HEADER.size + spec_len,
                                  shape=(num_docs + 1,))
        if self._offsets[0] != 0 or self._offsets[-1] != num_tokens:
            raise corrupt(f"{idx_path} offsets do not span [0, {num_tokens}]")
        chunk = 1 << 16  # check in slices: a 10^9-document index needs no large temporary (0.5 MB of int64)
        for start in range(0, num_docs, chunk):
            if np.any(np.diff(self._offsets[start:start + chunk + 1]) <= 0):
                raise corrupt(f"{idx_path} document offsets are not increasing")
        if num_tokens:
            self._tokens = np.memmap(bin_path, dtype=self.dtype, mode="r", shape=(num_tokens,))
        else:
            self._tokens = np.zeros(0, dtype=self.dtype)
        self._num_docs = int(num_docs)
        self._num_tokens = int(num_tokens)
        self._vocab_size = int(vocab_size)
        self._eod_id = int(eod_id)
        self._spec = spec

    def __len__(self) -> int:
        return self._num_docs

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod_id(self) -> int:
        return self._eod_id

    @property
    def tokenizer_spec(self) -> str:
        return self._spec

    @property
    def doc_lengths(self) -> np.ndarray:
        """Tokens per document (eod included, virtual ones too), int64 [num_docs]: made anew at each call and not
        kept (8 bytes a document: the samplers keep what they need, memory-mapped from a machine-wide file)."""
        lengths = np.diff(self._offsets).astype(np.int64)
        if self._add_eod is not None:
            lengths += self._add_eod
        return lengths

    def lengths_of(self, ids: np.ndarray) -> np.ndarray:
        """`doc_lengths[ids]`, read from the memory-mapped offsets of those documents alone (a split's, or a slice the
        samplers' lengths digest reads: no process that maps the samplers' files makes the whole `doc_lengths`)."""
        ids = np.asarray(ids, dtype=np.int64)
        lengths = (self._offsets[ids + 1] - self._offsets[ids]).astype(np.int64)
        if self._add_eod is not None:
            lengths += self._add_eod[ids]
        return lengths

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of document i (to its end when length is None).

        A view of the memory map, except for a slice that reaches a virtual eod (a copy).
        """
        if not 0 <= i < self._num_docs:
            raise IndexError(f"document {i} out of range [0, {self._num_docs})")
        start, end = int(self._offsets[i]), int(self._offsets[i + 1])
        stored = end - start
        n = stored + (1 if self._add_eod is not None and self._add_eod[i] else 0)
        if length is None:
            length = n - offset
        if offset < 0 or length < 0 or offset + length > n:
            raise IndexError(f"slice [{offset}, {offset + length}) outside document {i} of {n} tokens")
        if offset + length <= stored or length == 0:
            out = np.asarray(self._tokens[start + offset:start + offset + length]).astype(self._out_dtype,
                                                                                         copy=False)
        else:
            out = np.empty(length, dtype=self._out_dtype)  # the slice ends with the virtual eod
            out[:-1] = self._tokens[start + offset:end]
            out[-1] = self._eod_id
        if self._ids_checked and (bad := id_outside_vocab(out, self._vocab_size)) is not None:
            if self._vocab_claimed:  # the vocab is data.tokenizer's (no sidecar), checked on the first tokens only
                raise DataError(f"document {i} of {self.prefix} holds token id {bad}, outside the vocab [0, "
                                f"{self._vocab_size}) of data.tokenizer={self._spec}; set data.tokenizer to the "
                                "tokenizer the data was made with (this Megatron-LM dataset has no sidecar naming it)")
            raise DataError(f"document {i} of {self.prefix} holds token id {bad}, outside its vocab [0, "
                            f"{self._vocab_size}): the data is damaged or was made with another tokenizer; re-run "
                            f"megalm-preprocess --input ... --output-prefix {self.prefix} --overwrite")
        return out

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.prefix!r}, {self.format} format: {self._num_docs} docs, "
                f"{self._num_tokens} tokens, "
                f"vocab {self._vocab_size}, tokenizer {self._spec!r})")
