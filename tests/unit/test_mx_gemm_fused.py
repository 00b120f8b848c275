"""MX GEMMs on the fused path: the Triton quantizer and a bf16 GEMM, against the PyTorch
reference (fp32 emulation) that CPU runs.

On CUDA training runs the fused path (`megalm.precision.gemm.mx_gemm_fused`); here, without CUDA, the same
code runs with the kernel under the Triton interpreter (TRITON_INTERPRET=1, set as in test_mx_triton.py) and
the bf16 GEMM as the fp32 product of the bf16 values, by forcing `mx_gemm_fused` to True. Round-to-nearest
must give the reference's GEMM bit for bit on CPU (same quantized values, same fp32 matmul); the RHT sums in
another order (last-bit differences); stochastic rounding draws from Philox instead of torch's generator, so
it is tested for being unbiased, which also checks that the 3/4 prescale left in the operands is divided out.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.unit.triton_env import interpreter_fixture, restore_env, use_interpreter_without_cuda

use_interpreter_without_cuda()  # before triton is imported anywhere in this process

if importlib.util.find_spec("triton") is None:
    restore_env()
    pytest.skip("triton is not installed", allow_module_level=True)

from megalm import compat  # noqa: E402
from megalm.precision import gemm as precision_gemm  # noqa: E402
from megalm.precision.gemm import gemm  # noqa: E402
from megalm.precision.kernels import mx_triton  # noqa: E402
from megalm.precision.layer_state import gemm_generator  # noqa: E402
from megalm.precision.linear import low_precision_linear  # noqa: E402
from megalm.precision.recipes import get_recipe  # noqa: E402

DEVICE = "cpu" if compat.triton_interpreted() else "cuda"
if not mx_triton.triton_available(DEVICE):
    restore_env()
    pytest.skip(f"triton cannot run on {DEVICE}", allow_module_level=True)
EXACT = DEVICE == "cpu"  # on CUDA the reference's fp32 matmul and the bf16 GEMM sum in different orders


_triton_interpret = interpreter_fixture(DEVICE)


def _path(monkeypatch, fused: bool) -> None:
    monkeypatch.setattr(precision_gemm, "mx_gemm_fused", lambda device: fused)


def _operands(t: int = 48, k: int = 96, n: int = 40, seed: int = 0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(t, k, generator=gen)
    b = torch.randn(k, n, generator=gen)
    return a.to(DEVICE, dtype), b.to(DEVICE, dtype)


def _both(monkeypatch, spec, a, a_dim, b, b_dim, seed=7):
    out = {}
    for fused in (False, True):
        _path(monkeypatch, fused)
        out[fused] = gemm(spec, a, a_dim, b, b_dim, gemm_generator(seed, "dgrad", a.device), seed=seed)
    return out[False], out[True]


@pytest.mark.parametrize("recipe, gemm_name", [("mxfp4_rtn", "dgrad"), ("mxfp8", "fprop"), ("mxfp8", "wgrad")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_to_nearest_equals_the_reference(monkeypatch, recipe, gemm_name, dtype):
    """Every K layout the layer uses (K = dim 1 of a, dim 0 of b; K = dim 0 of both for wgrad), K not a
    multiple of 32 included (the last block zero-padded on both sides)."""
    spec = getattr(get_recipe(recipe), gemm_name)
    for k in (96, 80):
        a, b = _operands(k=k, dtype=dtype)
        for a_t, a_dim, b_t, b_dim in ((a, 1, b, 0), (a.t().contiguous(), 0, b, 0), (a, 1, b.t().contiguous(), 1)):
            ref, fused = _both(monkeypatch, spec, a_t, a_dim, b_t, b_dim)
            assert fused.dtype == torch.float32 and fused.shape == ref.shape
            if EXACT:
                assert torch.equal(fused, ref), (recipe, gemm_name, k, a_dim, b_dim)
            else:
                torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-5)


def test_rht_equals_the_reference_up_to_summation_order(monkeypatch):
    spec = get_recipe("mxfp4_rht").dgrad
    a, b = _operands(k=100)  # K padded to 128 for the Hadamard blocks
    ref, fused = _both(monkeypatch, spec, a, 1, b, 0)
    # the RHT's 64-term sums differ in the last bit, which can move a value across a rounding boundary
    # (one E2M1 step, ~1/4 relative) in rare elements: compare as a relative Frobenius error
    assert ((fused - ref).norm() / ref.norm()).item() < 0.02


@pytest.mark.parametrize("recipe", ["mxfp4_sr", "mxfp4"])
def test_stochastic_rounding_is_unbiased(monkeypatch, recipe):
    """The mean of many fused draws approaches the exact product (~1/sqrt(draws) of one draw's error); a
    prescale (3/4 on each operand) left in would make every draw 16/9 too large."""
    spec = get_recipe(recipe).dgrad
    a, b = _operands(t=32, k=64, n=32)
    exact = a.double() @ b.double()
    _path(monkeypatch, True)
    draws = torch.stack([gemm(spec, a, 1, b, 0, gemm_generator(s, "dgrad", a.device), seed=s) for s in range(32)])
    rel = lambda c: ((c.double() - exact).norm() / exact.norm()).item()
    one = rel(draws[0])
    assert 0.1 < one < 0.4  # one draw: the SR error band of the reference (linear.py docstring: ~0.24)
    assert rel(draws.mean(0)) < 0.45 * one  # 32 draws: ~1/sqrt(32) = 0.18 of it, with slack


def test_a_layer_runs_the_fused_path_and_matches_the_reference(monkeypatch):
    """A whole linear layer (forward in bf16, dgrad and wgrad in MXFP4) on the fused path equals the
    reference: the recipe reaches the kernel through `RecipeGemms` with no other change."""
    x, _ = _operands(t=64, k=96)
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    dy = torch.randn(64, 40, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    calls = []
    real = mx_triton.mx_quantize_triton
    monkeypatch.setattr(precision_gemm, "mx_quantize_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    grads = {}
    for fused in (False, True):
        _path(monkeypatch, fused)
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        low_precision_linear(xr, wr, None, "mxfp4_rtn", seed=11).backward(dy)
        grads[fused] = (xr.grad, wr.grad)
    assert len(calls) == 4  # dgrad and wgrad, two operands each, only on the fused path
    for ref, fused in zip(grads[False], grads[True], strict=True):
        if EXACT:
            assert torch.equal(fused, ref)
        else:
            torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-5)


def test_the_log_names_the_mx_path():
    from megalm.config import PrecisionConfig
    from megalm.model.linear import Linear
    from megalm.precision import Precision
    from megalm.precision.gemm import mx_gemm_path

    cpu = Precision(PrecisionConfig(name="mxfp4"), seed=0, device=torch.device("cpu"))
    cpu.convert(torch.nn.Sequential(Linear(8, 8)))
    assert "MX GEMMs emulated in fp32 (no fused kernels on cpu)" in cpu.note
    if torch.cuda.is_available():
        assert mx_gemm_path(torch.device("cuda")) == "Triton quantizer + bf16 GEMM"
    from megalm import compat

    if compat.triton_importable():  # a GPU below sm70 was said to lack triton (an audit, 2026-12-06)
        with compat.simulated_cuda((6, 0)):
            assert mx_gemm_path(torch.device("cuda")) == ("emulated in fp32 (Triton kernels need compute capability "
                                                          "7.0+, this GPU has (6, 0))")
