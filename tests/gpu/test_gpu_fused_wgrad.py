"""GPU tier: gradient accumulation fusion's CUDA GEMM (torch's `out_dtype` addmm: bf16 operands, fp32 accumulator
written in place), which no CPU runs (the CPU emulates it in fp32: tests/unit/test_gradient_accumulation_fusion.py).

Checked against fp64 sums of the same operands: the GEMM accumulates bf16 products in fp32, so a whole step's
summed weight gradients are within fp32 rounding of them (1e-5 relative), where the unfused path's bf16 weight
gradients are a bf16 rounding off (> 1e-4). The GEMM must be the one kernel: no upcast copies of its operands.
"""

from __future__ import annotations

import pytest
import torch

from megalm.model.naming import canonical_named_parameters
from megalm.parallel.data_parallel.fused_wgrad import wgrad_into
from megalm.training.trainer import Trainer
from tests.conftest import compose_config
from tests.gpu.conftest import CountOps, rel_error
from tests.unit.test_compile_blocks import EQUAL_DOCS
from tests.unit.test_gradient_accumulation_fusion import FUSED, MICRO, errors_against_fp64, fused_layers

pytestmark = pytest.mark.gpu


def test_the_cuda_gemm_overwrites_then_adds_in_fp32_without_upcasting():
    generator = torch.Generator(device="cuda").manual_seed(0)
    dy = torch.randn(4096, 256, device="cuda", generator=generator).bfloat16()
    x = torch.randn(4096, 512, device="cuda", generator=generator).bfloat16()
    out = torch.full((256, 512), float("nan"), device="cuda")
    expected = dy.double().t() @ x.double()
    with CountOps("addmm") as gemms:  # one profiler: two would nest, which torch's do not
        wgrad_into(out, dy, x, first=True)
        torch.cuda.synchronize()
    assert rel_error(out, expected) < 1e-5
    assert gemms.calls == 1 and gemms.count("_to_copy") == 0, (gemms.calls, gemms.count("_to_copy"))
    wgrad_into(out, dy, x, first=False)
    assert rel_error(out, 2 * expected) < 1e-5


def test_a_cuda_step_sums_unrounded_weight_gradients(tmp_path):
    """Step 1, after a whole step 0: the first micro-batch's GEMM must ignore step 0's sums."""
    trainer = Trainer(compose_config(*MICRO, *FUSED, "trainer.device=cuda", "trainer.compile=false"), tmp_path)
    trainer.train_step(0)
    errors = errors_against_fp64(trainer, 1)
    assert max(errors.values()) < 1e-5, errors


def test_compiled_blocks_add_the_eager_gradients_on_cuda(tmp_path):
    """Inductor's graph calls the layer's op, which runs the same GEMM: the first step's sums equal the eager run's
    to bf16 rounding of the fused elementwise kernels (one left out, or run twice, is off by O(1))."""
    runs = [Trainer(compose_config(*MICRO, *FUSED, *EQUAL_DOCS, "trainer.device=cuda", f"trainer.compile={c}"),
                    tmp_path / c) for c in ("false", "true")]
    for trainer in runs:
        trainer.forward_backward(0)
    grads = [dict(canonical_named_parameters(t.model)) for t in runs]
    for name in fused_layers(runs[0]):
        sums = [t.parallel.reducer.summed_grad(g[name]) for t, g in zip(runs, grads, strict=True)]
        assert rel_error(sums[1], sums[0]) < 1e-2, name
