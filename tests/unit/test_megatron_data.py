"""Megatron-LM's MMIDIDX .bin/.idx: megalm reads it as-is and megalm-preprocess --format megatron writes it.

The format is checked against a reader and a writer written here from the format's description
(numpy and struct, none of megalm's code), and against Megatron-LM's own reader when megatron-core is
installed. Megatron files carry no vocab or eod: the sidecar or the caller's tokenizer provides them,
and documents without a trailing eod get one virtually, so samplers see the same invariant as for
megalm's own format.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTok
from tokenizers import models, pre_tokenizers

from megalm.data import dataset
from megalm.data.build import build_datasets
from megalm.data.dataset import PackedDataset, VarlenDataset
from megalm.data.indexed import IndexedDataset, IndexedDatasetWriter
from megalm.data.megatron_format import MegatronDatasetWriter
from megalm.data.preprocess import main, preprocess
from megalm.data.tokenizer import ByteTokenizer
from megalm.errors import DataError

# ------------------------------------------------------ an independent MMIDIDX reader/writer (format spec)

CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}


def spec_read(prefix: str) -> tuple[np.dtype, list[np.ndarray]]:
    """Megatron documents from the format description: header, lengths, pointers, document indices."""
    idx = Path(f"{prefix}.idx").read_bytes()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    version, code, n_seq, n_doc = struct.unpack_from("<QBQQ", idx, 9)
    assert version == 1
    pos = 34
    lengths = np.frombuffer(idx, "<i4", n_seq, pos)
    pointers = np.frombuffer(idx, "<i8", n_seq, pos + 4 * n_seq)
    doc_index = np.frombuffer(idx, "<i8", n_doc, pos + 12 * n_seq)
    assert len(idx) == pos + 12 * n_seq + 8 * n_doc
    dtype = np.dtype(CODES[code])
    data = Path(f"{prefix}.bin").read_bytes()
    seqs = [np.frombuffer(data, dtype, int(n), int(p)) for n, p in zip(lengths, pointers, strict=True)]
    bounds = zip(doc_index[:-1], doc_index[1:], strict=True)
    docs = [np.concatenate(seqs[a:b]) if b > a else np.zeros(0, dtype) for a, b in bounds]
    return dtype, docs


def spec_write(prefix: Path, docs: list[list[list[int]]], dtype=np.uint16) -> str:
    """A Megatron dataset (no sidecar): each document a list of sequences, written from the format spec."""
    seqs = [np.asarray(s, dtype) for d in docs for s in d]
    lengths = np.array([len(s) for s in seqs], "<i4")
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype("<i8") * np.dtype(dtype).itemsize
    doc_index = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype("<i8")
    code = next(c for c, t in CODES.items() if np.dtype(t) == np.dtype(dtype))
    header = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(seqs), len(doc_index))
    Path(f"{prefix}.bin").write_bytes(b"".join(s.tobytes() for s in seqs))
    Path(f"{prefix}.idx").write_bytes(header + lengths.tobytes() + pointers[:len(seqs)].tobytes() + doc_index.tobytes())
    return str(prefix)


# ----------------------------------------------------------------------------------------- helpers


def make_hf_tokenizer(path: Path, words: list[str]) -> Path:
    vocab = {w: i for i, w in enumerate(["<unk>", *words, "<|endoftext|>"])}
    tok = HFTok(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path))
    return path


def write_jsonl(path: Path, n: int = 30) -> Path:
    path.write_text("".join(json.dumps({"text": f"w{i % 7} w{i % 5} " * (1 + i % 4) + f"doc {i} é"}) + "\n"
                            for i in range(n)) + "\n")  # a trailing blank line: skipped, like megalm's format
    return path


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main([*argv, "--no-progress"])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def docs_of(ds: IndexedDataset) -> list[list[int]]:
    return [ds.get(i).tolist() for i in range(len(ds))]


def assert_one_line(e: pytest.ExceptionInfo, *fragments: str) -> None:
    msg = str(e.value)
    assert "\n" not in msg and msg, msg
    for fragment in fragments:
        assert fragment in msg, msg


# ---------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("tokenizer", ["byte", "hf"])
def test_megatron_format_equals_megalm_format(tmp_path, capsys, tokenizer):
    src = write_jsonl(tmp_path / "docs.jsonl")
    spec = "byte" if tokenizer == "byte" else str(make_hf_tokenizer(tmp_path / "tok.json", [f"w{i}" for i in range(7)]))
    for fmt in ("megalm", "megatron"):
        code, out, err = cli(["--input", str(src), "--output-prefix", str(tmp_path / fmt), "--tokenizer", spec,
                              "--format", fmt], capsys)
        assert code == 0, err
        assert (f"+ {tmp_path / 'megatron'}.megalm.json (Megatron-LM format)" in out) == (fmt == "megatron")
    ours, theirs = IndexedDataset(tmp_path / "megalm"), IndexedDataset(tmp_path / "megatron")
    assert (ours.format, theirs.format) == ("megalm", "megatron")
    assert len(theirs) == len(ours) == 30
    assert docs_of(theirs) == docs_of(ours)
    assert all(d[-1] == ours.eod_id and d.count(ours.eod_id) == 1 for d in docs_of(theirs))  # one eod, at the end
    assert (theirs.vocab_size, theirs.eod_id, theirs.tokenizer_spec) == (ours.vocab_size, ours.eod_id,
                                                                          ours.tokenizer_spec)
    assert theirs.dtype == ours.dtype == np.uint16 and theirs.num_tokens == ours.num_tokens
    assert theirs.doc_lengths.tolist() == ours.doc_lengths.tolist()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("megatron")) == \
        ["megatron.bin", "megatron.idx", "megatron.megalm.json"]  # no temporaries left
    meta = json.loads((tmp_path / "megatron.megalm.json").read_text())
    assert meta["tokenizer_spec"] == spec and meta["eod_appended"] is True and meta["vocab_size"] == ours.vocab_size
    # the same tokens, byte for byte, as megalm's own .bin (both uint16 here)
    assert (tmp_path / "megatron.bin").read_bytes() == (tmp_path / "megalm").with_suffix(".bin").read_bytes()


def test_independent_reader_sees_the_same_documents_and_dtype(tmp_path):
    src = write_jsonl(tmp_path / "docs.jsonl")
    preprocess([src], tmp_path / "m", "byte", show_progress=False, output_format="megatron")
    dtype, docs = spec_read(str(tmp_path / "m"))
    assert dtype == np.uint16
    assert [d.tolist() for d in docs] == docs_of(IndexedDataset(tmp_path / "m"))
    assert all(d[-1] == 256 for d in docs)


def test_large_vocab_uses_megatrons_int32(tmp_path):
    docs = [[0, 69998, 5], [70000 - 2], []]
    with MegatronDatasetWriter(str(tmp_path / "big"), 70000, "", eod_id=69999) as w:
        for d in docs:
            w.add_document(d)
        w.finalize()
    with IndexedDatasetWriter(str(tmp_path / "own"), 70000, "", eod_id=69999) as w:
        for d in docs:
            w.add_document(d)
        w.finalize()
    dtype, got = spec_read(str(tmp_path / "big"))
    assert dtype == np.int32  # Megatron's rule: uint16 below 65500, else int32 (megalm's own: uint32)
    assert [g.tolist() for g in got] == [d + [69999] for d in docs]
    assert docs_of(IndexedDataset(tmp_path / "big")) == docs_of(IndexedDataset(tmp_path / "own"))


def _megatron_core():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("megatron.core.datasets.indexed_dataset")


def test_megatron_core_reads_ours_and_we_read_its_builder(tmp_path):
    """Megatron-LM's own reader and writer (megatron-core), when installed."""
    mcore = _megatron_core()
    src = write_jsonl(tmp_path / "docs.jsonl")
    preprocess([src], tmp_path / "m", "byte", show_progress=False, output_format="megatron")
    theirs, ours = mcore.IndexedDataset(str(tmp_path / "m")), IndexedDataset(tmp_path / "m")
    assert len(theirs) == len(ours) and list(theirs.document_indices) == list(range(len(ours) + 1))
    assert all(theirs[i].tolist() == ours.get(i).tolist() for i in range(len(ours)))
    assert theirs[0].dtype == np.uint16

    # Megatron's builder: multi-sequence documents, eod only on some (its --append-eod puts it last).
    builder = mcore.IndexedDatasetBuilder(str(tmp_path / "b.bin"), dtype=mcore.DType.optimal_dtype(257))
    docs = [[[1, 2], [3]], [[4, 256]], [[5], [6, 7], [8, 256]]]
    for d in docs:
        builder.add_document(np.array(sum(d, [])), [len(s) for s in d])
    builder.finalize(str(tmp_path / "b.idx"))
    ds = IndexedDataset(tmp_path / "b", tokenizer="byte")
    assert docs_of(ds) == [[1, 2, 3, 256], [4, 256], [5, 6, 7, 8, 256]]


