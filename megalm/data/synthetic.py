"""Synthetic documents for benchmarks: realistic length distribution, random tokens, no files.

Throughput and HDP balance depend on the distribution of document lengths, not on the text, so a
benchmark can run at any scale from a seed: lengths are log-normal (sigma 1, like web text's heavy
tail) with a chosen mean, or all equal; the tokens of document i come from their own generator
seeded with (seed, i), so any document is produced on demand, in any order, identically everywhere.
Reads like an `IndexedDataset` (`__len__`, `doc_lengths`, `get`, `vocab_size`).
"""

from __future__ import annotations

import numpy as np

SIGMA = 1.0
_LENGTHS_TAG = 5  # entropy (seed, 0, 5) for the lengths; never equal to a document's (seed, i)


class SyntheticDocuments:
    """`num_docs` random documents; the last token of each is eod = vocab_size - 1 (and only it is)."""

    def __init__(self, num_docs: int, vocab_size: int, mean_doc_length: int,
                 fixed_doc_length: int | None = None, seed: int = 0) -> None:
        if num_docs <= 0:
            raise ValueError(f"num_docs={num_docs} must be > 0")
        if vocab_size < 2:
            raise ValueError(f"vocab_size={vocab_size} must be >= 2 (one token plus eod)")
        self.num_docs = int(num_docs)
        self.vocab_size = int(vocab_size)
        self.eod_id = self.vocab_size - 1
        self.seed = int(seed)
        self.tokenizer_spec = ""
        if fixed_doc_length is not None:
            if fixed_doc_length < 2:
                raise ValueError(f"fixed_doc_length={fixed_doc_length} must be >= 2")
            self.doc_lengths = np.full(self.num_docs, fixed_doc_length, dtype=np.int64)
        else:
            if mean_doc_length < 2:
                raise ValueError(f"mean_doc_length={mean_doc_length} must be >= 2")
            # E[exp(N(mu, s^2))] = exp(mu + s^2/2), so mu = ln(mean) - s^2/2 gives the requested mean.
            rng = np.random.default_rng([self.seed, 0, _LENGTHS_TAG])
            mu = np.log(mean_doc_length) - SIGMA**2 / 2
            lengths = np.rint(rng.lognormal(mu, SIGMA, size=self.num_docs))
            self.doc_lengths = np.maximum(lengths, 2).astype(np.int64)
        self.num_tokens = int(self.doc_lengths.sum())

    def __len__(self) -> int:
        return self.num_docs

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of document i, int64."""
        if not 0 <= i < self.num_docs:
            raise IndexError(f"document {i} out of range [0, {self.num_docs})")
        n = int(self.doc_lengths[i])
        if length is None:
            length = n - offset
        if offset < 0 or length < 0 or offset + length > n:
            raise IndexError(f"slice [{offset}, {offset + length}) outside document {i} of {n} tokens")
        # Draws are sequential, so generating only the first offset + length tokens gives the same prefix.
        end = offset + length
        doc = np.empty(end, dtype=np.int64)
        body = min(end, n - 1)
        doc[:body] = np.random.default_rng([self.seed, i]).integers(0, self.eod_id, size=body)
        if end == n:
            doc[-1] = self.eod_id
        return doc[offset:]

    def __repr__(self) -> str:
        return (f"SyntheticDocuments({self.num_docs} docs, {self.num_tokens} tokens, "
                f"vocab {self.vocab_size}, seed {self.seed})")
