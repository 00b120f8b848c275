"""FP8 GEMMs with per-tensor (current or delayed) and per-row scaling; emulated in fp32 where there is
no FP8 hardware.

FP8 has too little range for raw activations and gradients, so a tensor is multiplied by a scale
before the cast and divided by it afterwards (Micikevicius et al. 2022, "FP8 Formats for Deep
Learning"):

    x_fp8 = cast(clamp(x * scale, -max, max)),   x ~ x_fp8 / scale,   scale = max / amax

E4M3 (max 448, 3 mantissa bits) for forward operands, E5M2 (max 57344, more range, 2 mantissa bits)
for gradients. Where amax comes from:

    current  amax of this very tensor (one extra pass over it; what torchao's "tensorwise" does)
    delayed  max of the amaxes of the last `history_len` uses (Transformer Engine's default): no pass
             before the cast, but a tensor that grew since then is clipped. The current amax is
             pushed to the history after use.
    rowwise  one scale per row of an operand along the GEMM's reduction dim K (DeepSeek-V3 style
             fine-grained scaling, coarser): outliers only hurt their own row.

`quantize(x, dtype, scale)` casts (on CUDA in one fused kernel straight from bf16, never through an fp32
copy), and `scaled_mm(qa, qb, ...)` multiplies the FP8 operands. On a CUDA GPU of compute capability 8.9+
(Ada, Hopper, Blackwell) with dimensions that are multiples of 16 it calls torch._scaled_mm; everywhere
else it emulates: dequantize (exact) and an fp32 matmul. The two differ only in summation order; the FP8
values are the same, since torch's cast to float8 rounds like the hardware's.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

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


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value: 448 (e4m3fn), 57344 (e5m2)."""
    return float(torch.finfo(dtype).max)


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """scale = max / amax / 2^margin (fp32); 1 where amax is 0 or not finite (nothing to fit)."""
    amax = amax.float()
    scale = fp8_max(dtype) / amax / 2.0**margin
    return torch.where((amax > 0) & torch.isfinite(amax), scale, torch.ones_like(scale))


