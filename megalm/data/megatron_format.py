"""Megatron-LM's MMIDIDX token datasets (PREFIX.bin + PREFIX.idx), read as they are and written by megalm.

Corpora are often tokenized once for Megatron-LM; reading its files directly saves re-tokenizing
terabytes, and writing them lets a corpus made by megalm-preprocess feed a Megatron-LM run.

.idx layout (version 1, little-endian), as Megatron-LM's `megatron/core/datasets/indexed_dataset.py`
writes it: magic b"MMIDIDX\\x00\\x00", <Q version (1), <B dtype code, <Q sequence count S, <Q document
index count D, int32 sequence_lengths[S], int64 sequence_pointers[S] (byte offsets into .bin),
int64 document_indices[D] (the sequence each document starts at, then S: D is documents + 1). A
multimodal index has int8 modes[S] after that; megalm reads text only. A megalm document is one
Megatron document: the concatenation of its sequences.

Megatron's files carry no vocab size, eod id or tokenizer. megalm-preprocess --format megatron writes
them into a sidecar, PREFIX.megalm.json; for files made by Megatron-LM they come from the tokenizer
the caller names (`data.tokenizer`). Megatron may or may not end documents with eod (--append-eod):
a document whose last token is not eod gets one appended virtually at read time, so every megalm
document ends with eod, as the samplers expect. The sidecar's `eod_appended: true` says every
document already does, which spares the check of each document's last token.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megalm.data.files import SIDECAR_SUFFIX, TokenFileWriter, id_outside_vocab, write_atomically
from megalm.data.tokenizer import Tokenizer, build_tokenizer
from megalm.errors import DataError

log = logging.getLogger("megalm")

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document index count
# Megatron-LM's DType enum codes.
DTYPE_CODES = {1: np.dtype("u1"), 2: np.dtype("i1"), 3: np.dtype("<i2"), 4: np.dtype("<i4"), 5: np.dtype("<i8"),
               6: np.dtype("<f8"), 7: np.dtype("<f4"), 8: np.dtype("<u2")}
SIDECAR_FORMAT = "megalm-megatron-sidecar"
SIDECAR_VERSION = 1
_CHUNK = 1 << 16  # elements checked at a time: a 10^9-entry index needs no large temporaries (0.5 MB of int64)
_VOCAB_PROBE = 1 << 20  # tokens checked against the vocab when it comes from the caller, not the sidecar


def megatron_dtype(vocab_size: int) -> np.dtype:
    """Megatron-LM's choice (DType.optimal_dtype): uint16 when vocab_size < 65500, else int32."""
    return DTYPE_CODES[8] if vocab_size < 65500 else DTYPE_CODES[4]


def sidecar_path(prefix: str) -> str:
    return f"{prefix}{SIDECAR_SUFFIX}"


def is_megatron_index(head: bytes) -> bool:
    return head[:len(MAGIC)] == MAGIC


