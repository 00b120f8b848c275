"""A micro-batch's attention over a ring of ranks: the `AttentionContext` context parallelism and HDP
attach to the micro-batches that span several ranks.

The model calls `context.attend(q, k, v, ...)` in every attention layer when its micro-batch carries
one (megalm/model/attention.py). The context holds everything the op needs, explicitly: the ring's
global ranks in order, this rank's position, the zigzag layout of the shard (computed once when the
micro-batch is prepared) and the communication (`ring`: K/V passed around the rank list on the
default group, so any list of ranks forms a ring; `a2a`: Ulysses over a fixed group of exactly those
ranks; `a2a+p2p`: all-to-all inside groups of consecutive ranks and a ring across them, hierarchical.py).
Interleaved micro-batches on different rings (pipelines, HDP, recomputation) each carry their
own, so nothing is looked up in module state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalm.config import MegalmConfig, choice, window_within_samples
from megalm.config.choices import ContextComm
from megalm.data.batch import PackedBatch
from megalm.errors import ConfigError
from megalm.parallel.context.hierarchical import HierarchicalRing
from megalm.parallel.context.ring import ring_attend, ring_attention, ring_meta, ring_note
from megalm.parallel.context.tokens import RingTokens
from megalm.parallel.context.ulysses import ulysses_attention
from megalm.parallel.context.zigzag import ZigzagLayout, layout_from_local_cu_seqlens, to_device
from megalm.parallel.microbatch import Ring
from megalm.parallel.progress import Progress

COMMS = ContextComm.names()


@dataclass(frozen=True, eq=False)
class RingContext:
    """Attention of one zigzag-sharded micro-batch over the ring `ranks` (global ranks, in ring order)."""

    ranks: tuple[int, ...]
    index: int  # this rank's position in `ranks`
    layout: ZigzagLayout
    comm: str = "ring"
    group: dist.ProcessGroup | None = None  # a2a: the group of exactly `ranks`
    progress: Progress | None = None  # the mesh's record of the transfer entered (hang reports)
    moe_tokens: RingTokens | None = None  # MoE models: the shard as the routers see it (tokens.py)
    hierarchical: HierarchicalRing | None = None  # a2a+p2p: built from `layout` when not given (`for_shard` gives it)
    window_covered: bool = True  # the model's sliding window holds each document whole: a ring attends as it does

    def __post_init__(self) -> None:
        if self.comm not in COMMS:
            raise ValueError(f"unknown context-parallel communication {self.comm!r}; use one of {', '.join(COMMS)}")
        # made once here, outside any compiled block: the ring op reads it on the host (ring.py, "the ring as one op")
        hierarchical = self.hierarchical
        if hierarchical is None and self.layout.inner > 1:
            hierarchical = HierarchicalRing.build(self.layout, self.ranks, self.index)
        meta = ring_meta(self.layout, self.ranks, self.index) if self.comm != "a2a" and not hierarchical else None
        object.__setattr__(self, "meta", meta)
        object.__setattr__(self, "hierarchical", hierarchical)
        # made here, not in attend: read inside a compiled block, the ranks would make dynamo guard on each of them
        object.__setattr__(self, "note", ring_note(self.ranks))
        object.__setattr__(self, "single_rank", len(self.ranks) == 1)

    @classmethod
    def for_shard(cls, batch: PackedBatch, ring: Ring, device: torch.device, comm: str = "ring",
                  group: dist.ProcessGroup | None = None, progress: Progress | None = None,
                  moe_over: tuple[torch.Tensor, dist.ProcessGroup | None] | None = None,
                  window_covered: bool = True) -> RingContext:
        """The context of `batch` (on the host), this rank's zigzag shard over `ring` (`zigzag.shard_batch`,
        possibly padded with one more even segment), with its layout on `device`. `moe_over`: (the shard's real
        tokens, the ring's group, or None for an HDP ring of ranks with no group) for an MoE model's routers
        (tokens.py). `window_covered`: the model has no sliding window, or one that holds every document whole
        (at least the sequence length, which no document exceeds: the only window the config lets a ring meet)."""
        # built on the host and moved from pinned memory like the batch: a plain copy of each of its tensors (and a
        # hierarchical ring's read of them back) synchronised the stream, 7 to 15 times a micro-batch
        ranks = tuple(int(r) for r in ring.ranks)
        host = layout_from_local_cu_seqlens(batch.cu_seqlens, len(ranks), ring.inner)
        hierarchical = HierarchicalRing.build(host, ranks, ring.index, device) if host.inner > 1 else None
        layout = host.to(device, non_blocking=True)
        tokens = None
        if moe_over is not None:
            real, ring_group = moe_over
            tokens = RingTokens(layout, ring.index, to_device(real, device, True), ring_group, progress, ranks)
        return cls(ranks, ring.index, layout, comm, group, progress, tokens, hierarchical, window_covered)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str, dropout_p: float = 0.0,
               scale: float | None = None, window: int | None = None) -> torch.Tensor:
        """Causal attention of this rank's shard q/k/v [T_local, H, D] against the ring's whole documents (within a
        sliding `window` under Ulysses; a ring only where the window holds every document whole: `validate_context`
        refuses a window shorter than the sequence for rings)."""
        if self.comm != "a2a":
            if dropout_p > 0.0:
                raise ValueError("ring attention has no attention dropout; set model.attention_dropout=0")
            if window is not None and not self.window_covered:
                raise ValueError(f"ring attention has no sliding window, and documents may be longer than its "
                                 f"{window} tokens; use parallel.cp_comm=a2a")
            if self.hierarchical is not None:
                if self.progress is not None:
                    self.progress.note(collective=self.note)
                return self.hierarchical.attend(q, k, v, backend, scale)
            if self.single_rank:
                return ring_attention(q, k, v, self.layout, self.ranks, self.index, backend=backend, scale=scale)
            if self.progress is not None:  # (a no-op inside a compiled block)
                self.progress.note(collective=self.note)
            return ring_attend(q, k, v, self.layout, self.meta, backend, scale)
        return ulysses_attention(q, k, v, self.layout, self.ranks, self.index, self.group, backend=backend,
                                 dropout_p=dropout_p, scale=scale, window=window)


def validate_context(cfg: MegalmConfig) -> None:
    """What rings and Ulysses need from the model and the layout (`parallel.cp > 1`; HDP rings ask for the
    same, megalm/parallel/hdp/split.py)."""
    p, m = cfg.parallel, cfg.model
    choice(p.cp_comm, "parallel.cp_comm", COMMS)
    if p.cp_a2a_size is not None and p.cp_comm != "a2a+p2p":
        raise ConfigError(f"parallel.cp_a2a_size={p.cp_a2a_size} sizes hierarchical CP's all-to-all groups; set "
                          "parallel.cp_comm=a2a+p2p or remove it")
    if p.cp_comm == "a2a+p2p" and (p.cp > 1 or p.hdp):  # at cp=1 no group is formed: said as unread (parallelism)
        cp_a2a_size(cfg)  # its checks
    # a window of at least the sequence holds every document whole: rings attend as the window does (the kernels
    # drop such a window too: model/attention.py, varlen_attention)
    if window_within_samples(m) is not None and (p.hdp or p.cp > 1 and p.cp_comm != "a2a"):
        layout = "parallel.hdp=true" if p.hdp else f"parallel.cp_comm={p.cp_comm}"
        raise ConfigError(f"model.sliding_window={m.sliding_window} with {layout} is not supported: ring attention "
                          "attends whole blocks of keys; use parallel.cp_comm=a2a (Ulysses: each rank attends whole "
                          "documents) or no context parallelism")
    if p.cp == 1 or p.hdp:
        return
    if p.cp_comm != "a2a" and m.attention_dropout > 0:
        raise ConfigError(f"parallel.cp={p.cp} with parallel.cp_comm={p.cp_comm} has no attention dropout; set "
                          "model.attention_dropout=0 or parallel.cp_comm=a2a")
    if p.cp_comm == "a2a":
        heads, kv_heads = m.num_heads // p.tp, max(1, m.num_kv_heads // p.tp)  # what each TP rank holds
        if heads % p.cp or kv_heads % p.cp:
            raise ConfigError(f"parallel.cp_comm=a2a splits each TP rank's {heads} query and {kv_heads} kv heads over "
                              f"parallel.cp={p.cp}, which must divide both; use parallel.cp_comm=ring or a cp that "
                              "divides them")


def cp_a2a_size(cfg: MegalmConfig) -> int:
    """Hierarchical CP's all-to-all group size u (`parallel.cp_comm=a2a+p2p`): `parallel.cp_a2a_size`, else one
    node's ranks. u must divide each TP rank's query and kv heads. Static CP: the group is u consecutive cp ranks;
    unset, the largest u ≤ 8 // tp that divides cp and the heads. HDP: u is how many HDP ranks a node holds (the
    planner's node: rings inside one run over NVLink, rings beyond take whole nodes as hierarchical rings); unset,
    8 // tp, which must divide dp·cp. Raises ConfigError when no group of 2 or more fits."""
    p, m = cfg.parallel, cfg.model
    heads, kv_heads = m.num_heads // p.tp, max(1, m.num_kv_heads // p.tp)
    node = max(1, 8 // p.tp)
    ranks = p.dp * p.cp if p.hdp else p.cp
    what = "the HDP domain dp*cp" if p.hdp else "parallel.cp"
    if p.cp_a2a_size is None:
        if p.hdp:
            u = node if not ranks % node else 1
        else:
            u = max(k for k in range(1, node + 1) if not ranks % k and not heads % k and not kv_heads % k)
        if p.hdp and u < 2:  # the default is one node's ranks, whatever the heads
            fits = [k for k in range(2, ranks + 1) if not ranks % k and not heads % k and not kv_heads % k]
            why = (f"at parallel.tp={p.tp} a node holds one (8 // tp = {node})" if node < 2 else
                   f"8 // tp = {node} by default, which does not divide {what}={ranks}")
            fix = (f"set parallel.cp_a2a_size to one of {fits} or use parallel.cp_comm=ring" if fits else
                   f"no group of 2 or more divides {ranks} and the {heads} query and {kv_heads} kv heads per TP "
                   "rank: use parallel.cp_comm=ring")
            raise ConfigError(f"parallel.cp_comm=a2a+p2p groups one node's HDP ranks: {why}; {fix}")
        if u < 2 or heads % u or kv_heads % u:
            raise ConfigError(f"parallel.cp_comm=a2a+p2p finds no all-to-all group for {what}={ranks} with {heads} "
                              f"query and {kv_heads} kv heads per TP rank; set parallel.cp_a2a_size (the ranks of "
                              "one node, dividing both) or use parallel.cp_comm=ring")
        return u
    u = p.cp_a2a_size
    if u < 2:
        raise ConfigError(f"parallel.cp_a2a_size={u} is the flat ring; use parallel.cp_comm=ring or a size >= 2")
    if ranks % u:
        raise ConfigError(f"parallel.cp_a2a_size={u} must divide {what}={ranks}; pick a divisor")
    if heads % u or kv_heads % u:
        raise ConfigError(f"parallel.cp_a2a_size={u} splits each TP rank's {heads} query and {kv_heads} kv heads, "
                          "which it must divide; pick a divisor or use parallel.cp_comm=ring")
    return u
