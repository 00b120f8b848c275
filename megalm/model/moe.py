"""Mixture-of-experts feed-forward layers: a token-choice top-k router over SwiGLU experts run as grouped GEMMs.

    scores = softmax(x W_rᵀ)              (Switch, Mixtral, Qwen3-MoE)  or  sigmoid(x W_rᵀ)   (DeepSeek-V3)
    chosen = top-k(scores + b)            b: the aux-loss-free balancing bias (0 unless it is on), selection only
    w      = scores[chosen]               normalised to sum 1 over the k if `norm_topk_prob`, x routed_scaling_factor
    y      = Σ_j w_j · expert_{chosen_j}(x) + shared_experts(x)

The router runs in fp32 whatever the compute dtype. Tokens are sorted by expert (a stable sort: within an expert,
token order, so the permutation is the same under every layout), the experts run as two grouped GEMMs over the
sorted rows (`torch._grouped_mm`), and each token's k outputs are gathered back and summed with their weights.
Dropless by default; with `capacity_factor` an expert takes at most ceil(cf · T · k / E) of a micro-batch's T
tokens and the rest of its assignments are dropped (their weight is lost, the residual carries the token), counted
in the layer's stats: the last in token order, or with `drop_policy=probs` those of the lowest routing weight
(Megatron's default; ties in token order).

Balancing losses, each a sum over tokens (as the LM loss is, megalm/model/loss.py) so that the step divides it by
the global batch's loss-token count once (the LM loss's normaliser N) and every split of the batch gives the same
gradient. The routed tokens T exceed N by one a document (a document's last token has no label), so each weighs
T/N of Megatron's per-micro-batch mean: 1.024 on the demo's documents, more for short ones:

    switch   T · E · Σ_e f_e · P̄_e              f_e = tokens routed to e / (T·k), P̄_e = mean score of e
                                                 (Fedus et al. 2021, eq. 4; Megatron's aux_loss)
    seq      Σ_docs T_d · E · Σ_e f_de · P̄_de    the same per document (DeepSeek-V3 §2.1.2, eq. 17-20)
    z        Σ_t logsumexp(logits_t)²           router z-loss (Zoph et al. 2022, ST-MoE eq. 5)

(sigmoid scores are normalised over the experts for P̄, as DeepSeek-V3 does). They reach the gradient through
`AuxLossScaler` (Megatron's MoEAuxLossAutoScaler): the layer's output carries the loss into the backward, where it
gets the gradient the step's loss gets (1 / its token count, `set_aux_loss_scale`), so a pipeline stage that is not
the last adds its layers' losses too. Aux-loss-free balancing (DeepSeek-V3 §2.1.2; Wang et al. 2024) moves the
per-expert bias b outside the gradient after each step: b_e += rate · sign(mean load - load_e), from the step's
counts over the whole batch (megalm/training/expert_load.py).

Each expert's weights are stacked: `experts.gate_up_proj.weight` [E, 2f, h] (rows [gate; up], as mlp.gate_up_proj)
and `experts.down_proj.weight` [E, h, f], so expert parallelism shards dim 0 from outside, and swaps the layer's
`dispatcher` (how the assignments reach their experts and come back) for an all-to-all one
(megalm/parallel/expert): the layer itself has no collective. `expert_loop` computes
the same experts one at a time: the tests' oracle (`torch._grouped_mm` runs on CPU too, from torch 2.9 on).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from megalm.config import ModelConfig
from megalm.model.deferred_wgrad import deferred_grouped_linear
from megalm.model.linear import WeightGradSink, deferrable
from megalm.model.mlp import SwiGLUMLP, swiglu
from megalm.model.naming import canonical_named_modules

# ------------------------------------------------------------------------------------------ grouped GEMMs


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: `torch._grouped_mm`'s backward rejects a gradient with
    stride 0 (what `.sum()` hands back)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class _DeferredGroupedLinear(torch.autograd.Function):
    """The grouped GEMM whose weight gradient goes to a zero-bubble pipeline's W action (`sink`, as a `Linear`'s
    does: megalm/model/linear.py): the input gradient in B, dW = per group dyᵀ x later. `weight` comes detached and
    the parameter in `param`, so that B never reaches its AccumulateGrad. Both GEMMs are the ones torch's own
    backward of `torch._grouped_mm` runs, so the gradients equal the undeferred layer's."""

    @staticmethod
    def forward(ctx, x, weight, offsets, sink, param):
        ctx.save_for_backward(x, weight, offsets)
        ctx.sink, ctx.param = sink, param
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)

    @staticmethod
    def backward(ctx, dy):
        x, weight, offsets = ctx.saved_tensors
        dy = dy.contiguous()  # `.sum()` hands back a gradient of stride 0
        param = ctx.param[0]
        ctx.sink.stash(param, lambda: torch._grouped_mm(x.t(), dy, offs=offsets).transpose(-2, -1).to(param.dtype))
        return torch._grouped_mm(dy, weight, offs=offsets), None, None, None, None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor,
                   sink: WeightGradSink | None = None) -> torch.Tensor:
    """x [N, in] sorted by group, weight [G, out, in], counts [G] rows per group -> [N, out]: each group's rows times
    its weightᵀ, as one grouped GEMM (in the autocast dtype under autocast, as F.linear). With a `sink` (a
    zero-bubble pipeline) the weight's gradient is handed to it instead of computed in the backward."""
    device = x.device.type
    defer = sink is not None and deferrable(weight, x)
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    x = x if dtype is None else x.to(dtype)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    if defer and torch.compiler.is_compiling() and hasattr(sink, "handle"):  # the ops read the weight, not the graph
        return deferred_grouped_linear(x, weight, offsets, sink)
    param, weight = weight, weight.detach() if defer else weight
    weight = weight if dtype is None else weight.to(dtype)
    if defer:
        return _DeferredGroupedLinear.apply(x, weight, offsets, sink, [param])
    return _ContiguousGrad.apply(torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets))