class DocumentOffsets:
    """The token offset of each document and of the end (int64 [num_docs + 1], as a megalm index stores them), read
    from the .idx's memory-mapped arrays at each access rather than held: document i starts at byte
    sequence_pointers[document_indices[i]] (`open_megatron` checked that the sequences lie back to back), and
    document_indices[-1] is the sequence count, the end. A held copy was 8 bytes a document on every rank (160 MB at
    20M documents), made at every open."""

    def __init__(self, pointers: np.ndarray, doc_index: np.ndarray, itemsize: int, num_tokens: int):
        self.pointers, self.doc_index, self.itemsize, self.num_tokens = pointers, doc_index, itemsize, num_tokens

    def __len__(self) -> int:
        return len(self.doc_index)

    def __getitem__(self, key: int | slice | np.ndarray) -> np.int64 | np.ndarray:
        count = len(self.pointers)
        if isinstance(key, (int, np.integer)):  # IndexedDataset.get's two a document: no array made
            sequence = int(self.doc_index[key])
            return np.int64(int(self.pointers[sequence]) // self.itemsize if sequence < count else self.num_tokens)
        sequences = np.asarray(self.doc_index[key], dtype=np.int64)
        if count == 0:  # no sequence: every document is empty
            return sequences * 0
        starts = np.asarray(self.pointers[np.minimum(sequences, count - 1)], dtype=np.int64) // self.itemsize
        return np.where(sequences < count, starts, np.int64(self.num_tokens))[()]

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        return np.asarray(self[:], dtype=dtype)


class DocumentFlags:
    """One bit a document (`np.packbits`), read like the bool array it packs: which documents get a virtual eod. A
    bool array was a byte a document on every rank."""

    def __init__(self, num_docs: int):
        self.bits, self.num_docs, self.count = np.zeros((num_docs + 7) // 8, dtype=np.uint8), num_docs, 0

    def set_from(self, start: int, flags: np.ndarray) -> None:
        """Flags of documents start, start + 1, ... (not set before)."""
        lo, hi = start // 8, (start + len(flags) + 7) // 8
        bits = np.unpackbits(self.bits[lo:hi])  # the bytes they share with their neighbours' flags
        bits[start - 8 * lo:start - 8 * lo + len(flags)] = flags
        self.bits[lo:hi] = np.packbits(bits)
        self.count += int(np.count_nonzero(flags))

    def __len__(self) -> int:
        return self.num_docs

    def __getitem__(self, key: int | slice | np.ndarray) -> np.bool_ | np.ndarray:
        """As a bool array's: an index (negative ones from the end), a slice, an array of indices or a bool mask."""
        if isinstance(key, (int, np.integer)):  # IndexedDataset.get's, once a document: no array made
            if not -self.num_docs <= key < self.num_docs:
                raise IndexError(f"document {key} outside [-{self.num_docs}, {self.num_docs})")
            key = int(key) % self.num_docs
            return np.bool_((int(self.bits[key >> 3]) >> (7 - (key & 7))) & 1)
        if isinstance(key, slice):
            ids = np.arange(*key.indices(self.num_docs))
        else:
            ids = np.asarray(key)
            if ids.dtype == bool:
                if ids.shape != (self.num_docs,):
                    raise IndexError(f"a mask of shape {ids.shape} for {self.num_docs} documents")
                ids = np.flatnonzero(ids)
            ids = ids.astype(np.int64, copy=False)
            if ids.size and (int(ids.min()) < -self.num_docs or int(ids.max()) >= self.num_docs):
                raise IndexError(f"a document index outside [-{self.num_docs}, {self.num_docs})")
            ids = np.where(ids < 0, ids + self.num_docs, ids)
        return ((self.bits[ids >> 3] >> (7 - (ids & 7))) & 1).astype(bool)[()]

    def any(self) -> bool:
        return self.count > 0

    def sum(self) -> int:
        return self.count

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        return np.asarray(np.unpackbits(self.bits, count=self.num_docs).astype(bool), dtype=dtype)


@dataclass
class MegatronData:
    """What IndexedDataset needs from an opened Megatron dataset."""

    tokens: np.ndarray  # the .bin stream (a memmap)
    offsets: DocumentOffsets  # [num_docs + 1]: document i is tokens[offsets[i]:offsets[i + 1]]
    add_eod: DocumentFlags | None  # [num_docs]: append eod virtually; None when no document needs it
    vocab_size: int
    eod_id: int
    tokenizer_spec: str
    vocab_claimed: bool = False  # no sidecar: vocab and eod are the caller's tokenizer's, checked on a probe only


def _fix(prefix: str) -> str:
    return (f"re-run megalm-preprocess --input ... --output-prefix {prefix} --format megatron --overwrite "
            "(or Megatron-LM/tools/preprocess_data.py)")


def _read_sidecar(prefix: str, num_docs: int, num_tokens: int) -> dict | None:
    path = sidecar_path(prefix)
    if not os.path.isfile(path):
        return None
    delete = (f"write it again with megalm-preprocess --sidecar {prefix} --tokenizer <the tokenizer the data was made "
              f"with> --overwrite, or delete it and set data.tokenizer to that tokenizer, or {_fix(prefix)}")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"sidecar {path} is unreadable ({type(e).__name__}); {delete}") from None
    if not isinstance(meta, dict) or meta.get("format") != SIDECAR_FORMAT:
        raise DataError(f"sidecar {path} is not a megalm sidecar (no \"format\": \"{SIDECAR_FORMAT}\"); {delete}")
    if meta.get("version") != SIDECAR_VERSION:
        raise DataError(f"sidecar {path} has version {meta.get('version')!r}, this megalm reads {SIDECAR_VERSION}; "
                        "upgrade megalm or " + delete)
    types = {"tokenizer_spec": str, "vocab_size": int, "eod_id": int, "eod_appended": bool, "num_docs": int,
             "num_tokens": int}
    for key, kind in types.items():
        value = meta.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise DataError(f"sidecar {path}: {key!r} is missing or not a {kind.__name__}; {delete}")
    if (meta["num_docs"], meta["num_tokens"]) != (num_docs, num_tokens):
        raise DataError(f"sidecar {path} describes {meta['num_docs']} documents / {meta['num_tokens']} tokens, "
                        f"{prefix}.idx has {num_docs} / {num_tokens} (stale sidecar?); {delete}")
    return meta


def open_megatron(prefix: str, tokenizer: Tokenizer | str | None = None, read_sidecar: bool = True) -> MegatronData:
    """Validate PREFIX.idx/.bin (MMIDIDX v1) and return documents, eod handling, vocab and tokenizer spec.

    vocab/eod/spec come from the sidecar when there is one (`tokenizer` is then ignored; `read_sidecar` false: not
    read), else from `tokenizer`; with neither, a DataError says to set data.tokenizer. Every error is one line.
    """
    idx_path, bin_path = f"{prefix}.idx", f"{prefix}.bin"

    def corrupt(why: str) -> DataError:
        return DataError(f"dataset {prefix} is corrupt ({why}); {_fix(prefix)}")

    idx_size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        head = f.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise corrupt(f"{idx_path} is truncated: {idx_size} bytes, shorter than Megatron's {_HEADER.size}-byte "
                      "header")
    magic, version, code, seq_count, doc_count = _HEADER.unpack(head)
    if magic != MAGIC:
        raise corrupt(f"{idx_path} is not a Megatron-LM index: bad magic bytes")
    if version != VERSION:
        raise corrupt(f"{idx_path} is Megatron index version {version}, megalm reads version {VERSION}")
    if code not in DTYPE_CODES:
        raise corrupt(f"{idx_path} has dtype code {code}, not one of Megatron-LM's codes 1-8")
    dtype = DTYPE_CODES[code]
    if dtype.kind == "f":
        raise corrupt(f"{idx_path} stores {dtype.name} values (dtype code {code}); token ids must be integers")
    expected = _HEADER.size + 12 * seq_count + 8 * doc_count
    if idx_size == expected + seq_count and seq_count:
        raise DataError(f"{idx_path} is a multimodal Megatron index (it has per-sequence modes); megalm trains on "
                        "text only: point data.path at a text dataset made by Megatron-LM/tools/preprocess_data.py")
    if idx_size < expected:
        raise corrupt(f"{idx_path} is truncated: {idx_size} bytes, its header implies {expected}")
    if idx_size != expected:
        raise corrupt(f"{idx_path} has {idx_size} bytes, its header implies {expected}")
    if doc_count < 1:
        raise corrupt(f"{idx_path} has no document indices (Megatron's list starts with 0)")
    lengths = np.memmap(idx_path, dtype="<i4", mode="r", offset=_HEADER.size, shape=(seq_count,)) \
        if seq_count else np.zeros(0, "<i4")
    pointers = np.memmap(idx_path, dtype="<i8", mode="r", offset=_HEADER.size + 4 * seq_count,
                         shape=(seq_count,)) if seq_count else np.zeros(0, "<i8")
    doc_index = np.memmap(idx_path, dtype="<i8", mode="r", offset=_HEADER.size + 12 * seq_count,
                          shape=(doc_count,))
    if doc_index[0] != 0 or doc_index[-1] != seq_count:
        raise corrupt(f"{idx_path} document indices run from {int(doc_index[0])} to {int(doc_index[-1])}, "
                      f"not from 0 to the sequence count {seq_count}")
    for start in range(0, doc_count, _CHUNK):
        if np.any(np.diff(doc_index[start:start + _CHUNK + 1]) < 0):
            raise corrupt(f"{idx_path} document indices are not monotonic")

    # Sequences must lie back to back in .bin (pointers == the running sum of lengths * itemsize), as Megatron-LM
    # writes them, so a document is one contiguous slice of the token stream, from its first sequence's pointer
    # (`DocumentOffsets`).
    carry = 0
    for start in range(0, seq_count, _CHUNK):
        lens = np.asarray(lengths[start:start + _CHUNK], dtype=np.int64)
        if np.any(lens < 0):
            raise corrupt(f"{idx_path} has negative sequence lengths")
        run = np.empty(len(lens) + 1, dtype=np.int64)
        run[0] = carry
        np.cumsum(lens, out=run[1:])
        run[1:] += carry
        bad = np.flatnonzero(np.asarray(pointers[start:start + _CHUNK]) != run[:-1] * dtype.itemsize)
        if bad.size:
            i = start + int(bad[0])
            raise corrupt(f"{idx_path} sequence {i} points at byte {int(pointers[i])}, its preceding lengths put "
                          f"it at {int(run[bad[0]]) * dtype.itemsize}")
        carry = int(run[-1])
    num_tokens = carry
    offsets = DocumentOffsets(pointers, doc_index, dtype.itemsize, num_tokens)
    bin_size = os.path.getsize(bin_path)
    if bin_size != num_tokens * dtype.itemsize:
        raise corrupt(f"{bin_path} has {bin_size} bytes, the index expects {num_tokens} tokens * "
                      f"{dtype.itemsize} bytes")
    tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(num_tokens,)) if num_tokens else np.zeros(0, dtype)
    num_docs = doc_count - 1

    meta = _read_sidecar(prefix, num_docs, num_tokens) if read_sidecar else None
    if meta is not None:
        vocab_size, eod_id, spec = meta["vocab_size"], meta["eod_id"], meta["tokenizer_spec"]
        if not 0 <= eod_id < vocab_size:
            raise DataError(f"sidecar {sidecar_path(prefix)}: eod_id {eod_id} is outside the vocab [0, {vocab_size})")
    else:
        if read_sidecar:  # (the one pass the sidecar spares, every open, every process: said once here)
            log.info(f"{prefix}: no megalm sidecar, so each of its {num_docs:,} documents' last token is read for "
                     f"its eod; `megalm-preprocess --sidecar {prefix} --tokenizer ...` writes one once")
        if tokenizer is None:
            raise DataError(f"{idx_path} is a Megatron-LM index without megalm's sidecar {sidecar_path(prefix)}, so "
                            "its vocab and eod token are unknown; set data.tokenizer=byte|PATH/tokenizer.json to "
                            "the tokenizer it was made with")
        tok = build_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        vocab_size, eod_id, spec = int(tok.vocab_size), int(tok.eod_id), tok.spec
        # The vocab is the caller's claim: check the first tokens against it, so that ids of another
        # tokenizer (e.g. GPT-2's read with the default data.tokenizer=byte) fail here, not as garbage.
        if (bad := id_outside_vocab(np.asarray(tokens[:_VOCAB_PROBE]), vocab_size)) is not None:
            raise DataError(f"{bin_path} holds token id {bad}, outside the vocab [0, {vocab_size}) of tokenizer "
                            f"{spec!r}; set data.tokenizer to the tokenizer the data was made with")

    eod_appended = meta is not None and meta["eod_appended"]
    add_eod = None if eod_appended else DocumentFlags(num_docs)
    for start in range(0, num_docs, _CHUNK):
        bounds = offsets[start:start + _CHUNK + 1]
        nonempty = np.diff(bounds) > 0
        if eod_appended and not nonempty.all():
            raise corrupt(f"sidecar {sidecar_path(prefix)} says every document ends with eod, but a document "
                          "is empty")
        if add_eod is not None:
            flags = np.ones(len(nonempty), dtype=bool)
            if meta is None:  # documents that already end with eod (Megatron's --append-eod) keep theirs alone
                flags[nonempty] = np.asarray(tokens[bounds[1:][nonempty] - 1]) != eod_id
            add_eod.set_from(start, flags)
    if add_eod is not None and not add_eod.any():
        add_eod = None
    return MegatronData(tokens, offsets, add_eod, int(vocab_size), int(eod_id), spec, vocab_claimed=meta is None)


