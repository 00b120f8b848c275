"""OCP MX quantization (megalm.precision.mx) against independent oracles.

The oracle grids are enumerated from the bit definitions of each element format (sign, exponent,
mantissa, bias, subnormals, reserved NaN/Inf codes), never from the implementation; rounding is
checked against brute-force nearest search, and against torch's own float8 casts for the FP8 elements.
"""

from __future__ import annotations

import math

import pytest
import torch

from megalm.precision.mx import (
    FORMATS,
    decode_elements,
    encode_elements,
    mx_dequantize,
    mx_quantize,
    mx_quantize_dequantize,
)

# name: (exponent bits, mantissa bits, largest finite magnitude per the OCP MX v1.0 spec)
SPEC = {"e2m1": (2, 1, 6.0), "e2m3": (2, 3, 7.5), "e3m2": (3, 2, 28.0), "e4m3": (4, 3, 448.0),
        "e5m2": (5, 2, 57344.0)}


def reference_grid(name: str) -> dict[int, float]:
    """code -> value for every finite code of the format, from its bit layout alone."""
    ebits, mbits, _ = SPEC[name]
    bias = 2 ** (ebits - 1) - 1
    grid = {}
    for code in range(2 ** (1 + ebits + mbits)):
        sign = -1.0 if code >> (ebits + mbits) else 1.0
        exp_field = (code >> mbits) & (2**ebits - 1)
        mant = code & (2**mbits - 1)
        if name == "e4m3" and exp_field == 2**ebits - 1 and mant == 2**mbits - 1:
            continue  # S.1111.111 is NaN (no infinities)
        if name == "e5m2" and exp_field == 2**ebits - 1:
            continue  # IEEE-style Inf / NaN
        if exp_field == 0:
            value = mant / 2**mbits * 2.0 ** (1 - bias)
        else:
            value = (1 + mant / 2**mbits) * 2.0 ** (exp_field - bias)
        grid[code] = sign * value
    return grid


def positive_values(name: str) -> torch.Tensor:
    return torch.tensor(sorted({v for v in reference_grid(name).values() if v >= 0}), dtype=torch.float64)


