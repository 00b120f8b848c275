"""Which transformer layers each pipeline rank holds, with interleaved virtual stages, and the chunks.

The model's `num_layers` are cut into `pp * vpp` contiguous *virtual stages*. Chunk `c` of pipeline
rank `r` holds virtual stage `c * pp + r` (the interleaved assignment): with vpp > 1 a micro-batch
visits every rank vpp times, which shrinks the pipeline bubble by vpp at the price of more p2p.

    8 layers, pp=2, vpp=2 -> virtual stages [0,1] [2,3] [4,5] [6,7]
                             rank 0: [0,1], [4,5]    rank 1: [2,3], [6,7]

The split is even by default. An explicit `layers_per_stage` (one count per virtual stage) lets a
config balance stages by hand: the first stage also runs the embedding and the last one the output
head and the loss (vocab-sized matmuls), so they are often given fewer layers. For the same reason
the FIRST and LAST virtual stage may hold 0 layers (an embedding-only or head-only stage); every
interior stage must hold >= 1, since an empty interior stage would only forward activations.
"""

from __future__ import annotations

import torch
from torch import nn

from megalm.config import MegalmConfig, ModelConfig, choice, ramp_batch_sizes
from megalm.errors import ConfigError
from megalm.model.gpt import GPT
from megalm.parallel.pipeline.schedules import SCHEDULES
from megalm.parallel.recompute import recompute_modes


class StageSplitError(ConfigError, ValueError):
    """An impossible layer split: a ConfigError (one-line CLI message) that is also a ValueError."""


def _check_sizes(pp: int, vpp: int) -> None:
    for name, value in (("pp", pp), ("vpp", vpp)):
        if value < 1:
            raise StageSplitError(f"parallel.{name}={value} must be >= 1")