# ------------------------------------------------------------------ Megatron's own files: eod, sequences


def test_no_sidecar_needs_a_tokenizer(tmp_path):
    prefix = spec_write(tmp_path / "m", [[[1, 2, 3]], [[4, 5]]])
    with pytest.raises(DataError) as e:
        IndexedDataset(prefix)
    assert_one_line(e, "m.idx", "sidecar", "data.tokenizer=")
    assert docs_of(IndexedDataset(prefix, tokenizer="byte")) == [[1, 2, 3, 256], [4, 5, 256]]
    assert docs_of(IndexedDataset(prefix, tokenizer=ByteTokenizer())) == [[1, 2, 3, 256], [4, 5, 256]]


def test_virtual_eod_is_consistent_for_every_slice(tmp_path):
    prefix = spec_write(tmp_path / "m", [[[10, 11, 12]], [[20, 256]], [], [[30]]])  # an eod, an empty doc
    ds = IndexedDataset(prefix, tokenizer="byte")
    full = [[10, 11, 12, 256], [20, 256], [256], [30, 256]]
    assert docs_of(ds) == full  # no second eod where there is one
    assert ds.doc_lengths.tolist() == [4, 2, 1, 2] and ds.num_tokens == 9
    for i, doc in enumerate(full):
        for offset in range(len(doc) + 1):
            for length in range(len(doc) - offset + 1):
                assert ds.get(i, offset, length).tolist() == doc[offset:offset + length], (i, offset, length)
        with pytest.raises(IndexError):
            ds.get(i, 0, len(doc) + 1)
    assert ds.vocab_size == 257 and ds.eod_id == 256 and ds.tokenizer_spec == "byte"
    # the samplers see the invariant: every document ends with eod
    for sampler in (PackedDataset(ds, np.arange(4), 3, seed=0), VarlenDataset(ds, np.arange(4), 3, seed=0)):
        assert sum(int(sampler[k].tokens.max() <= 256) for k in range(8)) == 8


