"""Context-parallel attention on gloo: ring (N = 2, 3, 4, GQA, two concurrent rings on WORLD), Ulysses and
hierarchical CP (a2a+p2p: 4 ranks as 2 groups of 2, in two rank orders, and as one group of 4) forward and
backward equal full attention of the unsharded documents.

Every rank builds the same full q/k/v and output gradient from a seed, shards them with the zigzag
plan, and compares its own shard of the output (real tokens) and of dq/dk/dv with the shard of the
reference. Padding gets a zero output gradient, so its dq/dk/dv must be 0 like the reference shards':
this checks that padding never reaches a real token.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megalm.model.attention import reference_varlen_attention
from megalm.parallel.context.attention import RingContext
from megalm.parallel.context.ring import ring_attention
from megalm.parallel.context.ulysses import ulysses_attention
from megalm.parallel.context.zigzag import ZigzagPlan, layout_from_local_cu_seqlens, shard_tensor, zigzag_plan

from .launch import run_distributed

TIMEOUT = 60  # seconds; a hang (an unmatched isend/irecv) fails the test instead of stalling CI
TOL = {"atol": 1e-5, "rtol": 1e-5}
CASES = [([24], 2, 2), ([13, 3, 1, 20, 7], 4, 2), ([2, 17], 4, 1)]  # (doc lengths, Hq, Hkv)
HIERARCHICAL_CASES = [([24], 4, 4), ([13, 3, 1, 20, 7], 4, 2)]  # heads that groups of 2 (and of 4) split


def _check(attention, lengths: list[int], hq: int, hkv: int, plan_n: int, rank_index: int, seed: int,
           what: str, inner: int = 1) -> None:
    """attention(q, k, v, plan) on this rank's shards == the shards of full attention, values and grads."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(int(cu[-1]), h, 8, generator=gen, requires_grad=True) for h in (hq, hkv, hkv))
    grad_out = torch.randn(q.shape, generator=gen)
    want = reference_varlen_attention(q, k, v, cu)
    want_grads = torch.autograd.grad(want, (q, k, v), grad_out)

    plan: ZigzagPlan = zigzag_plan(cu, plan_n, inner)
    shard = lambda t: shard_tensor(t.detach(), plan, rank_index)
    local = [shard(t).requires_grad_() for t in (q, k, v)]
    out = attention(*local, plan)
    real = plan.local_source(rank_index) >= 0  # padding queries see their document: their outputs are not 0
    torch.testing.assert_close(out[real], shard(want)[real], **TOL, msg=lambda m: f"{what} forward: {m}")
    out.backward(shard(grad_out))
    for name, got, full in zip("qkv", local, want_grads, strict=True):
        torch.testing.assert_close(got.grad, shard(full), **TOL, msg=lambda m, n=name: f"{what} d{n}: {m}")


def _ring_worker(rank: int, world_size: int) -> None:
    ranks = list(range(world_size))
    ring = lambda q, k, v, plan: ring_attention(q, k, v, plan, ranks, rank, backend="reference")
    for seed, (lengths, hq, hkv) in enumerate(CASES):
        _check(ring, lengths, hq, hkv, world_size, rank, seed, f"ring {world_size} {lengths} {hq}/{hkv}")


@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_attention_matches_full(world_size: int) -> None:
    run_distributed(_ring_worker, world_size, timeout=TIMEOUT)


def _four_ranks_worker(rank: int, world_size: int) -> None:
    """A ring of all 4 ranks; then ring [0, 2, 3] (size 3, non-contiguous, in that order) and ring [1]
    at the same time, both on WORLD with no new group, each on its own sequence; then hierarchical rings."""
    _ring_worker(rank, world_size)
    rings = {0: [0, 2, 3], 1: [1], 2: [0, 2, 3], 3: [0, 2, 3]}
    sequences = {3: ([11, 2, 17], 4, 2), 1: ([9, 5], 2, 2)}  # keyed by ring size
    ranks = rings[rank]
    lengths, hq, hkv = sequences[len(ranks)]
    ring = lambda q, k, v, plan: ring_attention(q, k, v, plan, ranks, ranks.index(rank), backend="reference")
    _check(ring, lengths, hq, hkv, len(ranks), ranks.index(rank), 7 + len(ranks), f"two rings, ring {ranks}")
    # hierarchical: groups of consecutive ranks in the list exchange heads, a ring per head group across the groups
    for ranks, inner in (([0, 1, 2, 3], 2), ([3, 1, 0, 2], 2), ([0, 1, 2, 3], 4)):
        index = ranks.index(rank)

        def attend(q, k, v, plan, ranks=ranks, index=index, inner=inner):
            layout = layout_from_local_cu_seqlens(plan.local_cu_seqlens, 4, inner)
            return RingContext(tuple(ranks), index, layout, "a2a+p2p").attend(q, k, v, "reference")

        for seed, (lengths, hq, hkv) in enumerate(HIERARCHICAL_CASES):
            if hkv % inner == 0:
                _check(attend, lengths, hq, hkv, 4, index, seed, f"a2a+p2p {ranks}/{inner} {lengths} {hq}/{hkv}", inner)


def test_ring_of_four_and_two_concurrent_rings_on_world() -> None:
    """One spawn of 4 processes for both 4-rank checks: process start-up dominates these tiny tests."""
    run_distributed(_four_ranks_worker, 4, timeout=TIMEOUT)


def _ulysses_worker(rank: int, world_size: int) -> None:
    """cp=2 Ulysses on a group of exactly its ranks; ranks [1, 0] checks ring position != group rank."""
    group = dist.new_group([0, 1])
    for ranks in ([0, 1], [1, 0]):
        index = ranks.index(rank)
        ulysses = lambda q, k, v, plan, r=ranks, i=index: ulysses_attention(q, k, v, plan, r, i, group,
                                                                             backend="reference")
        for seed, (lengths, hq, hkv) in enumerate(CASES[:2]):
            _check(ulysses, lengths, hq, hkv, 2, index, seed, f"ulysses {ranks} {lengths} {hq}/{hkv}")
    # the model-facing entry point: the context a micro-batch carries, its layout from the local cu_seqlens
    for comm in ("ring", "a2a"):
        def attend(q, k, v, plan, comm=comm):
            layout = layout_from_local_cu_seqlens(plan.local_cu_seqlens, 2)
            context = RingContext((0, 1), rank, layout, comm, group if comm == "a2a" else None)
            return context.attend(q, k, v, "sdpa")

        _check(attend, [10, 4], 4, 2, 2, rank, 3, f"RingContext {comm}")


def test_ulysses_attention_matches_full() -> None:
    run_distributed(_ulysses_worker, 2, timeout=TIMEOUT)

