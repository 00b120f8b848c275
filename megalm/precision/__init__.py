"""Precision recipes applied from outside the model. So far: fp32 and bf16 autocast."""

from __future__ import annotations

import contextlib

import torch


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast around forward passes (fp32 master weights and optimizer); fp32: no-op."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
