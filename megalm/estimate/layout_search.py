"""`megalm-estimate --search`: the layouts of a model that fit a cluster, ranked by predicted tokens/s.

    megalm-estimate model=70b model.seq_length=8192 trainer.global_batch_size=1024 --world 1024 --gpu h100 --search

Two passes, because one fake-tensor step of a 70B rank takes a minute and a cluster has thousands of layouts:

1. **Enumerate and price by a closed form.** Every layout of tp (a power of two up to a node, dividing the heads,
   and the KV heads or a multiple of them: replicated past them), pp (a power of two dividing the layers), vpp
   (interleaved, 2 chunks a stage), cp (a power of two) as a ring or, where cp divides each TP rank's query and kv
   heads, as Ulysses' all-to-all (`parallel.cp_comm=a2a`; the only CP of a model with a sliding window, which rings
   refuse), dp = world / (tp·pp·cp) (dividing the global batch), ZeRO-1, recompute (none, selective, full),
   activation offload and, with documents of many lengths (`data.varlen=true`), HDP. Sequence parallelism is on
   with tp > 1. The closed form (`closed_form`) prices each: static bytes per parameter of the rank (the recipes'
   2 + 4 + 12, ZeRO-1's shards), Korthikanti et al.'s activations per layer times the factor the estimator measures
   against them (docs/benchmarks.md), the micro-batches in flight, the logits; a roofline step of 6·N·T FLOPs and
   causal attention's at the efficiency the estimator's trace finds, the pipeline's bubble from the runtime's
   schedule simulator, and each dimension's collectives (the CP ring's as ring.ring_sent_bytes counts them,
   Ulysses' four all-to-alls a layer as `ulysses_bytes`).
2. **Confirm the best with the estimator.** In order of the closed form's tokens/s, among the layouts it says fit
   (with a margin: it is a pruning rule, not the answer), the estimator runs the first and the last pipeline stage's
   rank under fake tensors (megalm.estimate.rank). To take seconds rather than minutes, each rank runs twice at a
   depth of one and two layers (vpp and 2·vpp) per stage and the figures are extrapolated to the model's depth:
   every byte, FLOP and collective of a rank is a constant plus a per-layer term, exactly
   (tests/unit/test_estimate_search.py holds the extrapolation to a full-depth run). It runs the micro-batches a
   stage holds in flight (pp; 2·pp interleaved), which set the peak, and scales compute and the per-micro-batch
   collectives to the step's micro-batches. Layouts the estimator finds too big, or the config's rules refuse,
   drop out; the confirmed ones are ranked by the estimator's tokens/s.

Muon (`optim.name=muon`): the closed form prices its states, the rank's even share of its replicas' Newton-Schulz
iterations and what its step sends (megalm/estimate/muon_form.py); the estimator runs a Muon layout once at the
model's depth, since which matrices a rank orthogonalises depends on all of its stage's.

MoE models (`model.moe`): expert parallelism is searched too (every ep dividing dp·cp and the experts). The closed
form counts the routed experts whole on a TP rank and split over ep, ZeRO-1's shards of their gradients and states
over the expert-data-parallel ranks (times tp: sequence parallelism is on), the FLOPs of the active parameters, the
activations of k copies of each token through the experts (`moe_activation_ratio`), and each MoE layer's two
all-to-alls forward and backward. The shallow runs keep the leading dense blocks (`first_k_dense`) in the first
chunk, so every layer past them is an MoE one; `every_n_layers` > 1 is refused.

Not searched: tp beyond a node, hierarchical CP (a2a+p2p), the ZB schedule, FSDP, precision (the command's).
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from megalm.config.checks import is_moe_layer, pad_vocab, window_within_samples
from megalm.config.schema import MegalmConfig
from megalm.estimate import muon_form
from megalm.estimate.collectives import GPUS_PER_NODE, LINKS, comm_seconds, inside_node
from megalm.estimate.rank import (
    HBM_BYTES,
    RankEstimate,
    bubble_factor,
    check_gpu,
    communicators,
    compile_notes,
    estimate_rank,
    fp8_notes,
    gpu_precision,
    override_keys,
    reserve_bytes,
    roles,
    step_seconds,
)
from megalm.measure.op_cost import GPUS
from megalm.model.loss import CHUNK_BYTES
from megalm.parallel.expert import micro_batch_settings
from megalm.parallel.hdp.cost import ModelShape

# The estimator's first-stage peak against Korthikanti et al. (34·s·h/t a layer with SP and flash attention) at
# Llama-3 8B and 70B (docs/benchmarks.md, "The estimator against the closed forms"): 1.07x and 1.03x without
# recompute (GQA and SwiGLU's shapes, the backward's working set), 1.6x with megalm's selective. Full recompute
# keeps the layer input (2·s·h/t) plus one layer's recomputed activations during its backward, a working set the
# estimator measures at 2.2-2.5x 34·s·h/t; 1.25 (the factor before SwiGLU kept silu(gate) no more) is kept for it,
# on the low side, which the estimator's confirmation corrects.
ACTIVATION_FACTOR = {"none": 1.05, "selective": 1.6, "full": 1.25}
# The estimator's roofline runs 8B's step at about half the bf16 peak (222 TFLOP in 0.436 s on an H100: the
# memory-bound elementwise ops); the closed form takes the same share.
ROOFLINE_EFFICIENCY = 0.5
# Tensor parallelism with SP moves about 10 [s, h] tensors of the working dtype a layer and micro-batch, (t - 1) / t
# of each through a rank's link (the estimator's tp bytes at 70B, tp 8, pp 8: the forward's all-gathers and
# reduce-scatters, their mirrors and the re-gathers in the backward), 13 when recompute runs the forward's again.
# The backward's 4 the step leaves in flight beside the GEMMs (its input gradients' reduce-scatters, the
# re-gathers) hide, as the estimator prices them since 2026-12-02 (5.6% more tokens/s at tp 4, 2.7% at tp 2 there;
# 4.7% and 2.3% here): 6 and 9 are exposed.
TP_TRANSFERS = {"none": 6, "selective": 9, "full": 9}
CLOSED_FORM_MARGIN = 1.1  # the closed form may be this optimistic and still be confirmed (0.96-1.27x at 70B)
SEARCH_NOTE = "global batch not given: trainer.global_batch_size = --world sequences of model.seq_length"
REFUSALS_SHOWN = 5  # refused layouts named in the notes; the rest counted


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    vpp: int
    cp: int
    dp: int
    zero1: bool
    recompute: str
    offload: bool
    hdp: bool
    ep: int = 1  # expert parallelism (MoE models)
    cp_comm: str = "ring"  # or "a2a": Ulysses

    def communicators(self, moe: bool) -> int:
        """The NCCL communicators a rank of this layout talks over (rank.communicators): the search turns sequence
        parallelism on with tp > 1, under which an MoE model's routed-expert gradients span the TP ranks."""
        return communicators(self.tp, self.pp, self.cp, self.dp, self.ep, moe and self.tp > 1)

    def overrides(self) -> list[str]:
        """megalm-train's overrides for this layout."""
        out = [f"parallel.tp={self.tp}", f"parallel.pp={self.pp}", f"parallel.cp={self.cp}",
               f"parallel.sequence_parallel={str(self.tp > 1).lower()}", f"parallel.zero1={str(self.zero1).lower()}",
               f"parallel.recompute={self.recompute}"]
        if self.ep > 1:
            out.append(f"parallel.ep={self.ep}")
        if self.cp_comm != "ring":
            out.append(f"parallel.cp_comm={self.cp_comm}")
        if self.vpp > 1:
            out += [f"parallel.vpp={self.vpp}", "parallel.pp_schedule=interleaved"]
        if self.offload:
            out.append("offload.enabled=true")
        if self.hdp:
            out.append("parallel.hdp=true")
        return out


