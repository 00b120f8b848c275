"""ParallelDims: tp/pp/cp/dp sizes -> a DeviceMesh with named process groups, plus validation.

Rank order is tp fastest, then cp, dp, pp (Megatron's order), so the ranks of a TP group are
consecutive and stay inside one node, where the all-reduces of every layer are cheapest:

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

This module is the only place process groups are created. A single process gets a `ParallelMesh`
whose groups are None; the parallel layers treat a None group (or one of size 1) as "no
communication", so the same code runs with and without torch.distributed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalm.errors import ConfigError

MESH_DIMS = ("pp", "dp", "cp", "tp")  # slowest to fastest


@dataclass(frozen=True)
class ParallelDims:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each mesh dimension."""
        tp_rank = rank % self.tp
        cp_rank = (rank // self.tp) % self.cp
        dp_rank = (rank // (self.tp * self.cp)) % self.dp
        pp_rank = rank // (self.tp * self.cp * self.dp)
        return {"tp": tp_rank, "cp": cp_rank, "dp": dp_rank, "pp": pp_rank}


def validate_layout(cfg, world_size: int) -> ParallelDims:
    """Check `cfg.parallel` against the world size, the model and the batch; fill `parallel.dp`.

    `cfg` is a MegalmConfig whose model defaults are already resolved. Every rule is a one-line
    ConfigError naming what to change, raised identically on every rank (no collective needed).
    """
    p, m, t = cfg.parallel, cfg.model, cfg.trainer
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
    if m.num_heads % p.tp:
        raise ConfigError(f"model.num_heads={m.num_heads} is not divisible by parallel.tp={p.tp}; "
                          "choose tp among the divisors of num_heads")
    if m.num_kv_heads % p.tp and p.tp % m.num_kv_heads:
        raise ConfigError(f"model.num_kv_heads={m.num_kv_heads} and parallel.tp={p.tp}: one must divide the "
                          "other (kv heads are split over tp, or replicated when tp > kv heads)")
    if m.ffn_hidden_size % p.tp:
        raise ConfigError(f"model.ffn_hidden_size={m.ffn_hidden_size} is not divisible by parallel.tp={p.tp}; "
                          f"set it to a multiple of {p.tp}")
    if m.vocab_size % p.tp:
        padded = -(-m.vocab_size // (64 * p.tp)) * 64 * p.tp
        raise ConfigError(f"model.vocab_size={m.vocab_size} is not divisible by parallel.tp={p.tp}; pad it, "
                          f"e.g. model.vocab_size={padded}")
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tp>1; set parallel.tp or turn it off")
    if not p.hdp:  # under HDP the ring rules apply only when rings can form (_validate_hdp)
        _validate_context(cfg)
    _validate_hdp(cfg)
    if not p.hdp and t.tokens_per_step is None and t.global_batch_size % (t.micro_batch_size * p.dp):
        raise ConfigError(f"trainer.global_batch_size={t.global_batch_size} is not divisible by "
                          f"micro_batch_size*dp={t.micro_batch_size}*{p.dp}; change one of them")
    _validate_pipeline(cfg)
    return ParallelDims(tp=p.tp, pp=p.pp, cp=p.cp, dp=p.dp)


def _validate_context(cfg) -> None:
    """Context-parallel rules: what the ring and the all-to-all (Ulysses) need from the model."""
    p, m = cfg.parallel, cfg.model
    if p.cp == 1:
        return
    if p.cp_comm == "ring" and m.attention_dropout > 0:
        raise ConfigError(f"parallel.cp={p.cp} with parallel.cp_comm=ring has no attention dropout; set "
                          "model.attention_dropout=0 or parallel.cp_comm=a2a")
    modes = [p.recompute] if isinstance(p.recompute, str) else list(p.recompute)
    if "selective" in modes:  # its cache replays the collectives but not their in-place receive buffers
        raise ConfigError(f"parallel.recompute=selective does not combine with parallel.cp={p.cp} yet (the "
                          "ring/all-to-all would be replayed without its received data); use parallel.recompute="
                          "full or none")
    if p.cp_comm == "a2a":
        heads, kv_heads = m.num_heads // p.tp, max(1, m.num_kv_heads // p.tp)  # what each TP rank holds
        if heads % p.cp or kv_heads % p.cp:
            raise ConfigError(f"parallel.cp_comm=a2a splits each TP rank's {heads} query and {kv_heads} kv heads over "
                              f"parallel.cp={p.cp}, which must divide both; use parallel.cp_comm=ring or a cp that "
                              "divides them")


def _validate_hdp(cfg) -> None:
    """HDP rules: documents as samples, the capacity, and what ring micro-batches need (ring CP rules)."""
    p, m = cfg.parallel, cfg.model
    if not p.hdp:
        for key in ("hdp_capacity", "hdp_cost"):
            if getattr(p, key) is not None:
                raise ConfigError(f"parallel.{key} is set but parallel.hdp=false; set parallel.hdp=true or remove it")
        return
    if not cfg.data.varlen:
        raise ConfigError("parallel.hdp=true balances documents of different lengths; set data.varlen=true")
    if p.hdp_capacity is None:
        p.hdp_capacity = -(-m.seq_length // p.cp)
    if p.hdp_capacity < 1:
        raise ConfigError(f"parallel.hdp_capacity={p.hdp_capacity} must be >= 1 (tokens per rank per micro-batch)")
    domain = p.dp * p.cp
    widest = -(-m.seq_length // p.hdp_capacity)
    if widest > domain:
        raise ConfigError(f"a sample of model.seq_length={m.seq_length} tokens needs {widest} ranks of "
                          f"parallel.hdp_capacity={p.hdp_capacity}, but the HDP domain dp*cp has {domain}; raise "
                          f"parallel.hdp_capacity to >= {-(-m.seq_length // domain)} or use more ranks")
    if p.hdp_cost is not None:
        from megalm.parallel.hdp_cost import load_cost

        try:
            load_cost(p.hdp_cost)
        except Exception as e:  # a missing file, bad YAML, missing or mistyped keys
            raise ConfigError(f"parallel.hdp_cost={p.hdp_cost} cannot be loaded ({type(e).__name__}: {e}); "
                              "give a preset (7b) or a YAML like configs/hdp_cost/h100_7b.yaml") from None
    if p.cp_comm != "ring":
        raise ConfigError("parallel.hdp=true forms rings of any size over rank lists; set parallel.cp_comm=ring")
    if p.pp_schedule == "interleaved":
        raise ConfigError("parallel.hdp=true gives pipelines different micro-batch counts, which interleaved "
                          "pipelining cannot take; use parallel.pp_schedule=1f1b or zb")
    if widest > 1:  # some micro-batches may run on rings
        if m.attention_dropout > 0:
            raise ConfigError("parallel.hdp=true runs long documents with ring attention, which has no attention "
                              "dropout; set model.attention_dropout=0 or raise parallel.hdp_capacity to "
                              f"model.seq_length={m.seq_length}")
        modes = [p.recompute] if isinstance(p.recompute, str) else list(p.recompute)
        if "selective" in modes:
            raise ConfigError("parallel.recompute=selective does not combine with HDP rings yet; use "
                              "parallel.recompute=full or none")


def _validate_pipeline(cfg) -> None:
    """Pipeline rules: schedule vs vpp, the layer split, micro-batch counts, recompute modes."""
    from megalm.parallel.recompute import MODES
    from megalm.parallel.stages import split_layers

    p, t = cfg.parallel, cfg.trainer
    if p.vpp > 1 and p.pp == 1:
        raise ConfigError(f"parallel.vpp={p.vpp} needs pipeline parallelism; set parallel.pp>1 or parallel.vpp=1")
    if p.pp_schedule == "interleaved" and p.vpp == 1 and p.pp > 1:
        raise ConfigError("parallel.pp_schedule=interleaved needs parallel.vpp>1 (model chunks per rank)")
    if p.vpp > 1 and p.pp_schedule != "interleaved":
        raise ConfigError(f"parallel.vpp={p.vpp} needs parallel.pp_schedule=interleaved "
                          f"(got {p.pp_schedule}); set it or use parallel.vpp=1")
    micro_batches = t.global_batch_size // (t.micro_batch_size * p.dp)
    if p.pp_schedule == "interleaved" and p.pp > 1 and t.tokens_per_step is not None:
        raise ConfigError("trainer.tokens_per_step gives steps different micro-batch counts, which interleaved "
                          "pipelining cannot take; use parallel.pp_schedule=1f1b or zb, or trainer.global_batch_size")
    if p.pp_schedule == "interleaved" and p.pp > 1 and not p.hdp and micro_batches % p.pp:
        raise ConfigError(f"interleaved pipelining needs micro-batches per step ({micro_batches} = global_batch_size/"
                          f"(micro_batch_size*dp)) to be a multiple of parallel.pp={p.pp}; change the batch sizes")
    if p.layers_per_stage is not None and p.pp * p.vpp == 1:
        raise ConfigError("parallel.layers_per_stage is set but there is one pipeline stage; "
                          "remove it or set parallel.pp")
    split_layers(cfg.model.num_layers, p.pp * p.vpp, list(p.layers_per_stage) if p.layers_per_stage else None)
    modes = [p.recompute] if isinstance(p.recompute, str) else list(p.recompute)
    if not isinstance(p.recompute, str) and len(modes) != p.pp:
        raise ConfigError(f"parallel.recompute={modes} has {len(modes)} entries for parallel.pp={p.pp}; give one "
                          "mode, or one per pipeline rank")
    for mode in modes:
        if mode not in MODES:
            raise ConfigError(f"parallel.recompute={mode!r} is not one of {', '.join(MODES)}")
    if p.pp > 1 and p.zero1 and cfg.model.tie_embeddings:
        raise ConfigError("parallel.zero1 with pipeline parallelism and tied embeddings is not supported yet; "
                          "set parallel.zero1=false or model.tie_embeddings=false")


@dataclass
class ParallelMesh:
    """The process groups of one rank. Groups are None in a single process."""

    dims: ParallelDims
    rank: int = 0
    mesh: object | None = None  # torch DeviceMesh when distributed
    tp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    cp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    # DP x CP ranks of this rank's tp/pp coordinates: gradients are summed (and ZeRO-1 shards) over it.
    dp_cp_group: dist.ProcessGroup | None = None
    # First and last pipeline stage of this rank's tp/cp/dp coordinates (tied embedding gradients).
    embedding_group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        coords = self.dims.coordinates(self.rank)
        self.tp_rank, self.cp_rank, self.dp_rank, self.pp_rank = (coords[k] for k in ("tp", "cp", "dp", "pp"))

    @property
    def cp_ranks(self) -> list[int]:
        """Global ranks of this rank's context-parallel ring, in cp order (rank i holds zigzag chunks i, 2cp-1-i)."""
        d = self.dims
        return [((self.pp_rank * d.dp + self.dp_rank) * d.cp + c) * d.tp + self.tp_rank for c in range(d.cp)]

    @property
    def is_distributed(self) -> bool:
        return self.mesh is not None

    @property
    def is_logging_rank(self) -> bool:
        """Rank 0 prints and writes metrics; every other rank stays quiet."""
        return self.rank == 0


def init_distributed(device: torch.device) -> tuple[int, int]:
    """Join the torchrun job if there is one (env:// rendezvous). Returns (rank, world_size).

    A group someone else already initialised (a test launcher, a notebook) is used as it is.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return 0, 1
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size()


def build_mesh(dims: ParallelDims, device: torch.device) -> ParallelMesh:
    """Create the DeviceMesh and its named groups (all ranks must call this together)."""
    if dims.world_size == 1:
        return ParallelMesh(dims)
    from torch.distributed.device_mesh import init_device_mesh

    if dist.get_world_size() != dims.world_size:
        raise ConfigError(f"world size {dist.get_world_size()} != tp*pp*cp*dp = {dims.world_size}")
    mesh = init_device_mesh(device.type, (dims.pp, dims.dp, dims.cp, dims.tp), mesh_dim_names=MESH_DIMS)
    embedding_group = None
    if dims.pp > 1:  # every rank creates every group (new_group is collective), joins its own
        stage_size = dims.world_size // dims.pp
        for offset in range(stage_size):
            ranks = [offset, (dims.pp - 1) * stage_size + offset]
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                embedding_group = group
    dp_group = mesh.get_group("dp")
    dp_cp_group = dp_group
    if dims.cp > 1:  # one group per (pp, tp) coordinate over its dp x cp ranks
        for pp_rank in range(dims.pp):
            for tp_rank in range(dims.tp):
                ranks = [((pp_rank * dims.dp + d) * dims.cp + c) * dims.tp + tp_rank
                         for d in range(dims.dp) for c in range(dims.cp)]
                group = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    dp_cp_group = group
    return ParallelMesh(dims, rank=dist.get_rank(), mesh=mesh, tp_group=mesh.get_group("tp"), dp_group=dp_group,
                        cp_group=mesh.get_group("cp"), pp_group=mesh.get_group("pp"), embedding_group=embedding_group,
                        dp_cp_group=dp_cp_group)
