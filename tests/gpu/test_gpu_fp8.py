"""GPU tier: FP8 linear layers through torch._scaled_mm on the GPU against the CPU emulation.

`megalm.precision.linear.low_precision_linear(x, w, recipe=...)` forward and backward (fprop, dgrad, wgrad)
on CUDA and on the CPU, where every FP8 GEMM is emulated (cast to float8 and back, fp32 matmul), from the
same fp32 inputs and output gradient. Per-tensor current scaling (recipe fp8) and one scale per row along
K (fp8_rowwise); every dimension a multiple of 16, as torch._scaled_mm needs. Both sides quantize
identically (the same fp32 amax and scale arithmetic, the same round-to-nearest-even cast: on CUDA one
torch.compile'd kernel, bit for bit the eager cast the CPU runs), so they differ only in how the products
are summed, and in the bf16 output torch._scaled_mm gives with row scales. That comparison runs the recipe with
every GEMM promoting its partial sums to fp32; the recipe itself accumulates fprop fast (fp8.py, as TE and torchao
do), which is checked against it: y within fast accumulation's error, the backward's GEMMs bit for bit.
Skipped below compute capability 8.9: without FP8 units the GPU runs the same emulation.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megalm.precision.linear import low_precision_linear
from megalm.precision.recipes import Recipe, get_recipe
from tests.gpu.conftest import CountOps, capability, rel_error

pytestmark = pytest.mark.gpu

# Identical FP8 operands on both sides and fp32 outputs: only the summation order and the tensor cores'
# accumulation differ (~1e-6 relative); 1e-3 is far below FP8's own error (~4e-2) and catches any change in
# what is quantized or how it is scaled.
TOL = 1e-3
# fp8_rowwise fprop: torch._scaled_mm with row scales returns bf16 (8 significant bits, ~2e-3 per element).
ROWWISE_FPROP_TOL = 5e-3
# fprop with fast accumulation against the same GEMM promoting: Hopper's FP8 tensor cores keep about 14 bits of
# their sums (DeepSeek-V3, section 3.3.2: up to ~2% off in an element at K = 4096 without promotion); over a whole
# output (rel_error's norm) far less. A wrong scale or operand is off by ~1.
FAST_ACCUM_TOL = 1e-2


def promoting(recipe: str) -> Recipe:
    """`recipe` with its forward GEMM promoting its sums to fp32 too: what the emulation computes, up to order."""
    spec = get_recipe(recipe)
    return dataclasses.replace(spec, fprop=dataclasses.replace(spec.fprop, fast_accum=False))


def _run(recipe: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, dy: torch.Tensor, device: str):
    """(y, dx, dw, db) of low_precision_linear on copies of the inputs on `device`, and the _scaled_mm calls
    of the forward and of forward + backward."""
    x, w, b = (t.detach().to(device).requires_grad_() for t in (x, w, b))
    with CountOps("_scaled_mm") as forward_calls:
        y = low_precision_linear(x, w, b, recipe=recipe)
    with CountOps("_scaled_mm") as backward_calls:
        y.backward(dy.to(device))
    return (y, x.grad, w.grad, b.grad), forward_calls.calls, forward_calls.calls + backward_calls.calls


@pytest.mark.parametrize("shape", [(256, 512, 384), (64, 1024, 2048)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("recipe", ["fp8", "fp8_rowwise"])
def test_fp8_linear_on_cuda_matches_cpu_emulation(recipe: str, shape: tuple[int, int, int], no_tf32) -> None:
    if capability() < (8, 9):
        pytest.skip(f"FP8 GEMMs need compute capability 8.9+, this GPU has {capability()}")
    tokens, d_in, d_out = shape
    g = torch.Generator().manual_seed(tokens + d_out)
    x = torch.randn(tokens, d_in, generator=g)
    x[:, 7] *= 30.0  # an outlier feature: per-tensor and per-row scales see different amaxes
    w = torch.randn(d_out, d_in, generator=g) * d_in**-0.5
    b = torch.randn(d_out, generator=g)
    dy = torch.randn(tokens, d_out, generator=g) * 1e-3  # gradients are small: the E5M2 scale must cope
    got, fwd_calls, all_calls = _run(promoting(recipe), x, w, b, dy, "cuda")
    want, cpu_calls, _ = _run(recipe, x, w, b, dy, "cpu")
    assert cpu_calls == 0, "the CPU must emulate"
    # No silent fallback: the forward GEMM (E4M3 x E4M3, every dimension a multiple of 16) runs on the FP8 units.
    assert fwd_calls >= 1, f"{recipe}: fprop did not call torch._scaled_mm on a GPU of capability {capability()}"
    if recipe == "fp8":  # per tensor, E5M2 x E4M3 has a kernel too: dgrad and wgrad run on the FP8 units
        assert all_calls >= 3, f"fp8: {all_calls} torch._scaled_mm calls in forward + backward, expected 3"
    for name, gt, wt in zip(("y", "dx", "dw", "db"), got, want, strict=True):
        tol = ROWWISE_FPROP_TOL if (recipe, name) == ("fp8_rowwise", "y") else TOL
        err = rel_error(gt, wt)
        assert err < tol, f"{recipe} {name}: relative error {err:.2e} >= {tol:.0e} against the CPU emulation"
    fast, _, _ = _run(recipe, x, w, b, dy, "cuda")  # the recipe as it trains: fprop accumulating fast
    err = rel_error(fast[0], got[0])
    assert err < FAST_ACCUM_TOL, f"{recipe} y with fast accumulation: relative error {err:.2e} against promoting"
    for name, ft, pt in zip(("dx", "dw", "db"), fast[1:], got[1:], strict=True):
        assert torch.equal(ft, pt), f"{recipe} {name}: the backward's GEMMs promote in both runs, yet differ"


# bf16 inputs and outputs (the fp8 recipes' default since 2026-12-03: bf16 working weights): both sides quantize the
# same bf16 values and round their fp32 sums to bf16 (2^-9 relative an element), which a sum in another order moves
# across a rounding boundary here and there; a wrong scale or operand is off by ~1.
BF16_TOL = 1e-2


@pytest.mark.parametrize("recipe", ["fp8", "fp8_rowwise"])
def test_fp8_linear_on_bf16_working_weights_matches_cpu_emulation(recipe: str, no_tf32) -> None:
    """As the recipe trains by default: bf16 x, W and dy, fprop accumulating fast, against the CPU's emulation of the
    same bf16 operands."""
    if capability() < (8, 9):
        pytest.skip(f"FP8 GEMMs need compute capability 8.9+, this GPU has {capability()}")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(256, 1024, generator=g)
    x[:, 7] *= 30.0
    w = torch.randn(512, 1024, generator=g) * 1024**-0.5
    b = torch.randn(512, generator=g)
    dy = torch.randn(256, 512, generator=g) * 1e-3
    x, w, b, dy = (t.to(torch.bfloat16) for t in (x, w, b, dy))
    got, fwd_calls, _ = _run(recipe, x, w, b, dy, "cuda")
    want, cpu_calls, _ = _run(recipe, x, w, b, dy, "cpu")
    assert cpu_calls == 0 and fwd_calls >= 1, (cpu_calls, fwd_calls)
    for name, gt, wt in zip(("y", "dx", "dw", "db"), got, want, strict=True):
        assert gt.dtype == torch.bfloat16, f"{recipe} {name}: {gt.dtype}, not the working weights' bf16"
        err = rel_error(gt, wt)
        assert err < BF16_TOL, f"{recipe} {name}: relative error {err:.2e} >= {BF16_TOL:.0e} against the CPU emulation"
