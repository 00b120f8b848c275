"""Data package: tokenizers, the .bin/.idx format, megalm-preprocess, the demo corpus, and sampling.

Sampling tests check the properties the rest of megalm relies on: the global batch depends on
(seed, step) only, any micro-batch / DP split of it packs back to the same tokens, packed windows
cover each epoch's stream and mask the loss exactly at document boundaries.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as HFTok
from tokenizers import models, pre_tokenizers

from megalm.config import MegalmConfig
from megalm.data import demo as demo_mod
from megalm.data import indexed as indexed_mod
from megalm.data.batch import Sample, pack_samples
from megalm.data.build import build_datasets
from megalm.data.dataset import (
    PackedDataset,
    VarlenDataset,
    global_batch,
    loss_token_count,
    micro_batches,
    split_documents,
)
from megalm.data.demo import demo_corpus
from megalm.data.indexed import IndexedDataset, IndexedDatasetWriter
from megalm.data.preprocess import main, preprocess
from megalm.data.synthetic import SyntheticDocuments
from megalm.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer
from megalm.errors import DataError

# ----------------------------------------------------------------------------------------- helpers


def make_hf_tokenizer(path: Path, words: list[str], specials: tuple[str, ...] = ("<|endoftext|>",)) -> Path:
    """A WordLevel tokenizer: '<unk>' = 0, words = 1.., then the special tokens; whitespace split."""
    vocab = {w: i for i, w in enumerate(["<unk>", *words, *specials])}
    tok = HFTok(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if specials:
        tok.add_special_tokens(list(specials))
    tok.save(str(path))
    return path


def write_dataset(prefix: Path, docs: list[list[int]], vocab_size: int, eod_id: int, spec: str = "") -> str:
    with IndexedDatasetWriter(str(prefix), vocab_size, spec, eod_id=eod_id) as w:
        for d in docs:
            w.add_document(d)
        w.finalize()
    return str(prefix)


def byte_dataset(tmp_path: Path, texts: list[str]) -> str:
    tok = ByteTokenizer()
    return write_dataset(tmp_path / "bytes", [tok.encode(t) for t in texts], 257, 256, "byte")


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def synth() -> SyntheticDocuments:
    return SyntheticDocuments(num_docs=40, vocab_size=1000, mean_doc_length=24, seed=3)


# -------------------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip_and_eod():
    tok = build_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.eod_id, tok.spec) == (257, 256, "byte")
    text = "héllo → wörld\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.decode([104, 256, 105]) == "h<eod>i"
    assert tok.decode([0xFF, 104]) == "\ufffdh"  # invalid utf-8 is replaced, not raised
    assert tok.decode([300]) == "\ufffd"  # ids of a padded model vocab


def test_hf_tokenizer_round_trip(tmp_path):
    path = make_hf_tokenizer(tmp_path / "tok.json", ["hello", "world"], ("</s>", "<|endoftext|>"))
    tok = build_tokenizer(str(path))
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert tok.vocab_size == 5
    assert tok.eod_id == 4  # "<|endoftext|>" is preferred over "</s>"
    ids = tok.encode("hello world hello")
    assert ids == [1, 2, 1]
    assert tok.decode(ids) == "hello world hello"
    again = build_tokenizer(tok.spec)  # the spec rebuilds the same tokenizer
    assert again.encode("world hello") == tok.encode("world hello") == [2, 1]


def test_hf_tokenizer_directory_and_other_eod_names(tmp_path):
    path = make_hf_tokenizer(tmp_path / "tokenizer.json", ["a", "b"], ("<eos>",))
    tok = build_tokenizer(str(tmp_path))  # a directory means its tokenizer.json
    assert tok.spec == str(path.resolve()) and tok.eod_id == 3


def test_a_literal_special_token_in_a_document_is_text(tmp_path):
    """`tokenizers` matches added special tokens in the text even without add_special_tokens: a document holding
    the characters "<|endoftext|>" (scraped code, ML papers) got an end-of-document id inside it."""
    path = make_hf_tokenizer(tmp_path / "tok.json", ["a", "b", "<", "|", ">", "endoftext"])
    tok = build_tokenizer(str(path))
    ids = tok.encode("a <|endoftext|> b")
    assert tok.eod_id not in ids and ids[0] == 1 and ids[-1] == 2, ids
    assert tok.encode_batch(["a <|endoftext|>"])[0] == ids[:-1]


def test_a_vocab_whose_ids_skip_numbers_has_rows_for_its_largest_id(tmp_path):
    """vocab_size counted entries: ids {0, 1, 10} gave 3, and preprocess refused the eod id 10 with a traceback."""
    path = tmp_path / "gap.json"
    gap = HFTok(models.WordLevel({"<unk>": 0, "a": 1, "<|endoftext|>": 10}, unk_token="<unk>"))
    gap.pre_tokenizer = pre_tokenizers.Whitespace()
    gap.save(str(path))
    tok = build_tokenizer(str(path))
    assert (tok.vocab_size, tok.eod_id) == (11, 10)
    (tmp_path / "a.txt").write_text("a a")
    stats = preprocess([tmp_path / "a.txt"], str(tmp_path / "out"), tok, show_progress=False)
    assert (stats.num_tokens, stats.vocab_size) == (3, 11)


def test_text_that_is_not_utf8_is_repaired_and_said(tmp_path):
    """Latin-1 bytes and JSON's lone surrogate escapes: stored as U+FFFD and counted in the summary (surrogates
    were a traceback; other bytes were replaced without a word)."""
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    (tmp_path / "docs.jsonl").write_text('{"text": "ok"}\n{"text": "x\\ud800y"}\n')
    for tokenizer in ("byte", str(make_hf_tokenizer(tmp_path / "tok.json", ["ok"]))):
        stats = preprocess([tmp_path / "latin1.txt", tmp_path / "docs.jsonl"], str(tmp_path / tokenizer[-4:]),
                           tokenizer, show_progress=False)
        assert (stats.num_docs, stats.repaired) == (3, 2)
        assert "; 2 documents held bytes that are not UTF-8" in stats.summary()
    assert _texts(str(tmp_path / "byte")) == ["caf\ufffd", "ok", "x\ufffdy"]
    stats = preprocess([tmp_path / "docs.jsonl"], str(tmp_path / "clean"), "byte", show_progress=False)
    assert stats.repaired == 1
    (tmp_path / "fine.jsonl").write_text('{"text": "caf\\u00e9 \\ud83d\\ude00"}\n')  # a valid surrogate pair
    stats = preprocess([tmp_path / "fine.jsonl"], str(tmp_path / "fine"), "byte", show_progress=False)
    assert stats.repaired == 0 and "UTF-8" not in stats.summary()
    assert _texts(str(tmp_path / "fine")) == ["café 😀"]


def test_hf_tokenizer_errors(tmp_path):
    no_eod = make_hf_tokenizer(tmp_path / "noeod.json", ["a", "b"], ())
    with pytest.raises(DataError, match="end-of-document"):
        build_tokenizer(str(no_eod))
    with pytest.raises(DataError, match="not found"):
        build_tokenizer(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{ this is not a tokenizer")
    with pytest.raises(DataError, match="not a valid") as e:
        build_tokenizer(str(bad))
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------- indexed format


@pytest.mark.parametrize("vocab_size, dtype", [(1000, np.uint16), (65536, np.uint16), (70000, np.uint32)])
def test_indexed_round_trip(tmp_path, vocab_size, dtype):
    docs = [[1, 2, 3], [], [vocab_size - 2, 7], list(range(50))]
    eod = vocab_size - 1
    prefix = write_dataset(tmp_path / "ds", docs, vocab_size, eod, "spec-string")
    ds = IndexedDataset(prefix)
    assert len(ds) == 4 and ds.vocab_size == vocab_size and ds.tokenizer_spec == "spec-string"
    assert ds.eod_id == eod and ds.get(0).dtype == dtype
    assert ds.doc_lengths.dtype == np.int64 and ds.doc_lengths.tolist() == [4, 1, 3, 51]
    assert ds.num_tokens == 59
    for i, d in enumerate(docs):
        assert ds.get(i).tolist() == d + [eod]
    assert ds.get(3, offset=10, length=5).tolist() == [10, 11, 12, 13, 14]
    assert ds.get(3, offset=48).tolist() == [48, 49, eod]
    assert os.path.getsize(f"{prefix}.bin") == 59 * np.dtype(dtype).itemsize
    with pytest.raises(IndexError):
        ds.get(4)
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=3)


def test_writer_rejects_bad_ids_and_never_overwrites(tmp_path):
    prefix = str(tmp_path / "ds")
    with IndexedDatasetWriter(prefix, 10, "", eod_id=9) as w, pytest.raises(DataError, match="outside"):
        w.add_document([3, 10])
    assert os.listdir(tmp_path) == []  # the failed writer left no temporary files
    write_dataset(tmp_path / "ds", [[1, 2]], 10, 9)
    with pytest.raises(DataError, match="already exist"):
        write_dataset(tmp_path / "ds", [[3]], 10, 9)
    assert IndexedDataset(prefix).get(0).tolist() == [1, 2, 9]
    with IndexedDatasetWriter(prefix, 10, "", eod_id=9, overwrite=True) as w:
        w.add_document([5])
        w.finalize()
    assert IndexedDataset(prefix).get(0).tolist() == [5, 9]
    assert sorted(os.listdir(tmp_path)) == ["ds.bin", "ds.idx"]


def _corrupt(prefix: str, how: str) -> None:
    idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    data = bytearray(idx.read_bytes())
    if how == "magic":
        data[:8] = b"NOTMAGIC"
        idx.write_bytes(bytes(data))
    elif how == "truncated_idx":
        idx.write_bytes(bytes(data[:-8]))
    elif how == "short_header":
        idx.write_bytes(bytes(data[:10]))
    elif how == "truncated_bin":
        bin_.write_bytes(bin_.read_bytes()[:-2])
    elif how == "offsets":  # docs of 3, 2, 4 tokens: offsets 0 3 5 9 -> 0 5 3 9
        start = indexed_mod._HEADER.size + len(b"byte")
        offsets = np.frombuffer(bytes(data[start:]), dtype="<i8").copy()
        assert offsets.tolist() == [0, 3, 5, 9]
        offsets[1], offsets[2] = offsets[2], offsets[1]
        data[start:] = offsets.tobytes()
        idx.write_bytes(bytes(data))
    elif how == "missing_idx":
        idx.unlink()
    elif how == "missing_bin":
        bin_.unlink()


@pytest.mark.parametrize("how", ["magic", "truncated_idx", "short_header", "truncated_bin", "offsets"])
def test_corrupt_dataset_raises(tmp_path, how):
    prefix = write_dataset(tmp_path / "ds", [[1, 2], [3], [4, 5, 6]], 257, 256, "byte")
    IndexedDataset(prefix)
    _corrupt(prefix, how)
    with pytest.raises(DataError, match="corrupt.*re-run megalm-preprocess") as e:
        IndexedDataset(prefix)
    assert "\n" not in str(e.value)


def test_a_damaged_token_is_refused_when_read(tmp_path):
    """A megalm file's ids were checked when written; a token damaged since then (vocab 257 in uint16) is
    caught when read, before it can reach the embedding."""
    prefix = write_dataset(tmp_path / "ds", [[1, 2], [3], [4, 5, 6]], 257, 256, "byte")
    tokens = np.memmap(f"{prefix}.bin", dtype=np.uint16, mode="r+")
    tokens[6] = 4000  # document 2 (4, 5, 6, eod)'s second token, after 1, 2, eod, 3, eod
    tokens.flush()
    del tokens
    ds = IndexedDataset(prefix)
    assert ds.get(2, 0, 1).tolist() == [4]
    with pytest.raises(DataError, match=r"^document 2 of .* holds token id 4000, outside its vocab \[0, 257\)"):
        ds.get(2, 1, 2)


@pytest.mark.parametrize("how, missing", [("missing_idx", ".idx"), ("missing_bin", ".bin")])
def test_missing_dataset_files_raise(tmp_path, how, missing):
    prefix = write_dataset(tmp_path / "ds", [[1, 2], [3], [4, 5, 6]], 257, 256, "byte")
    _corrupt(prefix, how)
    with pytest.raises(DataError, match=f"{missing} not found; build it with megalm-preprocess"):
        IndexedDataset(prefix)


def test_a_dataset_path_naming_its_directory_names_the_prefix(tmp_path):
    """data.path=DIR holding DIR/corpus.{bin,idx}: the line names the prefix (it suggested preprocessing to
    --output-prefix DIR, which refuses a directory)."""
    prefix = write_dataset(tmp_path / "data" / "corpus", [[1, 2], [3]], 257, 256, "byte")
    for path in (tmp_path / "data", f"{tmp_path / 'data'}/"):
        with pytest.raises(DataError, match=rf"is a directory, not a dataset's prefix; it holds .*: write "
                                            rf"data.path={prefix}$"):
            IndexedDataset(str(path))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="it holds no .idx file"):
        IndexedDataset(str(tmp_path / "empty"))


def test_a_dataset_path_with_its_suffix_says_to_drop_it(tmp_path):
    prefix = write_dataset(tmp_path / "ds", [[1, 2], [3]], 257, 256, "byte")
    with pytest.raises(DataError, match=rf"names a file; .* write data.path={prefix}$"):
        IndexedDataset(f"{prefix}.bin")
    Path(f"{prefix}.idx").unlink()
    Path(f"{prefix}.idx").mkdir()
    with pytest.raises(DataError, match=r"\.idx is not a file"):
        IndexedDataset(prefix)
    text = tmp_path / "docs.jsonl"  # the text itself: its tokenized files had been asked for as docs.jsonl.idx
    text.write_text('{"text": "def f(): pass"}\n')
    with pytest.raises(DataError, match=rf"is a file, not a tokenized corpus: tokenize it with megalm-preprocess "
                                        rf"--input {text} --output-prefix {tmp_path / 'docs'}, then write "
                                        rf"data.path={tmp_path / 'docs'}$"):
        IndexedDataset(str(text))
    tokenizer = tmp_path / "tokenizer.json"  # data.tokenizer's: the corpus is made with it
    with pytest.raises(DataError, match=rf"--output-prefix {tmp_path / 'docs'} --tokenizer {tokenizer}, then"):
        IndexedDataset(str(text), tokenizer=str(tokenizer))


# -------------------------------------------------------------------------------------- preprocess


def _texts(prefix: str) -> list[str]:
    ds = IndexedDataset(prefix)
    tok = build_tokenizer(ds.tokenizer_spec)
    out = []
    for i in range(len(ds)):
        ids = ds.get(i)
        assert ids[-1] == tok.eod_id
        out.append(tok.decode(ids[:-1].tolist()))
    return out


def test_preprocess_jsonl(tmp_path):
    src = tmp_path / "in.jsonl"
    lines = [json.dumps({"text": "hello"}), json.dumps({"text": "wörld ✓", "meta": 1}), "",
             json.dumps({"text": ""})]
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    stats = preprocess([src], str(tmp_path / "out"), ByteTokenizer(), show_progress=False)
    assert (stats.num_docs, stats.num_files, stats.skipped_empty) == (2, 1, 2)
    assert stats.num_tokens == len(b"hello") + len("wörld ✓".encode()) + 2
    assert _texts(str(tmp_path / "out")) == ["hello", "wörld ✓"]
    ds = IndexedDataset(str(tmp_path / "out"))
    assert ds.get(0).dtype == np.uint16 and ds.tokenizer_spec == "byte" and ds.vocab_size == 257
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"content": "abc"}) + "\n")
    preprocess([other], str(tmp_path / "o2"), "byte", json_key="content", show_progress=False)
    assert _texts(str(tmp_path / "o2")) == ["abc"]


def test_preprocess_txt_whole_and_split_lines(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("line one\nline two\n\nline three\n")
    preprocess([src], str(tmp_path / "whole"), "byte", show_progress=False)
    assert _texts(str(tmp_path / "whole")) == ["line one\nline two\n\nline three\n"]
    preprocess([src], str(tmp_path / "lines"), "byte", split_lines=True, show_progress=False)
    assert _texts(str(tmp_path / "lines")) == ["line one", "line two", "line three"]


def test_preprocess_directory_sorted_and_glob(tmp_path):
    root = tmp_path / "corpus"
    (root / "a").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "b.txt").write_text("B")
    (root / "a" / "z.txt").write_text("Z")
    (root / "a" / "c.jsonl").write_text(json.dumps({"text": "C1"}) + "\n" + json.dumps({"text": "C2"}) + "\n")
    (root / "notes.md").write_text("N")
    (root / ".hidden.txt").write_text("H")
    (root / ".git" / "x.txt").write_text("G")
    stats = preprocess([root], str(tmp_path / "all"), "byte", show_progress=False)
    assert _texts(str(tmp_path / "all")) == ["C1", "C2", "Z", "B", "N"]  # a/c.jsonl a/z.txt b.txt notes.md
    assert stats.num_files == 4
    preprocess([root], str(tmp_path / "txt"), "byte", glob="*.txt", show_progress=False)
    assert _texts(str(tmp_path / "txt")) == ["Z", "B"]
    # Inputs are read in the order given; the output is byte-identical when run again.
    preprocess([root / "b.txt", root / "a"], str(tmp_path / "mixed"), "byte", show_progress=False)
    assert _texts(str(tmp_path / "mixed")) == ["B", "C1", "C2", "Z"]
    preprocess([root], str(tmp_path / "again"), "byte", show_progress=False)
    for ext in (".bin", ".idx"):
        assert Path(f"{tmp_path}/all{ext}").read_bytes() == Path(f"{tmp_path}/again{ext}").read_bytes()


@pytest.mark.parametrize("output_format", ["megalm", "megatron"])
def test_preprocess_again_into_its_input_directory_skips_its_own_output(tmp_path, output_format):
    """An output prefix inside an --input directory, run again with --overwrite: the first run's .bin/.idx (and
    Megatron's sidecar) are not read back as documents (until 2026-12-04 they were tokenized as text, an audit
    found); an --input that names one of them is refused in one line."""
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.txt").write_text("hello world")
    prefix = str(root / "ds")
    for _ in range(2):
        stats = preprocess([root], prefix, "byte", overwrite=True, show_progress=False, output_format=output_format)
    assert stats.num_files == 1 and stats.num_docs == 1
    with pytest.raises(DataError, match="is this run's own output") as error:
        preprocess([root / "ds.bin"], prefix, "byte", overwrite=True, show_progress=False,
                   output_format=output_format)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("output_format", ["megalm", "megatron"])
def test_preprocess_directory_skips_other_datasets_and_follows_symlinks(tmp_path, output_format, caplog):
    """A directory walk leaves out any tokenized dataset inside it (its .bin/.idx were read as text, and a Megatron
    sidecar as bad JSON, until 2026-12-06), with one warning, and follows a symlinked directory once (it was
    skipped silently; a symlink back up the tree is not walked twice)."""
    root, shared = tmp_path / "corpus", tmp_path / "shared"
    root.mkdir()
    shared.mkdir()
    (root / "a.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    (shared / "s.txt").write_text("from a symlinked directory")
    (root / "shard").symlink_to(shared, target_is_directory=True)
    (shared / "loop").symlink_to(root, target_is_directory=True)
    (root / "z.megalm.json").write_text(json.dumps({"text": "a sidecar's name, no dataset beside it"}) + "\n")
    preprocess([root / "a.jsonl"], str(root / "other"), "byte", show_progress=False, output_format=output_format)
    with caplog.at_level(logging.WARNING, logger="megalm.data.preprocess"):
        stats = preprocess([root], str(tmp_path / "all"), "byte", show_progress=False)
    assert _texts(str(tmp_path / "all")) == ["hello", "from a symlinked directory",
                                             "a sidecar's name, no dataset beside it"]
    assert stats.num_files == 3
    assert [r.getMessage() for r in caplog.records] == [
        f"skipping the tokenized dataset {root / 'other'} (.bin/.idx) inside the input directories"]


def test_preprocess_input_refusals_and_pipes(tmp_path):
    """A compressed input is refused in one line (it was tokenized as one document of binary noise), a pipe is read
    (it was "not found"), a JSON file's byte-order mark is dropped (it was "invalid JSON"), and a stale sidecar alone
    is named as what exists (the error named a .bin and .idx that were not there)."""
    import gzip

    gz = tmp_path / "docs.jsonl.gz"
    gz.write_bytes(gzip.compress(json.dumps({"text": "zipped"}).encode()))
    with pytest.raises(DataError, match="docs.jsonl.gz is compressed") as error:
        preprocess([tmp_path], str(tmp_path / "out"), "byte", show_progress=False)
    assert "\n" not in str(error.value)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text("through a pipe"))
    writer.start()
    preprocess([fifo], str(tmp_path / "piped"), "byte", show_progress=False)
    writer.join()
    assert _texts(str(tmp_path / "piped")) == ["through a pipe"]
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": "first"}).encode() + b"\n")
    preprocess([bom], str(tmp_path / "bom"), "byte", show_progress=False)
    assert _texts(str(tmp_path / "bom")) == ["first"]
    (tmp_path / "stale.megalm.json").write_text("{}")
    with pytest.raises(DataError, match=r"^\S*stale.megalm.json already exists; pass --overwrite"):
        preprocess([bom], str(tmp_path / "stale"), "byte", show_progress=False)


def test_preprocess_reads_text_files_as_editors_and_shells_write_them(tmp_path, monkeypatch, caplog):
    """A .txt's byte-order mark (Windows editors write one) was stored as 3 tokens of its first document; a parquet
    file (Hugging Face datasets' format) was one document of noise, exit 0; a quoted ~ in --output-prefix made a
    ./~ directory that data.path=~/... never found (an audit, 2026-12-06)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)  # where a ~ kept as a name would land
    (tmp_path / "home").mkdir()
    bom = tmp_path / "home" / "bom.txt"
    bom.write_bytes(b"\xef\xbb\xbfhello\nworld\n")
    for split_lines, texts in ((True, ["hello", "world"]), (False, ["hello\nworld\n"])):
        preprocess(["~/bom.txt"], "~/corpus", "byte", split_lines=split_lines, show_progress=False, overwrite=True)
        assert _texts(str(tmp_path / "home" / "corpus")) == texts
    assert not Path("~").exists()
    notes = tmp_path / "notes.md"  # --split-lines splits .txt files only: a .md was one document without a word
    notes.write_text("one\ntwo\n")
    with caplog.at_level(logging.WARNING, logger="megalm"):
        preprocess([notes, bom], str(tmp_path / "md"), "byte", split_lines=True, show_progress=False)
    assert _texts(str(tmp_path / "md")) == ["one\ntwo\n", "hello", "world"]
    assert [m for m in caplog.messages if "--split-lines" in m] == [
        f"--split-lines reads .txt files line by line; {notes} is read whole, one document each: add "
        "--input-format txt to split them too"]
    preprocess([notes], str(tmp_path / "md2"), "byte", split_lines=True, show_progress=False, input_format="txt")
    assert _texts(str(tmp_path / "md2")) == ["one", "two"]
    (tmp_path / "train.parquet").write_bytes(b"PAR1\x15\x04" + bytes(range(256)))
    with pytest.raises(DataError, match=r"train.parquet is a binary file, .* write its text as JSON lines first"):
        preprocess([tmp_path], str(tmp_path / "pq"), "byte", show_progress=False)
    assert not (tmp_path / "pq.bin").exists()


