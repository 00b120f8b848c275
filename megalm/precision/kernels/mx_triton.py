"""Fused Triton MX quantization: random Hadamard transform + E8M0 block scale + rounding + packing in one kernel.

`megalm.precision.mx` is the reference: readable PyTorch, exact, and slow on a GPU because it is a chain
of ~15 elementwise and reduction ops (widen to fp32, pad, amax, amin, frexp, scale, abs, exponent bits,
clamp, round, saturate, copysign, dequantize, cast back; the RHT adds a matmul and a copy), each of which
reads and writes the whole fp32 tensor in HBM. For a [8192, 8192] bf16 operand that is ~4-6 GB of
traffic for 128 MiB of input. `mx_quantize_triton` does the same arithmetic in registers: each program
loads a [BLOCK_M, 64] tile once (64 = the RHT block = two MX blocks of 32), optionally multiplies it by
R = diag(signs) H_64 / 8 with `tl.dot`, reduces the block amax, builds the E8M0 scale from the amax's
exponent bits, rounds (nearest-even or stochastic with Philox bits from `seed`), saturates, and writes
either the dequantized values (for the emulated GEMM) or the packed form: uint8 codes (FP4 two per byte)
and uint8 E8M0 scales, the byte layout of `mx.MXTensor`. One read of the input and one write of the
output, so the kernel is bandwidth-bound:

    [8192, 8192] bf16 in   -> bf16 dequantized out: 268 MB moved; at ~85% of 3.35 TB/s (H100) ~ 95 us
                           -> packed FP4 + scales:  170 MB moved;                           ~ 60 us
    (H200, 4.8 TB/s: ~ 65 us / 42 us), against ~1-3 ms for the reference's chain of ops. The RHT's
    64-wide dot runs on the tensor cores for bf16/fp16 input (the entries of R are +-1/8, exact in bf16:
    products exact, fp32 accumulation); fp32 input uses an IEEE fp32 dot (no TF32, or it would not be
    the fp32 transform): 128 flops per element on the CUDA cores, about as long as its memory traffic on
    an H100, so fp32 with RHT lands below the bandwidth bound. The default tile is 64 x 64 with 8 warps
    (~80-130 registers on sm_90, no spills). `tools/bench/mx_quantize_bandwidth.py` measures all this;
    the numbers above are estimates, not measurements.

Exactness. With round-to-nearest every step is exact or one correctly rounded fp32 operation, in the
same order as the reference, so the output equals `mx_quantize_dequantize` / `mx_quantize` bit for bit
(tests/unit/test_mx_triton.py, under TRITON_INTERPRET=1). With the RHT the kernel's dot sums the 64
products in another order than torch's matmul, so the transformed values (and hence, rarely, a rounding
decision) can differ in the last fp32 bit; they are bit-identical whenever the sums are exact (e.g.
inputs with few significant bits). Stochastic rounding draws its uniforms from Triton's Philox (24 bits
per element, counter = element index, key = `seed`), not from torch's generator: the same distribution
(E[q(v)] = v, only the two neighbouring grid points), not the same draws. The 3/4 prescale of SR with
floor scales is applied as in the reference.

GPU vs interpreter. The kernel is written so that the compiled kernel computes what the interpreter does:
FMA contraction is off (a fused x * factor + c would round once instead of twice), bf16 is widened and
narrowed by hand on the bits (exact, round-to-nearest-even, subnormals kept: what cvt.rn.bf16.f32 does;
the interpreter's own bf16 casts truncate and lose subnormals), and the only flush-to-zero instruction in
the PTX is the floor of a non-negative number (harmless). That is checked by compiling for sm_90 and
sm_100 (tests/unit/test_mx_triton.py), not yet by running on a GPU. One known difference: the bf16
tensor-core dot of the RHT (compiled only; the interpreter uses the fp32 dot) may flush bf16 subnormal
inputs (below 2^-126) to zero.

Layout. The input is 2-D [M, K] (any strides; a tensor of more dims is reshaped to [-1, K]) and is
quantized along its last dim, K: callers transpose for a GEMM whose K is dim 0. Without the RHT the
output has x's shape (K not a multiple of 32: the last block is zero-padded, as in the reference); with
it, K is zero-padded to a multiple of 64 and the output is that long, like `hadamard.rht`.

Native MX GEMM. `native_mx_scaled_mm_available(device)` detects (never assumes) MX block-scaled
`torch._scaled_mm` support: torch must expose `float8_e8m0fnu` (and `float4_e2m1fn_x2` for MXFP4), the
device must be CUDA with compute capability >= (10, 0) (Blackwell), and a tiny probe call must succeed.
Nothing in megalm calls it yet: it is for a GEMM path that feeds the packed codes and scales to the
tensor cores directly, used only where it reports True.

Triton is imported lazily (on the first kernel call or `triton_available`), never when megalm is imported;
TRITON_INTERPRET=1 must be set before that first call to run the kernel on CPU tensors.
"""