def write_sidecar(prefix: str, tokenizer: Tokenizer, overwrite: bool = False) -> dict:
    """megalm's sidecar for a dataset that Megatron-LM wrote (which has none): `tokenizer`'s vocab and eod, and
    whether every document ends with eod (Megatron's --append-eod) or none does, found from each document's last token
    once here, where each open without it reads them again in every process (a pass over the .bin's pages). A
    dataset whose documents differ in that cannot be described by one flag: refused, and its opens keep reading them.
    Written atomically; an existing sidecar is replaced only with `overwrite`. Returns what was written."""
    path = sidecar_path(prefix)
    if os.path.exists(path) and not overwrite:
        raise DataError(f"{path} exists; add --overwrite to write it again from the tokenizer given")
    data = open_megatron(prefix, tokenizer, read_sidecar=False)
    num_docs = len(data.offsets) - 1
    ending = num_docs - (data.add_eod.sum() if data.add_eod is not None else 0)  # documents that end with eod
    if ending not in (0, num_docs):
        raise DataError(f"{ending} of the {num_docs} documents of {prefix} end with eod ({data.eod_id}) and the others "
                        "do not (or are empty), which a sidecar cannot say; without one, megalm reads each "
                        "document's last token when it opens the dataset")
    meta = {"format": SIDECAR_FORMAT, "version": SIDECAR_VERSION, "tokenizer_spec": data.tokenizer_spec,
            "vocab_size": data.vocab_size, "eod_id": data.eod_id, "eod_appended": ending == num_docs,
            "dtype": data.tokens.dtype.name, "num_docs": num_docs, "num_tokens": int(data.offsets[-1])}
    write_atomically(Path(path), lambda f: f.write((json.dumps(meta, indent=1) + "\n").encode()))
    return meta


