"""A zero-bubble layer's weight gradient deferred from inside a compiled block.

In eager, a layer whose weight gradient a zero-bubble pipeline defers (megalm/parallel/pipeline/weight_grad.py) hands
its sink a Python closure in the backward (megalm/model/linear.py's `_Linear`). A compiled block's backward is a graph:
dynamo cannot trace the closure, and whatever it traced would run at trace time only. So inside a compiled block the
layer's backward calls one custom op, `megalm::deferred_dgrad`, which dynamo and inductor treat as an extern call and
which runs in eager each time: it computes the input gradient (the graph uses it, so no pass removes the op) and hands
the layer's sink the weight-gradient GEMM as a closure over dy and x, as the eager layer does. The sink is named to the
op by a CPU tensor (`LayerSink.handle`, megalm/model/handles.py), and its layer gives the parameter the W action
accumulates into.

The closure keeps dy and x past the graph's end. A graph that reused their memory for a later value (inductor's
buffer reuse and in-place kernels) would change them under it: blocks holding such layers are compiled without
either (megalm/training/compile.py's `inductor_options`).

A sink that accumulates (gradient accumulation fusion, megalm/parallel/data_parallel/fused_wgrad.py) gets dy and x
while the op runs, and its GEMM runs then: nothing outlives the graph, unless the sink defers them to a zero-bubble
W action (fused there too), which keeps them as the closure would.

The GEMMs are the eager layer's: `dy W` and `dyᵀ x` in dy's dtype (PLAIN_GEMMS), or the two grouped GEMMs of
torch's own `torch._grouped_mm` backward for an MoE layer's experts, so compiled and eager ZB give equal gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megalm.compat import as_function_output
from megalm.model.handles import handle_of, object_of


class LayerSink:
    """One layer's weight-gradient sink: passes `stash(param, compute)` on to `sink` (the pipeline's store), and
    names itself to the compiled path's op by `handle`; `module` holds the parameter (read when the op runs, so a
    parameter replaced since is the one that gets the gradient)."""

    def __init__(self, sink: Any, module: nn.Module) -> None:
        self.sink, self.module = sink, module
        self.handle = handle_of(self)
        self.fused = False  # a zero-bubble layer whose W action adds into the main gradient (gradient accumulation
        # fusion): it hands the store the GEMM's operands, for later, not a closure

    @property
    def accumulates(self) -> bool:
        """Whether the store takes the plain GEMM's operands (`accumulate`: gradient accumulation fusion,
        megalm/parallel/data_parallel/fused_wgrad.py, now or at a zero-bubble W action) rather than a closure
        (`stash`)."""
        return self.fused or getattr(self.sink, "accumulates", False)

    @property
    def defers(self) -> bool:
        """Whether what the layer hands over runs after its backward (a zero-bubble W action): its dy and x must
        outlive a compiled block's graph."""
        return not getattr(self.sink, "accumulates", False)

    def stash(self, param: nn.Parameter, compute: Callable[[], torch.Tensor]) -> None:
        self.sink.stash(param, compute)

    def accumulate(self, param: nn.Parameter, dy: torch.Tensor, x: torch.Tensor) -> None:
        """dWᵀ's operands dy [T, out] and x [T, in] (x in dy's dtype), for the store to multiply into the main
        gradient: now, or at the zero-bubble W action (a `fused` sink)."""
        self.sink.accumulate(param, dy, x)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "handle"}

    def __setstate__(self, state: dict) -> None:  # a copy (deepcopy) is a layer of its own: its own handle
        self.__dict__.update(state)
        self.handle = handle_of(self)


def _weight(layer: torch.Tensor, dtype: torch.dtype) -> tuple[LayerSink, torch.Tensor]:
    """The sink `layer` names, and its layer's weight (detached: B never reaches the parameter) in `dtype`."""
    sink = object_of(layer, "weight-gradient sink")
    return sink, sink.module.weight.detach().to(dtype)


@torch.library.custom_op("megalm::deferred_fprop", mutates_args=())
def _fprop(x: torch.Tensor, offsets: torch.Tensor | None, layer: torch.Tensor, out_features: int) -> torch.Tensor:
    """y = x Wᵀ in x's dtype of the layer `layer` names (x [T, in], weight [out, in]), or its grouped GEMM (weight
    [G, out, in], `offsets` the groups' ends)."""
    _, weight = _weight(layer, x.dtype)
    with torch.autocast(x.device.type, enabled=False):
        if offsets is None:
            return F.linear(x, weight)
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)


