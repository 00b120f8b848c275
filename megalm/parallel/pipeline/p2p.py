"""Point-to-point tensor exchange between pipeline neighbours, shapes sent before payloads.

Why: megalm's micro-batches are packed variable-length token streams, so the hidden states a stage
passes on are [T, h] with T different for every micro-batch (and, under HDP, pipelines run
different numbers of micro-batches of different lengths). A receiver therefore cannot allocate its
buffer from the config the way fixed-shape pipelines do. Every message here is two messages:

  1. a fixed-size int64 header: [ndim, dtype code, dim_0, ..., dim_{MAX_NDIM-1}] (unused dims 0);
  2. the payload, received into a buffer allocated from the header (skipped when it has 0 elements,
     e.g. a [0, h] micro-batch of a rank with no tokens: both sides know that from the header).

`exchange` posts all headers of one batch in a single `dist.batch_isend_irecv` and waits, then all
payloads in a second one. Posting a send to the next stage and a receive from the previous stage
together is what keeps a ring (or the steady state of 1F1B) from deadlocking: with blocking calls
every rank would sit in `send` waiting for a peer that is itself sitting in `send`.

The pipeline runtime sends every message through `exchange_known` instead: both sides know each micro-batch's
token count (the runtime's `activation_shape`), so one batch with no header does (no lone `isend`: NCCL may put
unbatched and batched p2p on different communicators, and may hold a send until its receive is posted;
rendezvous.py checks schedules for that). `exchange` (with `send_tensor`/`recv_tensor`) stays for a receiver that
does not know the shape; tests/dist/test_p2p.py runs it.

Ranks are GLOBAL ranks throughout (what `pipeline_neighbours` returns and what `P2POp`/`dist.send`
take); `group` only selects the communicator (e.g. `mesh.pp_group`), it does not renumber peers.

Messages between the same pair of ranks arrive in the order they were posted, so a sequence of
micro-batches sent one `exchange` (or one `send_tensor`) at a time arrives in order. Received
tensors are fresh leaf tensors without grad; the schedule sets `requires_grad_()` where it needs it.
With NCCL, note its rule that a group's first batched p2p call be made by all ranks of the group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megalm.parallel.dims import ParallelMesh
from megalm.parallel.progress import Progress

MAX_NDIM = 8
HEADER_LEN = 2 + MAX_NDIM
# The code of a dtype is its index here: append new dtypes at the end, never reorder.
DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32,
                                   torch.float64, torch.uint8, torch.int8, torch.bool)
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}


def encode_header(t: torch.Tensor) -> torch.Tensor:
    """The int64 header [ndim, dtype code, dims...] describing `t`, on `t`'s device."""
    if t.dtype not in _DTYPE_CODE:
        raise TypeError(f"p2p cannot send dtype {t.dtype}; supported: {', '.join(map(str, DTYPES))}")
    if t.dim() > MAX_NDIM:
        raise ValueError(f"p2p sends tensors of at most {MAX_NDIM} dims, got shape {tuple(t.shape)}")
    dims = list(t.shape) + [0] * (MAX_NDIM - t.dim())
    return torch.tensor([t.dim(), _DTYPE_CODE[t.dtype], *dims], dtype=torch.int64, device=t.device)


