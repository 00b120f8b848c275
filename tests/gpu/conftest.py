"""The GPU tier: tests marked `gpu` that compare megalm's CUDA paths with its CPU / reference paths.

`pytest -m gpu` runs them (tools/gpu_check.sh runs them with the Triton MX kernel's tests and the quick GPU
benchmarks); the default run deselects them, and without CUDA they skip (tests/conftest.py). Every comparison
states its tolerance and why: a test that demands bit-equality runs under `deterministic` (deterministic algorithms,
cuBLAS with a fixed workspace, SDPA's math backend), so that equality means what it claims; the others take
tolerances in units of their dtype's machine epsilon (`eps`). Helpers here: those two, the relative error measure,
a counter of FP8 GEMM calls, and the TF32 flags put back after each test (the trainer sets them for the process).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

# cuBLAS picks its reduction split by workspace: deterministic only with a fixed one, set before the first CUDA context
# (tools/gpu_check.sh exports it too; a CUDA context made earlier in the process would ignore it).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

TF32 = "tf32"  # fp32 GEMMs on tensor cores round operands to 10 mantissa bits


def eps(dtype: torch.dtype | str) -> float:
    """Machine epsilon of `dtype` (2^-7 for bf16, 2^-23 for fp32; TF32's 2^-10 for "tf32"): tolerances are multiples."""
    return 2.0**-10 if dtype == TF32 else torch.finfo(dtype).eps


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
        self.calls = self.count(self.name)

    def count(self, name: str) -> int:
        """How many ops whose name holds `name` ran under it (after the block: one profiler counts them all, since
        torch's profilers do not nest)."""
        return sum(event.count for event in self._profile.key_averages() if name in event.key)


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


@pytest.fixture
def deterministic() -> Iterator[None]:
    """Deterministic kernels for a bit-equality test: torch's deterministic algorithms (an op that has none warns, so
    the first GPU run reports a number rather than a traceback) and SDPA's math backend (the memory-efficient
    backward accumulates with atomics, in any order)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG"), "set CUBLAS_WORKSPACE_CONFIG before CUDA starts"
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        torch.use_deterministic_algorithms(saved)
