"""FP8 GEMMs with per-tensor (current or delayed) and per-row scaling; emulated in fp32 where there is
no FP8 hardware.

FP8 has too little range for raw activations and gradients, so a tensor is multiplied by a scale
before the cast and divided by it afterwards (Micikevicius et al. 2022, "FP8 Formats for Deep
Learning"):

    x_fp8 = cast(clamp(x * scale, -max, max)),   x ~ x_fp8 / scale,   scale = max / amax

E4M3 (max 448, 3 mantissa bits) for forward operands, E5M2 (max 57344, more range, 2 mantissa bits)
for gradients. Where amax comes from:

    current  amax of this very tensor (one extra pass over it; what torchao's "tensorwise" does)
    delayed  max of the amaxes of the last `history_len` steps (Transformer Engine's default recipe; the
             history per step, as torchao's delayed scaling keeps it): no pass before the cast, but a
             tensor that grew since then is clipped. The step's amaxes join the history when the next
             step starts (`amax_history.AmaxHistory`).
    rowwise  one scale per row of an operand along the GEMM's reduction dim K (DeepSeek-V3 style
             fine-grained scaling, coarser): outliers only hurt their own row.

`quantize(x, dtype, scale)` casts (on CUDA in one compiled kernel straight from bf16, never through an fp32
copy); `quantize_current` computes the amax, the scale and the cast in one compiled function, and
`quantize_delayed` returns the amax the history needs from the cast's own pass (TE's cast + amax);
`scaled_mm(qa, qb, ..., out_dtype)` multiplies the FP8 operands and writes the output dtype directly (bf16
activations need no fp32 round trip). On a CUDA GPU of compute capability 8.9+
(Ada, Hopper, Blackwell) with dimensions that are multiples of 16 it calls torch._scaled_mm; everywhere
else it emulates: dequantize (exact) and an fp32 matmul. The two differ only in summation order; the FP8
values are the same, since torch's cast to float8 rounds like the hardware's.

`fast_accum`: Hopper's FP8 tensor cores accumulate in reduced precision, and cuBLAS by default promotes the partial
sums to fp32 every few K-blocks (TE's "split accumulator"), which costs GEMM throughput; with fast accumulation it
does not. Transformer Engine's recipes and torchao's float8 (TorchTitan's) use it for the forward GEMM only, the
gradients' GEMMs promoting, and so do megalm's fp8 recipes (recipes.py). The emulation accumulates in fp32 either way.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable
from typing import Any

import torch

from megalm import compat

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_DTYPES = {"e4m3": E4M3, "e5m2": E5M2}


def fp8_dtype(name: str | torch.dtype) -> torch.dtype:
    """torch.float8_e4m3fn for "e4m3", torch.float8_e5m2 for "e5m2" (dtypes pass through)."""
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"unknown FP8 format {name!r}; expected e4m3 or e5m2")
    return _DTYPES[name]


def fp8_format(dtype: torch.dtype) -> str:
    """"e4m3" for torch.float8_e4m3fn, "e5m2" for torch.float8_e5m2 (`fp8_dtype`'s inverse)."""
    return next(name for name, d in _DTYPES.items() if d == dtype)


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value: 448 (e4m3fn), 57344 (e5m2)."""
    return float(torch.finfo(dtype).max)


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """scale = max / amax / 2^margin (fp32), at most fp32's largest (an amax below ~1e-36 would give inf, and 0 * inf
    NaN, as Transformer Engine clamps it); 1 where amax is 0 (nothing to fit); NaN where amax is inf or NaN, so that
    the cast, the GEMM and the loss are NaN, for the trainer's non-finite guard to see (saturating an inf to 448 hid
    an overflow: torchao's float8 and the MX recipes propagate it too). Five kernels in eager: delayed scaling takes a
    scale per history and step."""
    amax = amax.float().nan_to_num(nan=math.nan, posinf=math.nan)  # an amax is never negative: inf is its only inf
    scale = (fp8_max(dtype) / 2.0**margin / amax).clamp(max=torch.finfo(torch.float32).max)
    return torch.where(amax == 0, 1.0, scale)


def amax(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """max |x| in fp32: of the whole tensor (0-dim), or along `dim` (kept as size 1). One reduction reading x,
    with no |x| copy in memory (`x.abs().amax()` writes one in eager); NaN propagates as in `amax`."""
    x = x.detach()
    if x.numel() == 0:  # no tokens: 0 (a scale of 1), where the inf-norm refuses an empty tensor
        shape = () if dim is None else x.shape[:dim % x.dim()] + (1,) + x.shape[dim % x.dim() + 1:]
        return torch.zeros(shape, dtype=torch.float32, device=x.device)
    if dim is None:
        return torch.linalg.vector_norm(x, float("inf")).float()
    return torch.linalg.vector_norm(x, float("inf"), dim=dim, keepdim=True).float()


def tensor_scale(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Current per-tensor scale of x (a 0-dim fp32 tensor)."""
    return scale_from_amax(amax(x), dtype)


