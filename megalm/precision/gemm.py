"""One GEMM of a low-precision linear layer: operands quantized along the GEMM's K as a `GemmSpec` says, then
multiplied, on the fastest path the device has (megalm/precision/linear.py composes three of them into a layer
under a recipe and says which path runs where; recipes.py has the formats and the measured errors):

    fp32 / bf16  an fp32 matmul of the (bf16-rounded) operands; on CUDA, bf16 a bf16 GEMM with fp32 output
    fp8          `fp8.quantize` (one fused cast on CUDA) and `fp8.scaled_mm` (torch._scaled_mm on 8.9+)
    mx           on CUDA the Triton quantizer into bf16 and a bf16 GEMM (`mx_gemm_fused`); elsewhere the
                 PyTorch reference (megalm.precision.mx), after the random Hadamard transform when asked
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import torch

from megalm import compat
from megalm.precision import fp8
from megalm.precision.hadamard import random_signs, rht
from megalm.precision.kernels.mx_triton import BLOCK_SIZE, RHT_BLOCK, mx_quantize_triton, triton_available
from megalm.precision.mx import mx_quantize_dequantize, resolve_prescale

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GemmSpec:
    """How one GEMM rounds its operands a (first) and b (second), both along the GEMM's K.

    kind: fp32 | bf16 | fp8 | mx. a_format / b_format: e4m3 | e5m2 for fp8, an MX element format for mx.
    scaling: fp8: tensor | delayed | row; mx: floor | ceil. rounding (mx): nearest | stochastic.
    rht (mx): random Hadamard transform of rht_block along K before quantizing.
    fast_accum (fp8): torch._scaled_mm's fast accumulation, no fp32 promotion of the partial sums (fp8.py; a forward
    GEMM's, as in TE and torchao).
    """

    kind: str = "fp32"
    a_format: str = "e4m3"
    b_format: str = "e4m3"
    scaling: str = "tensor"
    rounding: str = "nearest"
    rht: bool = False
    block_size: int = 32
    rht_block: int = 64
    fast_accum: bool = False

    @property
    def random(self) -> bool:
        return self.kind == "mx" and (self.rht or self.rounding == "stochastic")


def hash_seed(*parts: object) -> int:
    """A 63-bit seed from any printable parts (stable across processes, unlike hash())."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


Fp8Operand = tuple[torch.Tensor, torch.Tensor]  # (FP8 tensor in the operand's own layout, its scale)


def fp8_operand(spec: GemmSpec, t: torch.Tensor, k_dim: int, fmt: str, scale: torch.Tensor | None = None
                ) -> Fp8Operand:
    """t quantized to FP8 for a GEMM whose K is t's dim `k_dim`: per-row scales along K (spec.scaling
    row), else the given per-tensor scale (None: t's current amax, computed with the cast). Kept in t's layout:
    transposing an FP8 tensor is a view, and the scale (0-dim, or size 1 along K) transposes with it."""
    dtype = fp8.fp8_dtype(fmt)
    if spec.scaling == "row":
        return fp8.quantize_current(t, dtype, dim=k_dim)
    if scale is None:
        return fp8.quantize_current(t, dtype)
    return fp8.quantize(t, dtype, scale), scale


def mx_gemm_fused(device: torch.device) -> bool:
    """Whether MX GEMMs on `device` run fused: the Triton quantizer (RHT, scale, rounding in one pass) and
    a bf16 GEMM of the dequantized operands. On CUDA with triton; elsewhere the PyTorch reference."""
    return device.type == "cuda" and triton_available(device)


def mx_gemm_path(device: torch.device) -> str:
    """Where MX GEMMs run on `device`, for the log."""
    if mx_gemm_fused(device):
        return "Triton quantizer + bf16 GEMM"
    if device.type != "cuda":
        why = f"no fused kernels on {device.type}"
    elif not compat.triton_importable():
        why = "triton is not importable"
    else:
        why = f"Triton kernels need compute capability 7.0+, this GPU has {compat.cuda_capability(device)}"
    return f"emulated in fp32 ({why})"


