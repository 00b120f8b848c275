"""Sampling: which tokens make up the global batch of a step.

The global batch is a function of (seed, step) only, never of the parallel layout: sample k of the
run is a pure function of (seed, k), step s takes samples s*gbs ... s*gbs + gbs - 1 (or a batch
ramp-up's or a token budget's: megalm/data/steps.py), and a layout only decides who processes which
slice (`micro_batches`). That is what lets the equivalence tests compare any tp/pp/cp/dp/HDP run
against one process, and what makes resuming trivial (no sampler state: the step number is the state).

Two ways to cut documents into samples of `seq_length` (L) inputs:
- `PackedDataset` (Megatron style): per epoch, shuffle documents, concatenate them into a stream,
  cut windows of L + 1 tokens every L tokens (neighbours share one token), shuffle the windows.
  Document boundaries inside a window are kept, so attention and loss never cross them.
- `VarlenDataset`: one document per sample, long documents cut into overlapping chunks; samples
  have different lengths. This is what HDP balances.

Random streams are keyed by explicit entropy lists (seed, epoch, tag) so no two uses share one.
"""

from __future__ import annotations

import hashlib
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from megalm.config import MegalmConfig
from megalm.data.batch import PackedBatch, Sample, pack_samples
from megalm.data.index_cache import IndexFiles, default_cache_dir
from megalm.data.tokenizer import Tokenizer, build_tokenizer
from megalm.errors import DataError

log = logging.getLogger(__name__)

# Tags of the random streams (numpy pads short entropy lists with zeros, so tags are nonzero).
_DOC_ORDER = 1
_SAMPLE_ORDER = 2
_VARLEN_ORDER = 3
_SPLIT = 4


class DocumentSource(Protocol):
    """What samplers read: `IndexedDataset` and `SyntheticDocuments` both qualify."""

    def __len__(self) -> int: ...

    @property
    def doc_lengths(self) -> np.ndarray: ...

    @property
    def vocab_size(self) -> int: ...

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray: ...


def document_lengths(source: DocumentSource, ids: np.ndarray) -> np.ndarray:
    """Tokens of documents `ids`, int64: read for those alone where the source can (IndexedDataset's `lengths_of`, from
    its memory-mapped offsets: a held-out split's few documents do not make the corpus' lengths on every rank), else
    taken from its `doc_lengths`."""
    if hasattr(source, "lengths_of"):
        return source.lengths_of(ids)
    return np.asarray(source.doc_lengths, dtype=np.int64)[ids]


DIGEST_SLICE = 1 << 16  # documents `lengths_digest` reads at a time (0.5 MB of int64 lengths)


def lengths_digest(source: DocumentSource) -> str:
    """A digest of the documents' lengths, what every sampler array is a function of (with the config), which names
    the samplers' index files (index_cache.py): read in slices of DIGEST_SLICE documents (`document_lengths`), so that
    every rank digests a billion-document dataset without making its lengths whole."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(str(len(source)).encode())
    for start in range(0, len(source), DIGEST_SLICE):
        ids = np.arange(start, min(start + DIGEST_SLICE, len(source)), dtype=np.int64)
        digest.update(np.ascontiguousarray(document_lengths(source, ids), dtype=np.int64))
    return digest.hexdigest()


def _permutation(n: int, *entropy: int) -> np.ndarray:
    return np.random.default_rng(list(entropy)).permutation(n)


def split_documents(num_docs: int, valid_fraction: float, split_seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train_ids, valid_ids), disjoint, sorted, together all of range(num_docs).

    A nonzero fraction holds out at least one document (when there are two or more); the split
    depends on `split_seed` alone, so changing the training seed never moves documents across it.
    """
    if not 0.0 <= valid_fraction < 1.0:
        raise ValueError(f"valid_fraction={valid_fraction} must be in [0, 1)")
    if valid_fraction == 0.0 or num_docs < 2:
        n_valid = 0
    else:
        n_valid = min(num_docs - 1, max(1, round(num_docs * valid_fraction)))
    perm = _permutation(num_docs, split_seed, 0, _SPLIT)
    return np.sort(perm[n_valid:]).astype(np.int64), np.sort(perm[:n_valid]).astype(np.int64)


class _EpochCache:
    """Per-epoch permutations, computed on first use; only the last two epochs are kept."""

    def __init__(self, build) -> None:
        self._build = build
        self._cache: dict[int, tuple] = {}

    def __call__(self, epoch: int) -> tuple:
        if epoch not in self._cache:
            if len(self._cache) >= 2:
                self._cache.pop(min(self._cache))
            self._cache[epoch] = self._build(epoch)
        return self._cache[epoch]


