"""Feed-forward blocks: SwiGLU (Llama; Shazeer 2020, "GLU Variants Improve Transformer") and GELU (GPT-2).

SwiGLU: down_proj(silu(gate) * up) with [gate, up] = gate_up_proj(x), one GEMM (rows [gate; up]:
megalm/model/fused.py); it has three matrices' worth of weights, which is why its default ffn size is 8h/3
instead of 4h (same parameter count as a 4h GELU MLP).
GELU:   down_proj(gelu_tanh(up_proj(x))), the tanh approximation GPT-2 was trained with.

The projections are `Linear` (nn.Linear with precision / weight-gradient hooks), so tensor parallelism
can swap them for column-parallel (gate_up, up) and row-parallel (down) layers from outside.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalm.config import ModelConfig
from megalm.model.linear import Linear


class SwiGLUMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ffn_hidden_size: int | None = None) -> None:
        super().__init__()
        h, f = cfg.hidden_size, ffn_hidden_size or cfg.ffn_hidden_size
        self.gate_up_proj = Linear(h, 2 * f, bias=cfg.bias)
        self.down_proj = Linear(f, h, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # this rank's units of each (tensor parallelism)
        return self.down_proj(F.silu(gate) * up)


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
