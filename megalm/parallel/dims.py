"""ParallelDims: tp/pp/cp/dp sizes -> a DeviceMesh with named process groups.

Rank order is tp fastest, then cp, dp, pp (Megatron's order), so the ranks of a TP group are
consecutive and stay inside one node, where the all-reduces of every layer are cheapest:

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank      (`ParallelDims.rank_of`)

That formula lives here only; everything else asks `rank_of` / `coordinates`. This module is the only
place process groups are created. A single process gets a `ParallelMesh` whose groups are None; the
parallel layers treat a None group (or one of size 1) as "no communication", so the same code runs
with and without torch.distributed.

NCCL rules kept here: the process group is bound to this rank's GPU (`device_id`, so communicators
exist before subsets of ranks use them), and the one host-side check (`check_same_on_all_ranks`)
exchanges a tensor on the run's device.
"""

from __future__ import annotations

import datetime
import hashlib
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from megalm.errors import ConfigError
from megalm.parallel.flight_recorder import record_collectives
from megalm.parallel.progress import Progress

MESH_DIMS = ("pp", "dp", "cp", "tp")  # slowest to fastest


@dataclass(frozen=True)
class ParallelDims:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1  # expert parallelism: consecutive ranks of each dp x cp domain (not a factor of the world size)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def rank_of(self, *, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """The global rank at these mesh coordinates."""
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each mesh dimension (the inverse of `rank_of`)."""
        tp_rank = rank % self.tp
        cp_rank = (rank // self.tp) % self.cp
        dp_rank = (rank // (self.tp * self.cp)) % self.dp
        pp_rank = rank // (self.tp * self.cp * self.dp)
        return {"tp": tp_rank, "cp": cp_rank, "dp": dp_rank, "pp": pp_rank}

    def domain_ranks(self, tp: int, pp: int) -> list[int]:
        """The dp x cp ranks at TP coordinate `tp` and pipeline stage `pp`, in (dp, cp) order: the ranks
        that split a global batch (gradients are summed over them; HDP plans over them)."""
        return [self.rank_of(tp=tp, cp=c, dp=d, pp=pp) for d in range(self.dp) for c in range(self.cp)]

    def expert_groups(self, tp: int, pp: int) -> tuple[list[list[int]], list[list[int]]]:
        """The expert-parallel groups of the domain at (tp, pp) (each `ep` consecutive domain ranks: together they
        hold every expert once) and its expert-data-parallel groups (the ranks holding the same experts, one of
        each EP group: expert gradients are summed over them)."""
        domain = self.domain_ranks(tp, pp)
        ep_groups = [domain[i:i + self.ep] for i in range(0, len(domain), self.ep)]
        return ep_groups, [list(column) for column in zip(*ep_groups, strict=True)]

    def expert_dp_groups(self, pp: int, over_tp: bool = False) -> list[list[int]]:
        """The expert-data-parallel groups of stage `pp` (the ranks whose routed-expert gradients are summed
        together): `expert_groups`' at every TP coordinate, or with `over_tp` (sequence parallelism: each TP rank
        runs the experts on its own tokens, as Megatron's experts do with expert tensor parallelism 1) one group per
        expert slice over all the TP coordinates."""
        per_tp = [self.expert_groups(t, pp)[1] for t in range(self.tp)]
        if not over_tp:
            return [ranks for groups in per_tp for ranks in groups]
        return [sorted(r for groups in per_tp for r in groups[slot]) for slot in range(self.ep)]


def resolve_dims(p, world_size: int) -> ParallelDims:
    """Check the sizes in `cfg.parallel` (`p`) against the world size and fill `parallel.dp`.

    Every rule is a one-line ConfigError naming what to change, raised identically on every rank.
    """
    for key in ("tp", "pp", "vpp", "cp"):
        if getattr(p, key) < 1:
            raise ConfigError(f"parallel.{key}={getattr(p, key)} must be >= 1")
    model_parallel = p.tp * p.pp * p.cp
    if p.dp is None:
        if world_size % model_parallel:
            raise ConfigError(f"world size {world_size} is not divisible by tp*pp*cp = {p.tp}*{p.pp}*{p.cp}; "
                              "change parallel.* or the number of processes")
        p.dp = world_size // model_parallel
    if p.dp < 1:
        raise ConfigError(f"parallel.dp={p.dp} must be >= 1")
    if p.dp * model_parallel != world_size:
        raise ConfigError(f"world size {world_size} != tp*pp*cp*dp = {p.tp}*{p.pp}*{p.cp}*{p.dp}; "
                          "change parallel.* or the number of processes (torchrun --nproc-per-node)")
    return ParallelDims(tp=p.tp, pp=p.pp, cp=p.cp, dp=p.dp)


@dataclass
class ParallelMesh:
    """The process groups of one rank (None in a single process), and the record of what the rank's parallel code
    last entered (`progress`: the hang watchdog reads it; runners, layers and reducers built from this mesh
    write it)."""

    dims: ParallelDims
    rank: int = 0
    mesh: DeviceMesh | None = None  # when distributed
    tp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    cp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    # DP x CP ranks of this rank's tp/pp coordinates: gradients are summed (and ZeRO-1 shards) over it.
    dp_cp_group: dist.ProcessGroup | None = None
    # First and last pipeline stage of this rank's tp/cp/dp coordinates (tied embedding gradients).
    embedding_group: dist.ProcessGroup | None = None
    # Expert parallelism (`dims.ep` > 1): this rank's EP group (it holds expert slice `ep_rank` of ep), a 1-D device
    # mesh over it (checkpoints write expert slices as DTensor shards on it), and the expert-data-parallel group
    # (under sequence parallelism it spans the TP ranks too, and exists with ep = 1: `expert_dp_groups`).
    ep_group: dist.ProcessGroup | None = None
    ep_mesh: DeviceMesh | None = None
    expert_dp_group: dist.ProcessGroup | None = None
    progress: Progress = field(default_factory=Progress, compare=False, repr=False)

    def __post_init__(self) -> None:
        coords = self.dims.coordinates(self.rank)
        self.tp_rank, self.cp_rank, self.dp_rank, self.pp_rank = (coords[k] for k in ("tp", "cp", "dp", "pp"))
        self.ep_rank = (self.dp_rank * self.dims.cp + self.cp_rank) % self.dims.ep  # place in its domain's EP group

    def peer(self, **coordinates: int) -> int:
        """The global rank that differs from this one only in the given coordinates (e.g. `peer(pp=0)`)."""
        here = {"tp": self.tp_rank, "cp": self.cp_rank, "dp": self.dp_rank, "pp": self.pp_rank}
        return self.dims.rank_of(**(here | coordinates))

    @property
    def cp_ranks(self) -> list[int]:
        """Global ranks of this rank's context-parallel ring, in cp order (rank i holds zigzag chunks i, 2cp-1-i)."""
        return [self.peer(cp=c) for c in range(self.dims.cp)]

    @property
    def is_distributed(self) -> bool:
        return self.mesh is not None

    def groups(self) -> dict[str, dist.ProcessGroup | None]:
        """This rank's groups by role (None where the layout has none)."""
        return {"tp": self.tp_group, "cp": self.cp_group, "dp": self.dp_group, "pp": self.pp_group,
                "dp_cp": self.dp_cp_group, "embedding": self.embedding_group, "ep": self.ep_group,
                "expert_dp": self.expert_dp_group}

    @property
    def is_logging_rank(self) -> bool:
        """Rank 0 prints and writes metrics; every other rank stays quiet."""
        return self.rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank runs the last pipeline stage (the loss)."""
        return self.pp_rank == self.dims.pp - 1


def init_distributed(device: torch.device, timeout_minutes: float | None = None,
                     host_collectives: bool = False, flight_recorder_entries: int = 0) -> tuple[int, int]:
    """Join the torchrun job if there is one (env:// rendezvous). Returns (rank, world_size).

    On CUDA the group is NCCL, bound to this rank's GPU (LOCAL_RANK); on CPU it is gloo. A group someone
    else already initialised (a test launcher, a notebook) is used as it is. `timeout_minutes`
    (`parallel.timeout_minutes`): how long a collective may wait before it fails; None keeps torch's default.
    `host_collectives` (`parallel.fsdp_cpu_offload`: gradients and the optimizer step on the host) adds gloo for
    CPU tensors beside NCCL, which takes only CUDA ones (TorchTitan does the same). `flight_recorder_entries`
    (`parallel.flight_recorder_entries`): torch's record of each process's last collectives, for hang reports
    (megalm/parallel/flight_recorder.py); 0 leaves it as the environment has it.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return 0, 1
    record_collectives(flight_recorder_entries)  # read when the groups are made
    timeout = {"timeout": datetime.timedelta(minutes=timeout_minutes)} if timeout_minutes else {}
    store = _attempt_store(world_size, timeout.get("timeout"))
    join = {"store": store, "rank": int(os.environ["RANK"]), "world_size": world_size} if store is not None else {}
    if device.type == "cuda":
        local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(local)
        backend = "cuda:nccl,cpu:gloo" if host_collectives else "nccl"
        dist.init_process_group(backend=backend, device_id=local, **timeout, **join)
    else:
        dist.init_process_group(backend="gloo", **timeout, **join)
    return dist.get_rank(), dist.get_world_size()


def _attempt_store(world_size: int, timeout: datetime.timedelta | None) -> dist.Store | None:
    """Under torchrun, the agent's store with a key prefix of this restart attempt (None: env:// as it is).

    torchrun's workers share the agent's TCPStore, and torch's env:// rendezvous adds no per-attempt prefix to it
    (it assumes a new store per restart). A restarted group that reads a key its dead predecessor wrote (a gloo
    rank's listening address) connects to a port nobody listens on: refused, or a wait until the timeout. Keys
    under the prefix "attempt_<TORCHELASTIC_RESTART_COUNT>" are this attempt's only."""
    client = elastic_store(world_size, timeout)
    if client is None:
        return None
    return dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)