def test_preprocess_reads_a_pipe_of_json_lines_as_json_lines(tmp_path, caplog):
    """The compressed-input error says to pipe the file in: a pipe has no suffix, and a piped .jsonl was one document
    of raw JSON text. auto reads a pipe by its first line (and says so); --input-format sets it; --split-lines splits
    a piped text."""
    import gzip
    import logging

    (tmp_path / "gz").mkdir()
    (tmp_path / "gz" / "docs.jsonl.gz").write_bytes(gzip.compress(b"{}"))
    with pytest.raises(DataError, match=r"--input <\(zcat FILE\) --input-format jsonl"):
        preprocess([tmp_path / "gz"], str(tmp_path / "out"), "byte", show_progress=False)

    def piped(text: str, prefix: str, **options) -> list[str]:
        fifo = tmp_path / f"{prefix}.fifo"
        os.mkfifo(fifo)
        writer = threading.Thread(target=lambda: fifo.write_text(text))
        writer.start()
        preprocess([fifo], str(tmp_path / prefix), "byte", show_progress=False, **options)
        writer.join()
        return _texts(str(tmp_path / prefix))

    lines = "\n" + json.dumps({"text": "one"}) + "\n" + json.dumps({"text": "two", "id": 2}) + "\n"
    with caplog.at_level(logging.INFO):
        assert piped(lines, "auto") == ["one", "two"]
    assert any("as jsonl (its first line is a JSON object); --input-format txt" in m
               for m in caplog.messages), caplog.messages
    assert piped(lines, "as_text", input_format="txt") == [lines]
    assert piped("a\nb\n", "split", split_lines=True) == ["a", "b"]
    assert piped("{not json\n", "text") == ["{not json\n"]
    with pytest.raises(DataError, match="no key 'text' \\(keys: body\\); pass --json-key KEY"):  # not one raw document
        piped(json.dumps({"body": "x"}) + "\n", "other_key")
    with pytest.raises(DataError, match="--input-format 'yaml' is not one of auto, jsonl, txt"):
        preprocess([tmp_path / "gz"], str(tmp_path / "out"), "byte", show_progress=False, input_format="yaml")