class _Lengths:
    """A document source of lengths alone, as `lengths_digest` reads any source without `lengths_of`."""

    def __init__(self, doc_lengths: np.ndarray) -> None:
        self.doc_lengths = doc_lengths

    def __len__(self) -> int:
        return len(self.doc_lengths)


@pytest.mark.parametrize("slice_docs", [1, 3, 1 << 20])
def test_the_index_files_digest_reads_the_lengths_with_their_virtual_eods(tmp_path, monkeypatch, slice_docs):
    """IndexedDataset's lengths digest, read from the offsets in slices (`lengths_of`; megalm/data/index_cache.py names
    the samplers' files by it), is the digest of `doc_lengths` itself, virtual eods included, for any slice size."""
    monkeypatch.setattr(dataset, "DIGEST_SLICE", slice_docs)
    prefix = spec_write(tmp_path / "m", [[[10, 11, 12]], [[20, 256]], [], [[30]], [[40, 41]]])
    ds = IndexedDataset(prefix, tokenizer="byte")
    plain = _Lengths(ds.doc_lengths)
    assert dataset.lengths_digest(ds) == dataset.lengths_digest(plain)
    plain.doc_lengths = ds.doc_lengths - np.array([0, 0, 0, 1, 0])  # the fourth's virtual eod left out
    assert dataset.lengths_digest(ds) != dataset.lengths_digest(plain)
    ids = np.array([4, 0, 3, 3])  # a split's documents, read alone (the held-out ones on every rank)
    assert ds.lengths_of(ids).tolist() == ds.doc_lengths[ids].tolist() == [3, 4, 2, 2]