from __future__ import annotations

import functools

import torch

from megalm import compat
from megalm.precision.mx import MXTensor, get_format, resolve_prescale

BLOCK_SIZE = 32  # MX block (elements per E8M0 scale)
RHT_BLOCK = 64  # Hadamard block: two MX blocks; also the width of one kernel tile
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


triton_available = compat.triton_runs_on  # where `mx_quantize_triton` can run


# ---------------------------------------------------------------------------------------------------
# Native MX GEMM detection
# ---------------------------------------------------------------------------------------------------


def native_mx_scaled_mm_available(device: torch.device | str | None = None, fmt: str = "e4m3") -> bool:
    """Whether torch can run an MX block-scaled GEMM natively on `device` (MXFP8 for fmt e4m3 / e5m2,
    MXFP4 for e2m1): detected, not assumed.

    Requires `torch._scaled_mm` and the dtype `torch.float8_e8m0fnu` (E8M0 block scales), for e2m1
    also `torch.float4_e2m1fn_x2` (packed FP4); a CUDA device of compute capability >= (10, 0); and a
    probe: a 128 x 128 x 128 `_scaled_mm` with all-one E8M0 scales (cuBLAS's blocked layout, 128 rows x
    4 scale columns) must run and return the right product. False on CPU and on anything that raises.
    Cached per (device, format). Nothing calls this yet; a GEMM path uses the native kernel only where it
    returns True and the emulation (`mx_quantize_dequantize` + matmul) elsewhere.
    """
    device = torch.device("cuda" if device is None else device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _probe_native_mx(index, get_format(fmt).name)


@functools.cache
def _probe_native_mx(index: int, fmt: str) -> bool:
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e8m0fnu"):
        return False
    elem_dtype = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2", "e2m1": "float4_e2m1fn_x2"}.get(fmt)
    if elem_dtype is None or not hasattr(torch, elem_dtype):
        return False
    if torch.cuda.get_device_capability(index) < (10, 0):
        return False
    try:
        a, b, scale = _probe_operands(fmt, torch.device("cuda", index))
        out = torch._scaled_mm(a, b, scale, scale, out_dtype=torch.bfloat16)
        torch.cuda.synchronize(index)
        return bool((out.float() == a.shape[0]).all().item())
    except Exception:  # not built with MX support, unsupported layout, cuBLAS too old, ...
        return False


def _probe_operands(fmt: str, device: torch.device, n: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All-ones n x n operands of an MX `_scaled_mm` (a row-major, b column-major) and all-one E8M0 scales
    (code 127 = 2^0; cuBLAS wants round_up(rows, 128) * round_up(K / 32, 4) of them per operand): their
    product is n everywhere. FP4: code 0b0010 = 1.0 in both nibbles, [rows, K / 2] bytes."""
    if fmt == "e2m1":
        packed = torch.full((n, n // 2), 0x22, dtype=torch.uint8, device=device)
        a = packed.view(torch.float4_e2m1fn_x2)
        b = packed.view(torch.float4_e2m1fn_x2).t()
    else:
        dtype = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
        a = torch.ones(n, n, device=device).to(dtype)
        b = torch.ones(n, n, device=device).to(dtype).t()
    scale = torch.full((n, n // BLOCK_SIZE), 127, dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu)
    return a, b, scale


# ---------------------------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------------------------


triton = tl = None  # bound by `_kernel` on first use: the kernel below resolves `tl` as a module global


@functools.cache
def _kernel(interpret: bool):
    """Build (once per interpreter mode) the jitted kernel; triton is imported here, not at module import.
    `interpret` is only a cache key: triton.jit reads TRITON_INTERPRET when it decorates. The kernel is
    nested for the lazy import, but refers only to globals (the interpreter does not see closures)."""
    global triton, tl
    import triton
    import triton.language as tl

    @triton.jit
    def mx_quantize_kernel(
        x_ptr, signs_ptr, out_ptr, codes_ptr, scales_ptr,
        M, K, K_OUT, N_BLOCKS,
        stride_xm, stride_xk, stride_om, stride_cm, stride_sm,
        seed, prescale,
        EBITS: tl.constexpr, MBITS: tl.constexpr, EMAX: tl.constexpr, EMIN: tl.constexpr, BIAS: tl.constexpr,
        MAXV: tl.constexpr, POW2_EMAX: tl.constexpr, POW2_EMIN: tl.constexpr,
        CEIL: tl.constexpr, STOCHASTIC: tl.constexpr, HAS_PRESCALE: tl.constexpr, DIVIDE_PRESCALE: tl.constexpr,
        HAS_RHT: tl.constexpr,
        IN_BF16: tl.constexpr, OUT_BF16: tl.constexpr, DOT_LOW: tl.constexpr,
        PACKED: tl.constexpr, FP4: tl.constexpr, BLOCK_M: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_k = tl.program_id(1)
        rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = rows < M
        cols = pid_k * 64 + tl.arange(0, 64)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk,
                    mask=row_ok[:, None] & (cols[None, :] < K), other=0)
        if IN_BF16:  # x arrives as int16 bits: widen by hand (exact, subnormals kept, as on the GPU)
            xf = (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            xf = x.to(tl.float32)
        if HAS_RHT:
            # R[i, j] = signs[i] * H[i, j] / 8, H[i, j] = (-1)^popcount(i & j) (Sylvester): x R per row.
            i = tl.arange(0, 64)
            p = i[:, None] & i[None, :]
            p = p ^ (p >> 4)
            p = p ^ (p >> 2)
            p = p ^ (p >> 1)
            signs = tl.load(signs_ptr + i)
            r = tl.where((p & 1) == 1, -0.125, 0.125) * signs[:, None]
            if DOT_LOW:  # bf16 / fp16 input: +-1/8 exact in it, products exact, fp32 accumulation
                if IN_BF16:
                    x = x.to(tl.bfloat16, bitcast=True)
                xf = tl.dot(x, r.to(x.dtype), out_dtype=tl.float32)
            else:
                xf = tl.dot(xf, r, input_precision="ieee")
        x = tl.reshape(xf, (BLOCK_M, 2, 32))
        xbits = x.to(tl.int32, bitcast=True)
        ax = tl.abs(x)
        nonfinite = (ax != ax) | (ax == float("inf"))
        bad = tl.max(nonfinite.to(tl.int32), axis=2) > 0  # [BLOCK_M, 2]: the block holds a NaN or an Inf
        amax = tl.max(tl.where(nonfinite, 0.0, ax), axis=2)  # (only used where the block is finite)

        # E8M0 scale exponent: floor(log2 amax) = biased exponent - 127 (0 or subnormal amax: -127).
        abits = amax.to(tl.int32, bitcast=True)
        ebiased = (abits >> 23) & 0xFF
        s = ebiased - 127 - EMAX
        if CEIL:  # one binade up where amax / 2^s = significand * 2^emax would exceed the format's max
            significand = ((abits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
            s += (significand * POW2_EMAX > MAXV).to(tl.int32)
        s = tl.minimum(tl.maximum(s, -127), 127)  # 0 or subnormal amax (ebiased 0): s < -127, so -127

        factor = tl.where(s < 127, (127 - s) << 23, 0x400000).to(tl.float32, bitcast=True)  # 2^-s, 2^-127 subnormal
        if HAS_PRESCALE:
            factor = factor * prescale
        a = tl.abs(x * factor[:, :, None])  # magnitudes in units of the block scale

        # Round to the element grid: spacing 2^(e - mbits), e = clamp(exponent of a, emin, emax).
        e = tl.minimum(tl.maximum(a.to(tl.int32, bitcast=True) >> 23, EMIN + 127), EMAX + 127)
        if STOCHASTIC:
            inv_spacing = ((2 * 127 + MBITS - e) << 23).to(tl.float32, bitcast=True)
            spacing = ((e - MBITS) << 23).to(tl.float32, bitcast=True)
            n_cols = tl.num_programs(1) * 64
            offs = rows[:, None, None] * n_cols + (pid_k * 64 + tl.arange(0, 2)[None, :, None] * 32
                                                   + tl.arange(0, 32)[None, None, :])
            bits = tl.randint(seed, offs)
            u = (bits >> 8).to(tl.float32) * 5.9604644775390625e-08  # 24 random bits / 2^24 in [0, 1)
            q = tl.floor(a * inv_spacing + u) * spacing
        else:  # (a + c) - c with c = 2^(e - mbits + 23): nearest, ties to even, in one fp32 addition
            c = ((e + 23 - MBITS) << 23).to(tl.float32, bitcast=True)
            q = (a + c) - c
        bad3 = bad[:, :, None]
        q = tl.where(bad3, 0.0, tl.where(q > MAXV, MAXV, q))  # saturate; a NaN/Inf block is written below
        neg = xbits < 0  # sign bit of the (transformed) input, -0 included

        j = tl.arange(0, 2)
        blk = pid_k * 2 + j  # MX block index along K
        if PACKED:
            qe = tl.maximum((q.to(tl.int32, bitcast=True) >> 23) - 127, EMIN)
            sub = q < POW2_EMIN
            exp_field = tl.where(sub, 0, qe + BIAS)
            mant = (q * ((MBITS - qe + 127) << 23).to(tl.float32, bitcast=True)
                    - tl.where(sub, 0.0, (1 << MBITS) * 1.0)).to(tl.int32)
            sign = (neg & ~bad3).to(tl.int32)
            code = (sign << (EBITS + MBITS)) | (exp_field << MBITS) | mant
            blk_ok = row_ok[:, None, None] & (blk < N_BLOCKS)[None, :, None]
            if FP4:  # element 2i in the low nibble, 2i + 1 in the high one
                lo, hi = tl.split(tl.reshape(code, (BLOCK_M, 2, 16, 2)))
                byte = lo | (hi << 4)
                kk = blk[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
                tl.store(codes_ptr + rows[:, None, None] * stride_cm + kk, byte.to(tl.uint8), mask=blk_ok)
            else:
                kk = blk[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
                tl.store(codes_ptr + rows[:, None, None] * stride_cm + kk, code.to(tl.uint8), mask=blk_ok)
            scale_code = tl.where(bad, 255, s + 127)  # E8M0; 255 = NaN
            tl.store(scales_ptr + rows[:, None] * stride_sm + blk[None, :], scale_code.to(tl.uint8),
                     mask=row_ok[:, None] & (blk < N_BLOCKS)[None, :])
        else:
            deq = tl.where(s > -127, (s + 127) << 23, 0x400000).to(tl.float32, bitcast=True)  # 2^s
            if DIVIDE_PRESCALE:
                deq = tl.math.div_rn(deq, prescale + tl.zeros_like(deq))  # correctly rounded, as torch's `/`
            y = q * deq[:, :, None]
            y = (y.to(tl.int32, bitcast=True) | (xbits & -2147483648)).to(tl.float32, bitcast=True)
            y = tl.where(bad3, float("nan"), y)
            if OUT_BF16:  # out is int16 bits: fp32 -> bf16 round to nearest even by hand (as cvt.rn.bf16.f32)
                yb = y.to(tl.uint32, bitcast=True)
                yb = tl.where(y != y, 0x7FC00000, yb + 0x7FFF + ((yb >> 16) & 1)) >> 16
                y = yb.to(tl.int16)
            else:
                y = y.to(out_ptr.dtype.element_ty)
            kk = blk[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
            tl.store(out_ptr + rows[:, None, None] * stride_om + kk, y, mask=row_ok[:, None, None] & (kk < K_OUT))

    return mx_quantize_kernel


def mx_quantize_triton(
    x: torch.Tensor,
    fmt: str = "e2m1",
    rounding: str = "nearest",
    scale_mode: str = "floor",
    rht_signs: torch.Tensor | None = None,
    seed: int = 0,
    packed: bool = False,
    *,
    prescale: float | None = None,
    out_dtype: torch.dtype | None = None,
    divide_prescale: bool = True,
    block_size: int = BLOCK_SIZE,
    block_m: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor | MXTensor:
    """MX-quantize x along its last dim in one Triton kernel; `mx.mx_quantize_dequantize` / `mx.mx_quantize`
    with dim=-1 and block_size=32, preceded by `hadamard.rht(x, rht_signs)` when signs are given.

    x: fp32 / bf16 / fp16, [M, K] with any strides (more dims: reshaped to [-1, K]). fmt: an MX element
    format (e2m1, e4m3, e5m2, e2m3, e3m2 or an alias). rounding: nearest | stochastic (Philox bits from
    `seed`). scale_mode: floor | ceil. rht_signs: 64 +-1 values, the same for every block of 64 along K
    (K is then zero-padded to a multiple of 64). prescale: None = 3/4 for SR with floor scales, else 1.
    packed=False: the dequantized tensor, dtype `out_dtype` (default x.dtype, or fp32 after an RHT, as the
    reference's rht returns fp32); divide_prescale=False leaves the prescale in (values q * 2^s, exact in
    bf16: a GEMM of two such operands divides its output by both prescales instead).
    packed=True: an `MXTensor` (codes uint8 [..., n_blocks, 32], FP4
    [..., n_blocks, 16]; scales uint8 [..., n_blocks]; dim = last) that `mx.mx_dequantize` reads.
    """
    if block_size != BLOCK_SIZE:
        raise ValueError(f"mx_quantize_triton supports block_size={BLOCK_SIZE} only, got {block_size}")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if scale_mode not in ("floor", "ceil"):
        raise ValueError(f"scale_mode must be 'floor' or 'ceil', got {scale_mode!r}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"mx_quantize_triton: x must be one of {_SUPPORTED_DTYPES}, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("mx_quantize_triton needs at least one dimension")
    if not triton_available(x.device):
        raise RuntimeError(f"mx_quantize_triton: triton cannot run on {x.device} (CUDA with triton, or "
                           "TRITON_INTERPRET=1 for CPU tensors)")
    elem = get_format(fmt)
    prescale = resolve_prescale(prescale, rounding, scale_mode)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    has_rht = rht_signs is not None
    if has_rht:
        if rht_signs.numel() != RHT_BLOCK:
            raise ValueError(f"rht_signs must have {RHT_BLOCK} entries (one block, shared), got {rht_signs.numel()}")
        signs = rht_signs.to(device=x.device, dtype=torch.float32).contiguous()
    else:
        signs = torch.empty(RHT_BLOCK, device=x.device, dtype=torch.float32)  # unused
    k_out = _cdiv(k, RHT_BLOCK) * RHT_BLOCK if has_rht else k
    out_dtype = out_dtype or (torch.float32 if has_rht else x.dtype)
    if block_m is None:  # 64 x 64 tiles, 8 warps: ~80-130 registers on sm_90, no spills (tl.dot needs >= 16)
        block_m = 16 if x.device.type == "cpu" else 64
    if num_warps is None:
        num_warps = 8 if block_m >= 64 else 4
    out, codes, scales = torch.ops.megalm.mx_quantize(
        x2, signs, elem.name, rounding, scale_mode, int(seed) & (2**63 - 1), packed, prescale, out_dtype,
        divide_prescale, has_rht, block_m, num_warps)
    shape = torch.Size((*lead, k_out))
    if not packed:
        return out.reshape(shape)
    n_blocks = scales.shape[-1]
    return MXTensor(codes.reshape(*lead, n_blocks, codes.shape[-1]), scales.reshape(*lead, n_blocks), elem,
                    BLOCK_SIZE, len(shape) - 1, shape, out_dtype, prescale)


def _mx_outputs(x2: torch.Tensor, fmt: str, packed: bool, has_rht: bool, out_dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's (out, codes, scales), empty: the dequantized [M, K_out] or the packed codes and scales; the unused
    ones are one-element placeholders (a custom op returns fresh tensors, never one twice)."""
    m, k = x2.shape
    k_out = _cdiv(k, RHT_BLOCK) * RHT_BLOCK if has_rht else k
    n_blocks = _cdiv(k_out, BLOCK_SIZE)
    placeholder = lambda dtype: x2.new_empty(1, dtype=dtype)
    if not packed:
        return x2.new_empty(m, k_out, dtype=out_dtype), placeholder(torch.uint8), placeholder(torch.uint8)
    width = BLOCK_SIZE // 2 if get_format(fmt).bits == 4 else BLOCK_SIZE
    return (placeholder(out_dtype), x2.new_empty(m, n_blocks, width, dtype=torch.uint8),
            x2.new_empty(m, n_blocks, dtype=torch.uint8))


# A custom op, so that FakeTensorMode (the fake-CUDA tests, memory estimates) and torch.compile see shapes without
# launching Triton: the launch is opaque to both, and `_mx_quantize_fake` says what it returns.
@torch.library.custom_op("megalm::mx_quantize", mutates_args=())
def _mx_quantize_op(x2: torch.Tensor, signs: torch.Tensor, fmt: str, rounding: str, scale_mode: str, seed: int,
                    packed: bool, prescale: float, out_dtype: torch.dtype, divide_prescale: bool, has_rht: bool,
                    block_m: int, num_warps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One launch of the kernel on x2 [M, K]; `mx_quantize_triton` validates and shapes around it."""
    elem = get_format(fmt)
    out, codes, scales = _mx_outputs(x2, fmt, packed, has_rht, out_dtype)
    m, k = x2.shape
    k_out = _cdiv(k, RHT_BLOCK) * RHT_BLOCK if has_rht else k
    n_blocks = _cdiv(k_out, BLOCK_SIZE)
    if m and n_blocks:
        grid = (_cdiv(m, block_m), _cdiv(k_out, RHT_BLOCK))
        interpret = compat.triton_interpreted()
        in_bf16, out_bf16 = x2.dtype == torch.bfloat16, out_dtype == torch.bfloat16 and not packed
        _kernel(interpret)[grid](
            x2.view(torch.int16) if in_bf16 else x2, signs, out.view(torch.int16) if out_bf16 else out, codes, scales,
            m, k, k_out, n_blocks,
            x2.stride(0), x2.stride(1), out.stride(0) if not packed else 0,
            codes.stride(0) if packed else 0, scales.stride(0) if packed else 0,
            seed, prescale,
            EBITS=elem.ebits, MBITS=elem.mbits, EMAX=elem.emax, EMIN=elem.emin, BIAS=elem.bias,
            MAXV=float(elem.max), POW2_EMAX=float(2.0**elem.emax), POW2_EMIN=float(2.0**elem.emin),
            CEIL=scale_mode == "ceil", STOCHASTIC=rounding == "stochastic", HAS_PRESCALE=prescale != 1.0,
            DIVIDE_PRESCALE=prescale != 1.0 and divide_prescale,
            HAS_RHT=has_rht, IN_BF16=in_bf16, OUT_BF16=out_bf16,
            DOT_LOW=x2.dtype != torch.float32 and not interpret, PACKED=packed, FP4=elem.bits == 4, BLOCK_M=block_m,
            num_warps=num_warps, enable_fp_fusion=False,
        )
    return out, codes, scales


@_mx_quantize_op.register_fake
def _mx_quantize_fake(x2, signs, fmt, rounding, scale_mode, seed, packed, prescale, out_dtype, divide_prescale,
                      has_rht, block_m, num_warps):
    return _mx_outputs(x2, fmt, packed, has_rht, out_dtype)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)