@_fprop.register_fake
def _(x, offsets, layer, out_features):
    return x.new_empty((x.shape[0], out_features))


@torch.library.custom_op("megalm::deferred_dgrad", mutates_args=())
def _dgrad_and_defer(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor | None, layer: torch.Tensor
                     ) -> torch.Tensor:
    """dx = dy W in dy's dtype; dW's GEMM (dyᵀ x) goes to the sink `layer` names, for the W action."""
    sink, weight = _weight(layer, dy.dtype)
    param = sink.module.weight
    with torch.autocast(dy.device.type, enabled=False):
        if offsets is None:
            if sink.accumulates:
                sink.accumulate(param, dy, x.to(dy.dtype))
            else:
                sink.stash(param, lambda: dy.t().matmul(x.to(dy.dtype)).to(param.dtype))
            return dy.matmul(weight)
        dy = dy.contiguous()  # `.sum()` hands back a gradient of stride 0, which `torch._grouped_mm` rejects
        sink.stash(param, lambda: torch._grouped_mm(x.t(), dy, offs=offsets).transpose(-2, -1).to(param.dtype))
        return torch._grouped_mm(dy, weight, offs=offsets)


@_dgrad_and_defer.register_fake
def _(dy, x, offsets, layer):
    return dy.new_empty(x.shape)


class _DeferredLinear(torch.autograd.Function):
    """linear.py's `_Linear` with PLAIN_GEMMS and a sink, as a compiled graph can hold it: the input gathered under
    sequence parallelism (the shard saved, gathered again in the backward), y = x Wᵀ (+ b in the compute dtype) from
    the op, and in the backward dx and the deferral from the other op. The weight is no input of the graph: a
    parameter that were one would have its post-accumulate-grad hooks called in B, with no gradient (the DP
    reducer's count of arrivals with them)."""

    @staticmethod
    def forward(ctx, x, bias, layer, input_comm, out_dtype, dtype, out_features):  # noqa: ANN001, ANN205
        whole = x if input_comm is None else input_comm.gather(x)
        with torch.autocast(x.device.type, enabled=False):
            y = _fprop(whole.reshape(-1, whole.shape[-1]).to(dtype), None, layer, out_features)
            if bias is not None:
                y = y + bias.to(y.dtype)
        ctx.save_for_backward(x, layer)
        ctx.input_comm, ctx.input_shape, ctx.input_dtype = input_comm, whole.shape, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return as_function_output(y.reshape(*whole.shape[:-1], y.shape[-1]).to(out_dtype))

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        x, layer = ctx.saved_tensors
        comm = ctx.input_comm
        whole = x if comm is None else comm.gather(x)
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = _dgrad_and_defer(dy2, whole.reshape(-1, whole.shape[-1]), None, layer)
        dx = dx.reshape(ctx.input_shape).to(ctx.input_dtype)
        dx = dx if comm is None else comm.start_scatter(dx).wait()  # a compiled graph schedules it
        db = None if ctx.bias_dtype is None else dy2.float().sum(dim=0).to(ctx.bias_dtype)
        return dx, db, None, None, None, None, None


def deferred_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sink: LayerSink,
                    input_comm: Any, out_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """linear.py's `linear` with its weight gradient deferred to `sink`, inside a compiled block: x [..., in] ->
    [..., out] in `out_dtype`, the GEMMs in `dtype` (`weight`, the layer's, gives the shape only)."""
    return _DeferredLinear.apply(x, bias, sink.handle, input_comm, out_dtype, dtype, weight.shape[0])


class _DeferredGroupedLinear(torch.autograd.Function):
    """moe.py's deferred grouped GEMM as a compiled graph can hold it: both GEMMs in the ops, as `_DeferredLinear`."""

    @staticmethod
    def forward(ctx, x, offsets, layer, out_features):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x, offsets, layer)
        return _fprop(x, offsets, layer, out_features)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        x, offsets, layer = ctx.saved_tensors
        return _dgrad_and_defer(dy, x, offsets, layer), None, None, None


def deferred_grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, sink: LayerSink
                            ) -> torch.Tensor:
    """moe.py's `grouped_linear` with its weight gradient deferred to `sink`, inside a compiled block (x in the
    compute dtype; `weight`, the layer's, gives the shape only)."""
    return _DeferredGroupedLinear.apply(x, offsets, sink.handle, weight.shape[1])
