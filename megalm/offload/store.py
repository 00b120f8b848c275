"""Where offloaded activations live: saved-tensor hooks that take over a group's activations, and the
copies that move them to host memory and back.

A *group* is what is offloaded as one: a micro-batch's forward through a pipeline chunk (PipeOffload), or
one transformer block's forward (layer-wise offload without a pipeline). While a group's forward runs
inside `store.hooks(key)`, every tensor autograd saves for backward passes through `pack`:

- parameters (and aliases of their storage), inputs held for their gradient (leaves that require grad: a
  pipeline stage's received activation), integer tensors (the batch's token ids and positions, held by the
  micro-batch all step), tensors the caller holds for every group (`keep`: the RoPE tables each block saves),
  tensors on another device, and tensors smaller than `min_tensor_bytes` are kept as they are (copying them
  saves nothing or costs more than it saves);
- with `recompute_cheap`, the output of a cheap activation (GELU: `CHEAP_OPS`) is not stored at all but
  recomputed from the op's input, which its own backward keeps anyway (PipeOffload's partial recompute); SwiGLU
  keeps no SiLU output to begin with (megalm/model/mlp.py);
- every other tensor is recorded by its *storage*: a view of a storage the group already holds (a
  transpose, a slice, a reshape) adds nothing and is rebuilt from it, by (offset, size, stride), on unpack.

`offload(key)` copies the group's storages into one host buffer from the `HostPool` and drops the device
references, so the caching allocator can reuse that memory; `reload(key)` copies them back into fresh device
buffers (one per storage), only those of storages the backward can still unpack. Once a group's forward is over,
each storage is let go as autograd drops its last saved-tensor handle on it (as autograd itself frees a saved
tensor after its node's backward), and the group is released (host buffer to the pool) with its last handle, i.e.
as soon as its backward has run, or by `release(key)`.
On CUDA the copies run on two side streams (device-to-host, host-to-device), ordered by events: an offload
starts after the compute that produced the activations (an event recorded on the compute stream), a reload
after its offload's copy, and the first unpack of a reloaded group makes the compute stream wait for the
reload (no host sync anywhere). An unpack of a group still on the host reloads it on the spot (counted in
`sync_reloads`: a reload that was not prefetched early enough). On CPU the same code runs with synchronous
copies into separate host buffers, so every test exercises the real bookkeeping; the bytes are measured, not
assumed.

The copies are bit-exact, so offload never changes what the model computes.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from megalm.measure import storage_identity
from megalm.offload.pool import HostPool

RESIDENT, OFFLOADED, RELOADED = "resident", "offloaded", "reloaded"


ALIGN = 64  # byte alignment of each storage inside a group's host buffer (and reloaded device buffer)


@dataclass
class _Storage:
    """One storage saved by a group: its bytes on the device (`device`, a uint8 tensor: all of the original
    storage, or its slice of the group's reloaded buffer) and its place in the group's host buffer."""

    nbytes: int
    device: torch.Tensor | None
    alias: torch.Tensor | None  # a saved tensor on it (shares its version counter) while on the device
    offset: int = 0  # in the group's host buffer
    version: int = 0  # the version counter when it was offloaded
    live: int = 0  # saved-tensor handles on it that autograd still holds
    on_host: bool = False  # its bytes are in the group's host buffer (offloaded, not reloaded yet)


@dataclass
class _Group:
    storages: list[_Storage] = field(default_factory=list)
    index: dict[int, int] = field(default_factory=dict)  # `storage_identity` -> position in `storages`
    host: torch.Tensor | None = None  # one pool buffer holding all storages while offloaded
    state: str = RESIDENT
    event: object | None = None  # CUDA event of the group's last copy
    waited: bool = True  # whether the compute stream waits for the reload already
    unpacked: bool = False  # whether its backward has started (the first unpack ran)
    live: int = 0  # saved-tensor handles autograd still holds; at 0 after the backward the group is freed
    closed: bool = False  # its forward is over (no more packs): only then can `live` reaching 0 free it

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.storages)


@dataclass(frozen=True, eq=False)
class _Ref:
    """What autograd holds instead of a saved tensor: where to rebuild it from, and the version counter it
    had when saved (autograd's in-place check, which saved-tensor hooks bypass, is redone here, for writes made
    before the group's OFFLOAD: after it the backward reads the host copy, and a later in-place write to the device
    tensor, which plain autograd would refuse, goes unseen)."""

    key: object
    group: _Group
    storage: int
    version: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


# PipeOffload's partial recompute: outputs of cheap elementwise ops are recomputed from their input (which
# the op's own backward keeps anyway) instead of being stored and copied.
CHEAP_OPS: dict[str, Callable[[object, torch.Tensor], torch.Tensor]] = {
    "GeluBackward0": lambda node, x: torch.nn.functional.gelu(x, approximate=node._saved_approximate),
}


@dataclass(frozen=True, eq=False)
class _Recompute:
    """A saved output of a cheap op: rebuilt from the op's input when backward needs it."""

    node: object  # the op's autograd node: its saved input is `node._saved_self`
    dtype: torch.dtype


def with_index(device: torch.device) -> torch.device:
    """cuda -> cuda:<current>: tensors always carry their index, and torch.device("cuda") != "cuda:0"."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over all of t's storage (to copy it whole, whatever views of it were saved), made as a view of
    t. (`torch.empty(0).set_(storage)` would do on a device, but under FakeTensorMode, where megalm-estimate runs
    offload, it keeps the storage alive for good.)"""
    nbytes, itemsize = t.untyped_storage().nbytes(), t.element_size()
    if nbytes % itemsize:  # a storage of another dtype's bytes: only `set_` spans it
        return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    return t.detach().as_strided((nbytes // itemsize,), (1,), 0).view(torch.uint8)


class ActivationStore:
    """Saved-tensor hooks per group, and offload / reload / release of a group's activations.

    Counters (bytes): `resident_bytes` of offloadable activations on the device now and `peak_resident_bytes`
    since `reset_peak`; `offloaded_bytes` / `reloaded_bytes` copied each way; `sync_reloads` counts reloads
    an unpack had to wait for. `on_unpack(key)` (optional) runs at each group's first unpack in backward:
    the layer-wise policy prefetches the next group from it.
    """

    def __init__(self, device: torch.device | str, params: Iterable[torch.Tensor] = (), min_tensor_bytes: int = 0,
                 pool: HostPool | None = None, recompute_cheap: bool = False) -> None:
        self.device = with_index(torch.device(device))
        self.cuda = self.device.type == "cuda"
        self.pool = pool or HostPool(pin=self.cuda)
        self.param_storages = {storage_identity(p) for p in params}  # parameters and buffers
        self.min_tensor_bytes = min_tensor_bytes
        self.recompute_cheap = recompute_cheap
        self.recomputed = 0  # cheap outputs rebuilt instead of stored
        self.groups: dict[object, _Group] = {}
        # groups released as their forward ended, holding nothing (no saved tensor reached min_tensor_bytes):
        # offload and reload have nothing to move for them, which is no error
        self.released_empty: set[object] = set()
        self.group_bytes_seen: dict[object, int] = {}  # each group's activation bytes, kept after its release
        self.on_unpack: Callable[[object], None] | None = None
        self.resident_bytes = self.peak_resident_bytes = 0
        self.offloaded_bytes = self.reloaded_bytes = self.sync_reloads = 0
        if self.cuda:
            self.d2h, self.h2d = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)

    # ------------------------------------------------------------------ hooks

    def hooks(self, key: object, keep: Iterable[torch.Tensor] = ()) -> contextlib.AbstractContextManager:
        """Saved-tensor hooks that record the activations saved inside as group `key` (a new group; a key
        whose group is still alive is refused). Tensors on the storages of `keep` are the caller's (a block's
        RoPE tables, which every block saves): they stay as they are, since moving a copy frees nothing."""
        if key in self.groups:
            raise RuntimeError(f"activation offload: group {key!r} is still alive (released after its backward)")
        group = self.groups[key] = _Group()
        self.released_empty.discard(key)
        kept = {storage_identity(t) for t in keep}

        def pack(t: torch.Tensor) -> torch.Tensor | _Ref | _Recompute:
            if not self._offloadable(t) or storage_identity(t) in kept:
                return t
            node = t.grad_fn
            if self.recompute_cheap and node is not None and type(node).__name__ in CHEAP_OPS and not t._is_view():
                return _Recompute(node, t.dtype)
            storage = t.untyped_storage()
            address = storage_identity(storage)
            if address not in group.index:
                group.index[address] = len(group.storages)
                group.storages.append(_Storage(storage.nbytes(), _bytes_of(t), t.detach()))
                self._add_resident(storage.nbytes())
                self.group_bytes_seen[key] = group.nbytes
            index = group.index[address]
            ref = _Ref(key, group, index, t._version, t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
            group.live += 1
            group.storages[index].live += 1
            weakref.finalize(ref, self._handle_freed, key, group, index)
            return ref

        @contextlib.contextmanager
        def recording() -> Iterator[None]:
            with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
                try:
                    yield
                finally:
                    group.closed = True
                    for saved in group.storages:  # saved, then dropped with its graph inside the forward
                        if saved.live == 0:
                            self._drop(group, saved)
                    if group.live == 0:  # nothing it saved is still needed
                        self.release(key)
                        self.released_empty.add(key)

        return recording()

    def _offloadable(self, t: torch.Tensor) -> bool:
        """Activations worth moving: on this device, not a parameter or buffer (or an alias of one), not an input
        its owner holds for its gradient, and on a storage of at least `min_tensor_bytes` (a small view of a large
        storage moves the storage). A leaf that requires grad (or a view of one) is such an input: the pipeline
        runtime keeps each received activation until its backward to read its `.grad`, so moving its copy would
        free nothing (a memory probe showed the store counting it as freed)."""
        if isinstance(t, nn.Parameter) or t.device != self.device or not t.is_floating_point():
            return False  # integer tensors are the batch's token ids and positions, which it holds all step
        base = t if t._base is None else t._base
        if base.is_leaf and base.requires_grad:
            return False
        storage = t.untyped_storage()
        if storage.nbytes() < self.min_tensor_bytes:
            return False
        return storage_identity(storage) not in self.param_storages

    def _unpack(self, ref: torch.Tensor | _Ref | _Recompute) -> torch.Tensor:
        if isinstance(ref, torch.Tensor):
            return ref
        if isinstance(ref, _Recompute):  # the op's input comes through these hooks too (reloaded if needed)
            self.recomputed += 1
            with torch.no_grad():
                return CHEAP_OPS[type(ref.node).__name__](ref.node, ref.node._saved_self.to(ref.dtype))
        group = ref.group
        if self.groups.get(ref.key) is not group:
            raise RuntimeError(f"activation offload: a tensor of group {ref.key!r} was used after its release")
        if group.state == OFFLOADED:
            self.sync_reloads += 1
            self.reload(ref.key)
        saved = group.storages[ref.storage]
        current = saved.alias._version if saved.alias is not None else saved.version
        if current != ref.version:
            raise RuntimeError("one of the variables needed for gradient computation has been modified by an "
                               f"inplace operation (activation offload, group {ref.key!r}: saved at version "
                               f"{ref.version}, now {current})")
        if not group.waited:  # first use after a reload: the compute stream waits for its copy
            torch.cuda.current_stream(self.device).wait_event(group.event)
            group.waited = True
        if not group.unpacked:
            group.unpacked = True
            if self.on_unpack is not None:
                self.on_unpack(ref.key)
        whole = saved.nbytes - saved.nbytes % ref.dtype.itemsize  # a storage of another dtype's bytes may not divide
        elements = saved.device[:whole].view(ref.dtype)  # the storage's bytes as ref's dtype (a view: `_bytes_of`)
        return elements.as_strided(ref.size, ref.stride, elements.storage_offset() + ref.offset)

    # ------------------------------------------------------------------ moves

    def offload(self, key: object) -> None:
        """Copy group `key`'s activations into one host buffer and let go of the device memory."""
        group = self._group(key)
        moving = [] if group is None or group.state != RESIDENT else [s for s in group.storages if s.device is not None]
        if not moving:
            return
        total = 0
        for s in moving:
            s.offset, total = total, total + -(-s.nbytes // ALIGN) * ALIGN
            s.version, s.alias, s.on_host = s.alias._version, None, True
        group.host = self.pool.take(total)
        if self.cuda:
            produced = torch.cuda.Event()
            produced.record(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.d2h):
                self.d2h.wait_event(produced)
                for s in moving:
                    group.host[s.offset:s.offset + s.nbytes].copy_(s.device, non_blocking=True)
                    s.device.record_stream(self.d2h)  # the allocator may reuse it only after this copy
                    s.device = None
                group.event = torch.cuda.Event()
                group.event.record(self.d2h)
        else:
            for s in moving:
                group.host[s.offset:s.offset + s.nbytes].copy_(s.device)
                s.device = None
        group.state = OFFLOADED
        nbytes = sum(s.nbytes for s in moving)
        self.resident_bytes -= nbytes
        self.offloaded_bytes += nbytes

    def reload(self, key: object) -> None:
        """Copy group `key`'s activations back into device buffers, one per storage (so that a tensor kept
        past its backward, e.g. by a zero-bubble W, keeps only its own), asynchronously on CUDA."""
        group = self._group(key)
        if group is None or group.state != OFFLOADED:
            return
        coming = [s for s in group.storages if s.on_host and s.live > 0]  # what the backward can still unpack
        for s in coming:  # allocated on the compute stream, which uses them
            s.device, s.on_host = torch.empty(s.nbytes, dtype=torch.uint8, device=self.device), False
        if self.cuda:
            self.h2d.wait_stream(torch.cuda.current_stream(self.device))  # the allocations are in place
            self.h2d.wait_event(group.event)  # the offload's copy has filled the host buffer
            with torch.cuda.stream(self.h2d):
                for s in coming:
                    s.device.copy_(group.host[s.offset:s.offset + s.nbytes], non_blocking=True)
                    s.device.record_stream(self.h2d)
                group.event = torch.cuda.Event()
                group.event.record(self.h2d)
            self.pool.give(group.host, group.event)
            group.waited = False
        else:
            for s in coming:
                s.device.copy_(group.host[s.offset:s.offset + s.nbytes])
            self.pool.give(group.host)
        group.host = None
        group.state = RELOADED
        nbytes = sum(s.nbytes for s in coming)
        self._add_resident(nbytes)
        self.reloaded_bytes += nbytes

    def _group(self, key: object) -> _Group | None:
        """Group `key`, or None when it was released empty at the end of its forward; an unknown key is an error."""
        if key in self.groups:
            return self.groups[key]
        if key in self.released_empty:
            return None
        raise KeyError(f"activation offload: no group {key!r} (never recorded, or released after its backward)")

    def release(self, key: object) -> None:
        """Forget group `key` (its backward has run): device buffers go to autograd's last users, host
        buffers back to the pool."""
        group = self.groups.pop(key, None)
        if group is None:
            return
        if group.state == OFFLOADED:
            self.pool.give(group.host, group.event)
        for saved in group.storages:  # (a handle freed later finds nothing left to drop)
            self._drop(group, saved)

    def _handle_freed(self, key: object, group: _Group, index: int) -> None:
        """Autograd let go of one of the group's saved tensors (its backward node ran, or the graph died). Once the
        group's forward is over, a storage with no handle left is let go at once, as autograd frees a saved tensor
        after its node's backward (holding every storage to the end of the group's backward raised the device
        peak above no offload's: the live-storage probe showed it); with the last handle the group is released."""
        group.live -= 1
        saved = group.storages[index]
        saved.live -= 1
        if saved.live == 0 and group.closed:
            self._drop(group, saved)
        if group.live == 0 and group.closed and self.groups.get(key) is group:
            self.release(key)

    def _drop(self, group: _Group, saved: _Storage) -> None:
        """Let go of a storage on the device that no saved tensor needs any more (its last user frees it)."""
        if saved.device is not None:
            saved.device, saved.alias = None, None
            self.resident_bytes -= saved.nbytes

    def release_all(self) -> None:
        for key in list(self.groups):
            self.release(key)
        self.released_empty.clear()

    # ------------------------------------------------------------------ accounting

    def _add_resident(self, nbytes: int) -> None:
        self.resident_bytes += nbytes
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)

    def reset_peak(self) -> None:
        self.peak_resident_bytes = self.resident_bytes