def test_preprocess_hf_tokenizer_and_uint32(tmp_path):
    words = [f"w{i}" for i in range(70000)]  # ids 1..70000, eod 70001
    tok = HFTokenizer(str(make_hf_tokenizer(tmp_path / "big.json", words)))
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "w69999 w3 w65535"}) + "\n" + json.dumps({"text": "w0"}) + "\n")
    preprocess([src], str(tmp_path / "big"), tok, show_progress=False)
    ds = IndexedDataset(str(tmp_path / "big"))
    assert ds.get(0).dtype == np.uint32 and ds.vocab_size == 70002 and ds.eod_id == 70001
    assert ds.get(0).tolist() == [70000, 4, 65536, 70001] and ds.get(1).tolist() == [1, 70001]
    assert ds.tokenizer_spec == tok.spec
    assert _texts(str(tmp_path / "big")) == ["w69999 w3 w65535", "w0"]


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_starts_each_document_as_its_tokenizer_starts_a_text(tmp_path, workers):
    """A Llama tokenizer puts <s> before every text; megalm's encode leaves special tokens out, so its documents
    started without it, where Megatron-LM's preprocess_data (and TorchTitan) write it: continued pretraining of an
    imported Llama trained on documents unlike its own (an audit, 2026-12-06). Megatron's layout, with eod after."""
    from tokenizers import processors

    path = make_hf_tokenizer(tmp_path / "tok.json", ["alpha", "beta"], specials=("<s>", "</s>"))
    tok = HFTok.from_file(str(path))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 3)])
    tok.save(str(path))
    src = tmp_path / "in.txt"
    src.write_text("alpha beta\nbeta")
    preprocess([src], str(tmp_path / "ds"), str(path), split_lines=True, show_progress=False, workers=workers)
    ds = IndexedDataset(str(tmp_path / "ds"))
    assert [ds.get(i).tolist() for i in range(len(ds))] == [tok.encode(t).ids + [4] for t in ("alpha beta", "beta")]
    assert [ds.get(i).tolist() for i in range(len(ds))] == [[3, 1, 2, 4], [3, 2, 4]]
    assert HFTokenizer(str(path)).prompt_start() == [3] and ByteTokenizer().prompt_start() == []


