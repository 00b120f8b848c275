"""A precision recipe's linear layer as one opaque op pair, so that compiled blocks run FP8/MX without a break.

A recipe's GEMMs keep Python state between calls (layer_state.py): a seed stream hashed per call, FP8 amax histories,
a weight cache valid per optimizer step. dynamo cannot trace that (hashing, weak references, storage pointers),
and whatever it traced would be frozen into the graph: the seed of the step it compiled. Inside a compiled block
the layer therefore calls two custom ops, `megalm::recipe_linear` and its backward, which dynamo and inductor
treat as extern calls and which run the recipe's eager code (the same `start`/`fprop`/`dgrad`/`wgrad`) each time.

What the ops cannot take as arguments travels as tensors: the layer's recipe is named by a CPU int64 tensor
(`layer_handle`, megalm/model/handles.py), and the call's
state that the backward needs (the seed its forward drew, the FP8 scales its forward computed) comes back from
the forward op as tensors the autograd graph saves. Integers dynamo would specialise on never enter the graph:
every layer's and every step's call share one compiled graph.

Under per-tensor FP8 scaling (`precision=fp8`, current; `fp8_delayed`) the casts leave the op: the layer is an
autograd function whose forward casts x and whose backward casts dy as plain torch ops (fp8.quantize_in_graph), which
the compiler sees and inductor fuses with whatever produced them (the norm before q/k/v, SwiGLU before the down
projection, the previous op's gradient), as torchao's tensorwise float8 is compiled in TorchTitan; only the GEMMs
(with the layer's cached FP8 weights) stay in the ops, `megalm::fp8_linear` and its backward. The values are the
eager path's: the same casts, the same GEMMs. Where torch._scaled_mm runs (CUDA from sm89, shapes of multiples of
16), the GEMMs leave the ops too (`fp8_graph_linear`): the graph calls torch._scaled_mm on the weight's FP8 copies,
which the compiled block's caller makes or finds in the layer's cache before the block runs (`prepared_weights`,
megalm/training/compile.py: all of a block's weights in one cast call once per optimizer step, then a token compare
per layer and block call), so the GEMMs run none of the layer's Python, as torchao's float8 compiles in TorchTitan.
Delayed scaling's scales come from the layers' amax histories before the block runs, and the amaxes go back to
them as a gradient (`GraphScales`): with its scale known beforehand a cast is one pass over its input, fused into
the kernel that produces it, where current scaling's must wait for the whole tensor's amax.

Eager runs keep linear.py's autograd function; this path is taken only while compiling (megalm/model/linear.py).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from megalm import compat
from megalm.model.handles import handle_of, object_of
from megalm.precision import fp8


@dataclass
class Call:
    """One forward call's state, shared by a layer's three GEMMs (linear.py): the call seed, the FP8 scales
    computed, and the FP8 operands cast under per-tensor scales ({(tensor, format): (FP8 tensor, scale)}): dy cast
    once for dgrad and wgrad, x once for fprop and wgrad (the layer keeps it for the backward)."""

    seed: int | None
    scales: dict
    operands: dict = field(default_factory=dict)


# The keys a call's per-tensor FP8 scales can have, in the order the ops pass them.
CALL_SCALES = tuple((tensor, fmt) for tensor in ("x", "w", "dy") for fmt in ("e4m3", "e5m2"))


def call_tensors(call: Call, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`call` as tensors: seed (CPU int64 [has one, seed]), scales [len(CALL_SCALES)] fp32 on `device` and which
    of them exist (CPU bool, read on the host without a device sync)."""
    seed = torch.tensor([call.seed is not None, call.seed or 0], dtype=torch.int64)
    zero = torch.zeros((), dtype=torch.float32, device=device)
    scales = torch.stack([call.scales[k].reshape(()).float() if k in call.scales else zero for k in CALL_SCALES])
    return seed, scales, torch.tensor([k in call.scales for k in CALL_SCALES])


def call_from(seed: torch.Tensor, scales: torch.Tensor, present: torch.Tensor) -> Call:
    """The `Call` that `call_tensors` made tensors of."""
    has_seed, value = seed.tolist()
    return Call(value if has_seed else None, {k: scales[i] for i, k in enumerate(CALL_SCALES) if present[i]})