@pytest.mark.parametrize("docs, appended", [
    ([[[1, 2, 256]], [[3], [4, 256]], [[5, 256]]], True),  # Megatron's --append-eod: every document ends with eod
    ([[[1, 2]], [[3], [4]], [], [[5]]], False),  # without it (an empty document too): each gets one at read time
], ids=["append_eod", "no_eod"])
def test_a_written_sidecar_reads_the_documents_as_the_open_without_it(tmp_path, capsys, caplog, docs, appended):
    """`megalm-preprocess --sidecar PREFIX` finds once what every open of a sidecar-less dataset finds from each
    document's last token (one line says so each time): the documents read through the sidecar are the same."""
    prefix = spec_write(tmp_path / "m", docs)
    with caplog.at_level("INFO", logger="megalm"):
        without = docs_of(IndexedDataset(prefix, tokenizer="byte"))
    assert "no megalm sidecar, so each of its" in caplog.text and "--sidecar" in caplog.text
    code, out, _ = cli(["--sidecar", prefix, "--tokenizer", "byte"], capsys)
    assert code == 0 and f"wrote {prefix}.megalm.json: {len(docs)} documents" in out
    sidecar = json.loads(Path(f"{prefix}.megalm.json").read_text())
    assert sidecar["eod_appended"] is appended and (sidecar["vocab_size"], sidecar["eod_id"]) == (257, 256)
    caplog.clear()
    with caplog.at_level("INFO", logger="megalm"):
        ds = IndexedDataset(prefix)  # no tokenizer needed: the sidecar names it
    assert docs_of(ds) == without and "no megalm sidecar" not in caplog.text
    # an existing sidecar is kept unless --overwrite, which reads the documents again, not the sidecar
    assert cli(["--sidecar", prefix, "--tokenizer", "byte"], capsys)[0] == 2
    Path(f"{prefix}.megalm.json").write_text(json.dumps({**sidecar, "num_docs": 99}))  # a stale one
    assert cli(["--sidecar", prefix, "--tokenizer", "byte", "--overwrite"], capsys)[0] == 0
    assert json.loads(Path(f"{prefix}.megalm.json").read_text()) == sidecar


def test_a_sidecar_cannot_describe_documents_that_differ(tmp_path, capsys):
    prefix = spec_write(tmp_path / "m", [[[1, 256]], [[2]]])
    code, _, err = cli(["--sidecar", prefix, "--tokenizer", "byte"], capsys)
    assert code == 2 and "1 of the 2 documents of" in err and "which a sidecar cannot say" in err
    assert len(err.strip().splitlines()) == 1 and not Path(f"{prefix}.megalm.json").exists()
    assert cli(["--sidecar", prefix, "--input", "x.txt"], capsys)[0] == 2  # it describes, never tokenizes
    assert cli(["--tokenizer", "byte"], capsys)[0] == 2  # neither --sidecar nor --input/--output-prefix
    code, _, err = cli(["--sidecar", str(tmp_path / "nothing")], capsys)
    assert code == 2 and "--sidecar" in err and "Errno" not in err, err
    megalm_prefix = str(tmp_path / "own")
    with IndexedDatasetWriter(megalm_prefix, 257, "byte") as w:
        w.add_document([1, 2])
        w.finalize()
    code, _, err = cli(["--sidecar", megalm_prefix], capsys)
    assert code == 2 and "is a megalm dataset" in err and "needs no sidecar" in err, err