class _DocumentSampler(ABC):
    """What both samplers share: the documents of one split, their lengths, L and the seed.

    Subclasses set `samples_per_epoch`, `_epoch` (an `_EpochCache` whose entry's last element is
    the epoch's sample permutation) and `_sample(epoch, r)`, the r-th unshuffled sample of an epoch.
    """

    samples_per_epoch: int
    _epoch: _EpochCache

    def __init__(self, source: DocumentSource, doc_ids: np.ndarray | list[int], seq_length: int,
                 seed: int, index: IndexFiles | None = None) -> None:
        if seq_length < 1:
            raise ValueError(f"seq_length={seq_length} must be >= 1")
        self.source = source
        self.doc_ids = np.asarray(doc_ids, dtype=np.int64)
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.num_docs = len(self.doc_ids)
        # the arrays below: memory-mapped files shared by the machine's processes where a run's config names the
        # cache (split_samplers), else in memory
        self._index = index or IndexFiles(None, ())
        self._lengths = self._index.arrays("lengths", 8 * self.num_docs, lambda: {
            "lengths": document_lengths(source, self.doc_ids)})["lengths"]
        self.num_tokens = int(self._lengths.sum())

    @abstractmethod
    def _sample(self, epoch: int, r: int) -> Sample:
        """The r-th sample of `epoch` before shuffling."""

    def __getitem__(self, k: int) -> Sample:
        """Sample k of the run (any k >= 0): epoch k // samples_per_epoch, shuffled within it."""
        if k < 0:
            raise IndexError(f"sample index {k} must be >= 0")
        epoch, r = divmod(int(k), self.samples_per_epoch)
        return self._sample(epoch, int(self._epoch(epoch)[-1][r]))


class PackedDataset(_DocumentSampler):
    """Fixed-length samples of seq_length + 1 tokens cut from a per-epoch shuffled document stream.

    Index k >= 0 is any sample of the run: epoch k // samples_per_epoch, and within it the window
    chosen by that epoch's sample permutation. The last (num_tokens - 1) % seq_length tokens of
    each epoch's stream do not fit a window and are skipped (different ones every epoch).
    """

    def __init__(self, source: DocumentSource, doc_ids: np.ndarray | list[int], seq_length: int,
                 seed: int, index: IndexFiles | None = None) -> None:
        super().__init__(source, doc_ids, seq_length, seed, index)
        self.samples_per_epoch = max(self.num_tokens - 1, 0) // self.seq_length
        if self.samples_per_epoch == 0:
            raise DataError(f"{self.num_docs} documents hold {self.num_tokens} tokens, fewer than the "
                            f"seq_length+1={self.seq_length + 1} one sample needs; use more data or a "
                            "smaller model.seq_length")
        self._epoch = _EpochCache(self._build_epoch)

    def _build_epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        def build() -> dict[str, np.ndarray]:
            perm = _permutation(self.num_docs, self.seed, epoch, _DOC_ORDER)
            starts = np.zeros(self.num_docs + 1, dtype=np.int64)
            np.cumsum(self._lengths[perm], out=starts[1:])
            windows = _permutation(self.samples_per_epoch, self.seed, epoch, _SAMPLE_ORDER)
            return {"order": self.doc_ids[perm], "starts": starts, "windows": windows}

        built = self._index.arrays(f"epoch{epoch}", 8 * (2 * self.num_docs + 1 + self.samples_per_epoch), build)
        return built["order"], built["starts"], built["windows"]

    def epoch_documents(self, epoch: int) -> np.ndarray:
        """Document ids in the order epoch `epoch` concatenates them."""
        return self._epoch(epoch)[0]

    def window(self, epoch: int, j: int) -> Sample:
        """Window j of the epoch's stream (before shuffling): stream[j*L : j*L + L + 1]."""
        if not 0 <= j < self.samples_per_epoch:
            raise IndexError(f"window {j} out of range [0, {self.samples_per_epoch})")
        order, starts, _ = self._epoch(epoch)
        pos = j * self.seq_length
        end = pos + self.seq_length + 1
        d = int(np.searchsorted(starts, pos, side="right")) - 1
        pieces, lengths = [], []
        while pos < end:
            take = min(end, int(starts[d + 1])) - pos
            if take > 0:
                pieces.append(self.source.get(int(order[d]), pos - int(starts[d]), take))
                lengths.append(take)
                pos += take
            d += 1
        return Sample(np.concatenate(pieces).astype(np.int64), tuple(lengths))

    def _sample(self, epoch: int, r: int) -> Sample:
        return self.window(epoch, r)

    def __repr__(self) -> str:
        return (f"PackedDataset({self.num_docs} docs, {self.num_tokens} tokens, "
                f"{self.samples_per_epoch} samples of {self.seq_length} per epoch)")