@dataclass(frozen=True)
class Experts:
    """An MoE model's experts, for the closed form: E routed experts of `ffn` units (top-k a token), shared experts
    of `shared_ffn` units in all, in every layer from `first_dense` on."""

    experts: int
    top_k: int
    ffn: int
    shared_ffn: int
    first_dense: int
    hdp: bool = False  # dropless and no switch loss: HDP may pack it (megalm/parallel/expert; searched at ep 1)

    def routed_params(self, hidden: int) -> int:
        return self.experts * 3 * hidden * self.ffn

    def active_mlp_params(self, hidden: int) -> int:  # router, k routed experts, shared experts
        return self.experts * hidden + 3 * hidden * (self.top_k * self.ffn + self.shared_ffn)


@dataclass(frozen=True)
class Reruns:
    """Of the GEMMs whose output only joins the residual, the shares full recompute runs again (`recompute_reruns`):
    the dense blocks' down projections, every block's attention output projection, the MoE blocks' experts' (and
    shared experts') down projections."""

    down: float = 0.0
    output: float = 1.0
    expert_down: float = 1.0


@dataclass(frozen=True)
class Shape:
    """What the closed form needs of the run: the model's shapes (the HDP cost model's `ModelShape`), the batch, the
    cluster."""

    model: ModelShape
    seq: int
    micro_batch: int
    global_batch: int
    world: int
    bf16: bool  # bf16 working weights (2 bytes) and fp32 main weights, or fp32 weights
    varlen: bool
    offload_fraction: float
    vocab_multiple: int  # model.make_vocab_size_divisible_by: the vocabulary is padded to it times tp
    tied: bool  # model.tie_embeddings: one vocabulary matrix, else the embedding's and the output layer's
    experts: Experts | None = None  # MoE models
    reruns: Reruns = Reruns()  # what full recompute runs again (`recompute_reruns`)
    window: int | None = None  # model.sliding_window shorter than the sequence, which rings and HDP refuse
    attention_dropout: float = 0.0  # which rings refuse too, HDP's among them (megalm/parallel/hdp/split.py)
    muon: int = 0  # optim.name=muon: its Newton-Schulz iterations a matrix (optim.muon_ns_steps); 0 under AdamW
    tf32: bool = True  # precision.tf32: fp32 GEMMs (Muon's iterations) on TF32 tensor cores, else at 1/8 of that


def layouts(shape: Shape) -> list[Layout]:
    """Every layout the search prices (see the module docstring); the config's own checks run at confirmation."""
    out = []
    powers = [2**k for k in range(12) if 2**k <= shape.world]
    for tp, pp, cp in itertools.product(powers, powers, powers):
        per_replica = tp * pp * cp
        kv_heads = shape.model.kv_heads  # tp past the kv heads replicates them (megalm/parallel/tensor/apply.py)
        if (tp > GPUS_PER_NODE or shape.model.heads % tp or (kv_heads % tp and tp % kv_heads) or shape.model.layers % pp
                or shape.world % per_replica or shape.seq % ((2 * cp if cp > 1 else 1) * tp)):
            continue
        dp = shape.world // per_replica
        if shape.global_batch % (dp * shape.micro_batch):
            continue
        micro_batches = shape.global_batch // (dp * shape.micro_batch)
        vpps = [1] + ([2] if pp > 1 and shape.model.layers % (2 * pp) == 0 and micro_batches % pp == 0 else [])
        experts = shape.experts
        eps = [ep for ep in powers if (dp * cp) % ep == 0 and experts.experts % ep == 0] if experts else [1]
        hdps = (False, True) if (shape.varlen and dp * cp > 1 and (experts is None or experts.hdp)
                                 and shape.window is None and not shape.attention_dropout) else (False,)
        comms = cp_comms(shape, tp, cp)
        if not comms:
            continue
        for vpp, zero1, recompute, offload, hdp, ep, comm in itertools.product(
                vpps, (False, True) if dp * cp > 1 else (False,), ("none", "selective", "full"), (False, True), hdps,
                eps, comms):
            if hdp and comm != "ring":
                continue  # HDP's rings are its own
            if experts is not None and experts.first_dense > shape.model.layers // (pp * vpp):
                continue  # dense blocks past the first chunk: the shallow runs' extrapolation would not hold
            # HDP runs interleaved pipelines and EP in lockstep (fillers pad every rank to one count), which the
            # closed form does not model (the estimator prices EP's lockstep waits from HDP's cost model)
            if hdp and (vpp > 1 or ep > 1):
                continue
            out.append(Layout(tp, pp, vpp, cp, dp, zero1, recompute, offload, hdp, ep, comm))
    return out


