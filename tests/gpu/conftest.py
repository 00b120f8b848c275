"""The GPU tier: tests marked `gpu` that compare megalm's CUDA paths with its CPU / reference paths.

`pytest -m gpu` runs them (tools/gpu_check.sh runs them with the Triton MX kernel's tests and the quick GPU
benchmarks); the default run deselects them, and without CUDA they skip (tests/conftest.py). Every comparison
states its tolerance and why. Helpers here: the relative error measure, a counter of FP8 GEMM calls, and the TF32
flags put back after each test (the trainer sets them for the whole process on CUDA).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (Frobenius, in fp64, on the CPU); inf when either holds a NaN or an Inf."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not (torch.isfinite(got).all() and torch.isfinite(want).all()):
        return float("inf")
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def capability() -> tuple[int, int]:
    """Compute capability of the current CUDA device, (0, 0) without one."""
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


class CountOps:
    """Counts the aten ops whose name holds `name` (e.g. "_scaled_mm", the FP8 GEMMs) that run under it, backward
    included, however Python calls them. Through the profiler, not a TorchDispatchMode: under a dispatch mode
    torch.compile'd functions (fp8.quantize's fused cast on CUDA) run eagerly, i.e. another path."""

    def __init__(self, name: str) -> None:
        self.name, self.calls = name, 0
        self._profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

    def __enter__(self) -> CountOps:
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profile.__exit__(*exc)
        self.calls = sum(event.count for event in self._profile.key_averages() if self.name in event.key)


@pytest.fixture(autouse=True)
def _restore_tf32_flags() -> Iterator[None]:
    """The trainer's Precision sets TF32 for the whole process on CUDA; keep each test's choice to itself."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture
def no_tf32() -> Iterator[None]:
    """fp32 matmuls in full fp32 on the GPU (TF32 rounds operands to 10 mantissa bits), for exact comparisons."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
