"""Split backward for zero-bubble pipelines: input gradients now (B), weight gradients later (W).

Qi et al. 2024, "Zero Bubble Pipeline Parallelism", observe that a linear layer y = x Wᵀ has two
backward GEMMs: dx = dy W, which the previous stage is waiting for, and dW = dyᵀ x, which nobody
waits for. ZB schedules run the first in the B action and defer the second to a W action placed in
a pipeline bubble.

How: `defer_weight_grads(model, store)` routes every linear layer's GEMM through
`_DeferredWeightGradLinear`. It is given the weight *detached* (so autograd never reaches the
weight's AccumulateGrad during B: no gradient, no post-accumulate-grad hook, no DP bucket counted)
plus the real parameter as a plain argument. Its backward returns dx and stashes (parameter, x, dy)
in `store` under the key the runtime set for the B being run (`store.collect(key)`). The W action
calls `store.apply(key)`: dW = dyᵀ x for each stash, then one `torch.autograd.backward` on the
parameters themselves, so the gradients land through AccumulateGrad exactly as in a normal backward
(accumulation over micro-batches, the DP reducer's hooks).

What is deferred: the weight of every nn.Linear and of megalm's Column/RowParallelLinear whose weight
is a leaf parameter. Biases, norms and embeddings (cheap, elementwise or gathers) keep their
gradients in B; so do weights that reach the GEMM through another op (GQA kv weights replicated over
TP ranks pass through an all-reduce in backward), which would otherwise need that collective at W.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable

import torch
import torch.nn.functional as F
from torch import nn

from megalm.parallel.tensor import ColumnParallelLinear, RowParallelLinear


class WeightGradStore:
    """Pending weight-gradient GEMMs, grouped by the key of the backward that produced them."""

    def __init__(self) -> None:
        self.pending: dict[Hashable, list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]]] = {}
        self.key: Hashable | None = None

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

    def stash(self, param: nn.Parameter, x: torch.Tensor, grad_out: torch.Tensor) -> None:
        if self.key is None:
            raise RuntimeError("a deferred linear ran backward outside WeightGradStore.collect(key); "
                               "the runtime must open a key for every B")
        self.pending[self.key].append((param, x, grad_out))

    def apply(self, key: Hashable) -> None:
        """Compute and accumulate the weight gradients stashed under `key` (the W action)."""
        stashes = self.pending.pop(key)
        if not stashes:
            return
        grads: dict[int, torch.Tensor] = {}
        params: dict[int, nn.Parameter] = {}
        for param, x, grad_out in stashes:
            dw = grad_out.reshape(-1, grad_out.shape[-1]).t().mm(x.reshape(-1, x.shape[-1])).to(param.dtype)
            grads[id(param)] = grads[id(param)] + dw if id(param) in grads else dw
            params[id(param)] = param
        torch.autograd.backward([params[k] for k in grads], [grads[k] for k in grads])

    def clear(self) -> None:
        self.pending.clear()
        self.key = None


class _DeferredWeightGradLinear(torch.autograd.Function):
    """y = x Wᵀ with dx in backward and dW handed to the store (W is passed detached)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, param: list[nn.Parameter], store: WeightGradStore):
        # `param` comes wrapped in a list: a tensor argument would become an autograd input, and
        # returning None for it still "accumulates" (fires the hooks with no gradient) during B.
        ctx.save_for_backward(x, weight)
        ctx.param, ctx.store = param[0], store
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        ctx.store.stash(ctx.param, x, grad_out)
        grad_x = grad_out.matmul(weight.to(grad_out.dtype)) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None


def deferred_linear(store: WeightGradStore, x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear whose weight gradient waits in `store` (leaf weights only; see the module docstring)."""
    if not (isinstance(weight, nn.Parameter) and weight.requires_grad and torch.is_grad_enabled()):
        return F.linear(x, weight, bias)
    # Under autocast F.linear would cast x and W to the compute dtype; do the same explicitly.
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, w = x.to(dtype), weight.detach().to(dtype)
    else:
        w = weight.detach()
    with torch.autocast(x.device.type, enabled=False):
        y = _DeferredWeightGradLinear.apply(x, w, [weight], store)
    return y if bias is None else y + bias.to(y.dtype)


def _plain_linear_forward(module: nn.Linear, store: WeightGradStore, x: torch.Tensor) -> torch.Tensor:
    return deferred_linear(store, x, module.weight, module.bias)


def defer_weight_grads(model: nn.Module, store: WeightGradStore) -> int:
    """Route every linear GEMM of `model` through `store`; returns how many layers were rerouted."""
    count = 0
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.linear_fn = functools.partial(deferred_linear, store)
        elif isinstance(module, nn.Linear):
            module.forward = functools.partial(_plain_linear_forward, module, store)
        else:
            continue
        count += 1
    return count