def mm_bf16(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """a [M, K] @ b [K, N] for operands whose values are exact in bf16, in `out_dtype`: on CUDA a bf16 GEMM with
    fp32 accumulation writing it (bf16 directly, or fp32); elsewhere an fp32 matmul rounded to it (the reference)."""
    if a.is_cuda and out_dtype == torch.bfloat16:
        return torch.mm(a.to(torch.bfloat16), b.to(torch.bfloat16))
    if a.is_cuda and compat.mm_out_dtype_available():
        return torch.mm(a.to(torch.bfloat16), b.to(torch.bfloat16), out_dtype=torch.float32).to(out_dtype)
    return (a.float() @ b.float()).to(out_dtype)


def _mx_gemm_triton(spec: GemmSpec, a: torch.Tensor, a_dim: int, b: torch.Tensor, b_dim: int,
                    signs: torch.Tensor | None, seed: int, out_dtype: torch.dtype) -> torch.Tensor:
    """The fused MX GEMM: each operand, as [rows, K] (a transposed view where K is dim 0), goes through the
    Triton quantizer (RHT, E8M0 scale, rounding) to bf16 values q * 2^s (exact: the prescale of stochastic
    rounding is left in), then one bf16 GEMM; the two prescales are divided out of its output."""
    rows_k = lambda t, k_dim: t if k_dim == t.dim() - 1 else t.t()
    prescale = resolve_prescale(None, spec.rounding, spec.scaling)
    quantized = [
        mx_quantize_triton(rows_k(t, k_dim), fmt, spec.rounding, spec.scaling, signs, hash_seed(seed, operand),
                           out_dtype=torch.bfloat16, divide_prescale=False)
        for t, k_dim, fmt, operand in ((a, a_dim, spec.a_format, "a"), (b, b_dim, spec.b_format, "b"))
    ]
    if prescale == 1.0:
        return mm_bf16(quantized[0], quantized[1].t(), out_dtype)
    return (mm_bf16(quantized[0], quantized[1].t()) * (1.0 / prescale**2)).to(out_dtype)


def gemm(
    spec: GemmSpec,
    a: torch.Tensor,
    a_dim: int,
    b: torch.Tensor,
    b_dim: int,
    generator: torch.Generator | None = None,
    *,
    seed: int | None = None,
    noise: torch.Generator | None = None,
    a_fp8: Fp8Operand | None = None,
    b_fp8: Fp8Operand | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Product of 2-D a and b contracted over their K dims: a's `a_dim` and b's `b_dim` (0 or 1), in `out_dtype`
    (on CUDA the GEMM writes it: bf16 activations need no fp32 copy; elsewhere the fp32 product rounded to it).

    Each operand is quantized along its K dim as `spec` says, with no transposed copies: blocks run
    along whichever dim K is. a_fp8 / b_fp8: an operand already quantized (the call's per-tensor scale shared by
    two GEMMs, a weight's cached FP8 copy); else quantized here (current scaling). MX: RHT signs from
    `generator`; on CUDA the fused path draws its stochastic rounding from `seed` (Triton's Philox), the
    reference from `noise` if given, else from `generator` after the signs.
    """
    as_a = (lambda t: t) if a_dim == 1 else (lambda t: t.t())  # -> [M, K]
    as_b = (lambda t: t) if b_dim == 0 else (lambda t: t.t())  # -> [K, N]
    if spec.kind == "fp32":
        return (as_a(a.float()) @ as_b(b.float())).to(out_dtype)
    if spec.kind == "bf16":
        return mm_bf16(as_a(a.to(torch.bfloat16)), as_b(b.to(torch.bfloat16)), out_dtype)
    if spec.kind == "fp8":
        qa, sa = a_fp8 if a_fp8 is not None else fp8_operand(spec, a, a_dim, spec.a_format)
        qb, sb = b_fp8 if b_fp8 is not None else fp8_operand(spec, b, b_dim, spec.b_format)
        return fp8.scaled_mm(as_a(qa), as_b(qb), as_a(sa) if sa.dim() else sa, as_b(sb) if sb.dim() else sb,
                             out_dtype, spec.fast_accum)
    if spec.kind == "mx":
        signs = random_signs(spec.rht_block, generator, a.device) if spec.rht else None
        if mx_gemm_fused(a.device) and (spec.block_size, spec.rht_block) == (BLOCK_SIZE, RHT_BLOCK):
            if seed is None:  # a standalone call: one draw from the generator (a host sync; GEMMs of a layer pass it)
                seed = int(torch.randint(2**62, (), generator=generator, device=generator.device).item()) \
                    if generator is not None else 0
            return _mx_gemm_triton(spec, a, a_dim, b, b_dim, signs, seed, out_dtype)
        a, b = a.float(), b.float()  # the reference works in fp32
        if spec.rht:
            a, b = rht(a, signs, a_dim, spec.rht_block), rht(b, signs, b_dim, spec.rht_block)
        rounding = noise if noise is not None else generator
        qa = mx_quantize_dequantize(a, spec.a_format, spec.block_size, a_dim, spec.rounding, spec.scaling, rounding)
        qb = mx_quantize_dequantize(b, spec.b_format, spec.block_size, b_dim, spec.rounding, spec.scaling, rounding)
        return (as_a(qa) @ as_b(qb)).to(out_dtype)
    raise ValueError(f"unknown GEMM kind {spec.kind!r}; expected fp32, bf16, fp8 or mx")