def elastic_store(world_size: int = 1, timeout: datetime.timedelta | None = None) -> dist.Store | None:
    """A client of torchrun's agent store, which every restart attempt of the job shares (None: not under torchrun's
    agent). Its keys outlive the workers that wrote them: `_attempt_store`'s prefix keeps an attempt to its own."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                         **({"timeout": timeout} if timeout is not None else {}))


def build_mesh(dims: ParallelDims, device: torch.device, experts_over_tp: bool = False,
               rings_over_dp: bool = False) -> ParallelMesh:
    """Create the DeviceMesh and its named groups (all ranks must call this together). `experts_over_tp`: an MoE
    model under sequence parallelism, whose routed-expert gradients are summed over TP too (`expert_dp_groups`).
    `rings_over_dp`: attention rings form over the dp ranks (HDP), so the gradients' group must not be the
    default group the rings' sends run on (below)."""
    if dims.world_size == 1:
        return ParallelMesh(dims)
    if dist.get_world_size() != dims.world_size:
        raise ConfigError(f"world size {dist.get_world_size()} != tp*pp*cp*dp = {dims.world_size}")
    mesh = init_device_mesh(device.type, (dims.pp, dims.dp, dims.cp, dims.tp), mesh_dim_names=MESH_DIMS)
    rank = dist.get_rank()
    embedding_group = None
    if dims.pp > 1:  # every rank creates every group (new_group is collective), joins its own
        for first in range(dims.world_size // dims.pp):  # the ranks of stage 0
            ranks = [first, dims.rank_of(**(dims.coordinates(first) | {"pp": dims.pp - 1}))]
            group = dist.new_group(ranks)
            if rank in ranks:
                embedding_group = group
    dp_group = mesh.get_group("dp")
    dp_cp_group = dp_group
    if dims.cp > 1:  # one group per (pp, tp) coordinate over its dp x cp ranks
        for pp_rank in range(dims.pp):
            for tp_rank in range(dims.tp):
                ranks = dims.domain_ranks(tp_rank, pp_rank)
                group = dist.new_group(ranks)
                if rank in ranks:
                    dp_cp_group = group
    if rings_over_dp and dims.cp == 1 and dist.get_world_size(dp_cp_group) == dims.world_size:
        # dp spans every rank, and torch's mesh hands back the default group, on which the rings' batched sends run
        # (context/ring.py, by global rank). NCCL runs one communicator's work in the order each rank issues it, and
        # HDP's ranks run different numbers of micro-batches: a rank whose last micro-batch is a ring launches bucket
        # reductions in its backward between ring sends that another member, with micro-batches still to come,
        # issues before its reductions. On one communicator each would wait for the other. gloo, which sends at
        # once, would not show it. So the gradients' reductions get a communicator of their own.
        dp_cp_group = dist.new_group(list(range(dims.world_size)))
    ep_group = ep_mesh = expert_dp_group = None
    experts_over_tp = experts_over_tp and dims.tp > 1
    if dims.ep > 1 or experts_over_tp:
        for pp_rank in range(dims.pp):
            for tp_rank in range(dims.tp if dims.ep > 1 else 0):
                for ranks in dims.expert_groups(tp_rank, pp_rank)[0]:
                    group = dist.new_group(ranks)
                    if rank in ranks:
                        ep_group = group
                        ep_mesh = DeviceMesh.from_group(group, device.type, mesh_dim_names=("ep",))
            for ranks in dims.expert_dp_groups(pp_rank, experts_over_tp):
                group = dist.new_group(ranks)
                if rank in ranks:
                    expert_dp_group = group
    return ParallelMesh(dims, rank=rank, mesh=mesh, tp_group=mesh.get_group("tp"), dp_group=dp_group,
                        cp_group=mesh.get_group("cp"), pp_group=mesh.get_group("pp"), embedding_group=embedding_group,
                        dp_cp_group=dp_cp_group, ep_group=ep_group, ep_mesh=ep_mesh, expert_dp_group=expert_dp_group)


def check_same_on_all_ranks(text: str, mesh: ParallelMesh, device: torch.device, what: str = "config") -> None:
    """Fail fast, on every rank, when ranks hold different `text` (e.g. were launched with different
    overrides, which would pair mismatched collectives and hang, or silently train garbage)."""
    if not mesh.is_distributed or dist.get_backend() == "fake":  # a fake process group (fake-tensor traces) has no data
        return
    digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    differ = [r for r, d in enumerate(everyone) if int(d) != digest]
    if differ:
        raise ConfigError(f"rank {mesh.rank}'s {what} differs from rank(s) {differ[:8]}'s; launch every rank with "
                          "the same config and overrides")