def expert_loop(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`grouped_linear` one group at a time (the tests' oracle; reads the counts on the host)."""
    pieces = x.split(counts.tolist())
    return torch.cat([piece @ w.t() for piece, w in zip(pieces, weight, strict=True)])


def per_expert(experts: torch.Tensor, values: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Sum of `values` per chosen expert id ([E], `values`' dtype): bincount with a shape known ahead (fake tensors,
    as the estimator runs the step, cannot give bincount one)."""
    flat = values.reshape(-1)
    return flat.new_zeros(num_experts).scatter_add_(0, experts.reshape(-1), flat)


class GroupedLinear(nn.Module):
    """G linear maps without bias, weight [G, out, in]; forward(x sorted by group, rows per group).
    `weight_grad_sink`: set from outside by a zero-bubble pipeline (megalm/parallel/pipeline/weight_grad.py)."""

    weight_grad_sink: WeightGradSink | None = None

    def __init__(self, groups: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(groups, out_features, in_features))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return grouped_linear(x, self.weight, counts, self.weight_grad_sink)


class GroupedExperts(nn.Module):
    """E SwiGLU experts: down(silu(gate) * up) of each expert's rows, two grouped GEMMs for all of them.
    Expert parallelism keeps a slice of the experts (dim 0 of both weights; their shard specs say which)."""

    def __init__(self, num_experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_up_proj = GroupedLinear(num_experts, hidden, 2 * ffn)
        self.down_proj = GroupedLinear(num_experts, ffn, hidden)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_up_proj(x, counts)), counts)


# ------------------------------------------------------------------------------------------ the router


@dataclass
class Routing:
    """One micro-batch's routing: `experts` [T, k] chosen ids, `weights` [T, k] fp32 combine weights (0 where
    dropped), `kept` [T, k] bool (False for padding tokens too), `counts` [E] assignments each expert kept (float),
    `dropped` the real tokens' assignments dropped (a scalar), `aux` the weighted balancing losses' token-sum (a
    scalar with gradient) and `stats` its detached parts for the logs."""

    experts: torch.Tensor
    weights: torch.Tensor
    kept: torch.Tensor
    counts: torch.Tensor
    dropped: torch.Tensor
    aux: torch.Tensor
    stats: torch.Tensor


class TokenShard(Protocol):
    """The micro-batch's tokens as this rank holds them, for what the router computes over the whole micro-batch
    (capacity queues, the switch and sequence losses' routed counts). Without one the rank holds the whole
    micro-batch (`WholeTokens`); context parallelism gives a shard of it (megalm/parallel/context/tokens.py).

    `real` bool [T]: not padding. `local_index` int64 [T]: each local token's place in the whole micro-batch (its
    token order, padding included), `whole_tokens` the whole's length. `gather(t)`: [T, ...] -> [whole_tokens, ...]
    every rank's rows in the whole's order (detached values of a numeric dtype, NCCL gathers no bool; a collective
    under CP). `local_docs` / `whole_docs`:
    each token's document (the same numbering on every rank), `num_docs`."""

    real: torch.Tensor | None
    local_index: torch.Tensor
    whole_tokens: int
    num_docs: int
    local_docs: torch.Tensor
    whole_docs: torch.Tensor

    def gather(self, t: torch.Tensor) -> torch.Tensor: ...


class WholeTokens:
    """A rank holding the whole micro-batch: every `TokenShard` reading is the identity. `real`: which tokens are
    not padding (None: all are)."""

    def __init__(self, cu_seqlens: torch.Tensor, tokens: int, real: torch.Tensor | None = None) -> None:
        self.cu_seqlens, self.whole_tokens, self.num_docs = cu_seqlens, tokens, cu_seqlens.numel() - 1
        self.real = real

    # computed where the router reads them (a capacity or a balancing loss that counts routed tokens), each time:
    # cached on a view that all layers share, they would be one compiled block's input and another's output (two
    # graphs, and a graph break under recomputation); a compiled graph computes each once anyway
    @property
    def local_index(self) -> torch.Tensor:
        return torch.arange(self.whole_tokens, device=self.cu_seqlens.device)

    @property
    def local_docs(self) -> torch.Tensor:
        return torch.searchsorted(self.cu_seqlens[1:].to(torch.int64), self.local_index, right=True)

    @property
    def whole_docs(self) -> torch.Tensor:
        return self.local_docs

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        return t


class Router(nn.Module):
    """Token-choice top-k gate: `weight` [E, h] (fp32 math), and `expert_bias` [E], the aux-loss-free bias (a
    buffer, moved outside the gradient; it only changes which experts are chosen)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.score, self.norm_topk_prob, self.scaling = moe.router_score, moe.norm_topk_prob, moe.routed_scaling_factor
        self.capacity_factor, self.drop_by_weight = moe.capacity_factor, moe.drop_policy == "probs"
        self.coeffs = (moe.aux_loss_coeff, moe.seq_aux_loss_coeff, moe.z_loss_coeff)
        self.weight = nn.Parameter(torch.empty(moe.num_experts, cfg.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(moe.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, tokens: TokenShard) -> Routing:
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float())  # [T, E] fp32
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        choice = scores.detach() + self.expert_bias  # the bias is 0 unless aux-loss-free balancing moved it
        experts = choice.topk(self.top_k, dim=-1).indices  # [T, k]
        weights = scores.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * self.scaling
        # the whole micro-batch's choices (and real tokens), gathered once: for the capacity queues and the switch
        # and sequence losses' counts (none of it when all are off, as by default)
        whole = None
        if self.capacity_factor is not None or self.coeffs[0] or self.coeffs[1]:
            whole = self._whole_choices(experts, tokens)
        kept = self._capacity_mask(experts, tokens, whole, weights)
        weights = weights * kept
        counts = per_expert(experts, kept.float(), self.num_experts)
        real = experts.numel() if tokens.real is None else tokens.real.sum() * self.top_k
        aux, stats = self._balancing_losses(logits, scores, tokens, whole)
        return Routing(experts, weights, kept, counts, real - counts.sum(), aux, stats)

    def _whole_choices(self, experts: torch.Tensor, tokens: TokenShard) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The whole micro-batch's chosen experts [T_whole, k] and real tokens [T_whole] (None: all real), in its
        token order: one gather (a collective under CP) of both."""
        if tokens.real is None:
            return tokens.gather(experts), None
        both = tokens.gather(torch.cat([experts, tokens.real.unsqueeze(-1).to(experts.dtype)], dim=-1))
        return both[:, :self.top_k], both[:, self.top_k].bool()

    def _capacity_mask(self, experts: torch.Tensor, tokens: TokenShard,
                       whole: tuple[torch.Tensor, torch.Tensor | None] | None, weights: torch.Tensor) -> torch.Tensor:
        """True for the assignments of real tokens that fit their expert's capacity: ceil(cf · T · k / E) of the
        whole micro-batch's T real tokens, first come in its token order (the same queue under every layout), or
        under `drop_policy=probs` first by routing weight, highest first (`weights` [T, k], gathered whole)."""
        real = tokens.real
        if self.capacity_factor is None:
            return torch.ones_like(experts, dtype=torch.bool) if real is None else real.unsqueeze(-1).expand_as(
                experts)
        whole_experts, whole_real = whole
        queue = whole_experts.reshape(-1)  # [T_whole * k]: each assignment's expert, in token order
        if real is None:
            # cf * (T·k) / E in doubles, as the masked path computes it on the device: grouped as cf·T·k / E the
            # rounding differed at k = 3 (cf 1.1, T 240, E 8: 99 or 100), and layouts kept other tokens
            capacity = math.ceil(self.capacity_factor * (tokens.whole_tokens * self.top_k) / self.num_experts)
            real_assignments = None
        else:  # padding takes no place in a queue: its assignments queue at a last, unused "expert"
            real_assignments = whole_real.repeat_interleave(self.top_k)
            queue = torch.where(real_assignments, queue, self.num_experts)
            capacity = torch.ceil(self.capacity_factor * real_assignments.sum().double() / self.num_experts)
        if self.drop_by_weight:  # the queues in order of weight, ties in token order (a stable sort)
            by_weight = torch.argsort(tokens.gather(weights.detach()).reshape(-1), descending=True, stable=True)
            positions = torch.empty_like(by_weight)
            positions[by_weight] = _queue_positions(queue[by_weight], self.num_experts + 1)
        else:
            positions = _queue_positions(queue, self.num_experts + 1)
        kept = positions < capacity
        if real_assignments is not None:
            kept = kept & real_assignments
        return kept.view(-1, self.top_k)[tokens.local_index]

    def _balancing_losses(self, logits: torch.Tensor, scores: torch.Tensor, tokens: TokenShard,
                          whole: tuple[torch.Tensor, torch.Tensor | None] | None,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """The coefficient-weighted sum of the three balancing losses (token-sums, module docstring), and the
        three unweighted, detached. Over a shard of the micro-batch (CP), each is this rank's part of the whole's:
        the routed counts f are the whole's (gathered, constants), the scores P this rank's, and the parts sum to
        the whole's loss, whose gradient each rank's scores get."""
        switch_c, seq_c, z_c = self.coeffs
        E, k = self.num_experts, self.top_k
        real = None if tokens.real is None else tokens.real.to(logits.dtype).unsqueeze(-1)
        switch = seq = z = logits.new_zeros(())
        if switch_c or seq_c:  # both weigh each expert's routed tokens by its mean score (none of it when both are off)
            probs = scores if self.score == "softmax" else scores / (scores.sum(-1, keepdim=True) + 1e-20)
            whole_experts, whole_real = whole
            routed = F.one_hot(whole_experts, E).sum(1).to(logits.dtype)  # [T_whole, E]: chosen (pre-drop)
            if real is not None:
                probs = probs * real
                whole_real = whole_real.to(logits.dtype)
                routed = routed * whole_real.unsqueeze(-1)
        if switch_c:
            count = max(tokens.whole_tokens, 1) if whole_real is None else whole_real.sum().clamp(min=1)
            switch = E / k * (routed.sum(0) * probs.sum(0)).sum() / count
        if seq_c:
            docs = tokens.num_docs
            per_doc_routed = logits.new_zeros(docs, E).index_add_(0, tokens.whole_docs, routed)
            per_doc_probs = logits.new_zeros(docs, E).index_add(0, tokens.local_docs, probs)
            ones = logits.new_ones(routed.shape[0]) if whole_real is None else whole_real
            # one slot more than the documents: inductor's C++ kernels cannot scatter-add into a tensor of one element
            # (torch 2.9 to 2.13: a micro-batch of one document, compiled on a CPU)
            doc_tokens = logits.new_zeros(docs + 1).index_add_(0, tokens.whole_docs, ones)[:docs]
            doc_tokens = doc_tokens.clamp(min=1).unsqueeze(-1)
            seq = (E / k * per_doc_routed * per_doc_probs / doc_tokens).sum()
        if z_c:
            lse = torch.logsumexp(logits, dim=-1).square()
            z = (lse if real is None else lse * real.squeeze(-1)).sum()
        aux = switch_c * switch + seq_c * seq + z_c * z
        return aux, torch.stack([switch, seq, z]).detach()


def _queue_positions(queue: torch.Tensor, num_queues: int) -> torch.Tensor:
    """Each entry's place in its queue, counted in `queue`'s order: entry i of value e is preceded by positions[i]
    entries of value e. A stable sort groups the queues and keeps their order, in O(n) memory where a one-hot's
    running count held three [n, E] int64 tensors at once (E = 256, T·k = 64K: a peak of 403 MB against 2.6 MB,
    counted by megalm/measure/storage.py's live storages)."""
    order = torch.argsort(queue, stable=True)
    counts = torch.zeros(num_queues, dtype=torch.long, device=queue.device).index_add_(
        0, queue, torch.ones_like(queue, dtype=torch.long))
    starts = counts.cumsum(0) - counts  # where each queue begins in the sorted order
    positions = torch.empty_like(order)
    positions[order] = torch.arange(queue.numel(), device=queue.device) - starts[queue[order]]
    return positions


# ------------------------------------------------------------------------------------------ the layer


class TokenDispatcher(Protocol):
    """dispatcher(x [T, h], routing, experts) -> [T*k, h]: the output of each of the micro-batch's T*k assignments'
    expert, in assignment (token) order; a dropped assignment's row is multiplied by its weight 0."""

    def __call__(self, x: torch.Tensor, routing: Routing, experts: GroupedExperts) -> torch.Tensor: ...


class LocalDispatcher:
    """Every expert on this rank: the assignments sorted by expert (stable: token order within one, the same under
    every layout), one grouped GEMM pair, scattered back. Dropped assignments run too: the rows per expert stay
    known without reading the drops on the host."""

    def __call__(self, x: torch.Tensor, routing: Routing, experts: GroupedExperts) -> torch.Tensor:
        flat = routing.experts.reshape(-1)  # [T*k] assignments in token order
        top_k = routing.experts.shape[-1]
        order = torch.argsort(flat, stable=True)  # by expert, then token order: layout-independent
        y_sorted = experts(x[order // top_k], per_expert(flat, torch.ones_like(flat), routing.counts.numel()))
        return y_sorted.new_zeros(flat.numel(), x.shape[-1]).index_copy(0, order, y_sorted)


class AuxLossScaler(torch.autograd.Function):
    """forward(output, aux, scale) = output; backward gives `aux` the gradient the step's loss sum gets, `scale`
    (Megatron's MoEAuxLossAutoScaler), so the balancing losses train the router wherever the layer runs (any pipeline
    stage). The scale is a tensor input of the forward (the layer's `aux_loss_scale` buffer), not a number read in the
    backward: a compiled block traces its backward ahead, and takes the buffer's value at run time."""

    @staticmethod
    def forward(ctx, output, aux, scale):
        ctx.aux_shape = aux.shape
        ctx.save_for_backward(scale)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        (scale,) = ctx.saved_tensors
        return grad, scale.to(torch.float32).reshape(ctx.aux_shape), None


@torch.no_grad()
def set_aux_loss_scale(model: nn.Module, scale: float | torch.Tensor) -> None:
    """Give every MoE layer of `model` the factor the step applies to its summed loss (1 / the batch's loss tokens):
    the balancing losses get it too. Runners set it before their forward passes; 1 (each layer's start) adds them to
    the loss sum as they are. In place, on the layers' device: a fill kernel for a number, no host-to-device copy, and
    the same buffer every step, so that compiled blocks take its value without recompiling."""
    for module in model.modules():
        if isinstance(module, MoE):
            if isinstance(scale, torch.Tensor):
                module.aux_loss_scale.copy_(scale)
            else:
                module.aux_loss_scale.fill_(scale)


@torch.library.custom_op("megalm::moe_record_routing", mutates_args=("stats",))
def record_routing(stats: torch.Tensor, routed: torch.Tensor) -> None:
    """stats += routed, in a training forward only: not in a recomputation inside the backward (counted once).
    An op of its own so that a compiled block neither breaks its graph on the check (dynamo cannot trace
    `_current_graph_task_id`) nor bakes in the answer of its trace: the op asks at run time."""
    if torch._C._current_graph_task_id() == -1:
        stats += routed.to(stats.dtype)


@record_routing.register_fake
def _(stats: torch.Tensor, routed: torch.Tensor) -> None:
    return None


class MoE(nn.Module):
    """The MoE feed-forward block (module docstring). `stats` accumulates, over a step's micro-batches and without a
    host sync, the assignments each expert kept, the dropped ones and the three balancing losses' token-sums
    (megalm/training/expert_load.py reads and clears it)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.router = Router(cfg)
        self.experts = GroupedExperts(moe.num_experts, cfg.hidden_size, moe.expert_ffn_hidden_size)
        self.shared_experts = None
        if moe.num_shared_experts:
            self.shared_experts = SwiGLUMLP(cfg, ffn_hidden_size=moe.shared_ffn_hidden_size)
        self.register_buffer("stats", torch.zeros(moe.num_experts + 4, dtype=torch.float64), persistent=False)
        self.register_buffer("aux_loss_scale", torch.ones((), dtype=torch.float32), persistent=False)  # set per step
        # how tokens reach the experts: all on this rank; expert parallelism swaps in an all-to-all (megalm/parallel)
        self.dispatcher: TokenDispatcher = LocalDispatcher()

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, tokens: TokenShard | None = None) -> torch.Tensor:
        """x [T, h]; `tokens`: how this rank's T tokens sit in the micro-batch (None: they are all of it)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        routing = self.router(x, tokens or WholeTokens(cu_seqlens, x.shape[0]))
        y = self.dispatcher(x, routing, self.experts)  # [T*k, h]: each assignment's expert output, token order
        out = (y.view(-1, self.top_k, shape[-1]).float() * routing.weights.unsqueeze(-1)).sum(1).to(y.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        # a training forward, not an evaluation (whose loads would reach the next step's logs and bias update); the
        # op skips a recomputation inside the backward
        if self.training:
            record_routing(self.stats, torch.cat([routing.counts, routing.dropped.reshape(1), routing.stats]).detach())
        return AuxLossScaler.apply(out, routing.aux, self.aux_loss_scale).reshape(*shape[:-1], out.shape[-1])

    def reset_buffers(self) -> None:
        """Zero the stats and the router's bias, and the loss scale to 1 (after `to_empty`: init_weights sets
        parameters only)."""
        self.stats.zero_()
        self.router.expert_bias.zero_()
        self.aux_loss_scale.fill_(1.0)


def moe_modules(model: nn.Module) -> dict[int, MoE]:
    """This rank's MoE blocks by global layer id (`model` a GPT or a pipeline rank's chunks)."""
    return {int(name.split(".")[1]): m for name, m in canonical_named_modules(model) if isinstance(m, MoE)}
