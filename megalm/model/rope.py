"""Rotary position embeddings (RoFormer, Su et al. 2021, eq. 34), "rotate-half" layout of Llama/HF.

Each head vector x of dim D is split into halves (x1, x2); the pair (x1[i], x2[i]) is rotated by the
angle p * theta^(-2i/D) for a token at position p:
    rope(x, p) = x * cos(p * w) + rotate_half(x) * sin(p * w),   rotate_half(x) = (-x2, x1),
with w = (w_0..w_{D/2-1}, w_0..w_{D/2-1}). Then <rope(q, m), rope(k, n)> depends on m - n only.

Positions come from explicit `position_ids` [T], which restart at 0 in every packed document, so
a document gets the same rotations wherever it sits in the packed stream. Angles are computed in
fp32 (bf16 positions above 256 are not exact) and the rotation is applied in fp32, then cast back.
"""

from __future__ import annotations

import torch


def rope_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, each fp32 [T, D], for positions `position_ids` [T]."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim
    )
    angles = position_ids.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    angles = torch.cat([angles, angles], dim=-1)  # [T, D]
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by cos/sin [T, D] (broadcast over heads); computed in fp32, returns x.dtype."""
    xf = x.float()
    cos, sin = cos[:, None, :], sin[:, None, :]
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)