def cp_comms(shape: Shape, tp: int, cp: int) -> list[str]:
    """How context parallelism of `cp` ranks may run at `tp`: a ring (not under a sliding window or attention
    dropout, which rings refuse: parallel/context/attention.py, validate_context) and Ulysses' all-to-all where cp
    divides each TP rank's query and kv heads (kv heads replicated past tp have one a rank: none divides); ["ring"]
    without CP."""
    if cp == 1:
        return ["ring"]
    m = shape.model
    a2a = m.heads // tp % cp == 0 and m.kv_heads >= tp and m.kv_heads // tp % cp == 0
    ring = shape.window is None and not shape.attention_dropout
    return (["ring"] if ring else []) + (["a2a"] if a2a else [])


def why_no_layouts(shape: Shape) -> str:
    """Why `layouts` found none: no data-parallel size the model's shapes allow (tp, pp and cp powers of two that
    divide its heads, layers and sequence) splits the global batch into whole micro-batches. dp = world (no tp, pp
    or cp) is always allowed, so a multiple of world x micro-batch always splits."""
    step = shape.world * shape.micro_batch
    example = math.ceil(shape.global_batch / step) * step
    return (f"no layout of {shape.world} GPUs the search tries (tp, pp and cp powers of two) splits the global "
            f"batch: no data-parallel size they leave (at most {shape.world}) divides {shape.global_batch} sequences "
            f"into micro-batches of {shape.micro_batch}; set trainer.global_batch_size to a multiple of dp x "
            f"{shape.micro_batch}, e.g. {example} (dp {shape.world}), or estimate another layout by name "
            "(parallel.pp=3)")


def stage_parameters(shape: Shape, layout: Layout) -> tuple[int, int]:
    """Parameters on a rank of the first (or last) stage, the fuller of the two: its layers sharded over tp, norms
    replicated, and the embedding's (or output layer's) vocabulary rows over tp; both matrices on the one stage of
    pp = 1, untied. As (all of them, the routed experts' among them: an MoE layer's routed experts are whole on
    every TP rank and split over ep; its router is replicated, its shared experts split over tp)."""
    return fuller_stage(shape, layout).parameters


@dataclass(frozen=True)
class Stage:
    """A rank's share of a pipeline stage, for the closed form: its parameters, the routed experts' and those Muon
    leaves to AdamW among them (the vocabulary matrices, norms and routers), and its dense and MoE blocks."""

    parameters: tuple[int, int]  # (all, routed experts')
    adamw: int
    dense_blocks: int
    moe_blocks: int


def fuller_stage(shape: Shape, layout: Layout) -> Stage:
    """The first or the last stage, whichever holds more parameters on a rank (`stage_parameters`)."""
    return max(end_stages(shape, layout), key=lambda stage: stage.parameters)


def end_stages(shape: Shape, layout: Layout) -> list[Stage]:
    """A rank's share of the first and (with pp > 1) the last stage."""
    m, t, e = shape.model, layout.tp, shape.experts
    vocab_matrices = 2 if layout.pp == 1 and not shape.tied else 1
    layers = m.layers // layout.pp
    # with tp past the kv heads each rank keeps a whole kv head of k and v, not 1/t of them
    replicated_kv = 2 * m.hidden * m.kv_dim * (1 / m.kv_heads - 1 / t) if t > m.kv_heads else 0
    dense = m.layer_params // t + 2 * m.hidden + replicated_kv
    vocab = vocab_matrices * pad_vocab(m.vocab, shape.vocab_multiple * t) * m.hidden // t
    if e is None:
        return [Stage((layers * dense + vocab, 0), vocab + layers * 2 * m.hidden, layers, 0)]
    attention = m.attention_params // t + 2 * m.hidden + replicated_kv
    routed = e.routed_params(m.hidden) // layout.ep
    moe = attention + e.experts * m.hidden + 3 * m.hidden * e.shared_ffn // t + routed
    first = min(e.first_dense, layers)
    stages = [(first, layers - first)] + ([(0, layers)] if layout.pp > 1 else [])  # first, last
    return [Stage((d * dense + n * moe + vocab, n * routed), vocab + (d + n) * 2 * m.hidden + n * e.experts * m.hidden,
                  d, n) for d, n in stages]


def rank_newton_schulz_flops(shape: Shape, layout: Layout, dense_blocks: int, moe_blocks: int) -> float:
    """A rank's share of its stage's iterations a step (`dense_blocks` and `moe_blocks` of them): the blocks' dense
    matrices (q, k, v and o apart; the MLP's or the shared experts') over the dp·cp replicas, each whole on every TP
    rank of its owner; the routed experts of the rank's ep slice, whole on every TP rank, over their
    expert-data-parallel replicas (dp·cp·tp / ep: sequence parallelism is on with tp > 1)."""
    m, e, steps = shape.model, shape.experts, shape.muon
    ns, mlp = muon_form.newton_schulz_flops, muon_form.mlp_flops
    attention = 2 * ns(m.hidden, m.hidden, steps) + 2 * ns(m.kv_dim, m.hidden, steps)
    dense = dense_blocks * (attention + mlp(m.hidden, m.ffn, steps))
    routed = 0.0
    if e is not None and moe_blocks:
        dense += moe_blocks * (attention + (mlp(m.hidden, e.shared_ffn, steps) if e.shared_ffn else 0))
        routed = moe_blocks * e.experts // layout.ep * mlp(m.hidden, e.ffn, steps)
        routed /= layout.dp * layout.cp * layout.tp // layout.ep
    return dense / (layout.dp * layout.cp) + routed


