"""Pipeline p2p on gloo: tensors of unknown shape and several dtypes round-trip exactly, a batched
ring exchange does not deadlock, and variable-length micro-batches arrive in order.

Every rank builds the same data deterministically (a function of the sender's rank and the message
index), so a receiver knows what it must get without any extra communication. pp-only meshes.
"""

from __future__ import annotations

import pytest
import torch

from megalm.parallel.dims import ParallelDims, ParallelMesh, build_mesh
from megalm.parallel.pipeline.p2p import (
    DTYPES,
    HEADER_LEN,
    decode_header,
    encode_header,
    exchange,
    pipeline_neighbours,
    recv_tensor,
    send_tensor,
)

from .launch import run_distributed

TIMEOUT = 30  # seconds; a hang (unpaired or blocking p2p) fails the test instead of stalling CI
H = 4


def _message(sender: int, index: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Deterministic content that differs per sender and index, exact in every supported dtype."""
    n = 1
    for d in shape:
        n *= d
    values = torch.arange(n, dtype=torch.float64) * 0.5 + 100 * sender + 7 * index  # halves: exact in fp16/bf16
    if dtype == torch.bool:
        values = (torch.arange(n) + sender + index) % 2
    elif not dtype.is_floating_point:
        values = values.floor()
    return values.reshape(shape).to(dtype)


CASES = [  # (shape, dtype): varying T, 0 tokens, scalars, higher rank, every dtype
    ((5, H), torch.float32), ((0, H), torch.float32), ((3, H), torch.bfloat16), ((0, H), torch.bfloat16),
    ((7, H), torch.float16), ((2, 3, H), torch.int64), ((11,), torch.int32), ((), torch.float32),
    ((1, 1, 1, 1, 1, 1, 1, 2), torch.float64), ((0,), torch.int64), ((3, 2), torch.uint8),
    ((4,), torch.int8), ((5,), torch.bool), ((2, 0, H), torch.float16),
]


def _assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}"
    assert torch.equal(got, want), f"{what}: values differ"


# ------------------------------------------------------------------------------ no processes needed


def test_header_round_trip_and_rejects():
    for shape, dtype in CASES:
        header = encode_header(torch.empty(shape, dtype=dtype))
        assert header.shape == (HEADER_LEN,) and header.dtype == torch.int64
        assert decode_header(header) == (torch.Size(shape), dtype)
    assert set(DTYPES) >= {torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32}
    with pytest.raises(TypeError, match="cannot send dtype torch.complex64"):
        encode_header(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="at most 8 dims"):
        encode_header(torch.zeros([1] * 9))
    with pytest.raises(RuntimeError, match="corrupt header"):
        decode_header(torch.full((HEADER_LEN,), -1, dtype=torch.int64))


def test_pipeline_neighbours_keep_tp_cp_dp_coordinates():
    dims = ParallelDims(tp=2, cp=1, dp=2, pp=3)  # 12 ranks, pp stride 4
    for rank in range(dims.world_size):
        mesh = ParallelMesh(dims, rank=rank)
        prev, nxt = pipeline_neighbours(mesh)
        wprev, wnxt = pipeline_neighbours(mesh, wrap=True)
        me = dims.coordinates(rank)
        for other, pp_rank in ((prev, me["pp"] - 1), (nxt, me["pp"] + 1), (wprev, (me["pp"] - 1) % 3),
                               (wnxt, (me["pp"] + 1) % 3)):
            if not 0 <= pp_rank < 3:
                assert other is None
                continue
            assert dims.coordinates(other) == dict(me, pp=pp_rank)
    assert pipeline_neighbours(ParallelMesh(dims, rank=6)) == (2, 10)  # tp0 dp1: pp0 -> 2, pp2 -> 10
    assert pipeline_neighbours(ParallelMesh(dims, rank=1)) == (None, 5)
    assert pipeline_neighbours(ParallelMesh(dims, rank=1), wrap=True) == (9, 5)
    assert pipeline_neighbours(ParallelMesh(ParallelDims(tp=2)), wrap=True) == (None, None)


# ------------------------------------------------------------------------------ workers


def _round_trip_worker(rank: int, world: int) -> None:
    """Rank 0 sends every case to rank 1 with blocking calls, then rank 1 sends them all back."""
    peer = 1 - rank
    for sender in (0, 1):
        for i, (shape, dtype) in enumerate(CASES):
            if rank == sender:
                send_tensor(_message(sender, i, shape, dtype), peer)
            else:
                _assert_same(recv_tensor(peer), _message(sender, i, shape, dtype), f"case {i} from {sender}")
    # a non-contiguous send arrives as its contiguous values
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    if rank == 0:
        send_tensor(t.t(), 1)
    else:
        _assert_same(recv_tensor(0), t.t().contiguous(), "transposed")


def _ring_worker(rank: int, world: int) -> None:
    """Every rank sends to next and receives from prev in one call (a blocking send-then-recv hangs);
    then both directions at once, as in the 1F1B steady state (activations forward, grads back)."""
    mesh = build_mesh(ParallelDims(pp=world), torch.device("cpu"))
    prev, nxt = pipeline_neighbours(mesh, wrap=True)
    assert (prev, nxt) == ((rank - 1) % world, (rank + 1) % world)
    for step, (shape, dtype) in enumerate(CASES):
        shape_of = (lambda r, s=shape: (s[0] + r, *s[1:])) if shape else (lambda r, s=shape: s)  # T varies by rank
        (got,) = exchange([(_message(rank, step, shape_of(rank), dtype), nxt)], [prev], group=mesh.pp_group)
        _assert_same(got, _message(prev, step, shape_of(prev), dtype), f"ring step {step}")
    for step in range(3):
        activation = _message(rank, step, (rank + step, H), torch.bfloat16)
        grad = _message(rank, 50 + step, (2 * rank + step, H), torch.float32)
        got_activation, got_grad = exchange([(activation, nxt), (grad, prev)], [prev, nxt], group=mesh.pp_group)
        _assert_same(got_activation, _message(prev, step, (prev + step, H), torch.bfloat16), "activation")
        _assert_same(got_grad, _message(nxt, 50 + step, (2 * nxt + step, H), torch.float32), "grad")


LENGTHS = [3, 0, 5, 1, 2]  # tokens per micro-batch


def _pipeline_worker(rank: int, world: int) -> None:
    """Micro-batches of different T flow down a non-wrapped pipeline, each stage adding its rank + 1.

    Pipelined like a real schedule: at step s a stage receives micro-batch s from prev and sends
    micro-batch s-1 to next in the same call, so stages overlap and several messages are in flight.
    """
    mesh = build_mesh(ParallelDims(pp=world), torch.device("cpu"))
    prev, nxt = pipeline_neighbours(mesh)
    assert (prev is None) == (rank == 0) and (nxt is None) == (rank == world - 1)
    outbox: torch.Tensor | None = None
    arrived = []
    for step in range(len(LENGTHS) + 1):
        sends = [(outbox, nxt)] if outbox is not None and nxt is not None else []
        recvs = [prev] if prev is not None and step < len(LENGTHS) else []
        got = exchange(sends, recvs, group=mesh.pp_group)
        if step == len(LENGTHS):
            break
        if prev is None:
            mb = _message(0, step, (LENGTHS[step], H), torch.float32)
        else:
            mb = got[0]
        arrived.append(mb)
        outbox = mb + (rank + 1)
    for step, mb in enumerate(arrived):  # in order, with every earlier stage's additions
        added = sum(r + 1 for r in range(rank))
        _assert_same(mb, _message(0, step, (LENGTHS[step], H), torch.float32) + added, f"micro-batch {step}")


# ------------------------------------------------------------------------------ tests


def test_round_trip_shapes_and_dtypes():
    run_distributed(_round_trip_worker, 2, timeout=TIMEOUT)


@pytest.mark.parametrize("world", [2, 4])
def test_ring_exchange_does_not_deadlock(world):
    run_distributed(_ring_worker, world, timeout=TIMEOUT)


@pytest.mark.parametrize("world", [2, 4])
def test_micro_batches_of_different_length_arrive_in_order(world):
    run_distributed(_pipeline_worker, world, timeout=TIMEOUT)
