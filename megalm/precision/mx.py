"""OCP Microscaling (MX) formats v1.0: blocks of 32 low-precision elements sharing one power-of-two scale.

An MX block is k elements P_i of a small float format plus one E8M0 scale X = 2^s, and represents
v_i = X * P_i (OCP Microscaling Formats (MX) Specification v1.0). Quantizing a block:

    s   = floor(log2(amax)) - emax_elem      clamped to [-127, 127]   ("floor", the spec)
    P_i = round(v_i / X)                     saturating to +-max of the element format

emax_elem is the exponent of the element format's largest normal number, so the block's largest
element lands in [2^emax, 2^(emax+1)). That range can exceed the format's max (6 for E2M1, 448 for
E4M3): the top of it is clipped. scale_mode="ceil" picks the smallest power of two with
amax / X <= max instead, so nothing clips (at the cost of one binade of resolution sometimes).

Element formats (sign, exponent bits, mantissa bits; all with subnormals):

    name  bits  bias  emax  max      notes
    e2m1   4     1     2    6.0      MXFP4
    e2m3   6     1     2    7.5      MXFP6
    e3m2   6     3     4    28.0     MXFP6
    e4m3   8     7     8    448.0    MXFP8; S.1111.111 is NaN, no Inf (torch.float8_e4m3fn)
    e5m2   8    15    15    57344.0  MXFP8; exponent 11111 is Inf/NaN (torch.float8_e5m2)

Rounding is to nearest, ties to even, or stochastic (`rounding="stochastic"`): an element between
grid points lo < v < hi becomes hi with probability (v - lo) / (hi - lo), so E[q(v)] = v. SR is
unbiased only where it cannot clip; with floor scales it can (amax / X reaches almost 2^(emax+1)),
so, as in "Training LLMs with MXFP4" (Tseng, Yu & Park 2025, arXiv 2502.20586), SR first
multiplies the scaled block by 3/4: 3/4 * 2^(emax+1) = 1.5 * 2^emax <= max for every format here,
so the block never clips, and the dequantized value is multiplied by 4/3 again (a GEMM whose two
operands both carry 3/4 can instead scale its output by 16/9).

Special values: a block of zeros is exact (its scale is 2^-127); a block holding a NaN or an Inf
becomes all NaN (the E8M0 NaN scale, code 255). Blocks run along one dimension `dim`; when its
length is not a multiple of the block size the last block is padded with zeros (which change
neither its amax nor the other elements) and the padding is dropped again on the way out.

All arithmetic is fp32 (bf16/fp16 inputs are widened first) and exact up to the rounding to the
element format (and the one fp32 rounding of the 3/4 prescale): scales are powers of two built from
exponent bits, and floor(log2 amax) comes from torch.frexp, never from a float log2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SCALE_EMIN, SCALE_EMAX = -127, 127  # E8M0: code c in [0, 254] means 2^(c - 127); 255 is NaN
SCALE_NAN_CODE = 255
SR_PRESCALE = 0.75  # Tseng et al.: scale by 3/4 before stochastic rounding so nothing clips


@dataclass(frozen=True)
class ElemFormat:
    """A small float format: 1 sign bit, `ebits` exponent bits, `mbits` mantissa bits, subnormals."""

    name: str
    ebits: int
    mbits: int
    max: float  # largest finite magnitude (saturation target)

    @property
    def bias(self) -> int:
        return 2 ** (self.ebits - 1) - 1

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number; subnormals share its quantum 2^(emin - mbits)."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest normal number (the spec's emax_elem): max = m * 2^emax, 1 <= m < 2."""
        return math.frexp(self.max)[1] - 1

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits


FORMATS: dict[str, ElemFormat] = {
    "e2m1": ElemFormat("e2m1", 2, 1, 6.0),
    "e2m3": ElemFormat("e2m3", 2, 3, 7.5),
    "e3m2": ElemFormat("e3m2", 3, 2, 28.0),
    "e4m3": ElemFormat("e4m3", 4, 3, 448.0),
    "e5m2": ElemFormat("e5m2", 5, 2, 57344.0),
}
_ALIASES = {"fp4": "e2m1", "fp4_e2m1": "e2m1", "fp6_e2m3": "e2m3", "fp6_e3m2": "e3m2",
            "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2"}