def static_bytes_per_parameter(bf16: bool, zero1: bool, dp: int) -> float:
    """Parameters, gradient buckets, optimizer states and ZeRO-1's gather buffers, per parameter of the rank (the
    closed forms tests/unit/test_estimate.py holds the estimator to)."""
    weight, main = (2, 12) if bf16 else (4, 8)
    if zero1:
        return weight + 4 + 4 / dp + main / dp + weight
    return weight + 4 + main


@functools.cache
def _bubble(pp: int, micro_batches: int, vpp: int) -> float:
    return bubble_factor(pp, micro_batches, "interleaved" if vpp > 1 else "1f1b", vpp)


def closed_form(shape: Shape, layout: Layout, gpu: str) -> tuple[int, float]:
    """(peak bytes of the fullest rank with the estimator's reserve, tokens/s) of a layout, by the closed form.
    Ulysses' activations are priced as the ring's: it keeps about one more [T, h/t] tensor a layer, which the
    estimator's confirmation measures (70B, tp 4, pp 4, cp 2: 64.9 against the ring's 63.0 GiB, inside the margin)."""
    t, pp, cp, dp, m, e = layout.tp, layout.pp, layout.cp, layout.dp, shape.model, shape.experts
    stage = fuller_stage(shape, layout)
    n, routed = stage.parameters
    # the routed experts' gradients and ZeRO-1 states shard over their expert-data-parallel ranks, which span TP
    # under sequence parallelism (on with tp > 1 here)
    expert_dp = dp * cp // layout.ep * t
    if shape.muon:
        static = muon_form.static_bytes(shape.bf16, layout.zero1, dp * cp, n - routed - stage.adamw, stage.adamw) + \
            muon_form.static_bytes(shape.bf16, layout.zero1, expert_dp, routed, 0)
    else:
        static = static_bytes_per_parameter(shape.bf16, layout.zero1, dp * cp) * (n - routed) + \
            static_bytes_per_parameter(shape.bf16, layout.zero1, expert_dp) * routed
    tokens = shape.seq * shape.micro_batch / cp  # a micro-batch's tokens on this rank
    layer = 34 * tokens * m.hidden / t * ACTIVATION_FACTOR[layout.recompute] * moe_activation_ratio(shape)
    micro_batches = shape.global_batch // (dp * shape.micro_batch)
    in_flight = min(pp, micro_batches) * (1 + (pp - 1) / (pp * layout.vpp) if layout.vpp > 1 else 1)
    kept = 2 * tokens * m.hidden / t if layout.recompute == "full" else layer
    if layout.offload:
        kept *= 1 - shape.offload_fraction
    activations = m.layers // pp * in_flight * kept + (layer if layout.recompute == "full" else 0)
    # the last stage's bf16 logits (the loss writes their gradient over them) and the one fp32 chunk the loss holds
    # at a time (megalm.model.loss)
    logits = 2 * tokens * m.vocab / t + min(CHUNK_BYTES, 4 * tokens * m.vocab / t)
    peak = static + activations + (logits if pp == 1 else 0)
    peak = max(peak, static + logits)  # the last stage: logits, fewer micro-batches in flight
    reserve = reserve_bytes(int(peak), layout.communicators(e is not None))
    compute = last_stage_flops(shape, layout) / (GPUS[gpu].bf16_tflops * 1e12 * ROOFLINE_EFFICIENCY)
    collective = link_bytes(shape, layout)
    step = compute * _bubble(pp, micro_batches, layout.vpp) + comm_seconds(collective, LINKS[gpu],
                                                                           inside_node(t, cp, layout.ep, layout.dp,
                                                                                       pp))
    if shape.muon:  # once a step, after the last stage's micro-batches (whose FLOPs set `compute`): its fp32 GEMMs
        last = end_stages(shape, layout)[-1]  # on TF32 tensor cores (or at 1/8 of them)
        fp32_peak = GPUS[gpu].tf32_tflops * 1e12 / (1 if shape.tf32 else 8)
        step += rank_newton_schulz_flops(shape, layout, last.dense_blocks, last.moe_blocks) / (
            fp32_peak * ROOFLINE_EFFICIENCY)
    return int(peak + reserve), shape.global_batch * shape.seq / step


def last_stage_flops(shape: Shape, layout: Layout) -> float:
    """A last-stage rank's FLOPs in a step, 6·N·T: its layers', with causal attention's 6·h·s a token and layer (QK^T
    and PV over s/2 keys on average, forward and backward; documents of the whole sequence: an upper bound under
    data.varlen), and the output layer's, which sets the pipeline's pace (until 2026-12-05 the FLOPs were the layers'
    spread evenly over the stages, and a deep pipeline of a large vocabulary looked as fast as a shallow one).

    Full recompute runs a block's forward again, 2·N·T, but the GEMMs whose outputs the backward does not need
    (`recompute_reruns`): priced as a whole forward, 4/3, until 2026-12-05, 6% high against the estimator's trace in
    eager, 8% compiled."""
    m, t, e, again = shape.model, layout.tp, shape.experts, shape.reruns
    per_token = m.hidden * shape.seq  # causal attention's share of 6·N per token and layer
    if e is not None and layout.pp > 1:  # the leading dense blocks are the first stage's: the last runs MoE blocks
        active = m.attention_params + e.active_mlp_params(m.hidden)
        dense = 0.0
    else:
        active = m.layer_params if e is None else active_layer_params(shape)
        dense = (m.layers if e is None else min(e.first_dense, m.layers)) / m.layers  # the blocks' share
    # what full recompute does not run again, a mean layer's share
    skipped = m.hidden * (m.ffn * dense * (1 - again.down) + m.hidden * (1 - again.output))
    if e is not None:
        skipped += m.hidden * (e.top_k * e.ffn + e.shared_ffn) * (1 - dense) * (1 - again.expert_down)
    layers = m.layers / layout.pp * (3 * (active + per_token) + (active + per_token - skipped) * (
        layout.recompute == "full"))
    head = 3 * pad_vocab(m.vocab, shape.vocab_multiple * t) * m.hidden
    return 2 * (layers + head) * shape.global_batch * shape.seq / (layout.dp * layout.cp * t)