def _suggested_split(num_layers: int, stages: int) -> list[int]:
    """A balanced layers_per_stage for an uneven split: the extra layers go to interior stages first."""
    counts = [num_layers // stages] * stages
    order = list(range(1, stages - 1)) + [0, stages - 1] if stages > 2 else list(range(stages))
    for i in order[: num_layers % stages]:
        counts[i] += 1
    return counts


def split_layers(num_layers: int, stages: int, layers_per_stage: list[int] | None = None) -> list[int]:
    """The validated number of layers of each of `stages` virtual stages."""
    if num_layers < 1:
        raise StageSplitError(f"model.num_layers={num_layers} must be >= 1")
    if layers_per_stage is None:
        if num_layers % stages:
            hint = _suggested_split(num_layers, stages) if num_layers >= stages - 2 else None
            # one quoted shell word: the shell split "[1, 2, 1]" at its spaces, and zsh globs an unquoted [...]
            fix = (f"set 'parallel.layers_per_stage=[{','.join(map(str, hint))}]'" if hint
                   else "use fewer stages (parallel.pp*parallel.vpp)")
            raise StageSplitError(f"num_layers={num_layers} is not divisible into pp*vpp={stages} stages; {fix}")
        return [num_layers // stages] * stages
    counts = list(layers_per_stage)
    if len(counts) != stages:
        raise StageSplitError(f"parallel.layers_per_stage has {len(counts)} entries but pp*vpp={stages}; "
                              "give one layer count per virtual stage")
    if any(not isinstance(n, int) or isinstance(n, bool) for n in counts):
        raise StageSplitError(f"parallel.layers_per_stage={counts} must be a list of integers")
    if sum(counts) != num_layers:
        raise StageSplitError(f"parallel.layers_per_stage={counts} sums to {sum(counts)}, not "
                              f"model.num_layers={num_layers}; make the counts add up")
    for i, n in enumerate(counts):
        edge = i in (0, stages - 1)
        if n < 0 or (n == 0 and not edge):
            raise StageSplitError(f"parallel.layers_per_stage[{i}]={n} must be >= {0 if edge else 1} "
                                  "(only the first and last stage may be empty); move layers to it")
    return counts


def stage_layer_ranges(
    num_layers: int, pp: int, vpp: int = 1, layers_per_stage: list[int] | None = None
) -> list[list[range]]:
    """For each pipeline rank, the layer index ranges of its `vpp` model chunks (chunk order).

    `result[r][c]` is the range of virtual stage `c * pp + r`; `layers_per_stage` (length pp*vpp,
    in virtual-stage order) overrides the even split.
    """
    _check_sizes(pp, vpp)
    counts = split_layers(num_layers, pp * vpp, layers_per_stage)
    starts = [sum(counts[:v]) for v in range(pp * vpp)]
    virtual = [range(start, start + n) for start, n in zip(starts, counts, strict=True)]
    return [[virtual[c * pp + r] for c in range(vpp)] for r in range(pp)]


def stage_layer_counts(cfg: MegalmConfig) -> list[int]:
    """The validated layer count of each of the run's pp·vpp virtual stages (`parallel.layers_per_stage`, or even)."""
    p = cfg.parallel
    return split_layers(cfg.model.num_layers, p.pp * p.vpp,
                        None if p.layers_per_stage is None else list(p.layers_per_stage))


def stage_holds(pp_rank: int, chunk: int, pp: int, vpp: int = 1) -> tuple[bool, bool]:
    """(has_embedding, has_head) of chunk `chunk` on pipeline rank `pp_rank`.

    The embedding lives on the first virtual stage (rank 0, chunk 0); the output head and the loss on
    the last (rank pp-1, chunk vpp-1), whatever the layer split.
    """
    _check_sizes(pp, vpp)
    if not 0 <= pp_rank < pp or not 0 <= chunk < vpp:
        raise StageSplitError(f"stage (pp_rank={pp_rank}, chunk={chunk}) is outside pp={pp}, vpp={vpp}")
    virtual = chunk * pp + pp_rank
    return virtual == 0, virtual == pp * vpp - 1


def build_stage_chunks(cfg: ModelConfig, pp_rank: int, pp: int, vpp: int = 1,
                       layers_per_stage: list[int] | None = None, device: torch.device | str = "meta") -> nn.ModuleList:
    """The `vpp` GPT chunks pipeline rank `pp_rank` holds (chunk c = virtual stage c * pp + pp_rank).

    Each chunk is a GPT keeping only its layers (with their global `layer_id`, so parameters keep the
    full model's names); the embedding lives on the first virtual stage, the final norm and output head
    on the last. With tied embeddings the last stage also keeps `embedding` (a copy) for its head.
    """
    ranges = stage_layer_ranges(cfg.num_layers, pp, vpp, layers_per_stage)[pp_rank]
    chunks = []
    for c, layer_range in enumerate(ranges):
        first, last = stage_holds(pp_rank, c, pp, vpp)
        chunk = GPT(cfg, device=device)
        chunk.layers = nn.ModuleList(chunk.layers[i] for i in layer_range)
        if not first:
            chunk.position_embedding = None
            if not (last and chunk.cfg.tie_embeddings):
                chunk.embedding = None
        if not last:
            chunk.final_norm = None
            chunk.output = None
        chunk.is_first_stage, chunk.is_last_stage = first, last
        chunks.append(chunk)
    return nn.ModuleList(chunks)


def validate_pipeline(cfg: MegalmConfig) -> None:
    """Pipeline rules: schedule vs vpp, the layer split, micro-batch counts, recompute modes."""
    p, t = cfg.parallel, cfg.trainer
    choice(p.pp_schedule, "parallel.pp_schedule", SCHEDULES)
    if p.vpp > 1 and p.pp == 1:
        raise ConfigError(f"parallel.vpp={p.vpp} needs pipeline parallelism; set parallel.pp>1 or parallel.vpp=1")
    if p.pp_schedule == "interleaved" and p.vpp == 1 and p.pp > 1:
        raise ConfigError("parallel.pp_schedule=interleaved needs parallel.vpp>1 (model chunks per rank)")
    if p.vpp > 1 and p.pp_schedule != "interleaved":
        raise ConfigError(f"parallel.vpp={p.vpp} needs parallel.pp_schedule=interleaved "
                          f"(got {p.pp_schedule}); set it or use parallel.vpp=1")
    if p.pp_schedule == "interleaved" and p.pp > 1 and not p.hdp:  # (HDP pads every pipeline to a multiple of pp)
        if t.tokens_per_step is not None:
            raise ConfigError("trainer.tokens_per_step gives steps different micro-batch counts, which interleaved "
                              "pipelining cannot take; use parallel.pp_schedule=1f1b or zb, trainer.global_batch_size, "
                              "or parallel.hdp=true (which pads every pipeline to a multiple of parallel.pp)")
        micro_batches = t.global_batch_size // (t.micro_batch_size * p.dp)
        if micro_batches % p.pp:
            raise ConfigError(f"interleaved pipelining needs micro-batches per step ({micro_batches} = "
                              f"global_batch_size/(micro_batch_size*dp)) to be a multiple of parallel.pp={p.pp}; "
                              "change the batch sizes")
        split = t.micro_batch_size * p.dp * p.pp
        if uneven := [size for size in ramp_batch_sizes(t.global_batch_size, t.rampup_batch_size) if size % split]:
            raise ConfigError(f"interleaved pipelining needs micro-batches per step to be a multiple of parallel.pp="
                              f"{p.pp}, and trainer.rampup_batch_size={list(t.rampup_batch_size)} takes a global "
                              f"batch of {uneven[0]}; make its start and increment multiples of "
                              f"micro_batch_size*dp*pp={split}")
    if p.layers_per_stage is not None and p.pp * p.vpp == 1:
        raise ConfigError("parallel.layers_per_stage is set but there is one pipeline stage; "
                          "remove it or set parallel.pp")
    stage_layer_counts(cfg)
    recompute_modes(p.recompute, p.pp)
