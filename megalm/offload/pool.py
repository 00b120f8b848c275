"""A host-memory pool for offloaded activations: buffers allocated once and reused.

Pinned (page-locked) host memory is what lets a device-to-host copy run asynchronously on its own CUDA
stream at full PCIe bandwidth, but pinning is slow (a cudaHostAlloc per buffer, milliseconds) and
fragments host memory, so buffers are kept and reused across micro-batches and steps rather than
allocated per copy (PipeOffload and Megatron-Core's fine-grained offloading do the same). Buffers are
bucketed by size (the next power of two of the request, at least 1 MiB), so the activations of
micro-batches of different token counts share buckets.

A buffer handed back while a copy that reads or writes it may still run on a stream is parked with that
copy's CUDA event and returns to the free lists once the event has completed (`Event.query`, no host
sync). On CPU the "host" buffers are ordinary tensors: the same bookkeeping runs, without pinning and
without streams.
"""

from __future__ import annotations

import torch

MIN_BUCKET = 1 << 20


def bucket_size(nbytes: int) -> int:
    """The bucket a request of `nbytes` is served from: the next power of two, at least 1 MiB."""
    return max(MIN_BUCKET, 1 << max(nbytes - 1, 0).bit_length())


class HostPool:
    """Reusable host byte buffers (pinned when `pin`), bucketed by power-of-two size."""

    def __init__(self, pin: bool = False) -> None:
        self.pin = pin
        self.free: dict[int, list[torch.Tensor]] = {}
        self.pending: list[tuple[torch.Tensor, object]] = []  # (buffer, CUDA event of its last copy)
        self.allocated_bytes = 0  # host bytes ever allocated (the pool's footprint)
        self.allocations = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer of at least `nbytes` (slice [:nbytes] to use it)."""
        self._reclaim()
        size = bucket_size(nbytes)
        bucket = self.free.get(size)
        if bucket:
            return bucket.pop()
        self.allocated_bytes += size
        self.allocations += 1
        return self.allocate(size)

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A new host buffer (the one place host memory is allocated: a memory probe labels what it returns)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def give(self, buffer: torch.Tensor, event: object | None = None) -> None:
        """Return `buffer`; with a CUDA `event`, only once the copy it marks has finished."""
        if event is None:
            self.free.setdefault(buffer.numel(), []).append(buffer)
        else:
            self.pending.append((buffer, event))

    def _reclaim(self) -> None:
        still = []
        for buffer, event in self.pending:
            if event.query():
                self.free.setdefault(buffer.numel(), []).append(buffer)
            else:
                still.append((buffer, event))
        self.pending = still