def link_bytes(shape: Shape, layout: Layout) -> dict[str, float]:
    """What a rank's step sends over each mesh dimension's links, by the closed form (the estimator's
    `collective_bytes`, which tests/unit/test_estimate_search.py holds it to)."""
    t, pp, cp, dp, m, e = layout.tp, layout.pp, layout.cp, layout.dp, shape.model, shape.experts
    stage = fuller_stage(shape, layout)
    n, routed = stage.parameters
    tokens = shape.seq * shape.micro_batch / cp  # a micro-batch's tokens on this rank
    micro_batches = shape.global_batch // (dp * shape.micro_batch)
    per_micro_batch = m.layers // pp * tokens * m.hidden * 2
    # link bytes: a ring all-reduce of the fp32 gradients sends 2 x 4 of every (n - 1) / n (the estimator counts as
    # much: collectives.link_share); ZeRO-1 a reduce-scatter of them (4) and an all-gather of the bf16 weights (2);
    # Muon's ZeRO-1 all-reduces them whole (megalm/estimate/muon_form.py)
    zero1_buckets = layout.zero1 and not shape.muon
    per_parameter = (6 if zero1_buckets else 8) * share(dp * cp)
    # the ring passes the rank's K and V: 1/t of the kv heads, or a whole one where tp past them replicates them
    kv = tokens * 2 * m.hidden // m.heads * max(m.kv_heads, t) / t
    # and with tp past the kv heads, every micro-batch's backward all-reduces the k and v weights' gradients over TP
    # in the working dtype (tensor.comm.sum_grad_over_sharers): 2 x the whole k and v of every layer
    replicated_kv = m.layers // pp * 2 * 2 * m.hidden * m.kv_dim * (2 if shape.bf16 else 4) if t > m.kv_heads else 0
    collective = {
        "tp": (TP_TRANSFERS[layout.recompute] * per_micro_batch + replicated_kv) * micro_batches * share(t),
        "cp": m.layers // pp * micro_batches * (
            ulysses_bytes(tokens, m.hidden // m.heads, (m.heads + m.kv_heads) // t, cp, shape.bf16, layout.recompute)
            if layout.cp_comm == "a2a" else ring_bytes(kv, cp, shape.bf16, layout.recompute == "full"))
        if cp > 1 else 0,
        "pp": pipeline_sends(layout.vpp) * tokens * m.hidden * 2 / t * micro_batches if pp > 1 else 0,
        "dp": per_parameter * (n - routed)}
    if shape.muon:
        matrices = n - routed - stage.adamw  # Muon's, of the rank's dense parameters
        collective["dp"] += muon_form.replica_bytes(shape.bf16, layout.zero1, dp * cp, matrices, n - routed)
        collective["tp"] += muon_form.gather_bytes(t, dp * cp, matrices)
    if e is not None:  # each MoE layer's two all-to-alls of k copies of the rank's tokens, forward and backward
        moe_layers = m.layers // pp if pp > 1 else m.layers - e.first_dense  # the fuller of the first and last
        replays = 2 if layout.recompute == "none" else 3  # selective recompute runs them again too
        collective["ep"] = 2 * replays * moe_layers * e.top_k * tokens / t * m.hidden * 2 * (layout.ep - 1) \
            / layout.ep * micro_batches
        expert_dp = dp * cp // layout.ep * t
        collective["expert_dp"] = (6 if zero1_buckets else 8) * share(expert_dp) * routed
        if shape.muon:  # the routed experts are whole on a TP rank: no gather
            collective["expert_dp"] += muon_form.replica_bytes(shape.bf16, layout.zero1, expert_dp, routed, routed)
    return collective


def pipeline_sends(vpp: int) -> int:
    """The sends of a micro-batch's activations or gradients the first or last stage makes (its receives pass beside
    them on a full-duplex link): one each way at each chunk boundary it holds, but the pipeline's own end. A middle
    stage sends one more; the search's confirmation runs the first and last stages, which this prices, as it does."""
    return 2 * vpp - 1


def share(ranks: int) -> float:
    """(n - 1) / n: of a collective's buffer, what each of its n ranks sends (0 for a group of one)."""
    return (ranks - 1) / ranks


def ring_bytes(kv: float, cp: int, bf16: bool, recomputed: bool) -> float:
    """What one layer's ring attention sends from a rank holding `kv` K and V elements (ring.ring_sent_bytes): the
    forward's K/V over cp - 1 hops, again in the backward (and in full recompute's forward), and dK/dV in fp32 over
    cp hops."""
    width = 2 if bf16 else 4
    return kv * ((2 + recomputed) * (cp - 1) * width + cp * 4)


def ulysses_bytes(tokens: float, head_dim: int, heads: int, cp: int, bf16: bool, recompute: str) -> float:
    """What one layer's Ulysses attention sends from a rank of `tokens` tokens and `heads` query plus kv heads
    (its TP rank's): all-to-alls of q, k, v to whole sequences of 1/cp of the heads and of the output back,
    (cp - 1) / cp of each, in the working dtype; the backward's four mirror them, and either recompute runs the
    forward's again (megalm's selective keeps no all-to-all's output)."""
    replays = 2 if recompute == "none" else 3
    return replays * share(cp) * tokens * head_dim * 2 * heads * (2 if bf16 else 4)