@pytest.mark.parametrize("num_docs", [0, 1, 7, 8, 9, 17])
def test_the_packed_eod_flags_read_as_the_bool_array(num_docs):
    """`DocumentFlags` (a bit a document, set in pieces of any length) answers every index a bool array answers."""
    from megalm.data.megatron_format import DocumentFlags

    rng = np.random.default_rng(num_docs)
    want = rng.random(num_docs) < 0.5
    flags, start = DocumentFlags(num_docs), 0
    while start < num_docs:
        piece = int(rng.integers(1, 5))
        flags.set_from(start, want[start:start + piece])
        start += piece
    assert np.asarray(flags).tolist() == want.tolist() and flags.sum() == want.sum() and flags.any() == want.any()
    for i in range(-num_docs, num_docs):
        assert flags[i] == want[i] and type(flags[i]) is np.bool_
    picks = rng.integers(0, num_docs, 5) if num_docs else np.zeros(0, np.int64)
    for key in (slice(1, None), slice(None, None, -2), slice(3, 1), picks, want, np.arange(-num_docs, 0)):
        assert flags[key].tolist() == want[key].tolist(), key
    for outside in (num_docs, -num_docs - 1, np.array([num_docs])):
        with pytest.raises(IndexError):
            flags[outside]


def test_the_offsets_read_from_the_index_are_the_held_ones(tmp_path):
    """`DocumentOffsets` (document i's first sequence's pointer, read at each access) against the offsets made from
    the format's description: empty documents first, inside and last, several sequences a document."""
    docs = [[], [[1, 2], [3]], [[4]], [], [[5, 6], [], [7]], [[8, 256]], []]
    prefix = spec_write(tmp_path / "m", docs)
    offsets = IndexedDataset(prefix, tokenizer="byte")._offsets
    held = np.concatenate([[0], np.cumsum([sum(len(s) for s in d) for d in docs])])
    assert np.asarray(offsets).tolist() == held.tolist() and len(offsets) == len(held)
    for i in range(-len(held), len(held)):
        assert offsets[i] == held[i] and type(offsets[i]) is np.int64
    for key in (slice(2, 6), slice(None, None, -3), np.array([6, 0, 3, 3]), np.array([], np.int64)):
        assert offsets[key].tolist() == held[key].tolist(), key
    empty = spec_write(tmp_path / "e", [[], []])  # no sequence at all
    assert np.asarray(IndexedDataset(empty, tokenizer="byte")._offsets).tolist() == [0, 0, 0]


def test_multi_sequence_documents(tmp_path):
    docs = [[[1, 2], [3], [4, 5, 6]], [[7]], [[8, 9], [10, 256]]]
    prefix = spec_write(tmp_path / "m", docs, dtype=np.int32)
    ds = IndexedDataset(prefix, tokenizer="byte")
    assert ds.dtype == np.int32 and len(ds) == 3
    assert docs_of(ds) == [[1, 2, 3, 4, 5, 6, 256], [7, 256], [8, 9, 10, 256]]


@pytest.mark.parametrize("chunk", [1, 2, 3, 1 << 22])
def test_validation_in_chunks_matches_the_spec_reader(tmp_path, monkeypatch, chunk):
    """The index is checked in slices (no multi-GB temporaries): slice edges must not change the result."""
    from megalm.data import megatron_format

    monkeypatch.setattr(megatron_format, "_CHUNK", chunk)
    rng = np.random.default_rng(1)
    docs = [[list(rng.integers(0, 256, rng.integers(0, 4))) for _ in range(rng.integers(0, 4))] for _ in range(15)]
    prefix = spec_write(tmp_path / "m", docs)
    ds = IndexedDataset(prefix, tokenizer="byte")
    want = [d.tolist() + ([] if d.size and d[-1] == 256 else [256]) for d in spec_read(prefix)[1]]
    assert docs_of(ds) == want and ds.doc_lengths.tolist() == [len(w) for w in want]
    # the same edges hold for the writer, and for a pointer that goes wrong late in the index
    with MegatronDatasetWriter(str(tmp_path / "w"), 257, "byte") as w:
        for d in want:
            w.add_document(d[:-1])
        w.finalize()
    assert [d.tolist() for d in spec_read(str(tmp_path / "w"))[1]] == want
    data, at, dt = _array_at(str(tmp_path / "w"), "pointers")
    struct.pack_into(dt, data, at + 8 * 13, 1)
    Path(tmp_path / "w.idx").write_bytes(bytes(data))
    with pytest.raises(DataError, match="sequence 13 points at byte 1"):
        IndexedDataset(tmp_path / "w")