def get_format(fmt: str | ElemFormat) -> ElemFormat:
    """The ElemFormat named `fmt` (e2m1 | e2m3 | e3m2 | e4m3 | e5m2, or fp4 / fp6_e2m3 / fp8_e4m3 ...)."""
    if isinstance(fmt, ElemFormat):
        return fmt
    name = _ALIASES.get(fmt.lower(), fmt.lower())
    if name not in FORMATS:
        raise ValueError(f"unknown MX element format {fmt!r}; expected one of {sorted(FORMATS)}")
    return FORMATS[name]


def _exp2(k: torch.Tensor) -> torch.Tensor:
    """2^k as fp32 for integer k in [-149, 127], exactly: built from the exponent bits (subnormals too)."""
    k = k.to(torch.int32)
    normal = ((k + 127).clamp(min=1) << 23).view(torch.float32)
    subnormal = (torch.ones_like(k) << (k + 149).clamp(0, 22)).view(torch.float32)
    return torch.where(k >= -126, normal, subnormal)


def _exp2_normal(k: torch.Tensor) -> torch.Tensor:
    """2^k for int32 k in [-126, 127] (the fast path, no range checks)."""
    return ((k + 127) << 23).view(torch.float32)


# ---------------------------------------------------------------------------------------------------
# Blocks
# ---------------------------------------------------------------------------------------------------


def _to_blocks(x: torch.Tensor, block_size: int, dim: int) -> torch.Tensor:
    """x -> fp32 blocks: `dim` (normalized, >= 0) zero-padded to whole blocks and split into
    (n_blocks, block_size), so the block's elements run along axis dim + 1. A view of x where possible:
    blocking along any dim needs no transpose."""
    xf = x.float()
    pad = -xf.shape[dim] % block_size
    if pad:
        xf = torch.nn.functional.pad(xf.movedim(dim, -1), (0, pad)).movedim(-1, dim)
    return xf.unflatten(dim, (-1, block_size))