def test_preprocess_workers_match_single_process(tmp_path):
    path = make_hf_tokenizer(tmp_path / "tok.json", ["alpha", "beta", "gamma"])
    src = tmp_path / "in.txt"
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta"]  # "delta" is unknown: <unk>
    src.write_text("\n".join(" ".join(rng.choice(words, size=rng.integers(1, 9))) for _ in range(1200)))
    preprocess([src], str(tmp_path / "one"), str(path), split_lines=True, show_progress=False)
    preprocess([src], str(tmp_path / "two"), str(path), split_lines=True, show_progress=False, workers=2)
    assert len(IndexedDataset(str(tmp_path / "one"))) == 1200
    for ext in (".bin", ".idx"):
        assert Path(f"{tmp_path}/one{ext}").read_bytes() == Path(f"{tmp_path}/two{ext}").read_bytes()


def test_cli_success_and_overwrite(tmp_path, capsys):
    src = tmp_path / "a.txt"
    src.write_text("abc")
    argv = ["--input", str(src), "--output-prefix", str(tmp_path / "out" / "ds")]
    code, out, err = run_cli(argv, capsys)
    assert code == 0 and "1 documents" in out and err == ""
    assert _texts(str(tmp_path / "out" / "ds")) == ["abc"]
    src.write_text("xyz")
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and "--overwrite" in err
    code, _, _ = run_cli([*argv, "--overwrite"], capsys)
    assert code == 0 and _texts(str(tmp_path / "out" / "ds")) == ["xyz"]


