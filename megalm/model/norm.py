"""Normalization layers: RMSNorm (Llama) and LayerNorm (GPT-2), both computed in fp32.

RMSNorm (Zhang & Sennrich 2019) rescales by the root mean square only: y = x / rms(x) * g, with
rms(x) = sqrt(mean(x^2) + eps). LayerNorm (Ba et al. 2016) also subtracts the mean and adds a bias.
With bf16 weights the residual stream is bf16: torch's norm kernels compute the statistics and the
normalisation in fp32 (their opmath) and return the input's dtype, so small-variance features are not lost and
no fp32 copy of the input or the weight is made around them (CUDA runs each as one fused kernel).

Off CUDA, torch has no fused RMSNorm with a backward: `F.rms_norm` decomposes, and autograd keeps two fp32 [T, h]
tensors of every norm (the upcast input and the normalised one: 8 bytes a token and feature, 16·s·h of a Llama
layer's ~50). `RMSNormFunction` saves what CUDA's kernel saves, the input in its own dtype and one fp32 rstd a token,
and writes the backward by hand (the gradient of y = x·rstd·g: dx = rstd·(gy − x̂·mean(gy·x̂)), dg = Σ dy·x̂).
So CPU runs, and megalm-estimate's CPU trace of a GPU run, hold the activations a GPU holds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalm.config import ModelConfig


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm over the last dimension, saving the input and the fp32 rstd (see the module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # noqa: ANN001 - ctx
        y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable  # rstd is saved as a constant: no double backward through it
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:  # noqa: ANN001
        x, weight, rstd = ctx.saved_tensors
        opmath = rstd.dtype  # fp32 for bf16/fp16/fp32 inputs, fp64 for fp64 (torch's kernels' opmath)
        normalised = x.to(opmath) * rstd
        dy = dy.to(opmath)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            gy = dy * weight.to(opmath)
            dx = (rstd * (gy - normalised * (gy * normalised).mean(-1, keepdim=True))).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = (dy * normalised).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        return dx, dw, None


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last dimension, computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # torch's fused kernel, forward and backward
            return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)
        return RMSNormFunction.apply(x, self.weight.to(x.dtype), self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(nn.Module):
    """y = (x - mean) / sqrt(var + eps) * weight + bias, over the last dimension, computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.layer_norm(x, (x.shape[-1],), self.weight.to(x.dtype), bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, bias={self.bias is not None}"


def build_norm(cfg: ModelConfig) -> nn.Module:
    """The norm layer `cfg.norm` names, over `cfg.hidden_size` (LayerNorm has a bias iff `cfg.bias`)."""
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.hidden_size, cfg.norm_eps)
    if cfg.norm == "layernorm":
        return LayerNorm(cfg.hidden_size, cfg.norm_eps, bias=cfg.bias)
    raise ValueError(f"unknown norm {cfg.norm!r}")
