"""The samplers' index arrays are built once per machine and memory-mapped by every process (data/index_cache.py).

A run's samplers (split_samplers) keep their arrays of 16 MB and more as .npy files under data.cache_dir/index: the
first process builds them under a lock, the others map them. The samples are those of in-memory samplers; a second
process holds none of the arrays in its anonymous memory (measured: RssAnon, which file-backed pages do not count);
processes that start together build each array once; a damaged file is built again; a directory that cannot be
written is said in one line and the arrays are built in memory. The source has 2.5M documents, so that the arrays
pass the default MIN_BYTES (16 MB); the memory test reads an indexed dataset of as many, as a run does.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megalm.data.dataset import PackedDataset, VarlenDataset, split_samplers
from megalm.data.index_cache import MIN_BYTES
from tests.conftest import compose_config

DOCS = 2_500_000  # 20 MB of int64 lengths: above MIN_BYTES, so every large array goes to a file


class LengthsSource:
    """Documents of 2..64 tokens whose tokens are a function of (document, position): no file to write."""

    vocab_size = 512

    def __init__(self, num_docs: int = DOCS) -> None:
        self.doc_lengths = np.random.default_rng(3).integers(2, 65, num_docs).astype(np.int64)

    def __len__(self) -> int:
        return len(self.doc_lengths)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        length = int(self.doc_lengths[i]) - offset if length is None else length
        return (i * 7 + np.arange(offset, offset + length)) % self.vocab_size


def _samples(dataset) -> list[list[int]]:
    """Samples of epochs 0, 1 and 2, their first and last included."""
    n = dataset.samples_per_epoch
    return [dataset[k].tokens.tolist() for k in (0, 1, n - 1, n, n + 17, 2 * n + 5)]


def _file_backed(array: np.ndarray) -> bool:
    """Whether `array` is (a view of) a memory-mapped file."""
    while isinstance(array, np.ndarray) and not isinstance(array, np.memmap):
        array = array.base
    return isinstance(array, np.memmap)


def _config(cache: Path, varlen: bool = False):
    return compose_config(f"data.cache_dir={cache}", f"data.varlen={str(varlen).lower()}", "data.valid_fraction=0.01")


def test_min_bytes_is_the_documented_sixteen_megabytes():
    assert MIN_BYTES == 16 << 20 and 8 * DOCS > MIN_BYTES


@pytest.mark.parametrize("varlen", [False, True], ids=["packed", "varlen"])
def test_cached_samplers_draw_the_in_memory_samplers_samples(tmp_path, varlen):
    source = LengthsSource()
    cfg = _config(tmp_path, varlen)
    train, valid = split_samplers(source, cfg, "test data")
    sampler = VarlenDataset if varlen else PackedDataset
    in_memory = sampler(source, train.doc_ids.copy(), cfg.model.seq_length, cfg.seed)
    assert _samples(train) == _samples(in_memory)
    files = sorted(p.name.split("-", 1)[1] for p in (tmp_path / "index").glob("*.fields"))
    expected = {False: ["epoch0.fields", "epoch1.fields", "epoch2.fields", "lengths.fields", "split.fields"],
                True: ["chunks.fields", "epoch0.fields", "epoch1.fields", "epoch2.fields", "lengths.fields",
                       "split.fields"]}[varlen]
    assert files == expected  # the run's arrays went to files (the held-out 1%'s are small: in memory)
    again, _ = split_samplers(source, cfg, "test data")  # another process's samplers: mapped, the same samples
    assert _file_backed(again._lengths) and _file_backed(again.doc_ids)
    assert _samples(again) == _samples(in_memory)
    held_out = sampler(source, valid.doc_ids.copy(), cfg.model.seq_length, cfg.seed)
    assert [valid[k].tokens.tolist() for k in range(3)] == [held_out[k].tokens.tolist() for k in range(3)]


# A process that opens an indexed dataset and reads the run's samplers of it: its anonymous memory (RssAnon) above its
# start once the dataset is open ("open"), and at most while it opens it, builds the samplers and draws from three
# epochs ("extra"), the cache either present (files mapped) or not (data.cache_dir unusable)
PROBE = r"""
import json, sys, threading, time
sys.path.insert(0, sys.argv[3])
from tests.unit.test_index_cache import _config, _samples
from megalm.data.dataset import split_samplers
from megalm.data.indexed import IndexedDataset
from megalm.data import megatron_format  # imported by the open: before the start, as the tokenizer is made
from megalm.data.tokenizer import build_tokenizer
from pathlib import Path