def test_uint8_data_gets_an_eod_that_does_not_fit(tmp_path):
    prefix = spec_write(tmp_path / "m", [[[1, 2]], [[3]]], dtype=np.uint8)
    ds = IndexedDataset(prefix, tokenizer="byte")
    assert docs_of(ds) == [[1, 2, 256], [3, 256]]
    assert ds.get(0).dtype == ds.get(0, 0, 1).dtype == np.int64


def test_tokens_of_another_tokenizer_are_refused(tmp_path):
    prefix = spec_write(tmp_path / "m", [[[1, 2]], [[50000]]])  # GPT-2 ids, read as bytes
    with pytest.raises(DataError) as e:
        IndexedDataset(prefix, tokenizer="byte")
    assert_one_line(e, "token id 50000", "data.tokenizer")


def test_build_datasets_reads_a_megalm_written_megatron_prefix(tmp_path):
    from megalm.config import MegalmConfig

    preprocess([write_jsonl(tmp_path / "docs.jsonl", 60)], tmp_path / "m", "byte", show_progress=False,
               output_format="megatron")
    cfg = MegalmConfig()
    cfg.model.seq_length = 16
    cfg.data.name, cfg.data.path, cfg.data.valid_fraction = "indexed", str(tmp_path / "m"), 0.1
    bundle = build_datasets(cfg)
    assert isinstance(bundle.tokenizer, ByteTokenizer) and bundle.source.format == "megatron"


def _sidecar_less_cfg(tmp_path: Path):
    from megalm.config import MegalmConfig

    words = [f"w{i}" for i in range(7)]
    spec = str(make_hf_tokenizer(tmp_path / "tok.json", words))  # vocab 9: <unk>, w0..w6, <|endoftext|>
    rng = np.random.default_rng(0)
    spec_write(tmp_path / "m", [[list(rng.integers(1, 8, 30)), list(rng.integers(1, 8, 5))] for _ in range(20)])
    cfg = MegalmConfig()
    cfg.model.seq_length = 16
    cfg.data.name, cfg.data.path, cfg.data.valid_fraction = "indexed", str(tmp_path / "m"), 0.1
    cfg.data.tokenizer = spec
    return cfg


def test_build_datasets_on_a_sidecar_less_prefix_given_the_tokenizer(tmp_path):
    """data=indexed on Megatron files without a sidecar: data.tokenizer gives vocab and eod (appended virtually)."""
    bundle = build_datasets(_sidecar_less_cfg(tmp_path))
    assert bundle.tokenizer.vocab_size == 9 and bundle.tokenizer.eod_id == 8
    assert all(d[-1] == 8 for d in docs_of(bundle.source)) and bundle.source.doc_lengths.min() == 36


def test_a_blend_of_sidecar_less_prefixes_takes_data_tokenizer(tmp_path):
    cfg = _sidecar_less_cfg(tmp_path)
    cfg.data.blend, cfg.data.path = [1.0, cfg.data.path], None
    bundle = build_datasets(cfg)
    assert bundle.tokenizer.vocab_size == 9


# --------------------------------------------------------------------------------------- bad input


def _idx_with(prefix: str, **fields) -> None:
    """Rewrite header fields (version, code, n_seq, n_doc) of a Megatron .idx."""
    path = Path(f"{prefix}.idx")
    data = bytearray(path.read_bytes())
    version, code, n_seq, n_doc = struct.unpack_from("<QBQQ", data, 9)
    values = {"version": version, "code": code, "n_seq": n_seq, "n_doc": n_doc, **fields}
    struct.pack_into("<QBQQ", data, 9, values["version"], values["code"], values["n_seq"], values["n_doc"])
    path.write_bytes(bytes(data))


def _array_at(prefix: str, which: str) -> tuple[bytearray, int, str]:
    data = bytearray(Path(f"{prefix}.idx").read_bytes())
    _, _, n_seq, _ = struct.unpack_from("<QBQQ", data, 9)
    return data, {"pointers": 34 + 4 * n_seq, "doc_index": 34 + 12 * n_seq}[which], "<q"


