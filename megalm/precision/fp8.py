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

`scaled_mm(a, b, ...)` computes a @ b from the quantized operands. On a CUDA GPU of compute
capability 8.9+ (Ada, Hopper, Blackwell) with dimensions that are multiples of 16 it calls
torch._scaled_mm; everywhere else it emulates: cast to the torch float8 dtype and back (which rounds
exactly like the hardware cast), then an fp32 matmul. The two differ only in summation order.
"""

from __future__ import annotations

import torch

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


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """x -> FP8 tensor of x * scale, saturated to +-max, rounded to nearest even."""
    limit = fp8_max(dtype)
    return (x.float() * scale).clamp_(-limit, limit).to(dtype)


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
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"emulated in fp32 (no FP8 GEMMs on {device.type})"
    if not hasattr(torch, "_scaled_mm") or torch.cuda.get_device_capability(device) < (8, 9):
        return "emulated in fp32 (FP8 GEMMs need compute capability 8.9+)"
    return ("torch._scaled_mm (emulated where a dimension is not a multiple of 16, for E5M2 x E5M2, "
            "and for E5M2 under per-row scales)")


def _scaled_mm_available(a: torch.Tensor, b: torch.Tensor, a_dtype: torch.dtype, b_dtype: torch.dtype,
                         rowwise: bool) -> bool:
    """Whether torch._scaled_mm can run a [M, K] @ b [K, N]: detected from the device, never assumed."""
    if a.device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    if torch.cuda.get_device_capability(a.device) < (8, 9):
        return False
    if any(n % 16 for n in (*a.shape, b.shape[1])):
        return False
    if a_dtype == E5M2 and b_dtype == E5M2:  # no e5m2 x e5m2 kernel
        return False
    return not rowwise or (a_dtype == E4M3 and b_dtype == E4M3)


def _scaled_mm_cuda(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                    a_dtype: torch.dtype, b_dtype: torch.dtype, rowwise: bool) -> torch.Tensor:
    """The hardware path: row-major a_fp8 [M, K] times column-major b_fp8 [K, N], each scaled back by its
    inverse scale (0-dim per tensor; [M, 1] and [1, N] per row, which needs a bf16 output)."""
    qa = quantize(a, a_dtype, a_scale).contiguous()
    qb = quantize(b, b_dtype, b_scale).t().contiguous().t()
    inv_a, inv_b = a_scale.float().reciprocal(), b_scale.float().reciprocal()
    out_dtype = torch.bfloat16 if rowwise else torch.float32
    return torch._scaled_mm(qa, qb, scale_a=inv_a, scale_b=inv_b, out_dtype=out_dtype).float()


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    a_dtype: torch.dtype = E4M3,
    b_dtype: torch.dtype = E4M3,
) -> torch.Tensor:
    """a [M, K] @ b [K, N] -> fp32 [M, N], both operands cast to FP8 (torch._scaled_mm's convention).

    Scales multiply before the cast: 0-dim tensors (per tensor), or a_scale [M, 1] and b_scale [1, N]
    (per row of a and per column of b, i.e. one scale per K-vector).
    """
    rowwise = a_scale.numel() > 1 or b_scale.numel() > 1
    if _scaled_mm_available(a, b, a_dtype, b_dtype, rowwise):
        return _scaled_mm_cuda(a, b, a_scale, b_scale, a_dtype, b_dtype, rowwise)
    return quantize_dequantize(a, a_dtype, a_scale) @ quantize_dequantize(b, b_dtype, b_scale)