def tensor_scale(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Current per-tensor scale of x (a 0-dim fp32 tensor)."""
    return scale_from_amax(x.detach().abs().amax(), dtype)


def rowwise_scale(x: torch.Tensor, dtype: torch.dtype, dim: int = -1) -> torch.Tensor:
    """One scale per row of x along `dim` (the GEMM's K), with `dim` kept as size 1 for broadcasting."""
    return scale_from_amax(x.detach().abs().amax(dim=dim, keepdim=True), dtype)


def _quantize_math(x: torch.Tensor, scale: torch.Tensor, limit: float, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * scale).clamp(-limit, limit).to(dtype)


def _scale_layout(scale: torch.Tensor) -> str:
    """How `scale` (as many dims as x) broadcasts over x: one scale, one per row, or one per column."""
    if scale.numel() == 1:
        return "tensor"
    return "row" if scale.shape[-1] == 1 else "column"


@functools.cache
def _quantize_fused(x_dtype: torch.dtype, dtype: torch.dtype, layout: str) -> Callable[..., torch.Tensor]:
    """`_quantize_math` compiled by torch.compile for one variant (x dtype, FP8 dtype, scale layout), with
    dynamic shapes: one kernel that reads x in its own dtype (bf16 activations and gradients), multiplies and
    clamps in fp32 registers and writes FP8, where eager PyTorch would write an fp32 copy of x first. It computes
    the same values bit for bit (tests/unit/test_precision_weight_cache.py compiles it on CPU and compares).

    Each variant compiles a copy of `_quantize_math` with a code object of its own: dynamo counts a function's
    graphs per code object and, past its recompile limit (8), fails a fullgraph compile. Up to 3 x 2 x 3 = 18
    variants would pass it if they shared one; one graph per code object keeps every variant compiled without
    raising that process-wide limit (tests/unit/test_compile_recompiles.py runs it over a training run's
    shapes and bounds the count)."""
    name = f"_quantize_{str(x_dtype).removeprefix('torch.')}_to_{str(dtype).removeprefix('torch.')}_{layout}"
    code = _quantize_math.__code__.replace(co_name=name)
    variant = types.FunctionType(code, _quantize_math.__globals__, name)
    return torch.compile(variant, dynamic=True, fullgraph=True)


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """x -> FP8 tensor of x * scale (in fp32), saturated to +-max, rounded to nearest even.

    On CUDA one fused kernel straight from x's dtype (no fp32 copy of a bf16 x in memory); elsewhere eager
    PyTorch, the reference. The fused kernel is compiled once per (x dtype, FP8 dtype, scale layout): x
    contiguous and the scale as many dims as x (a 0-dim scale is viewed as [1, 1]) so that layouts do not
    multiply its variants."""
    if not x.is_cuda or compat.is_fake(x):  # fake tensors (the fake-CUDA tier): the values, no kernel to compile
        return _quantize_math(x, scale, fp8_max(dtype), dtype)
    return quantize_compiled(x, dtype, scale)


def quantize_compiled(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """`quantize`'s CUDA path on any device: the compiled kernel, called as `quantize` calls it. x is detached
    (the cast has no gradient): dynamo guards on the type and requires_grad of its input and keeps a parameter's
    shape static, so passing weights as Parameters would compile one graph per weight shape."""
    scale = scale.reshape([1] * x.dim()) if scale.dim() == 0 else scale
    fused = _quantize_fused(x.dtype, dtype, _scale_layout(scale))
    return fused(x.detach().contiguous(), scale.detach(), fp8_max(dtype), dtype)


def quantize_dequantize(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """fp32 x rounded through FP8 with this scale: quantize(x) / scale."""
    return quantize(x, dtype, scale).float() / scale


class AmaxHistory:
    """The amax history of one tensor for delayed scaling: a ring of the last `length` amaxes, on
    the tensor's device (no host syncs). `scale` uses the max of the history, or the current amax
    while the history is empty; call `update` with the current amax after use."""

    def __init__(self, length: int = 16) -> None:
        self.length = length
        self.history: torch.Tensor | None = None
        self.count = 0

    def scale(self, current_amax: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
        amax = current_amax if self.history is None else self.history.amax()
        return scale_from_amax(amax, dtype, margin)

    def update(self, amax: torch.Tensor) -> None:
        if self.history is None:
            self.history = torch.zeros(self.length, dtype=torch.float32, device=amax.device)
        self.history[self.count % self.length] = amax.detach().float()
        self.count += 1

    def state_dict(self) -> dict:
        return {"history": self.history, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.history, self.count = state["history"], state["count"]


# ---------------------------------------------------------------------------------------------------
# GEMM
# ---------------------------------------------------------------------------------------------------


SCALED_MM_TOKEN_MULTIPLE = 16  # torch._scaled_mm needs every GEMM dimension, the tokens too, divisible by 16


def gemm_path(device: torch.device) -> str:
    """Where FP8 GEMMs run on `device`, for the log: torch._scaled_mm, or the fp32 emulation and why."""
    capability = compat.cuda_capability(device)
    if capability is None:
        return f"emulated in fp32 (no FP8 GEMMs on {device.type})"
    if not compat.scaled_mm_available() or capability < (8, 9):
        return "emulated in fp32 (FP8 GEMMs need compute capability 8.9+)"
    return ("torch._scaled_mm (emulated where a dimension is not a multiple of 16, for E5M2 x E5M2, "
            "and for E5M2 under per-row scales)")


def _scaled_mm_available(a: torch.Tensor, b: torch.Tensor, a_dtype: torch.dtype, b_dtype: torch.dtype,
                         rowwise: bool) -> bool:
    """Whether torch._scaled_mm can run a [M, K] @ b [K, N]: detected from the device, never assumed."""
    capability = compat.cuda_capability(a.device)
    if capability is None or capability < (8, 9) or not compat.scaled_mm_available():
        return False
    if any(n % 16 for n in (*a.shape, b.shape[1])):
        return False
    if a_dtype == E5M2 and b_dtype == E5M2:  # no e5m2 x e5m2 kernel
        return False
    return not rowwise or (a_dtype == E4M3 and b_dtype == E4M3)


def _scaled_mm_cuda(qa: torch.Tensor, qb: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                    rowwise: bool) -> torch.Tensor:
    """The hardware path: row-major qa [M, K] times column-major qb [K, N], each scaled back by its
    inverse scale (0-dim per tensor; [M, 1] and [1, N] per row, which needs a bf16 output)."""
    inv_a = a_scale.float().reciprocal().contiguous()
    inv_b = b_scale.float().reciprocal().contiguous()
    out_dtype = torch.bfloat16 if rowwise else torch.float32
    return torch._scaled_mm(qa.contiguous(), qb.t().contiguous().t(), scale_a=inv_a, scale_b=inv_b,
                            out_dtype=out_dtype).float()


def scaled_mm(qa: torch.Tensor, qb: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """qa [M, K] @ qb [K, N] -> fp32 [M, N] for FP8 operands quantized with these scales (`quantize`):
    0-dim tensors (per tensor), or a_scale [M, 1] and b_scale [1, N] (per row of a and per column of b,
    i.e. one scale per K-vector). torch._scaled_mm where the device and shapes allow, else the emulation:
    dequantize exactly and multiply in fp32 (the two differ only in summation order)."""
    rowwise = a_scale.numel() > 1 or b_scale.numel() > 1
    if _scaled_mm_available(qa, qb, qa.dtype, qb.dtype, rowwise):
        return _scaled_mm_cuda(qa, qb, a_scale, b_scale, rowwise)
    return (qa.float() / a_scale) @ (qb.float() / b_scale)
