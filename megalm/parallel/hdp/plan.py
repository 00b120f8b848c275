"""An HDP plan as data: `MicroBatch` (its ordered ranks and document indices) and `Plan` (the micro-batches, and
per rank the indices of those it runs, in order), plus the packing of short documents onto one rank that every
planner shares (planner.py: HDP's; baselines.py: the static mesh and Megatron-LM's hybrid CP). Pure Python."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple


class TooFewRanks(ValueError):
    """A document (or the static mesh's context) needs more ranks of `capacity` tokens than the step has: the fix is
    more ranks, more tokens per rank, or shorter sequences, which callers name in their own flags or keys."""


class MicroBatch(NamedTuple):
    """One unit of work. len(ranks) == 1: documents packed on one rank; > 1: a ring over `ranks`
    (in ring order; with `inner` = u > 1 the ring is r = d/u groups of u ranks of one node, all-to-all inside a
    group: megalm/parallel/context/hierarchical.py); no documents: a barrier over `ranks`. `tokens` counts real
    tokens, `padding` the extra positions computed (the static mesh pads), `sum_sq` is Σs² of the (padded) documents.
    A NamedTuple: immutable and cheap to build (a plan can hold tens of thousands)."""

    ranks: tuple[int, ...]
    seqs: tuple[int, ...]
    tokens: int
    sum_sq: int
    padding: int = 0
    inner: int = 1  # > 1: hierarchical CP, all-to-all in groups of `inner` consecutive ranks, a ring across


@dataclass
class Plan:
    policy: str
    micro_batches: list[MicroBatch]
    per_rank: list[list[int]]  # micro-batch indices, in execution order
    stats: dict = field(default_factory=dict)

    @property
    def num_ranks(self) -> int:
        return len(self.per_rank)


def zigzag_share(tokens: int, d: int, position: int, inner: int = 1) -> int:
    """Tokens of a `tokens`-token document that ring member `position` of `d` holds under the zigzag split
    (megalm/parallel/context/zigzag.py): chunks `position` and 2d-1-position of c = ceil(tokens / 2d); in a
    hierarchical ring of groups of `inner`, the back chunk is (2·d/inner − 1 − j)·inner + i for position j·inner + i
    (`zigzag_chunks`)."""
    c = -(-tokens // (2 * d))
    j, i = divmod(position, inner)
    return sum(max(0, min((k + 1) * c, tokens) - k * c) for k in (position, (2 * d // inner - 1 - j) * inner + i))


def tokens_per_rank(plan: Plan) -> list[int]:
    """The real tokens each rank of `plan` runs in the step: its packed documents, and its zigzag share of each
    ring's document (padding excluded). Exact for HDP's rings, one document each; a ring of several documents (the
    static baseline's) is split here as one sequence of their summed tokens, where zigzag splits each document."""
    load = [0] * plan.num_ranks
    for mb in plan.micro_batches:
        if len(mb.ranks) == 1:
            load[mb.ranks[0]] += mb.tokens
        elif mb.seqs:
            for position, r in enumerate(mb.ranks):
                load[r] += zigzag_share(mb.tokens, len(mb.ranks), position, mb.inner)
    return load


def local_micro_batch(rank: int, docs: list[int], lengths: Sequence[int]) -> MicroBatch:
    return MicroBatch((rank,), tuple(docs), sum(lengths[i] for i in docs), sum(lengths[i] ** 2 for i in docs))


def packed_micro_batches(rank: int, docs: list[int], lengths: Sequence[int], capacity: int) -> list[MicroBatch]:
    """Best-fit packing of documents (longest first) into micro-batches of at most `capacity` tokens."""
    if sum(lengths[i] for i in docs) <= capacity:
        return [local_micro_batch(rank, docs, lengths)]
    free: list[int] = []
    bins: list[list[int]] = []
    for i in docs:
        s = lengths[i]
        fits = [k for k, f in enumerate(free) if f >= s]
        if fits:
            k = min(fits, key=free.__getitem__)
            free[k] -= s
            bins[k].append(i)
        else:
            free.append(capacity - s)
            bins.append([i])
    return [local_micro_batch(rank, b, lengths) for b in bins]
