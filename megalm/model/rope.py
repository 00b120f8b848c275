"""Rotary position embeddings (RoFormer, Su et al. 2021, eq. 34), "rotate-half" layout of Llama/HF.

Each head vector x of dim D is split into halves (x1, x2); the pair (x1[i], x2[i]) is rotated by the
angle p * theta^(-2i/D) for a token at position p:
    rope(x, p) = x * cos(p * w) + rotate_half(x) * sin(p * w),   rotate_half(x) = (-x2, x1),
with w = (w_0..w_{D/2-1}, w_0..w_{D/2-1}). Then <rope(q, m), rope(k, n)> depends on m - n only.

Llama 3.1's frequency scaling and YaRN (`llama3_inv_freq`, `yarn_inv_freq`, model.rope_scaling) rescale w before the
angles are taken; YaRN also multiplies both tables by its attention factor.

Positions come from explicit `position_ids` [T], which restart at 0 in every packed document, so
a document gets the same rotations wherever it sits in the packed stream. Angles are computed in
fp32 (bf16 positions above 256 are not exact), once per forward for all layers, with the sign of
rotate_half folded into the sine table: rope(x) = x * cos + swap_halves(x) * (-sin, sin), one roll per
call and no negation or concatenation. The model casts the tables to its residual stream's dtype once per
forward (bf16 with bf16 weights: every op of the rotation then runs in bf16, no fp32 copy of q or k); tables
wider than x (fp32 under autocast) give fp32 products, cast back to x's dtype.

`apply_rope` is one autograd function: the rotation is linear in x, so its gradient is the transposed rotation,
dx = dy * cos + swap_halves(dy * sin) (swapping halves is its own inverse), and it keeps nothing for the backward
but the tables. With tables of x's dtype (bf16 weights, fp32 runs) each direction is three kernels (a roll, a
multiply, and an `addcmul` that multiplies and adds in one pass) where autograd through the composed ops ran four
forward and four backward (the two products, their sum, the roll, and the sum of the two gradient paths): two
passes over q and k fewer each way, which are the eager step's (compiled blocks fuse them anyway); fp32 tables on
bf16 x (autocast) add the cast back each way. addcmul rounds once where the composition rounded twice: in bf16 the
rotation differs from the composed one's by at most one rounding. No double backward (`once_differentiable`, as
RMSNorm's function), and the tables take no gradient.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megalm.config.schema import RopeScalingConfig


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScalingConfig) -> torch.Tensor:
    """Llama 3.1's frequency scaling (Meta's `apply_scaling`; Megatron's `--use-rope-scaling`, TorchTitan's llama3
    model): with L the original context and wavelength 2π/w, a frequency w whose wavelength exceeds L / low_freq_factor
    becomes w / factor, one whose wavelength is under L / high_freq_factor stays w, and those between are interpolated,
    (1 - a)·w / factor + a·w with a = (L / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor).
    a clamped to [0, 1] is the three cases in one expression."""
    wavelength = 2 * math.pi / inv_freq
    a = ((scaling.original_max_position_embeddings / wavelength - scaling.low_freq_factor)
         / (scaling.high_freq_factor - scaling.low_freq_factor)).clamp(0.0, 1.0)
    return (1 - a) * inv_freq / scaling.factor + a * inv_freq


def yarn_inv_freq(inv_freq: torch.Tensor, theta: float, scaling: RopeScalingConfig) -> torch.Tensor:
    """YaRN's frequencies (Peng et al. 2023, "YaRN: Efficient Context Window Extension of LLMs", sec. 3.2): with L the
    original context, dimension pair i turns L·w_i/2π times over it; pairs turning more than beta_fast times keep w_i,
    those turning fewer than beta_slow times get w_i / factor, and between them a linear ramp in i mixes the two. The
    ramp's ends are the pairs d(r) = D·ln(L / 2πr) / (2·ln theta) for r = beta_fast and beta_slow, rounded out to
    whole pairs with `truncate`, clamped to [0, D - 1]."""
    dim = 2 * inv_freq.numel()
    L = scaling.original_max_position_embeddings

    def pair(rotations: float) -> float:
        return dim * math.log(L / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair(scaling.beta_fast), pair(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high if high != low else high + 0.001  # (a ramp of no width)
    i = torch.arange(inv_freq.numel(), device=inv_freq.device, dtype=inv_freq.dtype)
    ramp = ((i - low) / (high - low)).clamp(0.0, 1.0)  # 0: kept, 1: divided by factor
    return inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's eq. 21, sqrt(1/t) = 0.1·mscale·ln(factor) + 1 (1 for factor <= 1); DeepSeek's configs divide two of
    them (mscale, mscale_all_dim), megalm-import's attention_factor."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(scaling: RopeScalingConfig) -> float:
    """YaRN's scale of cos and sin: `yarn_mscale(factor)`, unless the config names its own."""
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)
    return yarn_mscale(scaling.factor)


def rope_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float, scaling: RopeScalingConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation tables for positions `position_ids` [T], each fp32 [T, D]: cos of the angles (repeated for the
    two halves) and the signed sine (-sin, sin) that `apply_rope` takes. `scaling`: model.rope_scaling (type none:
    the frequencies as theta makes them; yarn also scales both tables)."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim
    )
    kind = scaling.type if scaling is not None else "none"
    if kind == "llama3":
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    elif kind == "yarn":
        inv_freq = yarn_inv_freq(inv_freq, theta, scaling)
    angles = position_ids.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = angles.cos(), angles.sin()
    if kind == "yarn":
        factor = yarn_attention_factor(scaling)
        cos, sin = cos * factor, sin * factor
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype`, cast only where it differs: torch 2.11's AOT autograd mis-traces a backward that returns the
    no-op `.to` of a tensor of that dtype (a wrong gradient under torch.compile; tests/unit/test_model.py)."""
    return t if t.dtype == dtype else t.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
    """x * cos + sign * swap_halves(x) * sin, in the wider of the dtypes, as x's dtype: with the signed sine, the
    rotation (sign 1) or its transpose (sign -1, `RotaryFunction.backward`)."""
    swapped = x.roll(x.shape[-1] // 2, dims=-1)  # (x2, x1): with the signed sine, rotate_half(x) * sin
    return _as(torch.addcmul(x * cos, swapped, sin, value=sign), x.dtype)


class RotaryFunction(torch.autograd.Function):
    """`apply_rope` with its gradient written out (module docstring): it keeps the tables only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # noqa: ANN001 - ctx
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: ANN001 - ctx
        cos, sin = ctx.saved_tensors
        # dx = dy * cos + swap_halves(dy * sin) = dy * cos + swap_halves(dy) * swap_halves(sin), and swapping the
        # halves of the signed sine (-sin, sin) negates it: dy * cos - swap_halves(dy) * sin, no op on the table
        return _rotate(dy, cos, sin, sign=-1.0), None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by the tables of `rope_cos_sin` [T, D] (broadcast over heads); products in the wider of
    x's and the tables' dtypes, returns x.dtype."""
    return RotaryFunction.apply(x, cos[:, None, :], sin[:, None, :])
