"""GPU tier: megalm's roofline (tools/bench/step_cost.py's OpCosts) against torch's own on the live GPU, op by op.

torch's `RuntimeEstimator` (its "operator-level-cost-model" mode) reads this GPU's peak and DRAM bandwidth, which no
CPU can give it (tests/unit/test_torch_roofline.py gives it an H100's). Over one eager micro-batch of the 125M model
(traced on fake tensors: no data), every op both price by the same conventions must cost the same at torch's rates
(megalm/measure/torch_roofline.py lists what differs and why); and the bandwidth torch reads off this GPU must be
within 10% of the datasheet's in megalm's `GPUS`, which step_cost.py's `--gpu` prices with.
"""

from __future__ import annotations

import subprocess

import pytest
import torch

from megalm.measure.torch_roofline import compared_with_torch, datasheet
from tools.bench import step_cost

pytestmark = pytest.mark.gpu


def test_torch_prices_a_step_as_megalm_does_on_this_gpu():
    from torch._inductor.utils import get_device_tflops, get_gpu_dram_gbps

    try:  # torch reads the peak from inductor's table by device name, else Triton asks nvidia-smi for the clock
        get_device_tflops(torch.bfloat16), get_gpu_dram_gbps()
    except (RuntimeError, AssertionError, ImportError, OSError, subprocess.SubprocessError) as error:
        pytest.skip(f"torch's estimator cannot read this GPU's numbers: {error!r}")
    with step_cost.fake_trainer(["model=125m", "model.seq_length=512"], "h100") as trainer:
        trainer.forward_backward(0)
        with compared_with_torch() as comparison:
            trainer.forward_backward(1)
    summary = comparison.summary()
    print(f"{torch.cuda.get_device_name()}: {summary}")  # in the GPU run's log
    assert comparison.unexplained() == []
    # most of the step is compared one to one (about 80% at the rates torch 2.11 reads off an H100 or H200)
    assert comparison.by_reason()["same conventions"]["megalm_ms"] >= 0.6 * comparison.megalm_total_ms
    sheet = datasheet(torch.cuda.get_device_name())
    if sheet is None:
        pytest.skip(f"{torch.cuda.get_device_name()} has no datasheet entry in megalm.measure.op_cost.GPUS")
    assert comparison.rates.hbm_tbytes_per_s == pytest.approx(sheet.hbm_tbytes_per_s, rel=0.10), (
        comparison.rates, sheet)
