"""The fused Triton MX quantization kernel (megalm.precision.kernels.mx_triton) against the PyTorch reference.

Without CUDA the kernel runs under the Triton interpreter: TRITON_INTERPRET=1 is set here (unless already
set) before triton is imported (the kernel module imports triton lazily, so megalm itself never does), and
put back as it was after this module. With CUDA it is not set (it would also turn every other triton kernel
of the process, e.g. torch.compile's, into interpreted ones), so the same tests run the compiled kernel on
the GPU; TRITON_INTERPRET=1 forces the interpreter there too.

Round-to-nearest must equal `mx_quantize_dequantize` / `mx_quantize` bit for bit (dequantized values,
element codes, E8M0 scales), RHT included where the transform's sums are exact (any summation order gives
the same fp32 result). Stochastic rounding uses Philox bits, not torch's generator, so it is tested for
what it promises: only the two neighbouring grid points, and E[q(x)] = x.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch  # importing torch does not import triton

from tests.unit.triton_env import interpreter_fixture, restore_env, use_interpreter_without_cuda

use_interpreter_without_cuda()  # before triton is imported anywhere in this process

if importlib.util.find_spec("triton") is None:
    restore_env()
    pytest.skip("triton is not installed", allow_module_level=True)
pytest.importorskip("triton")

from megalm import compat  # noqa: E402
from megalm.precision.hadamard import random_signs, rht  # noqa: E402
from megalm.precision.kernels import mx_triton  # noqa: E402
from megalm.precision.kernels.mx_triton import (  # noqa: E402
    mx_quantize_triton,
    native_mx_scaled_mm_available,
    triton_available,
)
from megalm.precision.mx import (  # noqa: E402
    FORMATS,
    decode_elements,
    mx_dequantize,
    mx_quantize,
    mx_quantize_dequantize,
)

DEVICE = "cpu" if compat.triton_interpreted() else "cuda"
if not triton_available(DEVICE):
    _reason = f"triton cannot run on {DEVICE} (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')})"
    restore_env()
    pytest.skip(_reason, allow_module_level=True)


_triton_interpret = interpreter_fixture(DEVICE)


# fp32 max in a ceil-scaled block rounds up to 4 * 2^126, which overflows to Inf on dequantization, in the
# reference as in the kernel (the packed form holds it); the interpreter's numpy reports that multiply.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")


def _subprocess_env() -> tuple[str, dict[str, str]]:
    """The repository root and an environment for a fresh python there: megalm importable, no interpreter."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return root, {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": path}


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape, NaN positions, and bit patterns elsewhere (so -0 != +0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.cpu(), b.cpu()
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    int_dtype = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    return torch.equal(a.view(int_dtype)[~nan], b.view(int_dtype)[~nan])


def special_input(m: int = 8, k: int = 128, seed: int = 0) -> torch.Tensor:
    """fp32 [m, k]: Gaussian blocks over a wide range of binades, and blocks of special values: zeros and
    -0, NaN, +-Inf, powers of two, amax exactly each format's max * 2^j and one ulp above (floor vs ceil),
    round-to-nearest ties of e2m1 and e4m3, subnormals, tiny and huge normals."""
    assert m >= 8 and k >= 128
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k // 32, 32, generator=gen)
    x *= torch.exp2(torch.randint(-24, 24, (m, k // 32, 1), generator=gen).float())
    blk = x  # blk[r, b] is MX block b of row r
    blk[0, 0] = 0.0
    blk[0, 0, 1::3] = -0.0
    blk[0, 1, 7] = float("nan")
    blk[0, 2, 3] = float("inf")
    blk[0, 3, 30] = float("-inf")
    signs = torch.where(torch.rand(32, generator=gen) < 0.5, -1.0, 1.0)
    blk[1, 0] = signs * torch.exp2(torch.randint(-10, 10, (32,), generator=gen).float())
    # amax = max * 2^j exactly, and the next fp32 above it: floor and ceil scales differ there
    for b, v in enumerate([6.0, 448.0, 7.5, 28.0]):
        blk[2, b] *= 0.01
        blk[2, b, 5] = v * 2.0**3
        blk[3, b] *= 0.01
        blk[3, b, 9] = -torch.nextafter(torch.tensor(v * 2.0**-3), torch.tensor(math.inf)).item()
    # ties (scale 2^0 for e2m1: amax 4): 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    ties = torch.tensor([4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.2, 0.3, 4.5, 1.0, 3.0, 0.5, 2.25, 1.5])
    blk[4, 0] = torch.cat([ties, -ties])
    # e4m3 ties at scale 2^0 (amax 256): midpoints of neighbouring e4m3 values
    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (e4m3[1:] + e4m3[:-1]) / 2
    pick = mids[torch.randint(0, mids.numel(), (31,), generator=gen)]
    blk[4, 1] = torch.cat([torch.tensor([256.0]), pick * torch.where(torch.rand(31, generator=gen) < 0.5, -1, 1)])
    # subnormal and tiny: all-subnormal block, subnormal next to 2^-126, amax 2^-127 (an E8M0 edge)
    blk[5, 0] = torch.randn(32, generator=gen) * 1e-40
    blk[5, 1] = torch.randn(32, generator=gen) * 1e-42
    blk[5, 1, 0] = 2.0**-126
    blk[5, 2] = torch.randn(32, generator=gen).clamp(-1, 1) * 2.0**-127
    blk[5, 3] = torch.randn(32, generator=gen) * 2.0**-120
    # huge: near fp32 max (scale 2^125 for e2m1), with tiny neighbours that flush to 0
    blk[6, 0] = torch.randn(32, generator=gen) * 1e37
    blk[6, 0, 0] = torch.finfo(torch.float32).max
    blk[6, 1] = torch.randn(32, generator=gen)
    blk[6, 1, 0] = 1e30
    blk[7, 0] = -0.0
    blk[7, 0, 0] = -1.0
    return x.reshape(m, k).to(DEVICE)


def dyadic_input(m: int = 8, k: int = 128, seed: int = 0) -> torch.Tensor:
    """Inputs whose RHT is exact in fp32 (integers below 2^10 times a power of two per row: every partial sum
    of 64 of them fits in 24 bits), so any summation order gives the same transform; with zero, NaN and Inf
    blocks of 64."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-1023, 1024, (m, k), generator=gen).float()
    x *= torch.exp2(torch.randint(-30, 30, (m, 1), generator=gen).float())
    x[1] *= 2.0**-100  # transformed values reach subnormals' neighbourhood
    x[0, :64] = 0.0
    x[2, 64 + 5] = float("nan")
    x[3, 10] = float("inf")
    x[4] = torch.where(x[4] > 0, 2.0**-135, -(2.0**-130))  # subnormal inputs and outputs
    return x.to(DEVICE)


# ---------------------------------------------------------------------------------------------------
# Round to nearest: bit-exact
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
@pytest.mark.parametrize("scale_mode", ["floor", "ceil"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nearest_matches_reference_bit_exactly(fmt, scale_mode, dtype):
    x = special_input().to(dtype)
    y = mx_quantize_triton(x, fmt, "nearest", scale_mode)
    ref = mx_quantize_dequantize(x.cpu(), fmt, rounding="nearest", scale_mode=scale_mode)
    assert bits_equal(y, ref)

    packed = mx_quantize_triton(x, fmt, "nearest", scale_mode, packed=True)
    ref_packed = mx_quantize(x.cpu(), fmt, rounding="nearest", scale_mode=scale_mode)
    assert torch.equal(packed.codes.cpu(), ref_packed.codes)
    assert torch.equal(packed.scales.cpu(), ref_packed.scales)
    assert (packed.fmt, packed.block_size, packed.dim, packed.shape, packed.dtype, packed.prescale) == (
        ref_packed.fmt, ref_packed.block_size, ref_packed.dim, ref_packed.shape, ref_packed.dtype, 1.0)
    assert bits_equal(mx_dequantize(packed), ref)


@pytest.mark.parametrize("fmt", ["e2m3", "e3m2", "e5m2"])
def test_other_formats_match_reference(fmt):
    x = special_input(seed=1)
    for scale_mode in ("floor", "ceil"):
        y = mx_quantize_triton(x, fmt, "nearest", scale_mode)
        assert bits_equal(y, mx_quantize_dequantize(x.cpu(), fmt, scale_mode=scale_mode))
        packed = mx_quantize_triton(x, fmt, "nearest", scale_mode, packed=True)
        ref = mx_quantize(x.cpu(), fmt, scale_mode=scale_mode)
        assert torch.equal(packed.codes.cpu(), ref.codes) and torch.equal(packed.scales.cpu(), ref.scales)


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
@pytest.mark.parametrize("scale_mode", ["floor", "ceil"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rht_then_nearest_matches_reference_bit_exactly(fmt, scale_mode, dtype):
    """Kernel RHT + quantize == mx_quantize_dequantize(rht(x, signs)), on inputs whose transform is exact."""
    x = dyadic_input(seed=2).to(dtype)
    signs = random_signs(64, torch.Generator().manual_seed(3))
    transformed = rht(x.cpu(), signs)
    y = mx_quantize_triton(x, fmt, "nearest", scale_mode, rht_signs=signs.to(DEVICE))
    ref = mx_quantize_dequantize(transformed, fmt, scale_mode=scale_mode)
    assert y.dtype == torch.float32 and bits_equal(y, ref)
    packed = mx_quantize_triton(x, fmt, "nearest", scale_mode, rht_signs=signs.to(DEVICE), packed=True)
    ref_packed = mx_quantize(transformed, fmt, scale_mode=scale_mode)
    assert torch.equal(packed.codes.cpu(), ref_packed.codes)
    assert torch.equal(packed.scales.cpu(), ref_packed.scales)
    assert packed.shape == ref_packed.shape


def test_rht_on_gaussian_input_matches_up_to_summation_order():
    """Generic fp32 inputs: the dot sums in another order than torch's matmul, so a transformed value can
    differ in its last bit; a rounding decision flips only if it sits within that bit of a tie."""
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(16, 128, generator=gen) * torch.logspace(-2, 2, 128)).to(DEVICE)
    signs = random_signs(64, gen)
    y = mx_quantize_triton(x, "e2m1", "nearest", "floor", rht_signs=signs.to(DEVICE)).cpu()
    transformed = rht(x.cpu(), signs)
    ref = mx_quantize_dequantize(transformed, "e2m1")
    assert (y != ref).sum().item() <= 2
    scale = torch.exp2(mx_quantize(transformed, "e2m1").scales.float() - 127).repeat_interleave(32, dim=1)
    assert bool(((y - ref).abs() <= 2 * scale).all())  # at worst one e2m1 grid step (the widest is 2 units)


def test_shapes_strides_and_padding():
    x = special_input(8, 128, seed=5)[:, :80]  # K = 80: 3 blocks, the last one padded; a strided view
    for fmt in ("e2m1", "e4m3"):
        assert bits_equal(mx_quantize_triton(x, fmt), mx_quantize_dequantize(x.cpu(), fmt))
        packed = mx_quantize_triton(x, fmt, packed=True)
        ref = mx_quantize(x.cpu(), fmt)
        assert packed.codes.shape == ref.codes.shape and torch.equal(packed.codes.cpu(), ref.codes)
        assert torch.equal(packed.scales.cpu(), ref.scales)
    xt = special_input(8, 128, seed=6).t().contiguous().t()  # column-major [8, 128]
    assert not xt.is_contiguous()
    assert bits_equal(mx_quantize_triton(xt, "e2m1", scale_mode="ceil"),
                      mx_quantize_dequantize(xt.cpu(), "e2m1", scale_mode="ceil"))
    x3 = special_input(8, 128, seed=7).reshape(2, 4, 128)  # leading dims are flattened
    assert bits_equal(mx_quantize_triton(x3, "e4m3"), mx_quantize_dequantize(x3.cpu(), "e4m3"))
    assert mx_quantize_triton(x3, "e2m1", packed=True).codes.shape == (2, 4, 4, 16)
    # RHT with K = 100: zero-padded to 128, like hadamard.rht
    signs = random_signs(64, torch.Generator().manual_seed(8))
    xd = dyadic_input(8, 128, seed=9)[:, :100]
    y = mx_quantize_triton(xd, "e2m1", rht_signs=signs.to(DEVICE))
    assert y.shape == (8, 128) and bits_equal(y, mx_quantize_dequantize(rht(xd.cpu(), signs), "e2m1"))
    # out_dtype: E2M1 values times a power of two are exact in bf16
    y16 = mx_quantize_triton(x, "e2m1", out_dtype=torch.bfloat16)
    assert bits_equal(y16, mx_quantize_dequantize(x.cpu(), "e2m1").bfloat16())


# ---------------------------------------------------------------------------------------------------
# Stochastic rounding: statistics
# ---------------------------------------------------------------------------------------------------


def grid_neighbours(v: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """For magnitudes v >= 0 (in units of the block scale, at most the format's max): the largest grid
    value <= v and the smallest >= v, from the decoded codes of the format."""
    f = FORMATS[fmt]
    codes = torch.arange(0, 2 ** (f.ebits + f.mbits), dtype=torch.uint8)
    grid = decode_elements(codes, fmt)
    grid = grid[torch.isfinite(grid) & (grid <= f.max)].double().unique()
    vd = v.double()
    lo_idx = (torch.searchsorted(grid, vd, right=True) - 1).clamp(min=0)
    hi_idx = torch.searchsorted(grid, vd, right=False).clamp(max=grid.numel() - 1)
    return grid[lo_idx], grid[hi_idx]


def sr_oracle(x: torch.Tensor, fmt: str, scale_mode: str):
    """Scale exponents (from the reference), the scaled magnitudes v the kernel rounds, their two grid
    neighbours, and the dequantization factor 2^s / prescale, all per element of x [m, k]."""
    prescale = 0.75 if scale_mode == "floor" else 1.0
    ref = mx_quantize(x.cpu(), fmt, rounding="nearest", scale_mode=scale_mode)  # scales do not depend on rounding
    s = ref.scales.to(torch.int32) - 127
    s_el = s.repeat_interleave(32, dim=1)[:, : x.shape[1]]
    v = (x.cpu().float() * (torch.exp2(-s_el.float()) * prescale)).abs()  # exact in fp32 up to one rounding
    lo, hi = grid_neighbours(v, fmt)
    deq = torch.exp2(s_el.double()) / prescale
    return ref.scales, v, lo, hi, deq


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
@pytest.mark.parametrize("scale_mode", ["floor", "ceil"])
def test_stochastic_rounds_only_to_neighbours(fmt, scale_mode):
    gen = torch.Generator().manual_seed(10)
    x = (torch.randn(8, 128, generator=gen) * torch.logspace(-3, 3, 128)).to(DEVICE)
    x[0, :32] *= 0  # a zero block
    scales, v, lo, hi, deq = sr_oracle(x, fmt, scale_mode)
    for seed in range(3):
        packed = mx_quantize_triton(x, fmt, "stochastic", scale_mode, seed=seed, packed=True)
        assert torch.equal(packed.scales.cpu(), scales)
        expected_prescale = 0.75 if scale_mode == "floor" else 1.0
        assert packed.prescale == expected_prescale
        codes = packed.codes.cpu()
        if fmt == "e2m1":
            codes = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2)
        q = decode_elements(codes.flatten(1), fmt)
        assert torch.equal(torch.signbit(q) | (q == 0), torch.signbit(x.cpu()) | (q == 0))
        qa = q.abs().double()
        assert bool(((qa == lo) | (qa == hi)).all()), "SR must round to one of the two neighbours"
        assert bool((qa[v.double() == lo] == lo[v.double() == lo]).all()), "grid values must stay put"
        # the dequantized form draws the same bits for the same seed
        y = mx_quantize_triton(x, fmt, "stochastic", scale_mode, seed=seed)
        assert bits_equal(y, mx_dequantize(packed))
    a = mx_quantize_triton(x, fmt, "stochastic", scale_mode, seed=123)
    assert bits_equal(a, mx_quantize_triton(x, fmt, "stochastic", scale_mode, seed=123))  # deterministic
    assert not torch.equal(a, mx_quantize_triton(x, fmt, "stochastic", scale_mode, seed=124))


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
def test_stochastic_rounding_is_unbiased(fmt):
    """Mean of N independent SR draws of every element against E[q(x)] = x (floor scales, 3/4 prescale).

    Each draw of element i lies in [lo_i, hi_i] (dequantized), so by Hoeffding the mean of N draws is
    within t_i = (hi_i - lo_i) sqrt(ln(2 / delta) / 2N) of its expectation except with probability delta;
    delta = 1e-9 per element. Round-to-nearest, biased, must fail the same bound (the test has power).
    """
    gen = torch.Generator().manual_seed(11)
    base = torch.randn(4, 64, generator=gen) * torch.logspace(-2, 2, 64)
    reps, seeds = 64, (0, 1)
    x = base.repeat(reps, 1).to(DEVICE)  # independent draws: every row has its own Philox counters
    n = reps * len(seeds)
    draws = torch.cat([mx_quantize_triton(x, fmt, "stochastic", "floor", seed=s).cpu().double().reshape(reps, 4, 64)
                       for s in seeds])
    _, v, lo, hi, deq = sr_oracle(base, fmt, "floor")
    expected = v.double() * deq * base.sign()  # E[q] * 2^s / (3/4), exactly, from the fp32 v the kernel rounds
    width = (hi - lo) * deq
    t = width * math.sqrt(math.log(2 / 1e-9) / (2 * n)) + 1e-6 * expected.abs()
    err = draws.mean(dim=0) - expected
    assert bool((err.abs() <= t).all()), f"max |err| / t = {(err.abs() / t).max().item():.2f}"
    # aggregate: the mean normalized error over all elements is ~N(0, 1 / (4 n numel)) at most
    z = (err / width.clamp(min=1e-300))[width > 0]
    assert abs(z.mean().item()) < 6 * math.sqrt(0.25 / (n * z.numel()))
    # power: the same bound rejects round-to-nearest, whose error is up to half a grid step in every draw
    rtn = mx_quantize_triton(base.to(DEVICE), fmt, "nearest", "floor").cpu().double()
    assert bool(((rtn - base.double()).abs() > t).any())


# ---------------------------------------------------------------------------------------------------
# API, detection, import hygiene
# ---------------------------------------------------------------------------------------------------


def test_detection_on_cpu():
    assert triton_available("cpu") == compat.triton_interpreted()
    for fmt in ("e4m3", "e2m1"):
        assert native_mx_scaled_mm_available("cpu", fmt) is False
    assert native_mx_scaled_mm_available(torch.device("meta")) is False


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_native_probe_operands_pass_torch_shape_checks(fmt):
    """The probe's operands satisfy torch's own MX checks of `_scaled_mm` (its meta function, on fake CUDA
    tensors), and scales of the wrong count are rejected there: the probe can only fail for lack of support."""
    fake_tensor = pytest.importorskip("torch._subclasses.fake_tensor")
    with fake_tensor.FakeTensorMode(allow_non_fake_inputs=True):
        a, b, scale = mx_triton._probe_operands(fmt, torch.device("cuda"))
        out = torch._scaled_mm(a, b, scale, scale, out_dtype=torch.bfloat16)
        assert out.shape == (128, 128) and out.dtype == torch.bfloat16
        short = torch.full((64, 4), 127, dtype=torch.uint8, device="cuda").view(torch.float8_e8m0fnu)
        with pytest.raises(RuntimeError, match="scal"):
            torch._scaled_mm(a, b, short, short, out_dtype=torch.bfloat16)


def test_argument_checks():
    x = special_input()
    with pytest.raises(ValueError, match="rounding"):
        mx_quantize_triton(x, "e2m1", "up")
    with pytest.raises(ValueError, match="scale_mode"):
        mx_quantize_triton(x, "e2m1", scale_mode="round")
    with pytest.raises(ValueError, match="unknown MX element format"):
        mx_quantize_triton(x, "e9m9")
    with pytest.raises(ValueError, match="rht_signs"):
        mx_quantize_triton(x, "e2m1", rht_signs=torch.ones(32))
    with pytest.raises(ValueError, match="block_size"):
        mx_quantize_triton(x, "e2m1", block_size=16)


def test_megalm_import_does_not_import_triton():
    code = ("import sys, megalm, megalm.precision, megalm.precision.mx, megalm.precision.linear, "
            "megalm.precision.kernels, megalm.precision.kernels.mx_triton as m; "
            "m.native_mx_scaled_mm_available('cpu'); print('triton' in sys.modules)")
    root, env = _subprocess_env()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, cwd=root)
    assert out.stdout.strip() == "False"



AOT_COMPILE = """
import sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from megalm.precision.kernels import mx_triton
from megalm.precision.mx import FORMATS

kernel = mx_triton._kernel(False)
f = FORMATS["e2m1"]
signature = {"x_ptr": "*i16", "signs_ptr": "*fp32", "out_ptr": "*i16", "codes_ptr": "*u8", "scales_ptr": "*u8",
             "M": "i32", "K": "i32", "K_OUT": "i32", "N_BLOCKS": "i32", "stride_xm": "i32", "stride_xk": "i32",
             "stride_om": "i32", "stride_cm": "i32", "stride_sm": "i32", "seed": "i64", "prescale": "fp32"}
for arch in (90, 100):
    # the mxfp4 recipe: bf16 in, RHT on the tensor cores, SR, floor scales; dequantized with and without the
    # prescale divided out (training's GEMMs leave it in), and packed
    for packed, divide in ((False, True), (False, False), (True, False)):
        constexprs = dict(EBITS=f.ebits, MBITS=f.mbits, EMAX=f.emax, EMIN=f.emin, BIAS=f.bias, MAXV=f.max,
                          POW2_EMAX=2.0**f.emax, POW2_EMIN=2.0**f.emin, CEIL=False, STOCHASTIC=True,
                          HAS_PRESCALE=True, DIVIDE_PRESCALE=divide, HAS_RHT=True, IN_BF16=True,
                          OUT_BF16=not packed, DOT_LOW=True,
                          PACKED=packed, FP4=True, BLOCK_M=64)
        sig = {**signature, **{name: "constexpr" for name in constexprs}}
        src = ASTSource(fn=kernel, signature=sig,
                        constexprs={(kernel.arg_names.index(n),): v for n, v in constexprs.items()})
        compiled = compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 8, "enable_fp_fusion": False})
        ptx = compiled.asm["ptx"]
        assert "fma.rn.f32" not in ptx, "FMA contraction would change the rounding"
        assert "mma" in ptx, "the Hadamard product should run on the tensor cores"
        assert len(compiled.asm["cubin"]) > 0
print("compiled")
"""


def test_gpu_path_compiles_ahead_of_time():
    """Without a GPU, compile the non-interpreted kernel to cubins for Hopper (sm_90) and Blackwell (sm_100)
    with triton's bundled ptxas, in a fresh process (triton cannot mix interpreted and compiled kernels in
    one): checks the lowering of the paths the interpreter does not take (bf16 tensor-core dot, FMA
    contraction off). Running them needs a GPU."""
    if DEVICE == "cuda":
        pytest.skip("the other tests run the compiled kernel on this GPU")
    root, env = _subprocess_env()
    out = subprocess.run([sys.executable, "-c", AOT_COMPILE], capture_output=True, text=True, env=env, cwd=root)
    if out.returncode and ("ptxas" in out.stderr and "not found" in out.stderr or "ImportError" in out.stderr):
        pytest.skip(f"cannot compile ahead of time here: {out.stderr.strip().splitlines()[-1]}")
    assert out.returncode == 0 and out.stdout.strip() == "compiled", out.stderr[-3000:]
