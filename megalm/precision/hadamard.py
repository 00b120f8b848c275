"""Blockwise random Hadamard transform (RHT) along a GEMM's reduction dimension.

For a GEMM C = A B^T with reduction (K) dimension last in both operands, any orthogonal R gives
(A R)(B R)^T = A R R^T B^T = A B^T. With R block-diagonal, each b x b block

    R_b = diag(s) H_b / sqrt(b)        H_b the Sylvester Hadamard matrix (entries +-1), s random +-1 signs,

the transform mixes every b consecutive elements of K: an outlier is spread over its block, so the
block's values look Gaussian and an MX block scale fits them much better. Quantizing the transformed
operands (with stochastic rounding) keeps the GEMM unbiased and bounds the variance of the rounding
error (Tseng et al. 2025, "Training LLMs with MXFP4", arXiv 2502.20586; the RHT itself
is from Ailon & Chazelle 2006 and QuIP#, Tseng et al. 2024). Both operands of one GEMM must use the
same signs; each GEMM call draws fresh ones.

x R_b = (x * s) H_b / sqrt(b): one batched [.., b] x [b, b] matmul with the signs folded into the
matrix. A fast Walsh-Hadamard transform needs only b log b additions, but at b = 64 a single BLAS call
is simple and cheap next to the GEMM it prepares. When K is not a multiple
of b the operand is zero-padded to whole blocks: padding both operands the same way leaves A B^T
unchanged, so callers must quantize and multiply the padded tensors.
"""

from __future__ import annotations

import functools
import math

import torch

from megalm.compat import fake_mode_active


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                    normalized: bool = True) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix H_{2m} = [[H_m, H_m], [H_m, -H_m]] (n a power of two),
    divided by sqrt(n) when `normalized` (then it is orthogonal and symmetric). Cached per (dtype, device): do not
    modify. Under a FakeTensorMode (megalm-estimate, the fake-CUDA tier) it is made afresh and not cached."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard block size must be a power of two, got {n}")
    if fake_mode_active():
        return _hadamard(n, dtype, device, normalized)
    return _cached_hadamard(n, dtype, None if device is None else torch.device(device), normalized)


def _hadamard(n: int, dtype: torch.dtype, device: torch.device | str | None, normalized: bool) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    if normalized:
        h = h / math.sqrt(n)
    return h.to(dtype=dtype, device=device)


_cached_hadamard = functools.cache(_hadamard)


def random_signs(n: int, generator: torch.Generator | None = None,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """n independent uniform +-1 signs (fp32), drawn from `generator` (on its device)."""
    device = generator.device if generator is not None and device is None else device
    bits = torch.randint(0, 2, (n,), generator=generator, device=device)
    return bits.to(torch.float32) * 2 - 1


def rht(x: torch.Tensor, signs: torch.Tensor, dim: int = -1, block_size: int = 64) -> torch.Tensor:
    """x R along `dim`, R block-diagonal with blocks diag(s) H / sqrt(block_size); fp32 (fp64 stays fp64).

    `signs` has block_size entries (the same signs in every block, as in Tseng et al.) or one per
    element of the padded `dim` (independent signs per block). The length of `dim` is rounded up to a
    multiple of block_size with zeros, so the result can be longer than x along `dim`. Works along any
    dim without transposing: a block along a middle dim is multiplied by R^T from the left.
    """
    dim = dim % x.dim()
    xf = x if x.dtype == torch.float64 else x.float()
    pad = -xf.shape[dim] % block_size
    if pad:
        xf = torch.nn.functional.pad(xf.movedim(dim, -1), (0, pad)).movedim(-1, dim).contiguous()
    length = xf.shape[dim]
    if signs.numel() not in (block_size, length):
        raise ValueError(f"rht: {signs.numel()} signs for blocks of {block_size} along a dim of {length}")
    h = hadamard_matrix(block_size, dtype=xf.dtype, device=xf.device)
    signs = signs.to(device=xf.device, dtype=xf.dtype)
    last = dim == xf.dim() - 1
    post = math.prod(xf.shape[dim + 1:])  # not -1: ambiguous where a dim is empty (a micro-batch of no tokens)
    if signs.numel() == block_size:  # the same signs in every block: fold them into R = diag(s) H
        r = signs.unsqueeze(1) * h
        if last:  # [..., n_blocks, b] @ R
            return (xf.unflatten(-1, (-1, block_size)) @ r).flatten(-2)
        # [pre, n_blocks, b, post]: (x R)[.., j, :] = sum_i R_ij x[.., i, :], i.e. R^T @ blocks
        return (r.t() @ xf.reshape(*xf.shape[:dim], length // block_size, block_size, post)).reshape(xf.shape)
    signs = signs.reshape(-1, block_size)  # one row of signs per block
    if last:
        return ((xf.unflatten(-1, (-1, block_size)) * signs) @ h).flatten(-2)
    blocks = xf.reshape(*xf.shape[:dim], length // block_size, block_size, post)
    return (h @ (blocks * signs.unsqueeze(-1))).reshape(xf.shape)