def nearest_even(x: torch.Tensor, name: str) -> torch.Tensor:
    """Brute-force round to nearest with ties to the even code, saturating at +-max (scale 1)."""
    grid = reference_grid(name)
    codes = torch.tensor(list(grid.keys()))
    values = torch.tensor(list(grid.values()), dtype=torch.float64)
    xd = x.double().clamp(-SPEC[name][2], SPEC[name][2])
    dist = (xd[:, None] - values[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    tied = dist == best
    # among tied candidates prefer an even code (mantissa LSB 0); +0 and -0 are both "0"
    score = tied.double() * 2 + (tied & (codes[None, :] % 2 == 0)).double()
    out = values[score.argmax(dim=1)]
    return torch.where(out == 0, torch.zeros_like(out), out)


@pytest.mark.parametrize("name", list(SPEC))
def test_format_constants_match_spec(name):
    fmt = FORMATS[name]
    ebits, mbits, max_value = SPEC[name]
    assert (fmt.ebits, fmt.mbits, fmt.max) == (ebits, mbits, max_value)
    assert max(reference_grid(name).values()) == max_value
    assert 2.0**fmt.emax <= max_value < 2.0 ** (fmt.emax + 1)


@pytest.mark.parametrize("name", list(SPEC))
def test_codes_decode_and_encode_per_bit_definition(name):
    grid = reference_grid(name)
    codes = torch.tensor(list(grid.keys()), dtype=torch.uint8)
    expected = torch.tensor(list(grid.values()), dtype=torch.float32)
    decoded = decode_elements(codes, name)
    assert torch.equal(decoded, expected)
    assert torch.equal(torch.signbit(decoded), torch.signbit(expected))  # -0 included
    assert torch.equal(encode_elements(expected, name), codes)


@pytest.mark.parametrize("name", list(SPEC))
@pytest.mark.parametrize("k", [-20, 0, 9])
def test_every_representable_value_round_trips(name, k):
    """A block holding max * 2^k gets scale 2^k, so every grid value * 2^k is exact, packed or not."""
    values = positive_values(name)
    block = torch.cat([values, -values]).float() * 2.0**k  # max is in the block
    x = torch.stack([block, block.flip(0)])
    n = block.numel()
    assert torch.equal(mx_quantize_dequantize(x, name, block_size=n), x)
    packed = mx_quantize(x, name, block_size=n if n % 2 == 0 else n + 1)
    assert torch.equal(packed.scales, torch.full((2, 1), 127 + k, dtype=torch.uint8))
    assert torch.equal(mx_dequantize(packed), x)


@pytest.mark.parametrize("name", list(SPEC))
def test_round_to_nearest_even_matches_brute_force(name):
    max_value = SPEC[name][2]
    values = positive_values(name)
    mids = (values[1:] + values[:-1]) / 2  # exact ties
    gen = torch.Generator().manual_seed(0)
    # some saturate; all stay below 2^(emax + 1) so that the block's scale stays 2^0
    limit = min(1.2 * max_value, 0.999 * 2.0 ** (FORMATS[name].emax + 1))
    rand = (torch.rand(2000, generator=gen, dtype=torch.float64) * 2 - 1) * limit
    x = torch.cat([mids, -mids, rand, values * 0.999, values * 1.001]).float()
    pad = -x.numel() % 31
    x = torch.cat([x, torch.zeros(pad)]).reshape(-1, 31)
    x = torch.cat([torch.full((x.shape[0], 1), max_value), x], dim=1)  # amax = max: scale 2^0
    out = mx_quantize_dequantize(x, name, block_size=32)
    expected = nearest_even(x.flatten(), name).reshape(x.shape).float()
    assert torch.equal(out, expected)


@pytest.mark.parametrize("name,dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_fp8_elements_match_torch_float8_cast(name, dtype):
    """Inside the range, MXFP8 elements round exactly like torch's (RNE) float8 casts."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 32, generator=gen) * torch.logspace(-3, 2, 32)
    x[:, 0] = SPEC[name][2]  # scale 1
    out = mx_quantize_dequantize(x, name)
    assert torch.equal(out, x.to(dtype).float())


def test_e2m1_hand_vectors():
    # scale 1 (amax 6); ties go to the even code: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
    # 3.5 -> 4, 5 -> 4; 0.2 -> 0, 0.3 -> 0.5 (subnormal), -0.75 -> -1; 5.9 -> 6
    x = torch.tensor([[6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.2, 0.3, -0.75, 5.9, -5.5, 0.0, 4.5, 1.0]])
    expected = torch.tensor([[6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, 0.5, -1.0, 6.0, -6.0, 0.0, 4.0, 1.0]])
    assert torch.equal(mx_quantize_dequantize(x, "e2m1", block_size=16), expected)


def test_floor_scale_clips_and_ceil_does_not():
    # amax 7.9: floor(log2) = 2 -> scale 2^0, 7.9 saturates to 6; ceil: scale 2 -> 8
    x = torch.tensor([[7.9, 1.0]])
    assert torch.equal(mx_quantize_dequantize(x, "e2m1", block_size=2), torch.tensor([[6.0, 1.0]]))
    assert torch.equal(mx_quantize_dequantize(x, "e2m1", block_size=2, scale_mode="ceil"), torch.tensor([[8.0, 1.0]]))
    # 3.99 has floor(log2) = 1 -> scale 1/2, 7.98 in element units saturates: 3.0
    x = torch.tensor([[3.99, 1.0]])
    assert torch.equal(mx_quantize_dequantize(x, "e2m1", block_size=2), torch.tensor([[3.0, 1.0]]))
    assert torch.equal(mx_quantize_dequantize(x, "e2m1", block_size=2, scale_mode="ceil"), torch.tensor([[4.0, 1.0]]))
    # ceil keeps the floor scale when amax / 2^s already fits: 5.5 -> scale 1 in both modes
    x = torch.tensor([[5.5, 1.0]])
    for mode in ("floor", "ceil"):
        assert mx_quantize(x, "e2m1", block_size=2, scale_mode=mode).scales.item() == 127


@pytest.mark.parametrize("name", list(SPEC))
def test_scale_exponent_exact_at_powers_of_two(name):
    """amax = 2^k and the float just below it differ by one in floor(log2): frexp, not float log2."""
    emax = FORMATS[name].emax
    for k in (-100, -3, 0, 1, 20, 100):
        at = torch.tensor([[2.0**k, 0.0]])
        below = torch.nextafter(at, torch.zeros_like(at))
        assert mx_quantize(at, name, block_size=2).scales.item() == 127 + k - emax
        assert mx_quantize(below, name, block_size=2).scales.item() == 127 + k - 1 - emax
        assert mx_quantize_dequantize(at, name, block_size=2)[0, 0].item() == 2.0**k


def test_element_subnormals():
    # e4m3 with scale 1: smallest subnormal 2^-9 exact; 2^-10 ties to 0; 3 * 2^-10 ties to 2^-8 (even code)
    x = torch.tensor([[448.0, 2.0**-9, 2.0**-10, 3 * 2.0**-10, 5 * 2.0**-10, -(2.0**-9), 7 * 2.0**-9, 0.0]])
    expected = torch.tensor([[448.0, 2.0**-9, 0.0, 2.0**-8, 2.0**-8, -(2.0**-9), 7 * 2.0**-9, 0.0]])
    assert torch.equal(mx_quantize_dequantize(x, "e4m3", block_size=8), expected)
    # e5m2 subnormals step 2^-16
    x = torch.tensor([[57344.0, 2.0**-16, 3 * 2.0**-16, 2.0**-17]])
    assert torch.equal(mx_quantize_dequantize(x, "e5m2", block_size=4), torch.tensor([[57344.0, 2.0**-16,
                                                                                       3 * 2.0**-16, 0.0]]))


def test_tiny_blocks_use_the_smallest_scale():
    # amax 2^-130 (an fp32 subnormal): floor(log2) - 8 = -138, clamped to -127; 2^-130 / 2^-127 = 1/8 fits e4m3
    x = torch.tensor([[2.0**-130, 2.0**-131, 0.0, 0.0]])
    packed = mx_quantize(x, "e4m3", block_size=4)
    assert packed.scales.item() == 0  # 2^-127
    assert torch.equal(mx_dequantize(packed), x)
    assert torch.equal(mx_quantize_dequantize(x, "e4m3", block_size=4), x)


def test_zero_and_nonfinite_blocks():
    x = torch.zeros(4, 32)
    x[1] = torch.linspace(-3, 3, 32)
    x[2, 5] = float("nan")
    x[3, 7] = float("inf")
    for name in SPEC:
        out = mx_quantize_dequantize(x, name)
        assert torch.equal(out[0], torch.zeros(32))
        assert torch.isfinite(out[1]).all()
        assert torch.isnan(out[2]).all() and torch.isnan(out[3]).all()
        packed = mx_quantize(x, name)
        assert packed.scales[2, 0] == 255 and packed.scales[3, 0] == 255
        assert torch.equal(mx_dequantize(packed)[:2], out[:2]) and torch.isnan(mx_dequantize(packed)[2:]).all()


def test_fp4_packing_layout():
    x = torch.tensor([[0.5, 6.0, -1.0, 0.0] + [0.0] * 28])
    packed = mx_quantize(x, "e2m1")
    assert packed.codes.dtype == torch.uint8 and packed.codes.shape == (1, 1, 16)
    assert packed.codes[0, 0, 0].item() == 0x71  # 0.5 = 0b0001 low nibble, 6 = 0b0111 high nibble
    assert packed.codes[0, 0, 1].item() == 0x0A  # -1 = 0b1010 low nibble, 0 high
    assert packed.scales.item() == 127


@pytest.mark.parametrize("name", list(SPEC))
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_packed_round_trip_any_dim_with_padding(name, dim):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(40, 3, 72, generator=gen) * torch.logspace(-2, 2, 72)
    for rounding in ("nearest", "stochastic"):
        g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
        packed = mx_quantize(x, name, dim=dim, rounding=rounding, generator=g1)
        expected = mx_quantize_dequantize(x, name, dim=dim, rounding=rounding, generator=g2)
        assert torch.equal(mx_dequantize(packed), expected)
        length = x.shape[dim]
        assert packed.scales.shape[dim] == math.ceil(length / 32)


def test_dim_and_padding_semantics():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 40, generator=gen)
    # blocking along dim 0 of x^T is blocking along dim 1 of x
    assert torch.equal(mx_quantize_dequantize(x.t().contiguous(), "e2m1", dim=0).t(),
                       mx_quantize_dequantize(x, "e2m1", dim=1))
    # 40 = one block of 32 + one block of 8 padded with zeros
    out = mx_quantize_dequantize(x, "e2m1")
    head = mx_quantize_dequantize(x[:, :32], "e2m1")
    tail = mx_quantize_dequantize(torch.cat([x[:, 32:], torch.zeros(5, 24)], dim=1), "e2m1")[:, :8]
    assert torch.equal(out, torch.cat([head, tail], dim=1))


def test_bf16_input_keeps_dtype():
    x = torch.randn(4, 64).bfloat16()
    out = mx_quantize_dequantize(x, "e4m3")
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, mx_quantize_dequantize(x.float(), "e4m3").bfloat16())


# ---------------------------------------------------------------------------------------------------
# Stochastic rounding
# ---------------------------------------------------------------------------------------------------


def neighbours(x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid points lo <= x <= hi around each positive x (scale 1)."""
    values = positive_values(name)
    idx = torch.searchsorted(values, x.double(), right=True).clamp(1, len(values) - 1)
    return values[idx - 1], values[idx]


def draws_within_bound(mean: torch.Tensor, target: torch.Tensor, var: torch.Tensor, n: int) -> torch.Tensor:
    """|mean - target| <= 5 standard errors (plus fp32 slack): fails with probability ~ 6e-7 per element."""
    return (mean - target).abs() <= 5 * (var / n).sqrt() + 1e-6


@pytest.mark.parametrize("name", ["e2m1", "e3m2", "e4m3"])
def test_stochastic_rounding_picks_neighbours_with_the_right_odds(name):
    max_value = SPEC[name][2]
    gen = torch.Generator().manual_seed(4)
    x = torch.rand(31, generator=gen) * max_value * 0.7 + 2.0 ** FORMATS[name].emin * 0.3
    block = torch.cat([torch.tensor([max_value]), x])  # scale 1: no prescale clipping issue, prescale=1
    n = 4000
    draws = mx_quantize_dequantize(block.expand(n, 32), name, rounding="stochastic", scale_mode="ceil",
                                   generator=torch.Generator().manual_seed(0))[:, 1:].double()
    lo, hi = neighbours(x, name)
    assert ((draws == lo) | (draws == hi)).all()
    p = (x.double() - lo) / (hi - lo)
    freq = (draws == hi).double().mean(0)
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / n).sqrt() + 1 / n).all()
    # unbiased: the mean converges to x at the rate the SR variance (x - lo)(hi - x) allows ...
    var = (x.double() - lo) * (hi - x.double())
    assert draws_within_bound(draws.mean(0), x.double(), var, n).all()
    # ... and the same bound rejects a rounding that is biased by a tenth of a grid step
    u = torch.rand(n, 31, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    biased = torch.where(u < (p + 0.1).clamp(max=1), hi, lo)
    assert not draws_within_bound(biased.mean(0), x.double(), var, n).all()
    # ... and round-to-nearest
    nearest = mx_quantize_dequantize(block[None], name, scale_mode="ceil")[0, 1:].double()
    assert not draws_within_bound(nearest, x.double(), var, n).all()


def test_stochastic_rounding_prescale_keeps_the_block_max_unbiased():
    """Floor scales put amax / X just under 8 > 6 for E2M1; SR on 3/4 of it never clips (Tseng et al.)."""
    x = torch.tensor([7.9, 7.5, 6.5, 3.3, -7.7, 0.1, 1.234, 5.55] + [0.0] * 24)
    n = 20000
    draws = mx_quantize_dequantize(x.expand(n, 32), "e2m1", rounding="stochastic",
                                   generator=torch.Generator().manual_seed(0)).double()
    mean, std = draws.mean(0), draws.std(0)
    assert ((mean - x.double()).abs() <= 5 * std / math.sqrt(n) + 1e-6).all()
    # the 4/3 * q(3/4 x) grid: 3/4 * 7.9 = 5.925 lies between 4 and 6
    assert torch.allclose(draws[:, 0].unique(), torch.tensor([16 / 3, 8.0], dtype=torch.float64))
    # without the prescale the top of the block clips and SR is biased there
    clipped = mx_quantize_dequantize(x.expand(n, 32), "e2m1", rounding="stochastic", prescale=1.0,
                                     generator=torch.Generator().manual_seed(0)).double()
    assert clipped[:, 0].max() == 6.0
    assert (clipped.mean(0)[0] - 7.9).abs() > 1.0


def test_stochastic_rounding_is_reproducible():
    x = torch.randn(8, 64)
    a = mx_quantize_dequantize(x, "e2m1", rounding="stochastic", generator=torch.Generator().manual_seed(7))
    b = mx_quantize_dequantize(x, "e2m1", rounding="stochastic", generator=torch.Generator().manual_seed(7))
    c = mx_quantize_dequantize(x, "e2m1", rounding="stochastic", generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
