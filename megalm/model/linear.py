"""The linear layer's GEMMs, with two hooks that transforms set from outside the model.

A linear layer y = x Wᵀ + b runs three GEMMs: fprop (y), dgrad (dx = dy W) and wgrad (dW = dyᵀ x).
Two features change them, and must compose:

- a precision recipe (megalm/precision/recipes.py, run by megalm/precision/linear.py) changes how each GEMM
  rounds its operands (`gemm_recipe`: an object with `start`, `fprop`, `dgrad` and `wgrad`);
- a zero-bubble pipeline (megalm/parallel/pipeline/weight_grad.py) changes *when* wgrad runs: dx in
  the B action, dW later in W (`weight_grad_sink`: an object with `stash(param, compute_dw)`); gradient
  accumulation fusion (megalm/parallel/data_parallel/fused_wgrad.py) changes *where* it writes: into the fp32 main
  gradient, through a sink that `accumulates`.

Both are attributes of the layer (`LinearHooks`), read by one function, `linear`, which runs the
recipe's three GEMMs and hands wgrad to the sink instead of running it. So ZB + fp8/MX is simply
both attributes set; neither replaces the other's `forward`. With neither set, `linear` is `F.linear`. Inside a
compiled block a deferred layer runs its GEMMs as opaque ops instead (megalm/model/deferred_wgrad.py), since dynamo
cannot trace the sink's closure.

A third argument serves tensor parallelism (megalm/parallel/tensor/layers.py): `input_comm`, the input's
collectives, which the caller passes (the model itself has none). Under sequence parallelism the layer takes this
rank's shard of the tokens, gathers the whole input for its GEMMs, and keeps only the shard for the backward,
gathering it again there (Megatron's sequence-parallel linear: 1/tp of the input held between forward and backward,
for one more all-gather); the input gradient leaves through the conjugate reduce-scatter. Under plain TP the input
is whole and its gradient is all-reduced. In the eager backward these collectives run in flight beside the GEMMs,
as Megatron's `LinearWithGradAccumulationAndAsyncCommunication` runs them: the re-gather beside dgrad's GEMM, the
input gradient's reduction beside wgrad's. Compiled blocks run them synchronously (inductor does not reorder them
by default).

`Linear` is the model's nn.Linear with these hooks; megalm's tensor-parallel layers inherit
`LinearHooks` too and call `linear` on their local shard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from megalm.compat import as_function_output
from megalm.model.deferred_wgrad import deferred_linear


class GemmRecipe(Protocol):
    """How a layer's three GEMMs compute (2-D operands). Each GEMM is asked for the dtype the layer needs (the
    output's, the input gradient's, the weight gradient's) so that it can write it directly; a recipe may return
    another dtype (the compute dtype), which the layer then casts.

    `start(x)` is called once per forward and returns the call's state (random seeds, cached scales),
    which the backward's GEMMs receive too, whenever they run."""

    def start(self, x: torch.Tensor) -> Any: ...

    def fprop(self, call: Any, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor: ...

    def dgrad(self, call: Any, dy: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor: ...

    def wgrad(self, call: Any, dy: torch.Tensor, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor: ...


class PackedInputRecipe(GemmRecipe, Protocol):
    """A recipe whose wgrad can read a form of the input other than x itself (an FP8 copy its fprop cast), which the
    layer then saves for the backward instead of x. `pack_input(call)` returns it, or None to keep x;
    `unpack_input(call, packed)` hands it back in the backward, and wgrad is then called with it; `finish(call)`
    once the call's GEMMs have all run: what they shared in the call is let go."""

    def pack_input(self, call: Any) -> torch.Tensor | None: ...

    def unpack_input(self, call: Any, packed: torch.Tensor) -> None: ...

    def finish(self, call: Any) -> None: ...


class WeightGradSink(Protocol):
    """Takes a layer's weight gradient as a thunk to run later (ZB's W action); one that `accumulates` takes the
    plain GEMM's operands instead and multiplies them into the parameter's main gradient, now or at the W action
    (gradient accumulation fusion, megalm/parallel/data_parallel/fused_wgrad.py)."""

    accumulates: bool

    def stash(self, param: nn.Parameter, compute: Callable[[], torch.Tensor]) -> None: ...

    def accumulate(self, param: nn.Parameter, dy: torch.Tensor, x: torch.Tensor) -> None: ...


class PendingCollective(Protocol):
    """A collective in flight: `wait()` gives its result."""

    def wait(self) -> torch.Tensor: ...


class InputCollectives(Protocol):
    """The input's collectives of a tensor-parallel linear: `gather` the layer's input -> the whole input its GEMMs
    see (forward; `start_gather` again in the backward, unless the recipe keeps its own form of the whole input),
    `start_scatter` the whole input's gradient -> the input's (summed over the ranks; it may reuse the tensor it is
    given). `shards_input`: whether the input is a shard of the tokens (SP), so that the layer keeps the shard."""

    shards_input: bool

    def gather(self, x: torch.Tensor) -> torch.Tensor: ...

    def start_gather(self, x: torch.Tensor) -> PendingCollective: ...

    def start_scatter(self, dx: torch.Tensor) -> PendingCollective: ...


class PlainGemms:
    """The GEMMs of F.linear in the compute dtype (autocast's, else the input's): what a layer runs
    when only its weight gradient is deferred."""

    def start(self, x: torch.Tensor) -> torch.dtype:
        device = x.device.type
        return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype

    def fprop(self, dtype: torch.dtype, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype
              ) -> torch.Tensor:
        return F.linear(x.to(dtype), weight.to(dtype))

    def dgrad(self, dtype: torch.dtype, dy: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype
              ) -> torch.Tensor:
        return dy.matmul(weight.to(dy.dtype))

    def wgrad(self, dtype: torch.dtype, dy: torch.Tensor, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return dy.t().matmul(x.to(dy.dtype))


PLAIN_GEMMS = PlainGemms()


class LinearHooks:
    """The two hooks of a linear layer (class attributes: None = unset, for every instance)."""

    gemm_recipe: GemmRecipe | None = None
    weight_grad_sink: WeightGradSink | None = None


class Linear(LinearHooks, nn.Linear):
    """nn.Linear whose GEMMs run through `linear` (same parameters, names and init)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.gemm_recipe, self.weight_grad_sink)


def deferrable(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """Only a leaf parameter's gradient can wait for W: a weight that reaches the GEMM through another op
    (kv rows shared over TP ranks pass an all-reduce in backward) keeps its gradient in B. So does the weight of a
    layer inside a compiled block whose input `x` needs no gradient: the op that defers it there also gives dx
    (megalm/model/deferred_wgrad.py), and with dx unused it would be dropped, its deferral with it."""
    return (isinstance(weight, nn.Parameter) and weight.requires_grad and torch.is_grad_enabled()
            and (x.requires_grad or not torch.compiler.is_compiling()))


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe: GemmRecipe, sink: WeightGradSink | None, param: list, out_dtype,
                comm: InputCollectives | None):
        # With a sink, `weight` comes detached and the real parameter in the `param` list: autograd then
        # never reaches the parameter's AccumulateGrad in B (no gradient, no DP hook fires until W).
        whole = x if comm is None else comm.gather(x)
        call = recipe.start(whole)
        x2 = whole.reshape(-1, whole.shape[-1])
        with torch.autocast(x.device.type, enabled=False):
            if bias is not None and recipe is PLAIN_GEMMS:  # F.linear's GEMM with its bias, as one process runs it
                y = F.linear(x2.to(call), weight.to(call), bias.to(call))
            else:  # a recipe's GEMM asked for fp32 where a bias is added to it
                y = recipe.fprop(call, x2, weight, out_dtype if bias is None else torch.float32)
                if bias is not None:
                    y = y + bias.to(y.dtype)
        pack = getattr(recipe, "pack_input", None)
        packed = pack(call) if pack is not None else None
        sharded = comm is not None and comm.shards_input
        packed = None if sharded else packed  # under SP the shard is smaller than a whole FP8 copy
        ctx.save_for_backward(x if packed is None else packed, weight)  # the shard only, under SP
        ctx.recipe, ctx.call, ctx.sink, ctx.param, ctx.comm = recipe, call, sink, param, comm
        ctx.packed, ctx.input_shape, ctx.input_dtype = packed is not None, whole.shape, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return as_function_output(y.reshape(*whole.shape[:-1], y.shape[-1]).to(out_dtype))  # SP: a gather ran

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        recipe, call, comm = ctx.recipe, ctx.call, ctx.comm
        if ctx.packed:  # the recipe's own form of the whole input (2-D), which its wgrad reads
            recipe.unpack_input(call, x)
        gathering = None if ctx.packed or comm is None else comm.start_gather(x)  # in flight beside dgrad
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = reducing = None
        with torch.autocast(x.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                dx = recipe.dgrad(call, dy2, weight, ctx.input_dtype).reshape(ctx.input_shape).to(ctx.input_dtype)
                reducing = None if comm is None else comm.start_scatter(dx)  # in flight beside wgrad
            whole = x if gathering is None else gathering.wait()
            x2 = whole if ctx.packed else whole.reshape(-1, whole.shape[-1])
            finish = getattr(recipe, "finish", None) or (lambda call: None)
            if ctx.sink is not None and recipe is PLAIN_GEMMS and getattr(ctx.sink, "accumulates", False):
                ctx.sink.accumulate(ctx.param[0], dy2, x2.to(dy2.dtype))  # into the main gradient (now, or at W)
            elif ctx.sink is not None:
                param = ctx.param[0]

                def deferred_wgrad() -> torch.Tensor:
                    dw = recipe.wgrad(call, dy2, x2, param.dtype).to(param.dtype)
                    finish(call)
                    return dw

                ctx.sink.stash(param, deferred_wgrad)
            else:
                if ctx.needs_input_grad[1]:
                    dw = recipe.wgrad(call, dy2, x2, weight.dtype).to(weight.dtype)
                finish(call)
            if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
                db = dy2.float().sum(dim=0).to(ctx.bias_dtype)
        dx = dx if reducing is None else reducing.wait()
        return dx, dw, db, None, None, None, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           recipe: GemmRecipe | None = None, sink: WeightGradSink | None = None,
           input_comm: InputCollectives | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with its GEMMs from `recipe` and its weight gradient handed to `sink`; with
    `input_comm`, x's collectives under tensor parallelism (under SP x is this rank's shard of the tokens and the
    GEMMs see them all).

    x [..., in], weight [out, in] -> [..., out] in the compute dtype (autocast's under autocast, as
    F.linear). Without a recipe, a (usable) sink or input collectives this is F.linear itself.
    """
    defer = sink is not None and deferrable(weight, x)
    if recipe is None and not defer and input_comm is None:
        return F.linear(x, weight, bias)
    device = x.device.type
    out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    compiled = getattr(recipe, "compiled_linear", None)  # a recipe whose Python state dynamo cannot trace
    if compiled is not None and not defer and input_comm is None and torch.compiler.is_compiling():
        return compiled(x, weight, bias, out_dtype)
    # inside a compiled block, the sink's closure as an op the graph holds (deferred_wgrad.py)
    if defer and recipe is None and torch.compiler.is_compiling() and hasattr(sink, "handle"):
        return deferred_linear(x, weight, bias, sink, input_comm, out_dtype, PLAIN_GEMMS.start(x))
    if defer:
        return _Linear.apply(x, weight.detach(), bias, recipe or PLAIN_GEMMS, sink, [weight], out_dtype,
                             input_comm)
    return _Linear.apply(x, weight, bias, recipe or PLAIN_GEMMS, None, [], out_dtype, input_comm)


def linear_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` that run their GEMMs through `linear` (model and tensor-parallel layers)."""
    return [m for m in model.modules() if isinstance(m, LinearHooks)]
