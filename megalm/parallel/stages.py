"""Which transformer layers each pipeline rank holds, with interleaved virtual stages.

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

from megalm.errors import ConfigError


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
            fix = f"set parallel.layers_per_stage={hint}" if hint else "use fewer stages (parallel.pp*parallel.vpp)"
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