def _corrupt(prefix: str, how: str) -> None:
    idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    if how == "truncated_idx":
        idx.write_bytes(idx.read_bytes()[:-8])
    elif how == "truncated_header":
        idx.write_bytes(idx.read_bytes()[:20])
    elif how == "extra_idx_bytes":
        idx.write_bytes(idx.read_bytes() + b"\0" * 5)
    elif how == "bad_magic":
        idx.write_bytes(b"NOTANIDX!" + idx.read_bytes()[9:])
    elif how == "version":
        _idx_with(prefix, version=2)
    elif how == "dtype_code":
        _idx_with(prefix, code=9)
    elif how == "float_dtype":
        _idx_with(prefix, code=7)
    elif how == "bin_size":
        bin_.write_bytes(bin_.read_bytes()[:-2])
    elif how == "pointers":
        data, at, dt = _array_at(prefix, "pointers")
        struct.pack_into(dt, data, at + 8, 7)  # sequence 1 points into the middle of sequence 0
        idx.write_bytes(bytes(data))
    elif how == "doc_index_order":  # 0 1 2 3 -> 0 2 1 3
        data, at, dt = _array_at(prefix, "doc_index")
        struct.pack_into("<qq", data, at + 8, 2, 1)
        idx.write_bytes(bytes(data))
    elif how == "doc_index_end":
        data, at, dt = _array_at(prefix, "doc_index")
        struct.pack_into(dt, data, at + 24, 2)
        idx.write_bytes(bytes(data))
    elif how == "multimodal":
        _, _, n_seq, _ = struct.unpack_from("<QBQQ", idx.read_bytes(), 9)
        idx.write_bytes(idx.read_bytes() + b"\0" * n_seq)


@pytest.mark.parametrize("how, fragment", [
    ("truncated_idx", "truncated"), ("truncated_header", "truncated"), ("extra_idx_bytes", "its header implies"),
    ("bad_magic", "bad magic"), ("version", "version 2"), ("dtype_code", "dtype code 9"),
    ("float_dtype", "float32"), ("bin_size", "m.bin has"), ("pointers", "points at byte 7"),
    ("doc_index_order", "not monotonic"), ("doc_index_end", "document indices run from 0 to 2"),
    ("multimodal", "multimodal"),
])
def test_corrupt_megatron_dataset_is_a_one_line_error(tmp_path, how, fragment):
    prefix = spec_write(tmp_path / "m", [[[1, 2, 3]], [[4, 5]], [[6]]])
    IndexedDataset(prefix, tokenizer="byte")
    _corrupt(prefix, how)
    with pytest.raises(DataError) as e:
        IndexedDataset(prefix, tokenizer="byte")
    assert_one_line(e, fragment, "m.")
    if how not in ("bad_magic", "multimodal"):
        assert "re-run megalm-preprocess" in str(e.value)


@pytest.mark.parametrize("content, fragment", [
    ("{not json", "unreadable"), ('{"format": "other"}', "not a megalm sidecar"),
    ("stale", "stale sidecar"), ("no_eod_key", "'eod_appended' is missing"),
])
def test_bad_sidecar_is_a_one_line_error(tmp_path, content, fragment):
    preprocess([write_jsonl(tmp_path / "docs.jsonl")], tmp_path / "m", "byte", show_progress=False,
               output_format="megatron")
    sidecar = tmp_path / "m.megalm.json"
    meta = json.loads(sidecar.read_text())
    if content == "stale":
        meta["num_docs"] += 1
        content = json.dumps(meta)
    elif content == "no_eod_key":
        del meta["eod_appended"]
        content = json.dumps(meta)
    sidecar.write_text(content)
    with pytest.raises(DataError) as e:
        IndexedDataset(tmp_path / "m", tokenizer="byte")
    assert_one_line(e, fragment, "m.megalm.json")


# ------------------------------------------------------------------------------------------ the CLI