class VarlenDataset(_DocumentSampler):
    """One document per sample; a document of n > L + 1 tokens becomes chunks starting every L tokens.

    Chunk q of a document is tokens [q*L, min(q*L + L + 1, n)): at most L + 1 tokens, neighbours
    share one token so every next-token prediction is made exactly once; chunks of fewer than 2
    tokens (nothing to predict) are dropped. All chunks are shuffled per epoch.
    """

    def __init__(self, source: DocumentSource, doc_ids: np.ndarray | list[int], seq_length: int,
                 seed: int, index: IndexFiles | None = None) -> None:
        super().__init__(source, doc_ids, seq_length, seed, index)

        def chunk_starts() -> dict[str, np.ndarray]:
            chunks = np.where(self._lengths >= 2, (self._lengths - 2) // self.seq_length + 1, 0)
            starts = np.zeros(self.num_docs + 1, dtype=np.int64)
            np.cumsum(chunks, out=starts[1:])
            return {"chunk_starts": starts}

        self._chunk_starts = self._index.arrays("chunks", 8 * (self.num_docs + 1), chunk_starts)["chunk_starts"]
        self.samples_per_epoch = int(self._chunk_starts[-1])
        if self.samples_per_epoch == 0:
            raise DataError(f"{self.num_docs} documents give no sample of 2 or more tokens; use more data")
        self._epoch = _EpochCache(lambda e: (self._index.arrays(f"epoch{e}", 8 * self.samples_per_epoch, lambda: {
            "order": _permutation(self.samples_per_epoch, self.seed, e, _VARLEN_ORDER)})["order"],))

    def _chunk_span(self, c: int) -> tuple[int, int, int]:
        """(document id, first token, tokens) of chunk c in document order (before shuffling)."""
        if not 0 <= c < self.samples_per_epoch:
            raise IndexError(f"chunk {c} out of range [0, {self.samples_per_epoch})")
        d = int(np.searchsorted(self._chunk_starts, c, side="right")) - 1
        start = (c - int(self._chunk_starts[d])) * self.seq_length
        return int(self.doc_ids[d]), start, min(self.seq_length + 1, int(self._lengths[d]) - start)

    def chunk(self, c: int) -> Sample:
        """Chunk c in document order (before shuffling)."""
        doc, start, length = self._chunk_span(c)
        return Sample(self.source.get(doc, start, length).astype(np.int64), (length,))

    def _sample(self, epoch: int, r: int) -> Sample:
        return self.chunk(r)

    def _span(self, k: int) -> tuple[int, int, int]:
        if k < 0:
            raise IndexError(f"sample index {k} must be >= 0")
        epoch, r = divmod(int(k), self.samples_per_epoch)
        return self._chunk_span(int(self._epoch(epoch)[-1][r]))

    def sample_length(self, k: int) -> int:
        """Tokens of sample k (inputs + 1), known without reading them: what the HDP planner needs."""
        return self._span(k)[2]

    def read(self, k: int, offset: int, length: int) -> np.ndarray:
        """Tokens [offset, offset + length) of sample k (int64): a ring member reads only its shard."""
        doc, start, n = self._span(k)
        if offset < 0 or length < 0 or offset + length > n:
            raise IndexError(f"slice [{offset}, {offset + length}) outside sample {k} of {n} tokens")
        return self.source.get(doc, start + offset, length).astype(np.int64)

    def __repr__(self) -> str:
        return (f"VarlenDataset({self.num_docs} docs, {self.num_tokens} tokens, "
                f"{self.samples_per_epoch} samples of <= {self.seq_length} inputs per epoch)")


class SampleDataset(Protocol):
    """What the trainer samples from (PackedDataset, VarlenDataset, or a blend of either, megalm/data/blend.py):
    sample k (any k >= 0) is a function of (seed, k); varlen ones also answer sample_length(k) and
    read(k, offset, length)."""

    num_docs: int

    def __getitem__(self, k: int) -> Sample: ...


def global_batch(dataset: SampleDataset, step: int, global_batch_size: int) -> list[Sample]:
    """The samples of optimizer step `step`: step*gbs ... step*gbs + gbs - 1, whatever the layout."""
    first = step * global_batch_size
    return [dataset[first + i] for i in range(global_batch_size)]


def micro_batches(samples: list[Sample], micro_batch_size: int, dp_rank: int = 0,
                  dp_size: int = 1, partial_last: bool = False) -> list[PackedBatch]:
    """DP rank r's share of a global batch: its contiguous slice of len/dp samples, packed in
    consecutive groups of `micro_batch_size`. Concatenating all ranks' micro-batches in order gives
    back the global batch. `partial_last` (token budgets: sample counts vary) lets the last group be
    smaller."""
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} out of range [0, {dp_size})")
    if len(samples) % dp_size:
        raise ValueError(f"{len(samples)} samples do not split evenly over dp_size={dp_size}")
    per_rank = len(samples) // dp_size
    if per_rank % micro_batch_size and not partial_last:
        raise ValueError(f"{per_rank} samples per rank are not a multiple of "
                         f"micro_batch_size={micro_batch_size}")
    mine = samples[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    return [pack_samples(mine[i:i + micro_batch_size]) for i in range(0, per_rank, micro_batch_size)]


def loss_token_count(samples: list[Sample]) -> int:
    """Tokens that carry a loss in these samples: the divisor of the step's summed loss."""
    return sum(s.num_loss_tokens() for s in samples)


@dataclass
class DataBundle:
    train: SampleDataset
    valid: SampleDataset | None
    tokenizer: Tokenizer | None
    source: DocumentSource | None = None  # None for a blend: each component has its own
    blend: list | None = None  # a blend's [[weight, prefix], ...] as sampled: part of the checkpoint's data order

    def summary(self) -> str:
        valid = f"valid {self.valid.num_docs} docs" if self.valid is not None else "no valid split"
        what = f"blend of {len(self.blend)}" if self.blend is not None else repr(self.source)
        return f"data {what}: train {self.train!r}; {valid}"


def indexed_tokenizer(source, override: str) -> Tokenizer | None:
    """The tokenizer an indexed dataset was written with, or `override` if it matches the data."""
    if override and override != "byte":
        tok = build_tokenizer(override)
        if tok.vocab_size != source.vocab_size or tok.eod_id != source.eod_id:
            raise DataError(f"data.tokenizer={override} (vocab {tok.vocab_size}, eod {tok.eod_id}) does not "
                            f"match {source.prefix} (vocab {source.vocab_size}, eod {source.eod_id}, "
                            f"written with {source.tokenizer_spec!r}); drop data.tokenizer to use the "
                            "dataset's own")
        return tok
    if not source.tokenizer_spec:
        return None
    try:
        return build_tokenizer(source.tokenizer_spec)
    except DataError as e:
        raise DataError(f"{source.prefix} was tokenized with {source.tokenizer_spec!r}, which cannot be "
                        f"loaded ({e}); set data.tokenizer=PATH/tokenizer.json to the same "
                        "tokenizer") from None


def check_vocab(source: DocumentSource, tokenizer: Tokenizer | None, model_vocab_size: int) -> None:
    """The data's (and tokenizer's) ids must fit the model's embedding: a one-line DataError naming the fix."""
    vocab = max(source.vocab_size, tokenizer.vocab_size if tokenizer is not None else 0)
    if vocab > model_vocab_size:
        what = "tokenizer vocab" if tokenizer is not None else "dataset vocab"
        raise DataError(f"{what} {vocab} exceeds model.vocab_size={model_vocab_size}; set model.vocab_size={vocab} "
                        "(the embedding and head are padded past it by make_vocab_size_divisible_by)")


def split_samplers(source: DocumentSource, cfg: MegalmConfig, what: str) -> tuple[SampleDataset, SampleDataset | None]:
    """(train, valid) samplers over the `data.split_seed` split of `source`; valid is None when nothing is held
    out or the held-out documents are too small for one sample. `what` names the data in errors."""
    d = cfg.data
    directory = Path(d.cache_dir or default_cache_dir()) / "index"
    split = IndexFiles(directory, ("split", len(source), d.valid_fraction, d.split_seed)).arrays(
        "split", 8 * len(source), lambda: dict(zip(("train", "valid"),
                                                   split_documents(len(source), d.valid_fraction, d.split_seed),
                                                   strict=True)))
    train_ids, valid_ids = split["train"], split["valid"]
    if len(train_ids) == 0:
        raise DataError(f"the train split is empty: {what} has {len(source)} documents; "
                        "use a dataset with documents in it")
    sampler = VarlenDataset if d.varlen else PackedDataset
    lengths = lengths_digest(source)

    def index(part: str) -> IndexFiles:  # what the sampler's arrays are a function of
        return IndexFiles(directory, (sampler.__name__, lengths, d.valid_fraction, d.split_seed, part,
                                      cfg.model.seq_length, cfg.seed))

    try:
        train = sampler(source, train_ids, cfg.model.seq_length, cfg.seed, index("train"))
    except DataError as e:  # which of a blend's components is too small
        held_out = (f" ({len(valid_ids)} of its {len(source)} documents are held out for validation by "
                    f"data.valid_fraction={d.valid_fraction}; data.valid_fraction=0 trains on all)"
                    if len(valid_ids) else "")
        raise DataError(f"{what}: {e}{held_out}") from None
    valid = None
    if len(valid_ids):
        try:
            valid = sampler(source, valid_ids, cfg.model.seq_length, cfg.seed, index("valid"))
        except DataError as e:
            log.warning("no validation set from %s: the %d held-out documents are too small (%s)", what,
                        len(valid_ids), e)
    return train, valid
