"""Split backward for zero-bubble pipelines: input gradients now (B), weight gradients later (W).

Qi et al. 2024, "Zero Bubble Pipeline Parallelism", observe that a linear layer y = x Wᵀ has two
backward GEMMs: dx = dy W, which the previous stage is waiting for, and dW = dyᵀ x, which nobody
waits for. ZB schedules run the first in the B action and defer the second to a W action placed in
a pipeline bubble.

How: `defer_weight_grads(model, store)` sets every linear layer's `weight_grad_sink` hook
(megalm/model/linear.py) to `store`. The layer's GEMM then gets its weight *detached* (so autograd
never reaches the weight's AccumulateGrad during B: no gradient, no post-accumulate-grad hook, no DP
bucket counted) and, in backward, hands the store a thunk that computes dW, under the key the runtime
opened for the B being run (`store.collect(key)`). The W action calls `store.apply(key)`: each thunk, and
for each parameter, once its dW is computed, `torch.autograd.backward` on the parameter itself, so the gradients land
through AccumulateGrad exactly as in a normal backward (accumulation over micro-batches, the DP reducer's hooks),
one dW alive at a time (until 2026-12-01 one backward took them all: a stage's weights in bf16 at once).
The thunk runs the layer's own wgrad GEMM, so a precision recipe set on the same layer
(`gemm_recipe`, e.g. fp8 or MXFP4 with its seeds) computes dW at W exactly as it would have in B.

What is deferred: the weight of every model `Linear` and of megalm's Column/RowParallelLinear whose
weight is a leaf parameter, and the stacked expert weights of an MoE layer's grouped GEMMs (`GroupedLinear`, whose
deferred function runs the same two grouped GEMMs as torch's own backward). The router's small GEMM keeps its
gradient in B. Biases, norms and embeddings (cheap, elementwise or gathers) keep their
gradients in B; so do weights that reach the GEMM through another op (GQA kv weights replicated over
TP ranks pass through an all-reduce in backward), which would otherwise need that collective at W.
Layers that do not run through `linear` (Transformer Engine's) keep their weight gradients in B.

With gradient accumulation fusion (`parallel.gradient_accumulation_fusion`) a plain layer's sink is `fused`: it
hands the store dy and x instead of a closure, and the W action runs the GEMM into the parameter's fp32 main gradient
in the DP bucket (megalm/parallel/data_parallel/fused_wgrad.py), with no bf16 dW and no copy into the bucket.

Each layer gets a sink of its own (`LayerSink`, megalm/model/deferred_wgrad.py) that passes its stashes on to the
store: inside a compiled block (`trainer.compile=true`) the closure cannot be traced, and the layer's GEMMs run as
opaque ops that name their sink by a tensor and hand it the same closure when they run.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn

from megalm.model.deferred_wgrad import LayerSink
from megalm.model.linear import linear_modules
from megalm.model.moe import GroupedLinear

log = logging.getLogger("megalm")


class WeightGradStore:
    """Pending weight-gradient GEMMs, grouped by the key of the backward that produced them."""

    accumulates = False  # a layer's sink hands closures (`stash`), unless the layer is fused (`LayerSink.fused`)

    def __init__(self) -> None:
        self.pending: dict[Hashable, list[tuple[nn.Parameter, Callable[[], torch.Tensor] | tuple]]] = {}
        self.key: Hashable | None = None
        # gradient accumulation fusion (megalm/parallel/data_parallel/fused_wgrad.py): its store, which the W action
        # hands the fused layers' operands to (`accumulate(param, dy, x)`: the GEMM into the main gradient)
        self.accumulator: Any = None

    def collect(self, key: Hashable) -> WeightGradStore:
        """Context manager: stashes made inside go under `key` (one micro-batch of one chunk)."""
        if key in self.pending:
            raise RuntimeError(f"weight gradients of {key} are already pending; run W before the next B")
        self.pending[key] = []
        self.key = key
        return self

    def __enter__(self) -> WeightGradStore:
        return self

    def __exit__(self, *exc) -> None:
        self.key = None

    def stash(self, param: nn.Parameter, compute: Callable[[], torch.Tensor]) -> None:
        """Keep `compute` (it returns dW of `param`) for the W of the current key."""
        if self.key is None:
            raise RuntimeError("a deferred linear ran backward outside WeightGradStore.collect(key); "
                               "the runtime must open a key for every B")
        self.pending[self.key].append((param, compute))

    def accumulate(self, param: nn.Parameter, dy: torch.Tensor, x: torch.Tensor) -> None:
        """Keep a fused layer's GEMM operands (dW = dyᵀ x) for the W of the current key, which adds them into the main
        gradient (`accumulator`)."""
        if self.accumulator is None:
            raise RuntimeError("a fused layer's weight gradient reached a zero-bubble store with no accumulator; "
                               "fuse_weight_grads sets it")
        self.stash(param, (dy, x))  # type: ignore[arg-type]

    def apply(self, key: Hashable) -> None:
        """Compute and accumulate the weight gradients stashed under `key` (the W action): fused layers' GEMMs into
        their main gradients, the others' through autograd (AccumulateGrad and its hooks, as a backward would).
        Each parameter's gradient goes in once its last stash under the key is computed, one arrival per parameter:
        one dW is alive at a time, not every deferred dW of the chunk (a stage's whole weights in bf16)."""
        stashes = self.pending.pop(key)
        left = Counter(id(param) for param, _ in stashes)  # a weight used twice in the chunk is stashed twice
        sums: dict[int, torch.Tensor] = {}
        operands: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for param, compute in stashes:
            k = id(param)
            if isinstance(compute, tuple):  # a fused layer's (dy, x)
                operands.setdefault(k, []).append(compute)
            else:
                dw = compute()
                sums[k] = sums[k] + dw if k in sums else dw
            left[k] -= 1
            if left[k]:
                continue
            if k in operands:
                self.accumulator.accumulate_all(param, operands.pop(k))
            if k in sums:
                torch.autograd.backward([param], [sums.pop(k)])

    def clear(self) -> None:
        self.pending.clear()
        self.key = None


def defer_weight_grads(model: nn.Module, store: WeightGradStore) -> int:
    """Send the weight gradients of every linear layer of `model` (an MoE layer's grouped expert GEMMs too) to
    `store`; returns how many layers."""
    layers = linear_modules(model) + [m for m in model.modules() if isinstance(m, GroupedLinear)]
    for module in layers:  # each layer's own sink, which a compiled block's op can name (deferred_wgrad.py)
        module.weight_grad_sink = LayerSink(store, module)
    foreign = sum(type(m).__module__.startswith("transformer_engine") for m in model.modules())
    if foreign:
        log.warning("zero-bubble schedule: %d Transformer Engine linear layers keep their weight gradients in B "
                    "(they do not run through megalm's linear hooks); precision.backend=native defers them too",
                    foreign)
    return len(layers)