def active_layer_params(shape: Shape) -> float:
    """An MoE model's mean active parameters per layer: attention, and the dense MLP or the router with k routed
    and the shared experts."""
    m, e = shape.model, shape.experts
    moe = m.layers - min(e.first_dense, m.layers)
    dense_mlp = 3 * m.hidden * m.ffn
    return m.attention_params + (moe * e.active_mlp_params(m.hidden) + (m.layers - moe) * dense_mlp) / m.layers


def moe_activation_ratio(shape: Shape) -> float:
    """An MoE layer's saved activations over a dense SwiGLU layer's, from Korthikanti et al.'s breakdown per token
    (attention and norms 15·h bytes, the MLP's input, output and mask 3·h, its GEMM outputs and activation 6·ffn)
    with the MoE MLP's k copies of each token's input and output (4·h each) and its experts' 6·ffn_expert: 1 for a
    dense model."""
    m, e = shape.model, shape.experts
    if e is None:
        return 1.0
    dense = 18 * m.hidden + 6 * m.ffn
    return (18 * m.hidden + e.top_k * (4 * m.hidden + 6 * e.ffn) + 6 * e.shared_ffn) / dense


# ------------------------------------------------------------------------------------------ the estimator, shallow

EXTRAPOLATED = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "comm_bytes", "host_bytes",
                "flops", "compute_s", "optimizer_s", "hidden_comm_s", "optimizer_flops")
PER_STEP_DIMS = ("dp", "dp_cp", "embedding", "expert_dp")  # collectives once a step: gradients, tied embeddings