def test_cli_bad_input_and_no_overwrite(tmp_path, capsys):
    src = write_jsonl(tmp_path / "docs.jsonl")
    out = str(tmp_path / "out")
    assert cli(["--input", str(src), "--output-prefix", out, "--format", "megatron"], capsys)[0] == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("out")}
    assert set(before) == {"out.bin", "out.idx", "out.megalm.json"}

    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    for argv, fragment in [
        (["--input", str(src), "--output-prefix", out, "--format", "megatron"], "already exist"),
        (["--input", str(src), "--output-prefix", out, "--format", "megalm"], "already exist"),
        (["--input", str(tmp_path / "bad.jsonl"), "--output-prefix", out, "--format", "megatron", "--overwrite"],
         "invalid JSON"),
        (["--input", str(tmp_path / "missing.jsonl"), "--output-prefix", out, "--format", "megatron", "--overwrite"],
         "not found"),
        (["--input", str(src), "--output-prefix", out, "--format", "parquet"], "--format"),
    ]:
        code, stdout, err = cli(argv, capsys)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code != 0 and len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], (argv, err)
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("out")} == before
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]

    # a lone sidecar also counts as an existing dataset
    (tmp_path / "lone.megalm.json").write_text("{}")
    code, _, err = cli(["--input", str(src), "--output-prefix", str(tmp_path / "lone"), "--format", "megatron"], capsys)
    assert code == 2 and "already exist" in err and (tmp_path / "lone.megalm.json").read_text() == "{}"


def test_overwrite_between_formats(tmp_path, capsys):
    src = write_jsonl(tmp_path / "docs.jsonl")
    out = str(tmp_path / "out")
    assert cli(["--input", str(src), "--output-prefix", out, "--format", "megatron"], capsys)[0] == 0
    megatron_docs = docs_of(IndexedDataset(out))
    assert cli(["--input", str(src), "--output-prefix", out, "--overwrite"], capsys)[0] == 0
    ds = IndexedDataset(out)
    assert ds.format == "megalm" and docs_of(ds) == megatron_docs
    assert not (tmp_path / "out.megalm.json").exists()  # the old sidecar went with the old index
    assert cli(["--input", str(src), "--output-prefix", out, "--overwrite", "--format", "megatron"], capsys)[0] == 0
    assert IndexedDataset(out).format == "megatron" and docs_of(IndexedDataset(out)) == megatron_docs


# ------------------------------------------------------------------------------------------- training


def test_train_a_few_steps_on_a_megatron_prefix(tmp_path):
    from megalm.training.trainer import Trainer
    from tests.conftest import compose_config

    preprocess([write_jsonl(tmp_path / "docs.jsonl", 80)], tmp_path / "corpus", "byte", show_progress=False,
               output_format="megatron")
    cfg = compose_config("data=indexed", f"data.path={tmp_path / 'corpus'}", "trainer.max_steps=2")
    summary = Trainer(cfg, tmp_path / "run").fit()
    assert np.isfinite(summary.last_loss)
    assert os.path.isdir(tmp_path / "run")


def test_an_id_outside_the_vocab_past_the_probe_is_refused_when_read(tmp_path, monkeypatch):
    """The open probes the first tokens only; every read checks its slice, so an id a GPU embedding would turn
    into "device-side assert triggered" stops the run with a line naming the document instead."""
    from megalm.data import megatron_format

    monkeypatch.setattr(megatron_format, "_VOCAB_PROBE", 4)
    prefix = spec_write(tmp_path / "m", [[[1, 2, 3, 4]], [[5, 300, 6]]])  # 300 is past the byte vocab (257)
    ds = IndexedDataset(prefix, tokenizer="byte")
    assert ds.get(0).tolist() == [1, 2, 3, 4, 256] and ds.get(1, 0, 1).tolist() == [5]
    with pytest.raises(DataError) as e:
        ds.get(1)
    # the vocab is data.tokenizer's (no sidecar): the fix is the tokenizer, not a preprocess that would overwrite
    # Megatron-LM's files
    assert_one_line(e, "document 1", "token id 300", "[0, 257) of data.tokenizer=byte",
                    "set data.tokenizer to the tokenizer the data was made with")
    assert "megalm-preprocess" not in str(e.value)
