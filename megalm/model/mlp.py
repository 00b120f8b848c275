"""Feed-forward blocks: SwiGLU (Llama; Shazeer 2020, "GLU Variants Improve Transformer") and GELU (GPT-2).

SwiGLU: down_proj(silu(gate) * up) with [gate, up] = gate_up_proj(x), one GEMM (rows [gate; up]:
megalm/model/fused.py); it has three matrices' worth of weights, which is why its default ffn size is 8h/3
instead of 4h (same parameter count as a 4h GELU MLP).
GELU:   down_proj(gelu_tanh(up_proj(x))), the tanh approximation GPT-2 was trained with.

`swiglu` is silu(gate) * up as one autograd function that saves its input alone, [gate, up], and recomputes
silu(gate) in the backward (one elementwise kernel), as Megatron's fused swiglu does. Composed from torch ops,
autograd would also keep silu(gate) for the product's backward: one [T, ffn] tensor more per layer (2f/h·s·h bytes
in bf16, 5.4·s·h at 1.3B: 14% of a layer's activations), and the backward would concatenate the two halves'
gradients (a copy of [T, 2·ffn]), where `swiglu` writes them into one tensor. In eager its values and gradients
are autograd's bit for bit (the same ops in the same order; tests/unit/test_model.py). No double backward
(`once_differentiable`, as RMSNorm's function).

The projections are `Linear` (nn.Linear with precision / weight-gradient hooks), so tensor parallelism
can swap them for column-parallel (gate_up, up) and row-parallel (down) layers from outside.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalm.config import ModelConfig
from megalm.model.linear import Linear


class SwiGLUFunction(torch.autograd.Function):
    """silu(gate) * up of gate_up = [gate, up] (last dimension), saving gate_up alone (module docstring)."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:  # noqa: ANN001 - ctx
        gate, up = gate_up.chunk(2, dim=-1)
        ctx.save_for_backward(gate_up)
        return F.silu(gate) * up

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy: torch.Tensor) -> torch.Tensor:  # noqa: ANN001 - ctx
        (gate_up,) = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        if torch.compiler.is_compiling():  # dynamo takes no `out=` view; inductor fuses the cat into its producers
            return torch.cat([torch.ops.aten.silu_backward(dy * up, gate), dy * F.silu(gate)], dim=-1)
        grad = torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)  # contiguous, as cat's
        grad_gate, grad_up = grad.chunk(2, dim=-1)
        torch.mul(dy, F.silu(gate), out=grad_up)
        torch.ops.aten.silu_backward.grad_input(dy * up, gate, grad_input=grad_gate)
        return grad


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, with [gate, up] = gate_up split in halves over the last dimension."""
    return SwiGLUFunction.apply(gate_up)


class SwiGLUMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ffn_hidden_size: int | None = None) -> None:
        super().__init__()
        h, f = cfg.hidden_size, ffn_hidden_size or cfg.ffn_hidden_size
        self.gate_up_proj = Linear(h, 2 * f, bias=cfg.bias)
        self.down_proj = Linear(f, h, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_up_proj(x)))  # this rank's units of gate and up (tensor parallelism)


class GeluMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        self.up_proj = Linear(h, f, bias=cfg.bias)
        self.down_proj = Linear(f, h, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))


def build_mlp(cfg: ModelConfig) -> nn.Module:
    """The MLP `cfg.activation` names (swiglu | gelu)."""
    if cfg.activation == "swiglu":
        return SwiGLUMLP(cfg)
    if cfg.activation == "gelu":
        return GeluMLP(cfg)
    raise ValueError(f"unknown activation {cfg.activation!r}")