def shallow_rank(base: list[str], layout: Layout, shape: Shape, stage: int, role: str, gpu: str) -> RankEstimate:
    """The estimator's rank of `stage`, run at one and two units of vpp layers per stage, extrapolated to the model's
    depth, with the micro-batches in flight that set the peak, scaled to the step's (see the module docstring).
    Under Muon, run once at the model's depth: which matrices a rank orthogonalises (and under ZeRO-1 which states
    it keeps) depends on all of its stage's (megalm/estimate/muon_form.py), so a shallow stage's do not grow by
    layer."""
    # a unit of layers per stage holds an MoE model's leading dense blocks and one MoE block in its first chunk, so
    # that every layer past the shallow run's is an MoE one (and the shallow model has experts)
    dense = shape.experts.first_dense if shape.experts else 0
    unit = layout.vpp * (dense + 1)
    micro_batches = shape.global_batch // (layout.dp * shape.micro_batch)
    run_micro = micro_batches if layout.hdp else min(micro_batches, layout.pp * (2 if layout.vpp > 1 else 1))
    batch = [f"trainer.micro_batch_size={shape.micro_batch}",
             f"trainer.global_batch_size={run_micro * layout.dp * shape.micro_batch}"]
    no_tp = [] if layout.tp > 1 else ["parallel.async_tp=false"]  # a command's async TP: nothing to fuse at tp 1
    if shape.muon:
        unit = shape.model.layers // layout.pp
    runs = [estimate_rank([*base, *layout.overrides(), *no_tp, *batch, f"model.num_layers={layout.pp * d}"],
                          shape.world, stage, role, gpu) for d in ((unit,) if shape.muon else (unit, 2 * unit))]
    shallow, deep = runs[0], runs[-1]
    depth = (shape.model.layers // layout.pp - unit) / unit  # the model's depth, in units past the shallow run's

    def grow(a: float, b: float) -> float:
        return a + (b - a) * depth

    values = {k: grow(getattr(shallow, k), getattr(deep, k)) for k in EXTRAPOLATED}
    scale = micro_batches / run_micro
    peak = int(grow(shallow.peak_bytes - shallow.reserve_bytes, deep.peak_bytes - deep.reserve_bytes))
    def per_micro_batch(r: RankEstimate, dim: str) -> int:  # the clip's and the optimizer step's run once a step
        return r.collective_bytes.get(dim, 0) - r.step_collective_bytes.get(dim, 0)

    collective = {dim: int(grow(per_micro_batch(shallow, dim), per_micro_batch(deep, dim))
                           * (1 if dim in PER_STEP_DIMS else scale)
                           + grow(shallow.step_collective_bytes.get(dim, 0), deep.step_collective_bytes.get(dim, 0)))
                  for dim in deep.collective_bytes}
    reserve = reserve_bytes(peak, layout.communicators(shape.experts is not None))
    hidden = values["hidden_comm_s"] * scale  # TP's collectives in flight: per micro-batch, as compute
    return replace(deep, **{k: int(v) for k, v in values.items() if k.endswith("_bytes")}, peak_bytes=peak + reserve,
                   reserve_bytes=reserve, flops=(values["flops"] - values["optimizer_flops"]) * scale
                   + values["optimizer_flops"], optimizer_s=values["optimizer_s"],
                   compute_s=(values["compute_s"] - values["optimizer_s"]) * scale + values["optimizer_s"],
                   collective_bytes=collective, domain=None, hidden_comm_s=hidden,
                   comm_s=comm_seconds(collective, LINKS[gpu], inside_node(layout.tp, layout.cp, layout.ep, layout.dp,
                                                                           layout.pp)) - hidden)


# ------------------------------------------------------------------------------------------------------ the search

STRIPPED = {"parallel.tp", "parallel.pp", "parallel.vpp", "parallel.cp", "parallel.dp", "parallel.pp_schedule",
            "parallel.sequence_parallel", "parallel.zero1", "parallel.recompute", "parallel.hdp",
            "parallel.layers_per_stage", "parallel.ep", "parallel.cp_comm", "offload.enabled",
            "trainer.micro_batch_size", "trainer.global_batch_size",
            "model.num_layers"}  # set per layout by the search; the others are kept


def search_shape(overrides: list[str], world: int, gpu: str | None = None) -> tuple[Shape, list[str], list[str]]:
    """The closed form's view of the run, the overrides every layout shares, and the notes on defaults taken (and,
    with `gpu`, on how its FP8 GEMMs are traced)."""
    from megalm.config.checks import resolve_model_defaults
    from megalm.config.compose import compose_config
    from megalm.errors import ConfigError

    cfg = compose_config(overrides)
    m, t = resolve_model_defaults(cfg.model), cfg.trainer
    # settings the closed form does not price, each confirmed layout ran anyway: FSDP's shards (18 bytes a parameter
    # pruned every layout: "none fits"), a token budget's batch (the tokens/s 22x off), Ulysses' fixed groups
    for key, value, why in (("parallel.fsdp", cfg.parallel.fsdp, "its closed form prices ZeRO-1 and plain DP states"),
                            ("trainer.tokens_per_step", t.tokens_per_step, "it searches a global batch of sequences"),
                            ("parallel.cp_comm", cfg.parallel.cp_comm == "a2a+p2p" and "a2a+p2p",
                             "it searches ring and Ulysses CP")):
        if value:
            raise ConfigError(f"--search does not price {key}={value if value is not True else 'true'} ({why}); "
                              f"estimate a layout with it by name (without --search), or search without it")
    experts = None
    if m.moe.num_experts:
        moe = m.moe
        if moe.every_n_layers > 1:
            raise ConfigError(f"--search prices MoE models whose blocks from model.moe.first_k_dense on all have "
                              f"experts; model.moe.every_n_layers={moe.every_n_layers}: estimate a layout by name "
                              "(without --search)")
        experts = Experts(moe.num_experts, moe.top_k, moe.expert_ffn_hidden_size,
                          moe.shared_ffn_hidden_size if moe.num_shared_experts else 0, moe.first_k_dense,
                          hdp=not micro_batch_settings(moe))
    keys = override_keys(overrides)
    notes = [] if "trainer.global_batch_size" in keys else [SEARCH_NOTE]
    notes += (fp8_notes(cfg.precision, gpu) if gpu else []) + compile_notes(cfg)
    micro = t.micro_batch_size if "trainer.micro_batch_size" in keys else 1
    model = ModelShape(layers=m.num_layers, hidden=m.hidden_size, heads=m.num_heads, kv_heads=m.num_kv_heads,
                       ffn=m.ffn_hidden_size, vocab=m.vocab_size)
    shape = Shape(model, m.seq_length, micro,
                  t.global_batch_size if "trainer.global_batch_size" in keys else world, world,
                  str(cfg.precision.name) != "fp32", bool(cfg.data.varlen), float(cfg.offload.fraction),
                  int(m.make_vocab_size_divisible_by), bool(m.tie_embeddings), experts, recompute_reruns(cfg),
                  window_within_samples(m), float(m.attention_dropout),
                  int(cfg.optim.muon_ns_steps) if str(cfg.optim.name) == "muon" else 0, bool(cfg.precision.tf32))
    base = [o for o in overrides if not override_keys([o]) & STRIPPED]
    return shape, base, notes


def recompute_reruns(cfg: MegalmConfig) -> Reruns:
    """What full recompute runs again of the GEMMs whose output only joins the residual: a block's attention output
    and down projections.

    Eager, torch's non-reentrant checkpoint stops the recomputed forward at the last tensor the backward saved, and
    an aten GEMM saves its inputs before it runs: a dense block's down projection is not run again, unless a dropout
    then masks its output or it runs as a custom autograd Function (a GEMM recipe's linear, or
    parallel.gradient_accumulation_fusion's), which saves after its GEMM; the output projection is (the MLP's norm
    reads the residual it joins), and so are an MoE block's experts (their outputs are weighted by the router's
    probabilities). Compiled (`trainer.compile` on AOT's backends), AOT's partitioner saves the residual instead and
    runs neither projection again, but a recipe's linear that runs as one opaque op (`compiles_in_sight` false).
    Measured against the estimator's trace (tests/unit/test_estimate_search.py)."""
    import fnmatch

    from megalm.precision import WHOLE_MODEL, compiles_in_sight, skipped_layers
    from megalm.precision.install import expand_layer_patterns

    # AOT autograd's partitioner (inductor, aot_eager); dynamo's eager backend runs the checkpoint as eager does
    m, compiled = cfg.model, bool(cfg.trainer.compile) and str(cfg.trainer.compile_backend) != "eager"
    recipe = str(cfg.precision.name) not in (*WHOLE_MODEL, "auto")
    skip = expand_layer_patterns([str(p) for p in skipped_layers(cfg.precision)], m.num_layers - 1)

    def share(blocks: list[int], layer: str) -> float:  # of `blocks`, those whose `layer` runs the recipe
        ran = [i for i in blocks if not any(fnmatch.fnmatchcase(f"layers.{i}.{layer}", p) for p in skip)]
        return len(ran) / len(blocks) if recipe and blocks else 0.0

    dense = [i for i in range(m.num_layers) if not is_moe_layer(m, i)]  # the blocks with a down projection of their own
    if compiled:
        opaque = not compiles_in_sight(cfg.precision)
        return Reruns(down=share(dense, "mlp.down_proj") if opaque else 0.0,
                      output=share(list(range(m.num_layers)), "attention.o_proj") if opaque else 0.0, expert_down=0.0)
    if m.dropout or cfg.parallel.gradient_accumulation_fusion:
        return Reruns(down=1.0)
    return Reruns(down=share(dense, "mlp.down_proj"))


# what the search prices a key of STRIPPED at where a layout's overrides leave it unset: a command that set one gets it
# back at this value beside the layout, or the command plus the layout trained another layout than the one priced
PRICED_DEFAULTS = {"parallel.vpp": "1", "parallel.pp_schedule": "1f1b", "parallel.hdp": "false", "parallel.ep": "1",
                   "parallel.layers_per_stage": "null", "parallel.dp": "null", "offload.enabled": "false",
                   "parallel.cp_comm": "ring"}


def priced_layout(overrides: list[str], layout: Layout) -> list[str]:
    """`layout`'s overrides as the search priced them for the command `overrides`: the command's layout keys the
    search set aside back at their defaults where the layout does not set them, and a command's async TP off at tp 1
    (nothing to fuse)."""
    own = layout.overrides()
    given, set_here = override_keys(overrides), override_keys(own)
    resets = [f"{key}={value}" for key, value in PRICED_DEFAULTS.items() if key in given and key not in set_here]
    return own + resets + (["parallel.async_tp=false"] if layout.tp == 1 and "parallel.async_tp" in given else [])


def priced_batch(overrides: list[str], shape: Shape) -> list[str]:
    """The batch settings the search priced and the command left to megalm-train's defaults (6 sequences a
    micro-batch, for the tiny CPU model): a layout's overrides carry them, or the command plus the layout trained
    another batch than the one priced, and was often refused (a global batch that micro-batches x dp do not
    divide)."""
    given = override_keys(overrides)
    return [f"{key}={value}" for key, value in (("trainer.micro_batch_size", shape.micro_batch),
                                                ("trainer.global_batch_size", shape.global_batch))
            if key not in given]


def search(overrides: list[str], world: int, gpu: str, top: int = 5, max_confirm: int = 8,
           memory_bytes: int | None = None, budget_s: float = 90.0) -> dict[str, Any]:
    """Layouts that fit `world` GPUs of `gpu` (of `memory_bytes` each, by default the GPU's), best predicted tokens/s
    first (see the module docstring). The estimator confirms at most `max_confirm` layouts and starts none after
    `budget_s` seconds."""
    from megalm.errors import ConfigError
    from megalm.training.flops import training_flops

    check_gpu(gpu)
    start = time.perf_counter()
    memory = memory_bytes or HBM_BYTES[gpu]
    shape, base, notes = search_shape(gpu_precision(overrides), world, gpu)
    batch = priced_batch(overrides, shape)
    if "trainer.micro_batch_size" not in override_keys(overrides):
        notes.append(f"micro-batch size not given: the search prices {shape.micro_batch} sequence(s) a micro-batch, "
                     "and each layout's overrides set it")
    candidates = layouts(shape)
    priced = [(layout, *closed_form(shape, layout, gpu)) for layout in candidates]
    hopeful = sorted((c for c in priced if c[1] <= memory * CLOSED_FORM_MARGIN), key=lambda c: -c[2])
    model_flops = None
    found, refused, tried = [], [], 0
    for layout, closed_peak, closed_rate in hopeful:
        if len(found) >= top or tried >= max_confirm or time.perf_counter() - start > budget_s:
            break
        stages = [(role, stage) for role, stage in roles(layout.pp) if role != "middle stage"]
        try:
            ranks = [shallow_rank(base, layout, shape, stage, role, gpu) for role, stage in stages]
        except ConfigError as error:  # the config's rules refuse it before any trace: not one of the tries
            refused.append(f"{' '.join(layout.overrides())}: {error}")
            continue
        tried += 1
        micro_batches = shape.global_batch // (layout.dp * shape.micro_batch)
        step = max(step_seconds(r, _bubble(layout.pp, micro_batches, layout.vpp)) for r in ranks)
        peak = max(r.peak_bytes for r in ranks)
        if peak > memory:
            continue
        if model_flops is None:
            from megalm.config.checks import resolve_model_defaults
            from megalm.config.compose import compose_config

            model = resolve_model_defaults(compose_config(overrides).model)  # the command's depth
            # the shallow run's documents, as many as the step's sequences (rank.step_documents)
            first = ranks[0]
            model_flops = training_flops(model, first.documents) * shape.global_batch / first.sequences
        found.append({"overrides": priced_layout(overrides, layout) + batch, "layout": asdict(layout),
                      "peak_bytes": peak,
                      "tokens_per_s": shape.global_batch * shape.seq / step, "step_time_s": step,
                      "mfu": model_flops / (world * GPUS[gpu].bf16_tflops * 1e12 * step),
                      "closed_form": {"peak_bytes": closed_peak, "tokens_per_s": closed_rate},
                      "ranks": [{"role": r.role, "rank": r.rank, "peak_bytes": r.peak_bytes} for r in ranks]})
    found.sort(key=lambda f: -f["tokens_per_s"])
    notes += [f"refused by the config's rules: {reason}" for reason in refused[:REFUSALS_SHOWN]]
    if len(refused) > REFUSALS_SHOWN:
        notes.append(f"... and {len(refused) - REFUSALS_SHOWN} more layouts the config's rules refused")
    return {"world": world, "gpu": gpu, "hbm_bytes": memory, "global_batch": shape.global_batch,
            "micro_batch": shape.micro_batch, "why_none": why_no_layouts(shape) if not candidates else None,
            "candidates": len(candidates), "fit_closed_form": len(hopeful), "confirmed": tried, "layouts": found,
            "seconds": time.perf_counter() - start, "notes": notes}


def search_table(result: dict[str, Any]) -> str:
    """The search's answer as a Markdown table."""
    gib = 2**30
    lines = [f"{result['candidates']} layouts on {result['world']} x {GPUS[result['gpu']].name} "
             f"({result['hbm_bytes'] / gib:.0f} GiB), global batch {result['global_batch']}: "
             f"{result['fit_closed_form']} fit by the closed form, {result['confirmed']} run by the estimator, "
             f"{result['seconds']:.0f} s",
             "| # | layout | peak GiB | tokens/s | MFU | closed form: peak GiB, tokens/s |", "| --- " * 6 + "|"]
    for i, f in enumerate(result["layouts"], 1):
        c = f["closed_form"]
        lines.append(f"| {i} | {' '.join(f['overrides'])} | {f['peak_bytes'] / gib:.1f} | {f['tokens_per_s']:,.0f} | "
                     f"{f['mfu']:.1%} | {c['peak_bytes'] / gib:.1f}, {c['tokens_per_s']:,.0f} |")
    return "\n".join(lines)