def rowwise_scale(x: torch.Tensor, dtype: torch.dtype, dim: int = -1) -> torch.Tensor:
    """One scale per row of x along `dim` (the GEMM's K), with `dim` kept as size 1 for broadcasting."""
    return scale_from_amax(amax(x, dim), dtype)


def _quantize_math(x: torch.Tensor, scale: torch.Tensor, limit: float, dtype: torch.dtype) -> torch.Tensor:
    """Saturating to +-limit what the scale takes past it (delayed scaling's scale is an earlier step's), but an
    inf of x, which becomes NaN: an overflow upstream stays visible (`scale_from_amax`)."""
    return torch.where(x.isinf(), math.nan, (x.float() * scale).clamp(-limit, limit)).to(dtype)


def _quantize_delayed_math(x: torch.Tensor, scale: torch.Tensor, limit: float, dtype: torch.dtype
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_math(x, scale, limit, dtype), amax(x)


def _quantize_current_math(x: torch.Tensor, scale_shape: torch.Tensor, limit: float, dtype: torch.dtype
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Current scaling of a 2-D x: one amax (`scale_shape` has one element) or one per row along the dim where the
    [M, 1] or [1, N] `scale_shape` has size 1 (a placeholder: only its shape is read)."""
    if scale_shape.numel() == 1:
        scale = scale_from_amax(amax(x), dtype)
    else:
        scale = scale_from_amax(amax(x, 1 if scale_shape.shape[-1] == 1 else 0), dtype)
    return _quantize_math(x, scale, limit, dtype), scale


def _scale_layout(scale: torch.Tensor) -> str:
    """How `scale` (as many dims as x) broadcasts over x: one scale, one per row, or one per column."""
    if scale.numel() == 1:
        return "tensor"
    return "row" if scale.shape[-1] == 1 else "column"


_MATH = {"cast": _quantize_math, "delayed": _quantize_delayed_math, "current": _quantize_current_math}


@functools.cache
def _quantize_fused(kind: str, x_dtype: torch.dtype, dtype: torch.dtype, layout: str) -> Callable[..., Any]:
    """The math of `kind` (cast with a given scale; cast returning x's amax; amax, scale and cast) compiled by
    torch.compile for one variant (x dtype, FP8 dtype, scale layout), with dynamic shapes: kernels that read x in
    its own dtype (bf16 activations and gradients), compute in fp32 registers and write FP8, where eager PyTorch
    would write an fp32 copy of x first (and `abs()` another). They compute the same values bit for bit
    (tests/unit/test_precision_weight_cache.py compiles them on CPU and compares).

    Each variant compiles a copy of its math with a code object of its own: dynamo counts a function's graphs per
    code object and, past its recompile limit (8), fails a fullgraph compile. Up to (3 + 1 + 3) x 3 x 2 = 42
    variants (layouts of cast, delayed and current x x dtypes x FP8 dtypes) would pass it if they shared one; one
    graph per code object keeps every variant compiled without raising that process-wide limit
    (tests/unit/test_compile_recompiles.py runs it over a training run's shapes and bounds the count)."""
    math = _MATH[kind]
    name = f"_quantize_{kind}_{str(x_dtype).removeprefix('torch.')}_to_{str(dtype).removeprefix('torch.')}_{layout}"
    code = math.__code__.replace(co_name=name)
    variant = types.FunctionType(code, math.__globals__, name)
    return torch.compile(variant, dynamic=True, fullgraph=True)


def runs_fused(x: torch.Tensor) -> bool:
    """Whether casts of x run as compiled kernels: CUDA tensors with data. Elsewhere (CPU, and fake tensors of the
    fake-CUDA tier, which have no kernel to compile) the same math runs in eager PyTorch, the reference."""
    return x.is_cuda and not compat.is_fake(x)


def _as_scale_dims(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return scale.reshape([1] * x.dim()) if scale.dim() == 0 else scale


def _run(kind: str, x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> Any:
    """`kind`'s math on x: compiled where `runs_fused`, eager elsewhere. The compiled variant takes x contiguous
    and detached (the cast has no gradient: dynamo guards on the type and requires_grad of its input and keeps a
    parameter's shape static, so passing weights as Parameters would compile one graph per weight shape) and the
    scale as many dims as x (a 0-dim scale is viewed as [1, 1]) so that layouts do not multiply its variants."""
    if not runs_fused(x):
        if x.device.type == "cpu" and compat.fp8_traced_capability() and compat.is_fake(x):
            return _traced_as_fused(kind, x, dtype, scale)
        return _MATH[kind](x, scale, fp8_max(dtype), dtype)
    return _call_fused(kind, x, dtype, scale)


def _traced_as_fused(kind: str, x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> Any:
    """The eager math on the estimator's fake tensors, costed as the GPU's compiled kernel: x read once (twice for
    current scaling: its amax is a reduction over all of x before the cast) and the FP8 tensor written."""
    from megalm.measure import op_cost  # only the estimator's trace needs it (torch's flop counter imports triton)

    with op_cost.one_kernel(f"fp8_cast_{kind}") as moved:
        out = _MATH[kind](x, scale, fp8_max(dtype), dtype)
        q = out[0] if isinstance(out, tuple) else out
        moved((2 if kind == "current" else 1) * x.numel() * x.element_size() + q.numel() * q.element_size())
    return out


def _call_fused(kind: str, x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> Any:
    scale = _as_scale_dims(x, scale)
    fused = _quantize_fused(kind, x.dtype, dtype, _scale_layout(scale))
    args = (x.detach().contiguous(), scale.detach(), fp8_max(dtype), dtype)
    # no duck sizing: equal sizes met once (64 tokens of hidden 64) must not become a guard that recompiles later.
    # Set by hand, not with `config.patch`, which builds a class per call: a third of the call's host time
    symbolic = torch.fx.experimental._config
    if not symbolic.use_duck_shape:
        return fused(*args)
    symbolic.use_duck_shape = False
    try:
        return fused(*args)
    finally:
        symbolic.use_duck_shape = True


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """x -> FP8 tensor of x * scale (in fp32), saturated to +-max, rounded to nearest even. On CUDA one compiled
    kernel straight from x's dtype (no fp32 copy of a bf16 x in memory); elsewhere eager PyTorch, the reference."""
    return _run("cast", x, dtype, scale)


def quantize_delayed(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(`quantize(x, dtype, scale)`, amax of x in fp32) from one compiled function on CUDA: delayed scaling casts
    with the history's scale and pushes the amax that the cast's pass over x computed (Transformer Engine's
    cast + amax), instead of reading x once more for it. Per-tensor scales only."""
    return _run("delayed", x, dtype, scale)


def quantize_current(x: torch.Tensor, dtype: torch.dtype, dim: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 x, its scale) under current scaling: one scale for the whole tensor (`dim` None, a 0-dim scale) or one
    per row along `dim` of a 2-D x (kept as size 1). amax, scale and cast are one compiled function on CUDA (no
    |x| copy, the scale's arithmetic folded in); the values are `quantize(x, dtype, tensor_scale(x, dtype))`'s."""
    one = x.new_ones((), dtype=torch.float32)  # stands for the scale's shape (expanded: no memory)
    shape = one if dim is None else one.expand([1 if d == dim % x.dim() else n for d, n in enumerate(x.shape)])
    q, scale = _run("current", x, dtype, shape)
    return q, scale.reshape(shape.shape)


WeightCopies = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # `quantize_weights`'s, per weight


def _quantize_weights_math(xs: list[torch.Tensor], limit: float, dtype: torch.dtype
                           ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    out = []
    for x in xs:
        scale = scale_from_amax(amax(x), dtype)
        q = _quantize_math(x, scale, limit, dtype)
        out.append((q, column_major(q), scale))
    return out


def _quantize_weights_delayed_math(xs: list[torch.Tensor], scales: list[torch.Tensor], limit: float,
                                   dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    out = []
    for x, scale in zip(xs, scales):  # noqa: B905 - one scale per weight, by construction
        q = _quantize_math(x, scale, limit, dtype)
        out.append((q, column_major(q), amax(x)))
    return out


_WEIGHTS_MATH = {"current": _quantize_weights_math, "delayed": _quantize_weights_delayed_math}


@functools.cache
def _quantize_weights_fused(shapes: tuple[tuple[int, ...], ...], x_dtype: torch.dtype, dtype: torch.dtype,
                            kind: str = "current") -> Callable[..., Any]:
    """`_quantize_weights_math` (current scaling) or `_quantize_weights_delayed_math` (`kind`) compiled for one list
    of weight shapes (static: a block's weights are the same in every block, so a model compiles one or two of
    these), with a code object of its own per list, as `_quantize_fused`'s variants have: the lists never count
    against one function's recompile limit."""
    cast = _WEIGHTS_MATH[kind]
    name = f"_quantize_weights_{kind}_{len(shapes)}_{str(x_dtype).removeprefix('torch.')}_to_" \
           f"{str(dtype).removeprefix('torch.')}_{abs(hash(shapes)):x}"
    code = cast.__code__.replace(co_name=name)
    variant = types.FunctionType(code, cast.__globals__, name)
    return torch.compile(variant, dynamic=False, fullgraph=True)


def quantize_weights(weights: list[torch.Tensor], dtype: torch.dtype) -> list[WeightCopies]:
    """Each weight's FP8 copy under current per-tensor scaling in both layouts torch._scaled_mm reads it in:
    (row-major q, column-major q, scale, 1 / scale), the values of `quantize_current(w, dtype)`, `column_major` of
    it and `inverse_scale`. Where casts run fused (`runs_fused`), one compiled call for the whole list: a compiled
    block's weights are cast once per optimizer step before the block runs, and cast weight by weight, each cast and
    each transposed copy is a host round trip of its own (a compiled call's guards and wrappers cost about 40 us of
    host time, and a step at 1.3B has 96 weights), where the kernels take microseconds. Elsewhere `quantize_current`
    weight by weight (the eager reference; on the estimator's fake tensors, costed as the GPU's cast kernels)."""
    detached = [w.detach() for w in weights]
    if not weights or not runs_fused(weights[0]):
        return [(q, column_major(q), scale, inverse_scale(scale))
                for q, scale in (quantize_current(w, dtype) for w in detached)]
    fused = _quantize_weights_fused(tuple(tuple(w.shape) for w in detached), detached[0].dtype, dtype)
    copies = fused([w.contiguous() for w in detached], fp8_max(dtype), dtype)
    # the inverses in eager, one foreach call: `inverse_scale`'s division to the last bit (a compiled one may not be)
    inverses = torch._foreach_reciprocal([scale for _, _, scale in copies])
    return [(*made, inverse) for made, inverse in zip(copies, inverses, strict=True)]


def quantize_weights_delayed(weights: list[torch.Tensor], dtype: torch.dtype, scales: list[torch.Tensor]
                             ) -> tuple[list[WeightCopies], list[torch.Tensor]]:
    """`quantize_weights` under delayed scaling: each weight cast with its history's scale, and each weight's amax for
    its history, (copies, amaxes): the values of `quantize_delayed(w, dtype, scale)`, `column_major` and
    `inverse_scale`; where casts run fused, one compiled call for the whole list (a compiled block's weights, once
    per optimizer step), as `quantize_weights` for the same reason."""
    detached = [w.detach() for w in weights]
    if not weights or not runs_fused(weights[0]):
        casts = [quantize_delayed(w, dtype, scale) for w, scale in zip(detached, scales, strict=True)]
        copies = [(q, column_major(q), scale, inverse_scale(scale))
                  for (q, _), scale in zip(casts, scales, strict=True)]
        return copies, [w_amax for _, w_amax in casts]
    fused = _quantize_weights_fused(tuple(tuple(w.shape) for w in detached), detached[0].dtype, dtype, "delayed")
    copies = fused([w.contiguous() for w in detached], [scale.detach() for scale in scales], fp8_max(dtype), dtype)
    inverses = torch._foreach_reciprocal(list(scales))
    return ([(q, columns, scale, inverse) for (q, columns, _), scale, inverse in zip(copies, scales, inverses,
                                                                                      strict=True)],
            [w_amax for _, _, w_amax in copies])


def quantize_in_graph(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(FP8 x, its per-tensor scale, x's amax) as plain torch ops, for a graph being compiled. `scale` None: current
    scaling, `quantize_current(x, dtype)`'s values; inductor then fuses the amax and the cast with whatever produced x
    (a norm, SwiGLU, the previous op's gradient), as torchao's tensorwise float8 is compiled, but the cast must wait
    for the amax of the whole tensor: a second pass over x. A `scale` given (delayed scaling: the amax history's,
    known before the producer runs) makes the cast a pointwise op of x that inductor fuses into the producer's kernel
    beside the amax the history needs, `quantize_delayed(x, dtype, scale)`'s values in one pass (Transformer
    Engine's fused cast + amax). The amax is taken per row, then over the rows: a row reduction is what inductor
    fuses into a norm's or SwiGLU's kernel (a whole-tensor one it splits and leaves as a pass of its own over x), and
    a max is exact in any order. The same values as the eager casts, bit for bit."""
    # no tokens (a rank's empty micro-batch): an amax of 0 and a scale of 1, as the eager `amax` (dynamo specialises a
    # size of 0, so the branch is a guard, not a break)
    x_amax = amax(x, -1).amax() if x.numel() else x.new_zeros((), dtype=torch.float32)
    if scale is None:
        scale = scale_from_amax(x_amax, dtype)
    return _quantize_math(x, scale, fp8_max(dtype), dtype), scale, x_amax


def quantize_compiled(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """`quantize`'s CUDA path on any device (tests compare it with the eager cast)."""
    return _call_fused("cast", x, dtype, scale)


def quantize_dequantize(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """fp32 x rounded through FP8 with this scale: quantize(x) / scale."""
    return quantize(x, dtype, scale).float() / scale


# ---------------------------------------------------------------------------------------------------
# GEMM
# ---------------------------------------------------------------------------------------------------


SCALED_MM_TOKEN_MULTIPLE = 16  # torch._scaled_mm needs every GEMM dimension, the tokens too, divisible by 16


def _fp8_capability(device: torch.device) -> tuple[int, int] | None:
    """`device`'s CUDA compute capability; on the CPU under the estimator's trace of a GPU
    (compat.fp8_traced_as_gpu), that GPU's."""
    capability = compat.cuda_capability(device)
    if capability is None and device.type == "cpu":
        return compat.fp8_traced_capability()
    return capability


def gemm_path(device: torch.device) -> str:
    """Where FP8 GEMMs run on `device`, for the log: torch._scaled_mm, or the fp32 emulation and why."""
    capability = _fp8_capability(device)
    if capability is None:
        return f"emulated in fp32 (no FP8 GEMMs on {device.type})"
    if not compat.scaled_mm_available() or capability < (8, 9):
        return "emulated in fp32 (FP8 GEMMs need compute capability 8.9+)"
    return ("torch._scaled_mm (emulated where a dimension is not a multiple of 16, for E5M2 x E5M2, "
            "and for E5M2 under per-row scales)")


def _scaled_mm_available(a: torch.Tensor, b: torch.Tensor, a_dtype: torch.dtype, b_dtype: torch.dtype,
                         rowwise: bool) -> bool:
    """Whether torch._scaled_mm can run a [M, K] @ b [K, N]: detected from the device, never assumed."""
    if not scaled_mm_runs(a.device) or (a.device.type == "cpu" and not compat.is_fake(a)):
        return False
    return scaled_mm_takes(a, b, a_dtype, b_dtype, rowwise)


def scaled_mm_takes(a: torch.Tensor, b: torch.Tensor, a_dtype: torch.dtype, b_dtype: torch.dtype,
                    rowwise: bool) -> bool:
    """Whether torch._scaled_mm has a kernel for these operands, whatever the device: every dimension a multiple of
    16, not E5M2 x E5M2, and per-row scales for E4M3 x E4M3 only."""
    if any(n % 16 for n in (*a.shape, b.shape[1])):
        return False
    if a_dtype == E5M2 and b_dtype == E5M2:  # no e5m2 x e5m2 kernel
        return False
    return not rowwise or (a_dtype == E4M3 and b_dtype == E4M3)


def _scaled_mm_cuda(qa: torch.Tensor, qb: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                    rowwise: bool, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """The hardware path: row-major qa [M, K] times column-major qb [K, N] (copied into that layout unless it is
    already: a weight's cached copy is, `column_major`), each scaled back by its inverse scale (0-dim per tensor;
    [M, 1] and [1, N] per row, which needs a bf16 output), written in `out_dtype` by the GEMM itself."""
    inv_a, inv_b = inverse_scale(a_scale).contiguous(), inverse_scale(b_scale).contiguous()
    gemm_dtype = torch.bfloat16 if rowwise else out_dtype
    out = torch._scaled_mm(qa.contiguous(), column_major(qb), scale_a=inv_a, scale_b=inv_b, out_dtype=gemm_dtype,
                           use_fast_accum=fast_accum)
    return out.to(out_dtype)


def inverse_scale(scale: torch.Tensor) -> torch.Tensor:
    """What torch._scaled_mm multiplies an FP8 operand by to scale it back: 1 / its scale, in fp32."""
    return scale.float().reciprocal()


def column_major(q: torch.Tensor) -> torch.Tensor:
    """q [K, N] with K contiguous, the layout torch._scaled_mm wants its second operand in (a view when it is)."""
    return q.t().contiguous().t()


def scaled_mm_runs(device: torch.device) -> bool:
    """Whether FP8 GEMMs on `device` can take the hardware path (then a cached weight is kept in its layout)."""
    capability = _fp8_capability(device)
    return capability is not None and capability >= (8, 9) and compat.scaled_mm_available()


def scaled_mm(qa: torch.Tensor, qb: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
              out_dtype: torch.dtype = torch.float32, fast_accum: bool = False) -> torch.Tensor:
    """qa [M, K] @ qb [K, N] -> [M, N] in `out_dtype` for FP8 operands quantized with these scales (`quantize`):
    0-dim tensors (per tensor), or a_scale [M, 1] and b_scale [1, N] (per row of a and per column of b,
    i.e. one scale per K-vector). torch._scaled_mm where the device and shapes allow, writing `out_dtype` (bf16
    activations straight from the GEMM); else the emulation: dequantize exactly, multiply in fp32, round to
    `out_dtype` (the two differ only in summation order). `fast_accum`: the hardware's fast accumulation (module
    docstring), for a forward GEMM."""
    rowwise = a_scale.numel() > 1 or b_scale.numel() > 1
    if _scaled_mm_available(qa, qb, qa.dtype, qb.dtype, rowwise):
        return _scaled_mm_cuda(qa, qb, a_scale, b_scale, rowwise, out_dtype, fast_accum)
    return ((qa.float() / a_scale) @ (qb.float() / b_scale)).to(out_dtype)