class CompiledRecipe(Protocol):
    """What the ops need from a layer's recipe (linear.py's `RecipeGemms`)."""

    def start(self, x: torch.Tensor) -> Any: ...

    def fprop(self, call: Any, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor: ...

    def dgrad(self, call: Any, dy: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor: ...

    def wgrad(self, call: Any, dy: torch.Tensor, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor: ...


def layer_handle(recipe: CompiledRecipe) -> torch.Tensor:
    """The CPU tensor that names `recipe` to the ops, for as long as `recipe` lives."""
    return handle_of(recipe)


def _recipe(layer: torch.Tensor) -> CompiledRecipe:
    return object_of(layer, "precision recipe")


@torch.library.custom_op("megalm::recipe_linear", mutates_args=())
def _forward(x: torch.Tensor, weight: torch.Tensor, layer: torch.Tensor, out_dtype: torch.dtype,
             y_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y [T, out] in `y_dtype`, and the call's seed, scales and which scales exist) of x [T, in] and weight
    [out, in]; `out_dtype`, what the layer returns, is the dtype its backward's dy arrives in on the eager path."""
    recipe = _recipe(layer)
    with torch.autocast(x.device.type, enabled=False):
        call = recipe.start(x)
        y = recipe.fprop(call, x, weight, y_dtype).to(y_dtype)
    return (y, *call_tensors(call, x.device))


@_forward.register_fake
def _(x, weight, layer, out_dtype, y_dtype):
    return (x.new_empty((x.shape[0], weight.shape[0]), dtype=y_dtype),
            torch.empty(2, dtype=torch.int64), x.new_empty(len(CALL_SCALES), dtype=torch.float32),
            torch.empty(len(CALL_SCALES), dtype=torch.bool))


@torch.library.custom_op("megalm::recipe_linear_backward", mutates_args=())
def _backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, layer: torch.Tensor, seed: torch.Tensor,
              scales: torch.Tensor, present: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx in x's dtype, dW in the weight's) with the call state the forward handed over."""
    recipe = _recipe(layer)
    call = call_from(seed, scales, present)
    with torch.autocast(x.device.type, enabled=False):
        return (recipe.dgrad(call, dy, weight, x.dtype).to(x.dtype),
                recipe.wgrad(call, dy, x, weight.dtype).to(weight.dtype))


@_backward.register_fake
def _(dy, x, weight, layer, seed, scales, present):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _save(ctx, inputs, output) -> None:
    x, weight, layer, ctx.out_dtype, _ = inputs
    _, seed, scales, present = output
    ctx.mark_non_differentiable(seed, scales, present)
    ctx.save_for_backward(x, weight, layer, seed, scales, present)


def _grads(ctx, dy, *_):
    dx, dw = _backward(dy.to(ctx.out_dtype), *ctx.saved_tensors)  # as the eager path gets it: exact (dy is the
    return dx, dw, None, None, None  # upcast of the out_dtype gradient `.to(out_dtype)` passes back)


_forward.register_autograd(_grads, setup_context=_save)


def _around_gemms(gemms: Callable[[torch.Tensor, torch.dtype], torch.Tensor], x: torch.Tensor,
                  bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """What both compiled paths do around a layer's GEMMs, as the eager path does: x [..., in] as [T, in], the GEMM
    output in `out_dtype` (fp32 when a bias follows, added in fp32), back to [..., out] in `out_dtype`.
    `gemms(x2d, y_dtype)` runs the layer's forward GEMM."""
    y_dtype = out_dtype if bias is None else torch.float32
    y = gemms(x.reshape(-1, x.shape[-1]), y_dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], y.shape[-1]).to(out_dtype)


def recipe_linear(layer: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """linear.py's `linear` for the layer `layer` names, as one op: x [..., in] -> [..., out] in `out_dtype`,
    the bias added in fp32 as the eager path adds it."""
    return _around_gemms(lambda x2, y_dtype: _forward(x2, weight, layer, out_dtype, y_dtype)[0], x, bias, out_dtype)


# ------------------------------------------------------------------------- per-tensor FP8: the casts in the graph


def _preset_call(**operands: tuple[torch.Tensor, torch.Tensor]) -> Call:
    """A call whose activations come cast already: {tensor name: (FP8 tensor, its scale)}, keyed by their format."""
    call = Call(None, {})
    for name, (q, scale) in operands.items():
        key = (name, fp8.fp8_format(q.dtype))
        call.scales[key], call.operands[key] = scale, (q, scale)
    return call


@torch.library.custom_op("megalm::fp8_linear", mutates_args=())
def _fp8_forward(qx: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, layer: torch.Tensor,
                 y_dtype: torch.dtype) -> torch.Tensor:
    """y [T, out] in `y_dtype` of FP8 x [T, in] (cast with `x_scale`) and the weight's cached FP8 copy."""
    with torch.autocast(qx.device.type, enabled=False):
        return _recipe(layer).fprop(_preset_call(x=(qx, x_scale)), qx, weight, y_dtype).to(y_dtype)


@_fp8_forward.register_fake
def _(qx, x_scale, weight, layer, y_dtype):
    return qx.new_empty((qx.shape[0], weight.shape[0]), dtype=y_dtype)


@torch.library.custom_op("megalm::fp8_linear_backward", mutates_args=())
def _fp8_backward(qdy: torch.Tensor, qdy_columns: torch.Tensor, dy_scale: torch.Tensor, qx_columns: torch.Tensor,
                  x_scale: torch.Tensor, weight: torch.Tensor, layer: torch.Tensor, x_dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx in `x_dtype`, dW in the weight's) of FP8 dy, row-major for dgrad and column-major for wgrad, and the FP8 x
    the forward kept (column-major): each GEMM gets its operands in the layouts torch._scaled_mm takes."""
    recipe = _recipe(layer)
    with torch.autocast(qdy.device.type, enabled=False):
        dx = recipe.dgrad(_preset_call(dy=(qdy, dy_scale)), qdy, weight, x_dtype).to(x_dtype)
        wgrad = _preset_call(x=(qx_columns, x_scale), dy=(qdy_columns, dy_scale))
        return dx, recipe.wgrad(wgrad, qdy_columns, qx_columns, weight.dtype).to(weight.dtype)


@_fp8_backward.register_fake
def _(qdy, qdy_columns, dy_scale, qx_columns, x_scale, weight, layer, x_dtype):
    return qx_columns.new_empty(qx_columns.shape, dtype=x_dtype), weight.new_empty(weight.shape)


class GraphScales(NamedTuple):
    """What a compiled block's graph reads of a delayed-scaling layer's amax histories (`AmaxHistory`), made in
    eager before the block runs (`prepare_graph_scales`): x's and dy's scales from their histories (None
    while a history is empty: the step's current amax scales, as the eager path's first step does) and `sink`, a
    leaf tensor [2] whose gradient is the call's amaxes of x and dy. The backward hands them back that way, as a
    gradient, so that no graph mutates a tensor: what AOT autograd's backward graphs do not take alike in every torch
    this project supports. A hook on the leaf pushes them to the histories. So x's amax reaches its history with the
    backward, where the eager path pushes it in the forward: the same histories for every forward followed by its
    backward (the trainer's, recomputation's), none from a training-mode forward without one, or from a backward
    that leaves the sink out (`autograd.grad` of chosen inputs)."""

    x_scale: torch.Tensor | None
    dy_scale: torch.Tensor | None
    sink: torch.Tensor


def _cast_x(ctx, x: torch.Tensor, x_fp8: torch.dtype, x_given: torch.Tensor | None,  # noqa: ANN001 - autograd's
            sink: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The forward's cast of x in the graph (fp8.quantize_in_graph) with the history's scale `x_given` (None: the
    current amax's): (FP8 x, its scale, its amax where a history takes it: a `sink` is given)."""
    qx, x_scale, x_amax = fp8.quantize_in_graph(x, x_fp8, x_given)
    ctx.delayed = sink is not None
    return qx, x_scale, x_amax if ctx.delayed else None


def _cast_dy(ctx, dy: torch.Tensor, dy_given: torch.Tensor | None  # noqa: ANN001
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The backward's cast of dy in the graph, as the eager path gets it: exact (the upcast of the out_dtype gradient
    `.to(out_dtype)` passes back); (FP8 dy, its scale, its amax where a history takes it)."""
    qdy, dy_scale, dy_amax = fp8.quantize_in_graph(dy.to(ctx.dy_dtype), ctx.dy_fp8, dy_given)
    return qdy, dy_scale, dy_amax if ctx.delayed else None


def _amaxes(x_amax: torch.Tensor | None, dy_amax: torch.Tensor | None) -> torch.Tensor | None:
    """The sink's gradient: the call's amaxes of x and dy (`GraphScales`); None under current scaling."""
    return None if x_amax is None else torch.stack([x_amax, dy_amax])


def graph_column_major(q: torch.Tensor) -> torch.Tensor:
    """`fp8.column_major(q)` in a graph being compiled, its layout fixed where the copy is made
    (`compat.inductor_force_strides`): inductor then writes it in the loop of the cast that makes q, beside the
    row-major copy and the amax (one pass over the bf16 input, Transformer Engine's cast-transpose), where a copy
    handed to torch._scaled_mm transposed (`.t()`, as wgrad's first operand) was lowered as a loop over the
    transposed shape, which inductor's C++ scheduler never fuses with the cast: two more passes over the input
    (tools/bench/inductor_kernels.py; docs/benchmarks.md, "Where the compiled FP8 backward's bytes go")."""
    columns = fp8.column_major(q)
    force = compat.inductor_force_strides
    return columns if force is None else force(columns, [1, q.shape[0]])


class _Fp8Linear(torch.autograd.Function):
    """x [T, in] -> y [T, out]: x cast in the graph, the GEMM in `megalm::fp8_linear`; the backward casts dy in the
    graph and keeps the FP8 x, not x (1 byte per element). wgrad's operands (dy and x, contracted over the tokens)
    are also written column-major in the graph, the layout torch._scaled_mm takes them in (with the cast that
    makes them, where inductor fuses the two: Transformer Engine's cast-transpose), so no op transposes a copy.
    `scales`: a delayed-scaling layer's (`GraphScales`), None under current scaling."""

    @staticmethod
    def forward(ctx, x, weight, layer, y_dtype, dy_dtype, x_fp8, dy_fp8, x_given, dy_given, sink):  # noqa: ANN001, ANN205
        ctx.x_dtype, ctx.dy_dtype, ctx.dy_fp8 = x.dtype, dy_dtype, dy_fp8
        qx, x_scale, x_amax = _cast_x(ctx, x, x_fp8, x_given, sink)
        ctx.save_for_backward(graph_column_major(qx), x_scale, weight, layer, x_amax, dy_given)
        return _fp8_forward(qx, x_scale, weight, layer, y_dtype)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        qx_columns, x_scale, weight, layer, x_amax, dy_given = ctx.saved_tensors
        qdy, dy_scale, dy_amax = _cast_dy(ctx, dy, dy_given)
        dx, dw = _fp8_backward(qdy, graph_column_major(qdy), dy_scale, qx_columns, x_scale, weight, layer, ctx.x_dtype)
        return dx, dw, None, None, None, None, None, None, None, _amaxes(x_amax, dy_amax)


def fp8_linear(layer: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               out_dtype: torch.dtype, x_fp8: torch.dtype, dy_fp8: torch.dtype,
               scales: GraphScales | None = None) -> torch.Tensor:
    """`recipe_linear` for a recipe of per-tensor scaling, current (`scales` None) or delayed (`GraphScales`): x cast
    to `x_fp8` and dy to `dy_fp8` in the graph (module docstring), the GEMMs in the ops."""
    given = (None, None, None) if scales is None else scales
    return _around_gemms(lambda x2, y_dtype: _Fp8Linear.apply(x2, weight, layer, y_dtype, out_dtype, x_fp8, dy_fp8,
                                                              *given), x, bias, out_dtype)


# ----------------------------------------------------- per-tensor FP8 where torch._scaled_mm runs: all in the graph


class _Fp8GraphLinear(torch.autograd.Function):
    """`_Fp8Linear` with its GEMMs as torch._scaled_mm ops of the graph too: the weight's FP8 copies (row-major for
    fprop, column-major for dgrad) and the inverse of their per-tensor scale come in as tensors, made before the
    compiled block runs (`prepared_weights`), so the GEMMs run no Python of the layer's (the op pair's ran ~0.3 ms of
    it a layer and micro-batch: docs/benchmarks.md). Each activation's inverse scale is taken once, beside its amax,
    and the backward keeps x's. `weight` is passed for its gradient only. The GEMMs are fp8._scaled_mm_cuda's calls
    for operands already in its layouts: row-major first, column-major second; the forward's with the recipe's
    `fast_accum` (a constant of the graph)."""

    @staticmethod
    def forward(ctx, x, weight, w_rows, w_columns, w_inverse, y_dtype, dy_dtype, x_fp8, dy_fp8,  # noqa: ANN001, ANN205
                x_given, dy_given, sink, fast_accum):
        ctx.x_dtype, ctx.w_dtype, ctx.dy_dtype, ctx.dy_fp8 = x.dtype, weight.dtype, dy_dtype, dy_fp8
        qx, x_scale, x_amax = _cast_x(ctx, x, x_fp8, x_given, sink)
        x_inverse = fp8.inverse_scale(x_scale)
        ctx.save_for_backward(graph_column_major(qx), x_inverse, w_columns, w_inverse, x_amax, dy_given)
        return torch._scaled_mm(qx, w_rows.t(), scale_a=x_inverse, scale_b=w_inverse, out_dtype=y_dtype,
                                use_fast_accum=fast_accum)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        qx_columns, x_inverse, w_columns, w_inverse, x_amax, dy_given = ctx.saved_tensors
        qdy, dy_scale, dy_amax = _cast_dy(ctx, dy, dy_given)
        dy_inverse = fp8.inverse_scale(dy_scale)
        dx = torch._scaled_mm(qdy, w_columns, scale_a=dy_inverse, scale_b=w_inverse, out_dtype=ctx.x_dtype)
        dw = torch._scaled_mm(graph_column_major(qdy).t(), qx_columns, scale_a=dy_inverse, scale_b=x_inverse,
                              out_dtype=ctx.w_dtype)
        return dx, dw, None, None, None, None, None, None, None, None, None, _amaxes(x_amax, dy_amax), None


def fp8_graph_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
                     weight_copies: tuple[torch.Tensor, torch.Tensor, torch.Tensor], x_fp8: torch.dtype,
                     dy_fp8: torch.dtype, scales: GraphScales | None = None, *, fast_accum: bool = False
                     ) -> torch.Tensor:
    """`fp8_linear` with the GEMMs in the graph as well, from the weight's FP8 copies `weight_copies` (row-major,
    column-major, the inverse of their scale: `RecipeGemms.graph_weights`). The tokens must be a multiple of 16
    (torch._scaled_mm's). `fast_accum`: the forward GEMM's fast accumulation (the recipe's fprop.fast_accum)."""
    rows, columns, w_inverse = weight_copies
    given = (None, None, None) if scales is None else scales
    return _around_gemms(lambda x2, y_dtype: _Fp8GraphLinear.apply(x2, weight, rows, columns, w_inverse, y_dtype,
                                                                   out_dtype, x_fp8, dy_fp8, *given, fast_accum),
                         x, bias, out_dtype)


@contextlib.contextmanager
def prepared_weights(linears: list[torch.nn.Module]) -> Iterator[None]:
    """Around a compiled block's forward, in eager: each of its linear layers whose recipe reads FP8 weight copies in
    the graph makes or finds them first (`RecipeGemms.prepare_graph_weights`: the layer's cache, once per optimizer
    step), and lets go of them after, so that no later graph (another compile of the layer) reads copies it did not
    check. The copies a block's layers still need are cast together, one call per FP8 format and scaling
    (`fp8.quantize_weights`, `fp8.quantize_weights_delayed`). Delayed-scaling layers also take their activations'
    scales from their histories (`prepare_graph_scales`). Entered after the block's forward pre-hooks: a weight
    ZeRO-1 gathers in flight has arrived."""
    prepared = [gemms for module in linears
                if hasattr(gemms := getattr(module, "gemm_recipe", None), "prepare_graph_weights")]
    wanted = [gemms for gemms in prepared if gemms.graph_weights_wanted()]
    for gemms in wanted:
        gemms.drop_weight_copies()
    made: dict[int, fp8.WeightCopies] = {}
    kind = lambda g: (g.recipe.delayed, g.recipe.fprop.b_format)  # noqa: E731
    for (delayed, fmt), group in itertools.groupby(sorted(wanted, key=kind), key=kind):
        # delayed scaling: each weight cast with its history's scale, its amax pushed to it, as the layer's `_fp8`
        # does; a history still empty (the first step: the current amax scales) casts in the layer
        group = [g for g in group if not delayed or g.state.amax["w"].history is not None]
        if not group:
            continue
        dtype, weights = fp8.fp8_dtype(fmt), [gemms.weight for gemms in group]
        with torch.no_grad():
            if delayed:
                histories = [gemms.state.amax["w"] for gemms in group]
                scales = [history.scale(None, dtype) for history in histories]  # the step's, made once for all
                copies, amaxes = fp8.quantize_weights_delayed(weights, dtype, scales)
                for gemms, history, w_amax in zip(group, histories, amaxes, strict=True):
                    if gemms.training:
                        history.update(w_amax)
            else:
                copies = fp8.quantize_weights(weights, dtype)
        made.update({id(gemms): made_copies for gemms, made_copies in zip(group, copies, strict=True)})
        del copies
    for gemms in prepared:
        gemms.prepare_graph_weights(made.get(id(gemms)))
    prepare_graph_scales(prepared)
    del made
    try:
        yield
    finally:
        for gemms in prepared:
            gemms.graph_weights = gemms.graph_scales = None


def prepare_graph_scales(layers: list) -> None:
    """Before a compiled block runs, in eager: each delayed-scaling layer's `graph_scales` (`GraphScales`) for the
    graph to cast x and dy with (None for other recipes' layers), each scale from its history as the eager path takes
    it (None while the history is empty: the graph then scales by the current amax, as the eager path's first step
    does): the scales made once a step for every history rolled with it (`AmaxHistory.scale`: a few kernels a step
    for the whole model, and made again where a history changed), with the leaf tensor whose gradient brings each
    call's amaxes back to its histories (`_amax_sink`). `layers`: linear.py's `RecipeGemms`."""
    for gemms in layers:
        gemms.graph_scales = None
        w = gemms.weight
        if not (gemms.recipe.casts_in_graph and gemms.recipe.delayed and gemms.state is not None and w is not None):
            continue
        scales = []
        with torch.no_grad():
            for name, spec in (("x", gemms.recipe.fprop), ("dy", gemms.recipe.dgrad)):
                history = gemms.state.amax[name]
                scales.append(None if history.history is None else history.scale(None, fp8.fp8_dtype(spec.a_format)))
        sink = gemms._graph_sink
        if sink is None or sink.device != w.device or compat.is_fake(sink) != compat.is_fake(w):
            sink = gemms._graph_sink = _amax_sink(gemms, w.device)
        gemms.graph_scales = GraphScales(*scales, sink)


def _amax_sink(gemms: Any, device: torch.device) -> torch.Tensor:
    """A delayed-scaling layer's `GraphScales.sink`: a leaf [2] whose gradient a compiled call's backward sets to its
    amaxes of x and dy; a hook hands them to the layer's histories as the eager path's `_fp8` does (while the layer
    trains) and clears the gradient. A layer called twice in one backward would hand the sum of its calls' amaxes
    (autograd adds the gradients before the hook runs): a larger amax, a smaller scale, never an overflow."""
    sink = torch.zeros(2, dtype=torch.float32, device=device, requires_grad=True)
    layer = weakref.ref(gemms)

    def arrived(t: torch.Tensor) -> None:
        gemms, amaxes = layer(), t.grad
        t.grad = None
        if gemms is not None and gemms.state is not None and gemms.training and amaxes is not None:
            gemms.state.amax["x"].update(amaxes[0])
            gemms.state.amax["dy"].update(amaxes[1])

    sink.register_post_accumulate_grad_hook(arrived)
    return sink