def _cli_case(tmp_path: Path, case: str) -> tuple[list[str], str]:
    out = ["--output-prefix", str(tmp_path / "out")]
    if case == "missing_input":
        return ["--input", str(tmp_path / "nope.jsonl"), *out], "not found"
    if case == "bad_json":
        (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": oops}\n')
        return ["--input", str(tmp_path / "bad.jsonl"), *out], "bad.jsonl:2: invalid JSON"
    if case == "missing_key":
        (tmp_path / "k.jsonl").write_text('{"body": "x"}\n')
        return ["--input", str(tmp_path / "k.jsonl"), *out], "k.jsonl:1: no key 'text'"
    if case == "exists":
        (tmp_path / "a.txt").write_text("a")
        (tmp_path / "out.idx").write_bytes(b"")
        return ["--input", str(tmp_path / "a.txt"), *out], "already exist"
    if case == "empty":
        (tmp_path / "empty.txt").write_text("")
        return ["--input", str(tmp_path / "empty.txt"), *out], "no documents"
    if case == "empty_dir":
        (tmp_path / "d").mkdir()
        return ["--input", str(tmp_path / "d"), *out], "no files matching"
    if case == "tokenizer":
        (tmp_path / "a.txt").write_text("a")
        argv = ["--input", str(tmp_path / "a.txt"), "--tokenizer", str(tmp_path / "t.json"), *out]
        return argv, "tokenizer file"
    if case == "huge_number":  # valid JSON that Python's int() refuses (a ValueError, not a JSONDecodeError)
        (tmp_path / "n.jsonl").write_text('{"text": "a"}\n{"text": "b", "id": ' + "9" * 5000 + "}\n")
        return ["--input", str(tmp_path / "n.jsonl"), *out], "n.jsonl:2: JSON that Python cannot read"
    if case == "deep_nesting":
        (tmp_path / "d.jsonl").write_text('{"text": "b", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
        return ["--input", str(tmp_path / "d.jsonl"), *out], "d.jsonl:1: JSON that Python cannot read"
    if case == "usage":
        return ["--input", "x"], "required"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["missing_input", "bad_json", "missing_key", "exists", "empty", "empty_dir",
                                  "tokenizer", "huge_number", "deep_nesting", "usage"])
def test_cli_errors_are_one_line_exit_2(tmp_path, capsys, case):
    argv, expected = _cli_case(tmp_path, case)
    code, out, err = run_cli(argv, capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and expected in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "out.bin").exists()


def test_cli_subprocess_exit_code(tmp_path):
    missing = tmp_path / "none.txt"
    argv = ["--input", str(missing), "--output-prefix", str(tmp_path / "o")]
    proc = subprocess.run([sys.executable, "-m", "megalm.data.preprocess", *argv], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: input {missing} not found; check --input"]


# ------------------------------------------------------------------------------------- demo corpus


def make_fake_stdlib(root: Path) -> Path:
    files = {
        "os2.py": "import sys\n",
        "pkg/__init__.py": "",  # empty: skipped as a document
        "pkg/mod.py": "def f():\n    return 1\n",
        "test/test_x.py": "EXCLUDED",
        "pkg/tests/t.py": "EXCLUDED",
        "idlelib/i.py": "EXCLUDED",
        "site-packages/s.py": "EXCLUDED",
        "lib2to3/l.py": "EXCLUDED",
        "__pycache__/c.py": "EXCLUDED",
        "README.txt": "EXCLUDED",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_demo_corpus_builds_once_and_caches(tmp_path, monkeypatch, caplog):
    src = make_fake_stdlib(tmp_path / "lib")
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="megalm.data.demo"):
        prefix = demo_corpus(str(cache), source_dir=str(src))
    assert [r for r in caplog.records if "building the demo corpus" in r.getMessage()]
    assert Path(prefix).parent.parent == cache
    assert Path(prefix).parent.name.startswith(f"py{sys.version_info.major}.{sys.version_info.minor}-")
    assert _texts(prefix) == ["import sys\n", "def f():\n    return 1\n"]
    assert IndexedDataset(prefix).tokenizer_spec == "byte"

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the cached demo corpus was rebuilt")

    monkeypatch.setattr(demo_mod, "preprocess", no_rebuild)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megalm.data.demo"):
        assert demo_corpus(str(cache), source_dir=str(src)) == prefix
    assert not caplog.records
    # A changed file list (or size) is another corpus: it would be built.
    (src / "new.py").write_text("x = 1\n")
    with pytest.raises(AssertionError, match="rebuilt"):
        demo_corpus(str(cache), source_dir=str(src))


def test_demo_corpus_default_cache_and_corrupt_rebuild(tmp_path, monkeypatch):
    src = make_fake_stdlib(tmp_path / "lib")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    prefix = demo_corpus(source_dir=str(src))
    assert Path(prefix).is_relative_to(tmp_path / "xdg" / "megalm")
    Path(f"{prefix}.bin").write_bytes(b"\0")  # corrupt cache: rebuilt, not an error
    assert demo_corpus(source_dir=str(src)) == prefix
    assert _texts(prefix) == ["import sys\n", "def f():\n    return 1\n"]


def test_demo_corpus_concurrent_builds(tmp_path):
    src = make_fake_stdlib(tmp_path / "lib")
    results, errors = [], []

    def build():
        try:
            results.append(demo_corpus(str(tmp_path / "cache"), source_dir=str(src)))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert sorted(os.listdir(Path(results[0]).parent)) == ["stdlib.bin", "stdlib.idx"]  # no temp files left
    assert len(IndexedDataset(results[0])) == 2


# --------------------------------------------------------------------------------------- synthetic


def test_synthetic_documents():
    a = SyntheticDocuments(2000, vocab_size=500, mean_doc_length=100, seed=1)
    b = SyntheticDocuments(2000, vocab_size=500, mean_doc_length=100, seed=1)
    c = SyntheticDocuments(2000, vocab_size=500, mean_doc_length=100, seed=2)
    assert np.array_equal(a.doc_lengths, b.doc_lengths) and not np.array_equal(a.doc_lengths, c.doc_lengths)
    assert a.doc_lengths.min() >= 2 and 80 < a.doc_lengths.mean() < 120 and a.doc_lengths.max() > 300
    assert len(a) == 2000 and a.num_tokens == a.doc_lengths.sum()
    for i in (0, 7, 1999):
        doc = a.get(i)
        assert len(doc) == a.doc_lengths[i] and doc[-1] == 499 and (doc[:-1] < 499).all()
        assert np.array_equal(doc, b.get(i)) and not np.array_equal(doc[:2], c.get(i)[:2])
        n = len(doc)
        assert np.array_equal(a.get(i, 1, n - 2), doc[1:-1]) and np.array_equal(a.get(i, n - 1), doc[-1:])
    fixed = SyntheticDocuments(10, vocab_size=50, mean_doc_length=100, fixed_doc_length=33)
    assert fixed.doc_lengths.tolist() == [33] * 10


# ---------------------------------------------------------------------------------------- sampling


def test_split_documents():
    train, valid = split_documents(1000, 0.05, split_seed=0)
    assert len(valid) == 50 and len(train) == 950
    assert sorted(np.concatenate([train, valid]).tolist()) == list(range(1000))
    t2, v2 = split_documents(1000, 0.05, split_seed=0)
    assert np.array_equal(valid, v2) and np.array_equal(train, t2)
    assert not np.array_equal(valid, split_documents(1000, 0.05, split_seed=1)[1])
    assert len(split_documents(10, 0.01, 0)[1]) == 1  # a nonzero fraction holds out at least one
    assert len(split_documents(10, 0.0, 0)[1]) == 0 and len(split_documents(1, 0.5, 0)[0]) == 1


def _eod_boundaries(tokens: np.ndarray, eod: int) -> tuple[int, ...]:
    """Document lengths implied by eod tokens: a document ends after each eod (but the last token)."""
    cuts = [i + 1 for i in np.flatnonzero(tokens[:-1] == eod)]
    edges = [0, *cuts, len(tokens)]
    return tuple(int(b - a) for a, b in zip(edges[:-1], edges[1:], strict=True))


def test_packed_windows_cover_the_stream_with_right_boundaries(synth):
    L = 16
    ds = PackedDataset(synth, np.arange(len(synth)), L, seed=7)
    order = ds.epoch_documents(0)
    assert sorted(order.tolist()) == list(range(len(synth)))
    stream = np.concatenate([synth.get(int(d)) for d in order])
    assert ds.samples_per_epoch == (len(stream) - 1) // L
    windows = [ds.window(0, j) for j in range(ds.samples_per_epoch)]
    rebuilt = np.concatenate([windows[0].tokens] + [w.tokens[1:] for w in windows[1:]])
    assert np.array_equal(rebuilt, stream[:len(rebuilt)])  # every token up to the < L tail is used
    assert len(stream) - len(rebuilt) < L
    for w in windows:
        assert len(w.tokens) == L + 1
        assert w.doc_lengths == _eod_boundaries(w.tokens, synth.eod_id)
        batch = pack_samples([w])
        inputs = w.tokens[:-1]
        # the loss is masked exactly where the label is the first token of the next document
        assert torch.equal(batch.loss_mask, torch.from_numpy((inputs != synth.eod_id).astype(np.float32)))
        starts = np.concatenate([[0], np.flatnonzero(inputs[:-1] == synth.eod_id) + 1])
        assert (batch.position_ids.numpy()[starts] == 0).all()
        assert batch.num_loss_tokens() == w.num_loss_tokens()


def test_packed_shuffle_and_epochs(synth):
    ds = PackedDataset(synth, np.arange(len(synth)), 16, seed=7)
    n = ds.samples_per_epoch
    key = lambda s: tuple(s.tokens.tolist())
    epoch0 = [key(ds[k]) for k in range(n)]
    assert sorted(epoch0) == sorted(key(ds.window(0, j)) for j in range(n))
    assert epoch0 != [key(ds.window(0, j)) for j in range(n)]  # shuffled
    epoch1 = [key(ds[n + k]) for k in range(n)]
    assert sorted(epoch1) == sorted(key(ds.window(1, j)) for j in range(n))
    assert not np.array_equal(ds.epoch_documents(0), ds.epoch_documents(1))
    assert key(ds[3]) == key(PackedDataset(synth, np.arange(len(synth)), 16, seed=7)[3])
    with pytest.raises(IndexError):
        ds[-1]


def test_varlen_chunking(tmp_path):
    L = 4
    sizes = [0, 1, L - 1, L, L + 1, 2 * L, 3 * L - 1]  # tokens before eod: documents of 1, 2, L, ... 3L
    docs = [list(range(100 * k, 100 * k + n)) for k, n in enumerate(sizes)]
    src = IndexedDataset(write_dataset(tmp_path / "v", docs, 1000, 999))
    ds = VarlenDataset(src, np.arange(len(src)), L, seed=0)
    expected_chunks = [0, 1, 1, 1, 2, 2, 3]
    assert ds.samples_per_epoch == sum(expected_chunks)
    c = 0
    for d, n in enumerate(expected_chunks):
        chunks = [ds.chunk(c + q) for q in range(n)]
        c += n
        for q, s in enumerate(chunks):
            assert 2 <= len(s.tokens) <= L + 1 and s.doc_lengths == (len(s.tokens),)
            assert s.tokens[0] == src.get(d)[q * L]
        if n:
            rebuilt = np.concatenate([chunks[0].tokens] + [s.tokens[1:] for s in chunks[1:]])
            assert rebuilt.tolist() == src.get(d).tolist()  # neighbours share one token: no prediction lost
            assert sum(s.num_loss_tokens() for s in chunks) == src.doc_lengths[d] - 1
    key = lambda s: tuple(s.tokens.tolist())
    shuffled = [key(ds[k]) for k in range(ds.samples_per_epoch)]
    in_order = [key(ds.chunk(j)) for j in range(ds.samples_per_epoch)]
    assert sorted(shuffled) == sorted(in_order) and shuffled != in_order
    assert [key(ds[ds.samples_per_epoch + k]) for k in range(ds.samples_per_epoch)] != shuffled


@pytest.mark.parametrize("sampler", [PackedDataset, VarlenDataset])
def test_global_batch_depends_on_seed_and_step_only(synth, sampler):
    ids = np.arange(len(synth))
    key = lambda batch: [tuple(s.tokens.tolist()) for s in batch]
    a = key(global_batch(sampler(synth, ids, 16, seed=1), step=5, global_batch_size=8))
    b = key(global_batch(sampler(synth, ids, 16, seed=1), step=5, global_batch_size=8))
    c = key(global_batch(sampler(synth, ids, 16, seed=2), step=5, global_batch_size=8))
    d = key(global_batch(sampler(synth, ids, 16, seed=1), step=6, global_batch_size=8))
    assert a == b and a != c and a != d and len(a) == 8
    # steps tile the sample sequence: step s with gbs 8 = steps 2s, 2s+1 with gbs 4
    ds = sampler(synth, ids, 16, seed=1)
    assert a == key(global_batch(ds, 10, 4) + global_batch(ds, 11, 4))


@pytest.mark.parametrize("sampler", [PackedDataset, VarlenDataset])
def test_micro_batches_are_independent_of_layout(synth, sampler):
    samples = global_batch(sampler(synth, np.arange(len(synth)), 16, seed=4), step=2, global_batch_size=8)
    whole = pack_samples(samples)
    total = loss_token_count(samples)
    assert total == whole.num_loss_tokens() == sum(s.num_loss_tokens() for s in samples)
    for dp in (1, 2, 4):
        for mbs in (1, 2):
            if 8 % (dp * mbs):
                continue
            mbs_all = [mb for r in range(dp) for mb in micro_batches(samples, mbs, r, dp)]
            assert len(mbs_all) == 8 // mbs
            for field in ("tokens", "labels", "loss_mask", "position_ids"):
                joined = torch.cat([getattr(mb, field) for mb in mbs_all])
                assert torch.equal(joined, getattr(whole, field)), (dp, mbs, field)
            assert [n for mb in mbs_all for n in mb.doc_lengths] == whole.doc_lengths
            assert sum(mb.num_loss_tokens() for mb in mbs_all) == total
            rank1 = micro_batches(samples, mbs, dp - 1, dp)
            assert sum(loss_token_count(samples[i:i + 1]) for i in range(8 - 8 // dp, 8)) == \
                sum(mb.num_loss_tokens() for mb in rank1)
    with pytest.raises(ValueError):
        micro_batches(samples, 3)
    with pytest.raises(ValueError):
        micro_batches(samples, 1, 0, 3)


def test_loss_token_count():
    samples = [Sample(np.arange(5), (2, 3)), Sample(np.arange(4), (4,)), Sample(np.arange(3), (1, 1, 1))]
    assert loss_token_count(samples) == 3 + 3 + 0
    assert loss_token_count(samples) == pack_samples(samples).num_loss_tokens()


# ------------------------------------------------------------------------------------ build_datasets


def _cfg(**data) -> MegalmConfig:
    cfg = MegalmConfig()
    cfg.model.seq_length = 16
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def test_build_datasets_synthetic():
    cfg = _cfg(name="synthetic", valid_fraction=0.1)
    cfg.data.synthetic.num_docs = 60
    cfg.data.synthetic.mean_doc_length = 40
    bundle = build_datasets(cfg)
    assert isinstance(bundle.train, PackedDataset) and bundle.tokenizer is None
    assert bundle.valid is not None and bundle.train.num_docs + bundle.valid.num_docs == 60
    assert not set(bundle.train.doc_ids) & set(bundle.valid.doc_ids)
    batch = global_batch(bundle.train, 0, 4)
    assert all(len(s.tokens) == 17 and s.tokens.max() < cfg.model.vocab_size for s in batch)
    cfg.data.varlen = True
    assert isinstance(build_datasets(cfg).train, VarlenDataset)
    cfg.data.tokenizer = "/nonexistent/tokenizer.json"  # was accepted and never read
    with pytest.raises(DataError, match="data=synthetic draws token ids.*would not be read"):
        build_datasets(cfg)


def test_a_data_path_under_home_is_found(tmp_path, monkeypatch):
    """data.path="~/..." was not expanded (blend prefixes, data.tokenizer and data.cache_dir are)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    byte_dataset(tmp_path, ["hello world"] * 40)
    cfg = _cfg(name="indexed", path="~/bytes")
    assert build_datasets(cfg).source.prefix == str(tmp_path / "bytes")


def test_build_datasets_indexed_byte(tmp_path):
    prefix = byte_dataset(tmp_path, [f"document number {i} " * 3 for i in range(20)])
    bundle = build_datasets(_cfg(name="indexed", path=prefix, valid_fraction=0.1))
    assert isinstance(bundle.tokenizer, ByteTokenizer)
    assert bundle.valid is not None and bundle.valid.num_docs == 2
    text = bundle.tokenizer.decode(global_batch(bundle.train, 0, 1)[0].tokens.tolist())
    assert "number" in text and len(text) == 17


def test_build_datasets_vocab_and_tokenizer_errors(tmp_path):
    path = make_hf_tokenizer(tmp_path / "tok.json", [f"w{i}" for i in range(398)])  # vocab 400
    src = tmp_path / "in.txt"
    src.write_text(" ".join(f"w{i}" for i in range(0, 398, 3)))
    preprocess([src], str(tmp_path / "hf"), str(path), show_progress=False)
    with pytest.raises(DataError, match=r"^tokenizer vocab 400 exceeds model.vocab_size=320; "
                                        r"set model.vocab_size=400 \(the embedding and head are padded"):
        build_datasets(_cfg(name="indexed", path=str(tmp_path / "hf"), valid_fraction=0.0))
    cfg = _cfg(name="indexed", path=str(tmp_path / "hf"), valid_fraction=0.0)
    cfg.model.vocab_size = 400
    assert build_datasets(cfg).tokenizer.vocab_size == 400
    path.unlink()
    with pytest.raises(DataError, match="data.tokenizer="):
        build_datasets(cfg)
    with pytest.raises(DataError, match="not found"):
        build_datasets(_cfg(name="indexed", path=str(tmp_path / "nothing")))


def test_build_datasets_empty_or_tiny(tmp_path):
    empty = write_dataset(tmp_path / "empty", [], 257, 256, "byte")
    with pytest.raises(DataError, match="train split is empty"):
        build_datasets(_cfg(name="indexed", path=empty))
    tiny = byte_dataset(tmp_path, ["abc"])
    with pytest.raises(DataError, match="fewer than the seq_length") as error:
        build_datasets(_cfg(name="indexed", path=tiny))
    assert "valid_fraction" not in str(error.value)
    # Two documents: the default valid_fraction holds one out, and the error says so (it counted the train half's
    # tokens alone and named only more data or a shorter sequence, until 2026-12-06).
    (tmp_path / "two").mkdir()
    two = byte_dataset(tmp_path / "two", ["a" * 10, "b" * 10])  # 11 tokens each, 17 a sample
    with pytest.raises(DataError, match=r"1 of its 2 documents are held out .* data.valid_fraction=0 trains on all"):
        build_datasets(_cfg(name="indexed", path=two))


def test_build_datasets_demo(tmp_path, monkeypatch):
    src = make_fake_stdlib(tmp_path / "lib")
    real = demo_mod.demo_corpus
    monkeypatch.setattr(demo_mod, "demo_corpus", lambda cache_dir=None: real(cache_dir, source_dir=str(src)))
    cfg = _cfg(name="demo", cache_dir=str(tmp_path / "cache"), valid_fraction=0.0)
    cfg.model.seq_length = 8
    bundle = build_datasets(cfg)
    assert isinstance(bundle.tokenizer, ByteTokenizer) and bundle.valid is None
    assert bundle.train.num_tokens == len("import sys\n") + len("def f():\n    return 1\n") + 2
    with pytest.raises(DataError, match="byte-tokenized"):
        build_datasets(_cfg(name="demo", tokenizer="some/tokenizer.json"))


def test_a_generated_continuation_keeps_the_space_a_sentencepiece_decoder_drops(tmp_path):
    """megalm-generate printed the prompt, then the continuation decoded alone: a Metaspace decoder (Llama-2,
    Mistral, Mixtral tokenizers) strips the leading space of a decoded sequence, so "the cat" + "the the" printed
    "the catthe the" (an audit, 2026-12-04). The continuation is now what it adds to the prompt's decoding."""
    from megalm.generate import continuation

    vocab = {w: i for i, w in enumerate(["<unk>", "\u2581the", "\u2581cat", "<|endoftext|>"])}
    tok = HFTok(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    from tokenizers import decoders

    tok.decoder = decoders.Metaspace()
    tok.save(str(tmp_path / "spm.json"))
    spm = build_tokenizer(str(tmp_path / "spm.json"))
    prompt = spm.encode("the cat")
    assert prompt == [1, 2] and spm.decode([1]) == "the"  # the decoder drops the leading space
    assert "the cat" + continuation(spm, prompt, [1, 1, spm.eod_id]) == "the cat the the"
    byte = build_tokenizer("byte")
    assert continuation(byte, byte.encode("def"), byte.encode(" f(x)")) == " f(x)"
    assert continuation(byte, [byte.eod_id], byte.encode("x = 1")) == "x = 1"  # an empty prompt
