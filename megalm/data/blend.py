"""Dataset blends (`data.blend`, Megatron's `--data-path 0.3 A 0.7 B`): one sample stream mixed from several.

Sample i of a blend is sample j(i) of component d(i), where
- d(i) follows a fixed interleave that repeats every P samples: the weights are made integers n_d (exact
  fractions when the weights have denominators <= 10^6, else rounded to P = 10^6 by largest remainder) and one
  period lists component d n_d times, in Webster/Sainte-Laguë order: the k-th sample of component d sits at
  key (k + 1/2) / n_d, and the period is the samples sorted by key (ties: lower d first). Any prefix of N
  samples then holds component d within half a sample of N·n_d/P for two components, (K - 1)/2 for K;
- j(i) = (i // P) * n_d + (how many of d's samples come before i in its period), so component d sees its own
  samples 0, 1, 2, ... in order, each drawn by its own sampler (its own seeded shuffle, epochs and
  train/valid split).
Both are table look-ups: sample i is a function of (seed, i) alone, with no state and no replay, so the global
batch of a step depends on (seed, step) only and a resumed run continues exactly.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from megalm.config import MegalmConfig, blend_pairs
from megalm.data.batch import Sample
from megalm.data.dataset import DataBundle, SampleDataset, check_vocab, indexed_tokenizer, split_samplers
from megalm.data.indexed import IndexedDataset, missing_dataset
from megalm.errors import ConfigError, DataError

log = logging.getLogger(__name__)

MAX_PERIOD = 10**6  # weights resolve to multiples of 1/MAX_PERIOD at worst


def blend_quotas(weights: Sequence[float], max_period: int = MAX_PERIOD) -> list[int]:
    """Integer samples per period for each weight: the smallest exact ratio when the weights are fractions with
    denominators <= max_period (0.3/0.7 -> [3, 7], 1/2/3 -> [1, 2, 3]), else largest remainder over max_period.
    Integers make the interleave periodic, so d(i) and j(i) have a closed form."""
    if not weights or any(not 0 < w < math.inf for w in weights):
        raise ValueError(f"weights {list(weights)} must be positive and finite")
    fracs = [Fraction(w).limit_denominator(max_period) for w in weights]
    if all(f > 0 for f in fracs):
        lcm = math.lcm(*(f.denominator for f in fracs))
        ints = [int(f * lcm) for f in fracs]
        g = math.gcd(*ints)
        quotas = [n // g for n in ints]
        if sum(quotas) <= max_period:
            return quotas
    total = math.fsum(weights)
    exact = [w / total * max_period for w in weights]
    quotas = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda d: (-(exact[d] - quotas[d]), d))
    for d in by_remainder[:max_period - sum(quotas)]:
        quotas[d] += 1
    if min(quotas) == 0:
        small = weights[quotas.index(0)]
        raise DataError(f"data.blend weight {small} is below 1/{max_period} of the total {total}; raise it or drop "
                        "that dataset")
    g = math.gcd(*quotas)
    return [n // g for n in quotas]


def blend_period(quotas: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(component, rank) of each position of one period: component d appears quotas[d] times, its k-th appearance
    at key (2k + 1) / (2 quotas[d]) (Webster order, ties to the lower d), rank = k.

    Keys are float64 quotients of integers below 2^21: equal fractions give the same correctly rounded float and
    different ones differ by far more than one ulp, so the order is exact and the same on every machine."""
    n = np.asarray(quotas, dtype=np.int64)
    if n.ndim != 1 or len(n) == 0 or (n <= 0).any():
        raise ValueError(f"quotas {list(quotas)} must be positive integers")
    component = np.repeat(np.arange(len(n), dtype=np.int64), n)
    rank = np.arange(len(component), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
    keys = (2 * rank + 1) / (2 * n[component]).astype(np.float64)
    order = np.lexsort((component, keys))
    return component[order].astype(np.int32), rank[order].astype(np.int32)  # a period is <= 10^6 samples


class BlendedDataset:
    """Samples mixed from `components` (all packed or all varlen) in the proportions `quotas`.

    Sample i is component d(i)'s own sample j(i) (module docstring): both look-ups into one period's tables,
    so any i costs O(1) and the blend keeps the samplers' contract: sample i is a function of (seed, i).
    """

    def __init__(self, components: Sequence[SampleDataset], quotas: Sequence[int], names: Sequence[str]) -> None:
        if not len(components) == len(quotas) == len(names) or not components:
            raise ValueError("a blend needs one quota and one name per component, and at least one component")
        kinds = {type(c).__name__ for c in components}
        if len(kinds) > 1:
            raise ValueError(f"blend components must all be of one kind, got {sorted(kinds)}")
        self.components = list(components)
        self.names = [str(n) for n in names]
        self.quotas = np.asarray(quotas, dtype=np.int64)
        self.period = int(self.quotas.sum())
        self._component, self._rank = blend_period(self.quotas)
        first = self.components[0]
        self.seq_length = first.seq_length
        self.varlen = hasattr(first, "sample_length")
        self.num_docs = sum(c.num_docs for c in self.components)
        self.num_tokens = sum(c.num_tokens for c in self.components)

    @property
    def weights(self) -> list[float]:
        """The weights as sampled (normalized quotas): each period of `period` samples holds exactly these shares."""
        return [int(n) / self.period for n in self.quotas]

    @property
    def samples_per_epoch(self) -> int:
        """Samples of the blend before one of its components runs out of samples of its own and starts over (its
        epoch ends): where reading on repeats samples (an evaluation of more is said in one line)."""
        ends = []
        for d, component in enumerate(self.components):
            cycles, k = divmod(component.samples_per_epoch, int(self.quotas[d]))  # its first repeat: appearance k
            ends.append(cycles * self.period + int(np.flatnonzero((self._component == d) & (self._rank == k))[0]))
        return min(ends)

    def locate(self, i: int) -> tuple[int, int]:
        """(d, j): sample i of the blend is sample j of component d."""
        if i < 0:
            raise IndexError(f"sample index {i} must be >= 0")
        cycle, r = divmod(int(i), self.period)
        d = int(self._component[r])
        return d, cycle * int(self.quotas[d]) + int(self._rank[r])

    def __getitem__(self, i: int) -> Sample:
        d, j = self.locate(i)
        return self.components[d][j]

    def sample_length(self, i: int) -> int:
        """Tokens of sample i (inputs + 1), without reading them (varlen components: HDP and token budgets)."""
        d, j = self.locate(i)
        return self.components[d].sample_length(j)

    def read(self, i: int, offset: int, length: int) -> np.ndarray:
        """Tokens [offset, offset + length) of sample i (varlen components: a ring member reads its shard)."""
        d, j = self.locate(i)
        return self.components[d].read(j, offset, length)

    def __repr__(self) -> str:
        parts = ", ".join(f"{w:.4g} {name}: {c!r}" for w, name, c in zip(self.weights, self.names, self.components,
                                                                         strict=True))
        return f"BlendedDataset(period {self.period}; {parts})"


def open_component(prefix: str, tokenizer: str | None = None) -> IndexedDataset:
    """One blend component, with errors that name `data.blend` (not data.path); `tokenizer` (data.tokenizer)
    describes Megatron-format components that have no sidecar."""
    path = os.path.expanduser(prefix)
    if (missing := missing_dataset(path, tokenizer, key="the data.blend entry")) is not None:  # data.path's hint
        raise missing
    try:
        return IndexedDataset(path, tokenizer=tokenizer)
    except DataError as e:
        raise DataError(f"data.blend component {prefix}: {e}") from None


def tokenizer_identity(spec: str) -> str:
    """What a dataset's tokenizer is: "byte", the SHA-256 of its tokenizer.json, or the spec itself when that file is
    not on this machine. By path, the same file copied or linked elsewhere (datasets preprocessed on two machines)
    was two tokenizers, and their blend was refused."""
    if not spec or spec == "byte":
        return spec
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    try:
        with open(path, "rb") as f:
            return "sha256:" + hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return spec


def _check_same_tokens(sources: Sequence[IndexedDataset], names: Sequence[str], tokenizer: str) -> None:
    """All components must share one vocabulary: same vocab size, eod id and tokenizer (its file's content; with
    `data.tokenizer` set, that tokenizer stands for all, each checked against it when it is read)."""
    first = sources[0]
    named = bool(tokenizer) and tokenizer != "byte"
    key = lambda s: (s.vocab_size, s.eod_id, None if named else tokenizer_identity(s.tokenizer_spec))
    first_key = key(first)  # its tokenizer file read and hashed once
    for source, name in zip(sources[1:], names[1:], strict=True):
        if key(source) != first_key:
            raise DataError(f"data.blend mixes tokenizations: {names[0]} has vocab {first.vocab_size}, eod "
                            f"{first.eod_id}, tokenizer {first.tokenizer_spec!r} but {name} has vocab "
                            f"{source.vocab_size}, eod {source.eod_id}, tokenizer {source.tokenizer_spec!r}; "
                            "preprocess all of them with the same --tokenizer (or, if the two files are one "
                            "tokenizer, name it: data.tokenizer=PATH)")


def build_blend(cfg: MegalmConfig) -> DataBundle:
    """The train and valid blends of `cfg.data.blend`: each component split and sampled on its own
    (`data.valid_fraction`, `data.split_seed`, `seed`), then mixed by the weights."""
    d = cfg.data
    if d.path:
        raise ConfigError(f"data.path={d.path} and data.blend are both set; use one")
    pairs = blend_pairs(d.blend)
    names = [path for _, path in pairs]
    quotas = blend_quotas([w for w, _ in pairs])
    sources = [open_component(p, d.tokenizer) for p in names]
    _check_same_tokens(sources, names, d.tokenizer)
    tokenizer = indexed_tokenizer(sources[0], d.tokenizer)
    check_vocab(sources[0], tokenizer, cfg.model.vocab_size)
    splits = [split_samplers(s, cfg, f"data.blend component {name}") for s, name in zip(sources, names, strict=True)]
    train = BlendedDataset([t for t, _ in splits], quotas, names)
    keep = [i for i, (_, v) in enumerate(splits) if v is not None]
    valid = None
    if keep:
        if len(keep) < len(splits):
            log.warning("validation blend without %s: no held-out sample there", [names[i] for i in range(len(names))
                                                                                 if i not in keep])
        valid = BlendedDataset([splits[i][1] for i in keep], [quotas[i] for i in keep], [names[i] for i in keep])
    record = [[w, name] for w, name in zip(train.weights, names, strict=True)]
    return DataBundle(train, valid, tokenizer, None, blend=record)