class MegatronDatasetWriter(TokenFileWriter):
    """Streams documents into Megatron-LM's PREFIX.bin/.idx plus megalm's sidecar PREFIX.megalm.json.

    Same interface as `IndexedDatasetWriter`, same tokens: each document gets eod appended and is one
    Megatron sequence; the dtype is Megatron's choice for the vocab. Nothing is visible under PREFIX
    until `finalize()`, which moves .bin, then the sidecar, then .idx into place, so a reader that sees
    the .idx also sees its sidecar.
    """

    def __init__(self, prefix: str, vocab_size: int, tokenizer_spec: str, eod_id: int | None = None,
                 overwrite: bool = False) -> None:
        super().__init__(prefix, vocab_size, tokenizer_spec, eod_id, overwrite, dtype=megatron_dtype(vocab_size),
                         max_vocab=2**31, vocab_note=" (Megatron stores ids as int32)",
                         temporary=("bin", "json", "idx"))
        self._lengths = array("q")

    def _check_length(self, num_tokens: int) -> None:
        if num_tokens + 1 > np.iinfo(np.int32).max:
            raise DataError(f"a document of {num_tokens} tokens is longer than a Megatron sequence can be (2**31 - 1)")

    def _record(self, length: int) -> None:
        self._lengths.append(length)  # one document, one Megatron sequence

    def _write_index(self, f) -> None:
        n = self.num_docs
        code = next(c for c, d in DTYPE_CODES.items() if d == self.dtype)
        f.write(_HEADER.pack(MAGIC, VERSION, code, n, n + 1))
        lengths = np.frombuffer(self._lengths, dtype=np.int64) if n else np.zeros(0, np.int64)
        for start in range(0, n, _CHUNK):
            f.write(lengths[start:start + _CHUNK].astype("<i4").tobytes())
        carry = 0
        for start in range(0, n, _CHUNK):
            chunk = lengths[start:start + _CHUNK]
            pointers = (np.cumsum(chunk) - chunk + carry) * self.dtype.itemsize
            f.write(pointers.astype("<i8").tobytes())
            carry += int(chunk.sum())
        for start in range(0, n + 1, _CHUNK):
            f.write(np.arange(start, min(start + _CHUNK, n + 1), dtype="<i8").tobytes())

    def _finish(self) -> None:
        """Write the sidecar and the .idx, then move everything into place: .bin, sidecar, .idx last."""
        meta = {"format": SIDECAR_FORMAT, "version": SIDECAR_VERSION, "tokenizer_spec": self.tokenizer_spec,
                "vocab_size": self.vocab_size, "eod_id": self.eod_id, "eod_appended": True,
                "dtype": self.dtype.name, "num_docs": self.num_docs, "num_tokens": self.num_tokens}
        with self._write_temporary("json", "w") as f:
            json.dump(meta, f, indent=1)
            f.write("\n")
        with self._write_temporary("idx") as f:
            self._write_index(f)
        self._publish([(self._tmp["bin"], f"{self.prefix}.bin"), (self._tmp["json"], sidecar_path(self.prefix)),
                       (self._tmp["idx"], f"{self.prefix}.idx")])