def rss_anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

cfg = _config(Path(sys.argv[1]), sys.argv[2] == "varlen")
tokenizer = build_tokenizer("byte")  # a Megatron-LM dataset without megalm's sidecar needs data.tokenizer
peak, done = [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss_anon())
        time.sleep(0.001)
start = rss_anon()
thread = threading.Thread(target=sample, daemon=True)
thread.start()
source = IndexedDataset(sys.argv[4], tokenizer)
opened = rss_anon() - start
train, _ = split_samplers(source, cfg, "test data")
checksum = hash(str(_samples(train)))
done.set()
thread.join()
print(json.dumps({"open": opened, "extra": max(peak[0], rss_anon()) - start, "checksum": checksum}))
"""


def _run(script: str, cache: Path, kind: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    root = Path(__file__).parents[2]
    return subprocess.Popen([sys.executable, "-c", script, str(cache), kind, str(root), *args], cwd=root, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONHASHSEED": "0",
                                 **(env or {})})


def _result(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=240)
    assert process.returncode == 0, err[-2000:]
    return {**json.loads(out.strip().splitlines()[-1]), "log": err}


@pytest.fixture(scope="module")
def indexed(tmp_path_factory, request) -> str:
    """An indexed dataset of 2.5M documents of 1 to 3 tokens and their eod (zeros: what the arrays hold is their
    lengths), in megalm's format (8.5 s to write) or Megatron-LM's (13 s; without megalm's sidecar, as Megatron-LM
    writes it: each document's last token read at the open decides its virtual eod)."""
    from megalm.data.indexed import IndexedDatasetWriter
    from megalm.data.megatron_format import MegatronDatasetWriter, sidecar_path

    prefix = str(tmp_path_factory.mktemp("indexed") / "docs")
    tokens = np.zeros(3, dtype=np.int64)
    writer_class = MegatronDatasetWriter if request.param == "megatron" else IndexedDatasetWriter
    with writer_class(prefix, 257, "byte", eod_id=256) as writer:
        for n in np.random.default_rng(3).integers(1, 4, DOCS):
            writer.add_document(tokens[:n])
        writer.finalize()
    if request.param == "megatron":
        os.remove(sidecar_path(prefix))
    return prefix


@pytest.mark.parametrize("indexed, varlen", [
    pytest.param("megalm", False, id="packed"), pytest.param("megalm", True, id="varlen"),
    # 30 s (its own 2.5M documents, written in 13 s): with the long tests
    pytest.param("megatron", False, id="megatron_packed", marks=pytest.mark.slow)], indirect=["indexed"])
def test_a_second_process_maps_the_arrays_instead_of_holding_them(tmp_path, indexed, varlen):
    """Every rank of a run, on a real dataset: the lengths digest read from the offsets in slices, the held-out
    split's few lengths read alone (they had made the corpus' lengths: 16 bytes a document on every rank). A
    Megatron-LM dataset's document offsets are read from its index's mapped sequence pointers, and its virtual eods are
    a bit a document (they were 9 bytes a document on every rank, made at every open)."""
    kind = "varlen" if varlen else "packed"
    first = _result(_run(PROBE, tmp_path / "cache", kind, indexed))  # builds and writes them
    second = _result(_run(PROBE, tmp_path / "cache", kind, indexed))  # maps them
    (tmp_path / "not_a_dir").write_text("")
    unusable = _result(_run(PROBE, tmp_path / "not_a_dir", kind, indexed))  # builds them in its own memory
    assert first["checksum"] == second["checksum"] == unusable["checksum"]
    assert "cannot hold the sampler's index files" in unusable["log"]
    arrays = sum(f.stat().st_size for f in (tmp_path / "cache" / "index").glob("*.npy"))
    # 2026-12-07, packed: files 164 MB (three epochs), held in memory 143 MB (two epochs at a time), mapped 2.1 MB
    # (the digest's slices; 39 MB while the held-out split's lengths were taken from the whole corpus'); varlen: 119,
    # 100 and 2.1 MB
    mb = lambda n: f"{n / 1e6:.2f}"  # noqa: E731
    print(f"MB above the start: held once open {mb(first['open'])}; at most, mapping {mb(second['extra'])}, "
          f"building in memory {mb(unusable['extra'])}; the files {mb(arrays)}")  # (pytest -s shows it)
    assert unusable["extra"] > 0.5 * arrays  # the probe sees arrays held in memory
    assert second["extra"] < 0.1 * unusable["extra"], (second["extra"], unusable["extra"], arrays)
    # 2026-12-07: 0.17-0.39 MB held once open in both formats (Megatron's: 20 MB, its offsets, before); at most 6.3 MB
    # (megalm) and 6.9 MB (Megatron) while opening and mapping, were 22 and 80 MB (the open's checks in slices of 4M
    # entries, not 64K)
    assert first["open"] < 0.05 * 8 * DOCS, first["open"]


GO = r"""
import json, os, sys, time, logging
sys.path.insert(0, sys.argv[3])
from tests.unit.test_index_cache import LengthsSource, _config, _samples
from megalm.data.dataset import split_samplers
from pathlib import Path
logging.basicConfig(level=logging.INFO, format="%(message)s")
source = LengthsSource()
cfg = _config(Path(sys.argv[1]))
Path(sys.argv[4], str(os.getpid())).write_text("")  # ready
while not Path(sys.argv[4], "go").exists():
    time.sleep(0.001)
train, _ = split_samplers(source, cfg, "test data")
print(json.dumps({"checksum": hash(str(_samples(train)))}))
"""


def test_processes_that_start_together_build_each_array_once(tmp_path):
    ready = tmp_path / "ready"
    ready.mkdir()
    processes = [_run(GO, tmp_path / "cache", "packed", str(ready)) for _ in range(3)]
    deadline = 240
    while len(list(ready.iterdir())) < 3 and deadline > 0:
        import time

        time.sleep(0.05)
        deadline -= 0.05
    (ready / "go").write_text("")
    results = [_result(p) for p in processes]
    assert len({r["checksum"] for r in results}) == 1
    written = [line for r in results for line in r["log"].splitlines() if "written to" in line]
    # split, lengths and epochs 0, 1, 2: five arrays, each built by one process while the others waited
    assert len(written) == 5, written


@pytest.mark.parametrize("damage", ["cut short", "emptied", "empty listing"])
def test_a_damaged_file_is_built_again(tmp_path, caplog, damage):
    """A file cut short, one a crash left empty before its data reached the disk (np.load: EOFError), a listing of no
    arrays: each is built and written again, with the samples of the first build."""
    source = LengthsSource()
    cfg = _config(tmp_path)
    train, _ = split_samplers(source, cfg, "test data")
    want = _samples(train)
    damaged = next((tmp_path / "index").glob("*-lengths.lengths.npy"))
    if damage == "cut short":
        damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    elif damage == "emptied":
        damaged.write_bytes(b"")
    else:
        next((tmp_path / "index").glob("*-lengths.fields")).write_text("")
    with caplog.at_level(logging.WARNING, logger="megalm.data.index_cache"):
        again, _ = split_samplers(source, cfg, "test data")
    assert "is damaged" in caplog.text and "building it again" in caplog.text
    assert _samples(again) == want
    assert np.load(damaged, mmap_mode="r").shape == (len(again.doc_ids),)  # written whole again


def test_a_full_disk_leaves_no_partial_file_and_keeps_what_was_built(tmp_path, monkeypatch, caplog):
    """A write that fails part-way (a full disk or quota: ENOSPC) leaves no temporary file behind, is said in one
    line, and the process trains on the arrays it built (it does not build them a second time)."""
    save = np.save

    def full_disk(file, array):
        if array.nbytes > 1 << 20:
            file.write(b"\x93NUMPY partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        save(file, array)

    monkeypatch.setattr(np, "save", full_disk)
    source = LengthsSource()
    with caplog.at_level(logging.WARNING, logger="megalm.data.index_cache"):
        train, _ = split_samplers(source, _config(tmp_path), "test data")
        monkeypatch.undo()
        want = _samples(PackedDataset(source, train.doc_ids.copy(), train.seq_length, train.seed))
        assert _samples(train) == want
    assert "cannot hold the sampler's index files (No space left on device)" in caplog.text
    assert caplog.text.count("cannot hold") == 1  # one line for the directory, however many arrays met it
    assert [p.name for p in (tmp_path / "index").iterdir() if ".tmp-" in p.name] == []