def _from_blocks(blocks: torch.Tensor, shape: torch.Size, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `_to_blocks`: merge (n_blocks, block_size) back into `dim` and drop the padding."""
    return blocks.flatten(dim, dim + 1).narrow(dim, 0, shape[dim]).to(dtype)


def _scale_exponent(
    blocks: torch.Tensor, axis: int, fmt: ElemFormat, scale_mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block scale exponent s (int32, size 1 along the block `axis`) and whether the block is finite.

    floor: s = floor(log2 amax) - emax. ceil: one more where amax / 2^s would exceed the format's max.
    amax = m * 2^e with m in [0.5, 1) (frexp), so floor(log2 amax) = e - 1 and amax / 2^s = 2m * 2^emax.
    """
    amax = torch.maximum(blocks.amax(dim=axis, keepdim=True), -blocks.amin(dim=axis, keepdim=True))  # NaN propagates
    mantissa, exponent = torch.frexp(amax)
    s = exponent - 1 - fmt.emax
    if scale_mode == "ceil":
        s = s + (mantissa * 2.0 ** (fmt.emax + 1) > fmt.max).to(s.dtype)
    elif scale_mode != "floor":
        raise ValueError(f"scale_mode must be 'floor' or 'ceil', got {scale_mode!r}")
    s = torch.where(amax == 0, SCALE_EMIN, s).clamp(SCALE_EMIN, SCALE_EMAX)
    return s.to(torch.int32), torch.isfinite(amax)


def _round_(a: torch.Tensor, fmt: ElemFormat, rounding: str, generator: torch.Generator | None) -> torch.Tensor:
    """Round fp32 magnitudes `a` (>= 0, or NaN) to the grid of `fmt` in place, saturating at its max.

    The grid spacing around a is 2^(e - mbits) with e = clamp(floor(log2 a), emin, emax): below 2^emin
    (subnormals) it stays 2^(emin - mbits); values past the top binade use its spacing, round to >= max
    and saturate. e is read from the fp32 exponent bits: exact, and far faster than frexp per element.

    nearest: (a + c) - c with c = 2^(e - mbits + 23) rounds a to a multiple of the spacing, ties to
    even, in one fp32 addition: a + c lies in [c, 2c), where fp32's spacing is exactly c / 2^23.
    stochastic: floor(a / spacing + u) * spacing with u ~ U[0, 1) from `generator`: rounds up with
    probability equal to the fractional part, so E[q] = a (to the 24 bits of u).
    Everything is in place on `a` or on one int32 buffer (a fresh large tensor costs more than an op).
    """
    e = (a.view(torch.int32) >> 23).clamp_(fmt.emin + 127, fmt.emax + 127)  # biased exponent of a
    if rounding == "nearest":
        c = e.add_(23 - fmt.mbits).bitwise_left_shift_(23).view(torch.float32)
        a.add_(c).sub_(c)
    elif rounding == "stochastic":
        inv_spacing = e.neg_().add_(2 * 127 + fmt.mbits).bitwise_left_shift_(23).view(torch.float32)
        a.mul_(inv_spacing)
        a.add_(torch.rand(a.shape, generator=generator, device=a.device, dtype=a.dtype)).floor_()
        spacing = e.neg_().add_(2 * 127 << 23).view(torch.float32)  # bits of 2^k + bits of 2^-k = 254 << 23
        a.mul_(spacing)
    else:
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    return a.clamp_(max=fmt.max)


def round_to_format(
    v: torch.Tensor,
    fmt: str | ElemFormat,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """fp32 copy of v rounded to the element format: to nearest (ties to even) or stochastically,
    saturating to +-max, signs (and -0) kept, NaN kept."""
    return _round_(v.float().abs(), get_format(fmt), rounding, generator).copysign_(v)


def _quantize_blocks(
    blocks: torch.Tensor,
    axis: int,
    fmt: ElemFormat,
    rounding: str,
    scale_mode: str,
    prescale: float,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 blocks (elements along `axis`) -> (elements: values of `fmt` in units of the block scale, NaN
    in a non-finite block; scale exponents s and finite mask, both of size 1 along `axis`)."""
    s, finite = _scale_exponent(blocks, axis, fmt, scale_mode)
    # 1 / 2^s (exact) times the prescale, per block; NaN for a non-finite block makes all its elements NaN.
    factor = torch.where(finite, _exp2(-s) * prescale, float("nan"))
    elements = _round_((blocks * factor).abs_(), fmt, rounding, generator).copysign_(blocks)
    return elements, s, finite


def _dequant_factor(s: torch.Tensor, prescale: float) -> torch.Tensor:
    """Per-block 2^s / prescale: what element values are multiplied by to dequantize."""
    return _exp2(s) / prescale if prescale != 1.0 else _exp2(s)


def resolve_prescale(prescale: float | None, rounding: str, scale_mode: str) -> float:
    """Default: 3/4 for stochastic rounding with floor scales (the only case that could clip), else 1."""
    if prescale is not None:
        return float(prescale)
    return SR_PRESCALE if rounding == "stochastic" and scale_mode == "floor" else 1.0


def mx_quantize_dequantize(
    x: torch.Tensor,
    fmt: str | ElemFormat,
    block_size: int = 32,
    dim: int = -1,
    rounding: str = "nearest",
    scale_mode: str = "floor",
    generator: torch.Generator | None = None,
    prescale: float | None = None,
) -> torch.Tensor:
    """x rounded through MX format `fmt` with blocks of `block_size` along `dim`; same shape and dtype.

    rounding: "nearest" (ties to even) | "stochastic" (draws from `generator`; pass one for
    reproducibility). scale_mode: "floor" (OCP spec) | "ceil" (no clipping). prescale: the factor
    applied to the scaled block before rounding and divided out after; None = 3/4 for stochastic
    rounding with floor scales (Tseng et al.), 1 otherwise. With a prescale other than 1 the values
    (grid x 2^s / prescale) are exact in fp32, not in bf16: a bf16 x comes back with 4/3 rounded up to
    1.3359, a +0.11% bias in stochastic rounding's mean (an audit, 2026-12-07). The GEMMs are not
    affected: they take their operands in fp32 (megalm/precision/gemm.py); pass x.float() for an
    unbiased result.
    """
    fmt = get_format(fmt)
    prescale = resolve_prescale(prescale, rounding, scale_mode)
    dim = dim % x.dim()
    blocks = _to_blocks(x, block_size, dim)
    elements, s, _ = _quantize_blocks(blocks, dim + 1, fmt, rounding, scale_mode, prescale, generator)
    return _from_blocks(elements.mul_(_dequant_factor(s, prescale)), x.shape, dim, x.dtype)


# ---------------------------------------------------------------------------------------------------
# Packed form: element codes and E8M0 scales as bytes
# ---------------------------------------------------------------------------------------------------


@dataclass
class MXTensor:
    """An MX-quantized tensor in its storage form.

    codes   uint8, x's shape with `dim` (padded to whole blocks) split into (n_blocks, block_size); bit
            pattern sign | exponent | mantissa of the element format. FP4 (e2m1) is packed two per byte,
            (n_blocks, block_size // 2): element 2i of a block in the low nibble, 2i + 1 in the high one.
    scales  uint8, x's shape with `dim` replaced by n_blocks: E8M0, scale = 2^(code - 127); 255 is NaN
            (a block that held a NaN or an Inf).
    prescale: what the elements were multiplied by before rounding (3/4 for stochastic rounding);
            `mx_dequantize` divides it out.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    fmt: ElemFormat
    block_size: int
    dim: int
    shape: torch.Size
    dtype: torch.dtype
    prescale: float = 1.0


def encode_elements(values: torch.Tensor, fmt: str | ElemFormat) -> torch.Tensor:
    """Representable values of `fmt` (fp32; NaN -> 0) -> uint8 codes sign | exponent | mantissa."""
    fmt = get_format(fmt)
    a = torch.nan_to_num(values.abs(), nan=0.0)
    e = ((a.view(torch.int32) >> 23) - 127).clamp(min=fmt.emin)
    subnormal = a < 2.0**fmt.emin
    exp_field = torch.where(subnormal, 0, e + fmt.bias)
    # normal: a = 2^e (1 + m / 2^mbits); subnormal: a = 2^emin * m / 2^mbits
    mant = a * _exp2_normal(fmt.mbits - e) - torch.where(subnormal, 0.0, 2.0**fmt.mbits)
    sign = torch.signbit(values) & ~torch.isnan(values)
    code = (sign.to(torch.int32) << (fmt.ebits + fmt.mbits)) | (exp_field << fmt.mbits) | mant.to(torch.int32)
    return code.to(torch.uint8)


def decode_elements(codes: torch.Tensor, fmt: str | ElemFormat) -> torch.Tensor:
    """uint8 codes of `fmt` -> fp32 values (NaN/Inf codes of e4m3/e5m2 never occur in MX elements)."""
    fmt = get_format(fmt)
    c = codes.to(torch.int32)
    sign = (c >> (fmt.ebits + fmt.mbits)) & 1
    exp_field = (c >> fmt.mbits) & ((1 << fmt.ebits) - 1)
    mant = (c & ((1 << fmt.mbits) - 1)).float()
    subnormal = exp_field == 0
    significand = torch.where(subnormal, mant, mant + 2.0**fmt.mbits)
    e = torch.where(subnormal, fmt.emin, exp_field - fmt.bias)
    value = significand * _exp2_normal(e - fmt.mbits)
    return torch.where(sign.bool(), -value, value)


def mx_quantize(
    x: torch.Tensor,
    fmt: str | ElemFormat,
    block_size: int = 32,
    dim: int = -1,
    rounding: str = "nearest",
    scale_mode: str = "floor",
    generator: torch.Generator | None = None,
    prescale: float | None = None,
) -> MXTensor:
    """x -> MXTensor (element codes and E8M0 scales); arguments as for `mx_quantize_dequantize`,
    and `mx_dequantize(mx_quantize(x, ...))` equals `mx_quantize_dequantize(x, ...)` for the same draws."""
    fmt = get_format(fmt)
    if fmt.bits == 4 and block_size % 2:
        raise ValueError(f"FP4 packs two elements per byte: block_size must be even, got {block_size}")
    prescale = resolve_prescale(prescale, rounding, scale_mode)
    dim = dim % x.dim()
    axis = dim + 1
    elements, s, finite = _quantize_blocks(_to_blocks(x, block_size, dim), axis, fmt, rounding, scale_mode,
                                           prescale, generator)
    codes = encode_elements(elements, fmt)
    if fmt.bits == 4:
        pairs = codes.unflatten(axis, (-1, 2))
        codes = pairs.select(axis + 1, 0) | (pairs.select(axis + 1, 1) << 4)
    scales = torch.where(finite, s + 127, SCALE_NAN_CODE).squeeze(axis).to(torch.uint8)
    return MXTensor(codes, scales, fmt, block_size, dim, x.shape, x.dtype, prescale)


def mx_dequantize(t: MXTensor) -> torch.Tensor:
    """MXTensor -> tensor of its original shape and dtype."""
    axis = t.dim + 1
    codes = t.codes
    if t.fmt.bits == 4:
        codes = torch.stack([codes & 0xF, codes >> 4], dim=axis + 1).flatten(axis, axis + 1)
    s = t.scales.to(torch.int32).unsqueeze(axis)
    factor = torch.where(s == SCALE_NAN_CODE, float("nan"), _dequant_factor(s.clamp(max=254) - 127, t.prescale))
    return _from_blocks(decode_elements(codes, t.fmt).mul_(factor), t.shape, t.dim, t.dtype)
