"""What a rank's collectives cost in megalm-estimate's step (megalm/estimate/rank.py): the bytes each moves through
the rank's link (`Collectives`, a dispatch mode over the step), the links' bandwidths (`LINKS`: NVLink inside a node
of `GPUS_PER_NODE` GPUs, a NIC across nodes), the seconds those bytes take (`comm_seconds`), and the share hidden
behind compute by the collectives the step leaves in flight (`InFlight`: tensor parallelism's backward collectives in
eager blocks, megalm/parallel/tensor/comm.py). Apart from rank.py, which builds and steps the rank, so that each reads
alone; the layout search's closed form prices its collectives with the same links."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megalm import compat
from megalm.measure import is_higher_order
from megalm.measure.op_cost import FUSED_COLLECTIVE_GEMMS, OpCosts

CP_OPS = ("ring_attention", "ring_attention_backward", "p2p_all_to_all")  # megalm's point-to-point CP ops


@dataclass(frozen=True)
class Links:
    """Per-GPU link bandwidths in bytes/s, one direction (vendor datasheets)."""

    nvlink: float  # inside a node
    network: float  # across nodes (InfiniBand / RoCE NIC per GPU)


LINKS = {  # NVLink 4: 900 GB/s both ways (H100, H200); NVLink 3: 600 (A100); NVLink 5: 1.8 TB/s (B200). One
    # 400 Gb/s NIC per GPU (ConnectX-7) on H100/H200/B200 clusters, 200 Gb/s (HDR) on A100 ones.
    "h100": Links(450e9, 50e9),
    "h200": Links(450e9, 50e9),
    "a100": Links(300e9, 25e9),
    "b200": Links(900e9, 50e9),
}
GPUS_PER_NODE = 8  # HGX/DGX nodes of every GPU in LINKS


def inside_node(tp: int, cp: int, ep: int = 1, dp: int = 0, pp: int = 1, fsdp_shard: int = 0) -> set[str]:
    """The mesh dimensions whose groups lie inside one node of GPUS_PER_NODE GPUs (ranks are ordered tp fastest,
    then cp, dp, pp; a group spans the consecutive ranks of its dimension and the faster ones, inside a node when
    that span divides the node): tp, cp (tp x cp), ep (consecutive dp x cp ranks: tp x ep), HSDP's `fsdp_shard`
    (`fsdp_shard` consecutive dp x cp ranks: tp x fsdp_shard), dp, dp_cp, expert_dp and HSDP's `fsdp_replicate`
    (tp x cp x dp), pp and embedding (the whole world), and always `cp_in_node` (`ring_dim`). Their collectives run
    over NVLink, the others over the NICs. `dp` 0: not known, across nodes (a single node's dp and pp traffic was
    priced at the NICs', 9x slower, until 2026-12-06)."""
    within = tp * cp * dp
    spans = (("tp", tp), ("cp", tp * cp), ("ep", tp * ep), ("fsdp_shard", tp * fsdp_shard), ("dp", within),
             ("dp_cp", within), ("expert_dp", within), ("fsdp_replicate", within), ("pp", within * pp),
             ("embedding", within * pp))
    return {dim for dim, span in spans if 0 < span <= GPUS_PER_NODE and GPUS_PER_NODE % span == 0} | {"cp_in_node"}


def ring_dim(ranks: list[int], inside: set[str]) -> str:
    """The dimension a ring's point-to-point transfers among global `ranks` are priced under: `cp` where its link is
    the cp group's (a static ring is that group), else `cp_in_node` (NVLink: an HDP ring, or a hierarchical ring's
    all-to-all, inside one node) or `cp_across_nodes` (the NICs)."""
    one_node = len({rank // GPUS_PER_NODE for rank in ranks}) == 1
    if one_node == ("cp" in inside):
        return "cp"
    return "cp_in_node" if one_node else "cp_across_nodes"


def comm_seconds(nbytes: dict[str, int], links: Links, inside: set[str]) -> float:
    """Collectives' link bytes (`Collectives`) at their link's bandwidth: the dimensions `inside` a node over NVLink,
    the rest across nodes."""
    return sum(n / (links.nvlink if dim in inside else links.network) for dim, n in nbytes.items())


_RING_COLLECTIVES = {  # op name prefix -> buffers a ring algorithm sends per (n - 1) / n of the largest tensor
    "allreduce": 2, "all_reduce": 2,  # a reduce-scatter, then an all-gather
    "allgather": 1, "_allgather": 1, "all_gather": 1,  # of the output
    "reduce_scatter": 1, "_reduce_scatter": 1,  # of the input
    "alltoall": 1, "all_to_all": 1}


# c10d's point-to-point ops: a pipeline stage's sends address global ranks over the default group
# (megalm/parallel/pipeline/p2p.py), which no mesh dimension names where dp, cp or tp > 1; they are pp's
POINT_TO_POINT = ("send", "recv_", "recv_any_source_")


def link_share(op: str, ranks: int) -> float:
    """Of a collective's largest tensor, the share each rank of a group of `ranks` sends through its link (NCCL's
    bus bandwidth: an all-reduce 2 (n - 1) / n, an all-gather, a reduce-scatter or an all-to-all (n - 1) / n); a
    send or a broadcast sends it once, a receive nothing: its sender counts it, and a full-duplex link carries a
    rank's receives beside its sends (a pipeline stage's had been counted twice)."""
    if op.startswith("recv"):
        return 0.0
    factor = next((f for prefix, f in _RING_COLLECTIVES.items() if op.startswith(prefix)), None)
    return 1.0 if factor is None else factor * (ranks - 1) / ranks


class Collectives(TorchDispatchMode):
    """Bytes the step's collectives move through this rank's link, by the group's mesh dimension (`link_share` of the
    call's largest tensor: an all-reduce's buffer, an all-gather's output, a reduce-scatter's input; counted once).
    Until 2026-12-05 the (n - 1) / n was left out, which doubled a group of 2's bytes; until 2026-12-08 a list
    all-gather's output (Muon's gathers of whole matrices) was taken as one of its pieces, 1/n of it.
    Eager code dispatches `c10d` ops (the group a boxed ScriptObject); compiled blocks the functional collectives
    dynamo traces them into (`_c10d_functional`, the group by its name, the result returned; their `wait_tensor`
    moves nothing), and under async TP torch's fused collective GEMMs (`symm_mem`, op_cost's
    `FUSED_COLLECTIVE_GEMMS`), whose collective is counted here and whose GEMM the `OpCosts` below this mode prices
    (`pipelined` keeps both for `InFlight`).

    Context parallelism's ring attention and its hierarchical all-to-all send point-to-point between global ranks
    from inside megalm's ops (megalm/parallel/context), whose fake kernels send nothing: the bytes their real ones
    send are counted per op (`ring.ring_sent_bytes`, (u - 1) of an all-to-all's u slots), under `ring_dim` of the
    ranks they pass among (`inside`: the dimensions inside a node). The ring's transfers run beside its block
    kernels (each step's is posted before its compute): they are `pipelined` too, over the ring's n ranks."""

    def __init__(self, groups: dict[str, str], inside: set[str] | None = None) -> None:
        super().__init__()
        self.groups = groups  # process group name -> mesh dimension
        self.inside = inside if inside is not None else set()
        self.bytes: dict[str, int] = defaultdict(int)
        self.step_bytes: dict[str, int] = defaultdict(int)  # of `bytes`, those moved while `once_a_step` is set
        self.once_a_step = False
        self.last: tuple[str, int] = ("other", 0)  # the latest collective's (mesh dimension, link bytes)
        # transfers that run beside their op's own compute (async TP's fused collective GEMMs, the CP ring): (mesh
        # dimension, link bytes, ranks, the op's roofline seconds by `clock`)
        self.pipelined: list[tuple[str, int, int, float]] = []
        self.clock: Callable[[], float] = lambda: 0.0  # the roofline seconds priced so far (InFlight's)

    def _count(self, dim: str, moved: int) -> None:
        self.bytes[dim] += moved
        self.last = (dim, moved)
        if self.once_a_step:
            self.step_bytes[dim] += moved

    def _fused_collective_gemm(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Async TP's `symm_mem` op: its all-gather sends the shard to the group's other ranks, its reduce-scatter
        (n - 1) / n of the GEMM's whole output; the GEMM inside is priced by the trace below this mode (OpCosts runs
        the op's body)."""
        from torch.distributed import distributed_c10d as c10d

        name = func._overloadpacket.__name__
        group = args[3] if name == "fused_all_gather_matmul" else args[4]
        ranks = c10d._resolve_process_group(group).size()
        before = self.clock()
        out = func(*args, **kwargs)
        tensor = args[0] if name == "fused_all_gather_matmul" else out
        dim = self.groups.get(group, "other")
        moved = tensor.numel() * tensor.element_size() * (ranks - 1)  # every shard but its own
        self._count(dim, moved)
        self.pipelined.append((dim, moved, ranks, self.clock() - before))
        return out

    def _context_parallel(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """One of megalm's point-to-point CP ops (the class docstring)."""
        from megalm.parallel.context.ring import ring_ranks, ring_sent_bytes

        name = func._overloadpacket.__name__
        before = self.clock()
        out = func(*args, **kwargs)
        if name == "p2p_all_to_all":
            x, meta = args[:2]
            ranks = compat.host_values(meta)[1:]
            self._count(ring_dim(ranks, self.inside), x.numel() * x.element_size() * (len(ranks) - 1) // len(ranks))
            return out
        backward = name == "ring_attention_backward"
        q, k = args[1:3] if backward else args[:2]
        ranks = ring_ranks(args[7] if backward else args[4])
        dim, moved = ring_dim(ranks, self.inside), ring_sent_bytes(q, k, len(ranks), backward)
        self._count(dim, moved)
        self.pipelined.append((dim, moved, len(ranks), self.clock() - before))
        return out

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Compiled blocks run compiled under this trace too (OpCosts.ignore_compile_internals)."""
        return True

    supports_higher_order_operators = True  # run through (measure.storage.is_higher_order)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        import torch.distributed as dist

        if (not is_higher_order(func) and func.namespace == "symm_mem"
                and func._overloadpacket.__name__ in FUSED_COLLECTIVE_GEMMS):
            return self._fused_collective_gemm(func, args, kwargs or {})
        if not is_higher_order(func) and func.namespace == "megalm" and func._overloadpacket.__name__ in CP_OPS:
            return self._context_parallel(func, args, kwargs or {})
        out = func(*args, **(kwargs or {}))
        if is_higher_order(func):
            return out
        functional = func.namespace == "_c10d_functional" and not func.__name__.startswith("wait_tensor")
        if func.namespace == "c10d" or functional:
            from torch.distributed import distributed_c10d as c10d

            flat = tree_flatten((args, kwargs or {}, out))[0]
            tensors = [t for t in flat if isinstance(t, torch.Tensor)]
            if functional:  # the group by its name, its `group_name` argument
                named = {**dict(zip((a.name for a in func._schema.arguments), args, strict=False)), **(kwargs or {})}
                groups = [c10d._resolve_process_group(named["group_name"])] if "group_name" in named else []
            else:  # the group arrives boxed (a ScriptObject)
                groups = [dist.ProcessGroup.unbox(a) for a in flat if isinstance(a, torch.ScriptObject)
                          and "ProcessGroup" in str(a._type())]
            group = groups[0] if groups else None
            dim = self.groups.get(group.group_name, "other") if group is not None else "other"
            name = func._overloadpacket.__name__
            if dim == "other" and name in POINT_TO_POINT:  # the pipeline's (CP's are counted above)
                dim = "pp"
            largest = max((t.numel() * t.element_size() for t in tensors), default=0)
            if name == "allgather_":  # a list all-gather's output is a list of one piece a rank (`dist.all_gather`)
                largest *= group.size() if group else 1
            self._count(dim, int(largest * link_share(name, group.size() if group else 1)))
        return out


class InFlight:
    """While inside, the collectives the step leaves in flight (`Pending` with a work handle: tensor parallelism's
    backward collectives, megalm/parallel/tensor/comm.py) are priced as hidden behind the compute the rank runs
    until it waits for each: `hidden_s` sums min(the collective's time on its link, the roofline time `costs` priced
    between its start and its wait). The NCCL stream runs them beside the GEMMs; that they share the GPU's memory
    bandwidth with them is not priced.

    The ops whose transfers run beside their own compute (`Collectives.pipelined`) hide all but one of their n
    steps' transfers, or compute, whichever is shorter: min(transfer time, the op's roofline time) x (n - 1) / n,
    added to `hidden_s` on leaving. Async TP's fused collective GEMMs split the GEMM into one chunk per TP rank and
    move a chunk while the GEMM multiplies the one before it; the CP ring posts each step's K/V (and dK/dV) transfer
    before that step's block kernels, over its n ranks."""

    def __init__(self, costs: OpCosts, comms: Collectives, links: Links, inside: set[str]) -> None:
        self.costs, self.comms, self.links, self.inside = costs, comms, links, inside
        self.hidden_s = 0.0

    def __enter__(self) -> InFlight:
        from megalm.parallel.tensor.comm import Pending

        self.comms.clock = lambda: self.costs.total().ms / 1e3
        if not _ACTIVE:  # the outermost: patch (an inner one prices into the innermost, `_ACTIVE[-1]`)
            _ORIGINALS["init"], _ORIGINALS["wait"] = Pending.__init__, Pending.wait
            Pending.__init__, Pending.wait = _observed_init, _observed_wait
        _ACTIVE.append(self)
        return self

    def started(self, pending: Any) -> None:
        """`pending` was just dispatched in flight: note the collective and the compute priced so far."""
        pending._priced = (self.comms.last, self.costs.total().ms)

    def waited(self, pending: Any) -> None:
        """`pending` is waited for: the compute priced since its start hides its time, up to that time."""
        if (started := getattr(pending, "_priced", None)) is not None:
            (dim, moved), ms = started
            beside_s = (self.costs.total().ms - ms) / 1e3
            self.hidden_s += min(comm_seconds({dim: moved}, self.links, self.inside), beside_s)

    def __exit__(self, *exc: object) -> None:
        from megalm.parallel.tensor.comm import Pending

        _ACTIVE.remove(self)
        if not _ACTIVE:
            Pending.__init__, Pending.wait = _ORIGINALS["init"], _ORIGINALS["wait"]
        for dim, moved, ranks, gemm_s in self.comms.pipelined:
            self.hidden_s += min(comm_seconds({dim: moved}, self.links, self.inside), gemm_s) * (ranks - 1) / ranks


# InFlight's patches of Pending, module-level functions reading module globals: a compiled block creates and waits
# for its Pendings synchronously (work None) while dynamo traces it, inside autograd.Functions, where dynamo must
# wrap every closure cell of a function it calls; a closure holding the InFlight broke the graph at every TP
# collective of a compiled block's trace (found 2026-12-02). The unpatched methods (`_ORIGINALS`, plain functions)
# are read on every call; the InFlight objects (`_ACTIVE`) on the in-flight path only, which dynamo never takes.
_ORIGINALS: dict[str, Any] = {}
_ACTIVE: list[InFlight] = []


def _observed_init(pending: Any, out: torch.Tensor, work: Any = None) -> None:
    _ORIGINALS["init"](pending, out, work)
    if work is not None:
        _ACTIVE[-1].started(pending)


def _observed_wait(pending: Any) -> torch.Tensor:
    if pending.work is not None:
        _ACTIVE[-1].waited(pending)
    return _ORIGINALS["wait"](pending)