def decode_header(header: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    """(shape, dtype) from a received header; raises if it is not one `encode_header` wrote."""
    values = header.tolist()
    ndim, code = values[0], values[1]
    if not (0 <= ndim <= MAX_NDIM and 0 <= code < len(DTYPES)) or any(d < 0 for d in values[2:]):
        raise RuntimeError(f"p2p received a corrupt header {values} (unpaired send/recv between ranks?)")
    return torch.Size(values[2:2 + ndim]), DTYPES[code]


def _run_batch(ops: list[dist.P2POp], progress: Progress | None = None) -> None:
    """Post `ops` together and wait for all of them (an empty list is a no-op); `progress` records them."""
    if ops:
        if progress is not None:
            progress.note(collective=f"pipeline p2p: {len(ops)} sends/receives with ranks "
                                     f"{sorted({op.peer for op in ops})}")
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def exchange(
    sends: Sequence[tuple[torch.Tensor, int]],
    recvs: Sequence[int],
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
) -> list[torch.Tensor]:
    """Send each `(tensor, dst)` and receive one tensor from each `src`, all posted together.

    `dst`/`src` are global ranks; received tensors are allocated on `device` and returned in the
    order of `recvs`. Every send must be matched by a `recvs` entry on its destination (and vice
    versa) in the same call, or both sides hang. Two phases: headers, then payloads.
    """
    device = torch.device(device)
    payloads = [t.detach().contiguous() for t, _ in sends]
    headers = [encode_header(t) for t in payloads]
    in_headers = [torch.empty(HEADER_LEN, dtype=torch.int64, device=device) for _ in recvs]
    ops = [dist.P2POp(dist.isend, h, dst, group) for h, (_, dst) in zip(headers, sends, strict=True)]
    ops += [dist.P2POp(dist.irecv, h, src, group) for h, src in zip(in_headers, recvs, strict=True)]
    _run_batch(ops)

    received = []
    for header in in_headers:
        shape, dtype = decode_header(header)
        received.append(torch.empty(shape, dtype=dtype, device=device))
    ops = [dist.P2POp(dist.isend, t, dst, group) for t, (_, dst) in zip(payloads, sends, strict=True) if t.numel()]
    ops += [dist.P2POp(dist.irecv, t, src, group) for t, src in zip(received, recvs, strict=True) if t.numel()]
    _run_batch(ops)
    return received


def exchange_known(
    sends: Sequence[tuple[torch.Tensor, int]],
    recvs: Sequence[tuple[int, torch.Size | tuple[int, ...], torch.dtype]],
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
    progress: Progress | None = None,
) -> list[torch.Tensor]:
    """`exchange` for messages whose shape and dtype the receiver knows, in ONE batch (no headers).

    `recvs` are (src, shape, dtype). One phase matters under NCCL: a batch that waited for shape headers
    before posting its payloads could hold a payload send that the peer only receives after a later batch
    of its own (rendezvous.py models exactly this single-phase batch). Empty tensors are not sent.
    """
    device = torch.device(device)
    payloads = [t.detach().contiguous() for t, _ in sends]
    received = [torch.empty(shape, dtype=dtype, device=device) for _, shape, dtype in recvs]
    ops = [dist.P2POp(dist.isend, t, dst, group) for t, (_, dst) in zip(payloads, sends, strict=True) if t.numel()]
    ops += [dist.P2POp(dist.irecv, t, src, group) for t, (src, _, _) in zip(received, recvs, strict=True)
            if t.numel()]
    _run_batch(ops, progress)
    return received


def send_tensor(t: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> None:
    """Blocking send of `t` (any shape, a supported dtype) to global rank `dst`."""
    exchange([(t, dst)], [], group, t.device)


def recv_tensor(src: int, group: dist.ProcessGroup | None = None,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """Blocking receive from global rank `src` of a tensor whose shape is not known in advance."""
    return exchange([], [src], group, device)[0]


def pipeline_peer(mesh: ParallelMesh, pp_rank: int) -> int:
    """Global rank of pipeline rank `pp_rank` with this rank's tp/cp/dp coordinates."""
    if not 0 <= pp_rank < mesh.dims.pp:
        raise ValueError(f"pipeline rank {pp_rank} is outside pp={mesh.dims.pp}")
    return mesh.peer(pp=pp_rank)


def pipeline_neighbours(mesh: ParallelMesh, wrap: bool = False) -> tuple[int | None, int | None]:
    """Global ranks (prev, next) of the same tp/cp/dp coordinates at pp_rank - 1 and pp_rank + 1.

    None at the ends of the pipeline (and always when pp == 1). `wrap=True` links the last stage to
    the first, which the interleaved (vpp > 1) schedule needs to go from chunk c to chunk c + 1.
    """
    pp = mesh.dims.pp

    def rank_at(pp_rank: int) -> int | None:
        if pp == 1:
            return None
        if wrap:
            pp_rank %= pp
        elif not 0 <= pp_rank < pp:
            return None
        return pipeline_peer(mesh, pp_rank)

    return rank_at(mesh.pp_rank - 1), rank_at(mesh.pp_rank + 1)
