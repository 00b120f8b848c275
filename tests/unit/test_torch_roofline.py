"""megalm's roofline against torch's own (megalm/measure/torch_roofline.py), on a CPU.

torch's RuntimeEstimator reads the live GPU's peak and bandwidth and refuses to run without CUDA; here it is given an
H100's datasheet numbers (`torch_given`), and told CUDA is there only while the step is traced: what the two count is
compared, not the live GPU's rates. tests/gpu/test_gpu_roofline.py runs the same check on the live GPU.
"""

from __future__ import annotations

import json

import pytest
import torch

from megalm.measure import op_cost
from megalm.measure.op_cost import GPUS
from megalm.measure.torch_roofline import REASONS, Comparison, compared_with_torch
from tools.bench import step_cost

H100 = GPUS["h100"]


def traced_step(overrides: list[str]) -> Comparison:
    """One micro-batch of megalm's eager step (step_cost.py's trainer) under both rooflines, torch's estimator given
    an H100's datasheet numbers."""
    with step_cost.fake_trainer(overrides, "h100") as trainer:
        trainer.forward_backward(0)  # the first step untraced, as step_cost.py does
        with compared_with_torch(given=H100) as comparison:
            trainer.forward_backward(1)
    return comparison


def test_megalm_and_torch_price_every_op_alike_where_their_conventions_agree():
    is_available = torch.cuda.is_available
    comparison = traced_step(["model=tiny"])
    assert torch.cuda.is_available is is_available  # answered for the estimator's calls only, and put back
    assert comparison.unexplained() == []
    # every op both priced is paired, call by call
    assert sum(p.torch_ms for p in comparison.pairs.values()) == pytest.approx(comparison.torch_total_ms, rel=1e-9)
    assert sum(p.megalm_ms for p in comparison.pairs.values()) == pytest.approx(comparison.megalm_total_ms, rel=1e-9)
    # what is compared one to one is the bulk of the step: its GEMMs and elementwise kernels
    same = comparison.by_reason()["same conventions"]
    assert same["megalm_ms"] >= 0.75 * comparison.megalm_total_ms, comparison.by_reason()
    assert comparison.pairs[("mm", None)].calls > 0 and comparison.pairs[("mm", None)].megalm_ms > 0
    assert set(comparison.by_reason()) - {"same conventions"} <= set(REASONS)
    # torch's rates, as probed from its own functions: its bandwidth as given; its compute time is MACs / (0.75 ·
    # peak): given a datasheet's TFLOP/s, torch 2.13 prices a GEMM at 1.5x it, and torch 2.11, which expects
    # Triton's peta-MAC/s there, at 1,500x
    assert comparison.rates.hbm_tbytes_per_s == pytest.approx(H100.hbm_tbytes_per_s)
    assert comparison.rates.bf16_tflops / H100.bf16_tflops == pytest.approx(1.5, rel=1e-9) or (
        comparison.rates.bf16_tflops / H100.bf16_tflops == pytest.approx(1500, rel=1e-9))


@pytest.mark.parametrize("overrides", [["precision=fp32", "precision.tf32=false"], ["precision=fp8"]],
                         ids=["fp32_without_tf32", "fp8"])
def test_other_recipes_pair_too(overrides):
    """fp32 GEMMs at torch's fp32 rate as its matmul precision has it (megalm's tf32 flag is torch's rate already);
    FP8's casts, which megalm counts as the one kernel a GPU compiles them into, apart as `fused`."""
    comparison = traced_step(["model=tiny", *overrides])
    assert comparison.unexplained() == []
    assert sum(p.megalm_ms for p in comparison.pairs.values()) == pytest.approx(comparison.megalm_total_ms, rel=1e-9)
    fused = comparison.by_reason().get("fused")
    assert (fused is not None and fused["megalm_ms"] > 0) == ("precision=fp8" in overrides), fused


def test_a_miscounted_op_is_caught(monkeypatch):
    """Broken on purpose: megalm's trace counts every bf16 tensor one byte too many."""
    nbytes = op_cost._nbytes
    monkeypatch.setattr(op_cost, "_nbytes", lambda t: nbytes(t) + (t.dtype == torch.bfloat16))
    unexplained = traced_step(["model=tiny"]).unexplained()
    assert any(line.startswith("mul:") for line in unexplained), unexplained


def test_step_cost_prints_torch_roofline_beside_its_own(capsys, monkeypatch):
    """`--torch-estimator`: the megalm row carries the comparison and the table its lines; without CUDA (as here)
    torch's estimator is given the numbers of `--gpu`, and the output says so."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a CPU, also where a GPU runs the suite
    assert step_cost.main(["--systems", "megalm", "--torch-estimator", "--gpu", "h200", "--json", "model=tiny"]) == 0
    summary = json.loads(capsys.readouterr().out)["systems"][0]["torch_estimator"]
    assert summary["source"] == "H200 SXM's datasheet, given"
    assert summary["unexplained"] == [] and summary["torch_ms"] > summary["megalm_ms_at_torch_rates"] > 0
    assert summary["torch_rates"]["hbm_tbytes_per_s"] == pytest.approx(4.8)
    lines = step_cost.torch_estimator_lines(summary)
    assert lines[-1].endswith("differ: none") and any(line.startswith("| same conventions |") for line in lines)
