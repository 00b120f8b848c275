"""tools/bench/fp8_gemms.py: it times the GEMMs of the model's own block (its linear layers' shapes), in the layouts
megalm's FP8 linears give torch._scaled_mm, with fast accumulation where the fp8 recipe has it, and says when FP8
cannot run instead of timing something else."""

from __future__ import annotations

import pytest
import torch

from megalm.precision.recipes import get_recipe
from tests.conftest import TINY
from tools.bench import fp8_gemms as bench

MODEL = [o for o in TINY if o.startswith("model.")]


def test_the_block_is_the_models_first_layer():
    from megalm.config.checks import resolve_model_defaults
    from megalm.model.gpt import GPT
    from megalm.model.linear import Linear
    from tools.bench.throughput import compose_config

    cfg = compose_config(MODEL)
    model = GPT(resolve_model_defaults(cfg.model))
    linears, layers, tokens = bench.block_linears(MODEL)
    shapes = [tuple(m.weight.shape) for m in model.layers[0].modules() if isinstance(m, Linear)]
    assert [(out, inp) for _, out, inp in linears] == shapes and len(shapes) == 4
    assert layers == len(model.layers) and tokens == cfg.model.seq_length * cfg.trainer.micro_batch_size


def test_its_megalm_setting_is_the_fp8_recipes():
    recipe = get_recipe("fp8")
    assert bench.SETTINGS["megalm"] == tuple(gemm for gemm in bench.GEMMS if getattr(recipe, gemm).fast_accum)


def test_each_gemm_computes_the_layers_product_in_the_layouts_scaled_mm_takes():
    """fprop x W^T, dgrad dy W, wgrad dy^T x, from operands row-major first and column-major second, in bf16 and FP8
    (E4M3 x and W, E5M2 dy): each within its format's error of the fp32 product (a transposed operand would not be;
    the shapes are square where a transpose would keep them)."""
    if reason := bench.scaled_mm_runs(torch.device("cpu")):
        pytest.skip(f"torch._scaled_mm does not run on this CPU: {reason}")
    gen = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(*shape, generator=gen) for shape in ((32, 32), (32, 32), (32, 32)))
    want = {"fprop": x @ w.t(), "dgrad": dy @ w, "wgrad": dy.t() @ x}
    one = torch.ones(())
    for kind, gemms in bench.operands(x, w, dy).items():
        for gemm, (a, b) in gemms.items():
            assert a.is_contiguous() and b.t().is_contiguous(), (kind, gemm)
            got = torch.mm(a, b) if kind == "bf16" else torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                                                                         out_dtype=torch.bfloat16)
            error = ((got.float() - want[gemm]).norm() / want[gemm].norm()).item()
            assert error < (0.01 if kind == "bf16" else 0.15), (kind, gemm, error)
    formats = {gemm: (a.dtype, b.dtype) for gemm, (a, b) in bench.operands(x, w, dy)["fp8"].items()}
    assert formats == {"fprop": (bench.E4M3, bench.E4M3), "dgrad": (bench.E5M2, bench.E4M3),
                       "wgrad": (bench.E5M2, bench.E4M3)}


def test_it_times_every_setting_or_says_why_fp8_cannot_run(monkeypatch, capsys):
    flags = ["--iters", "1", "--warmup", "0"]
    if bench.scaled_mm_runs(torch.device("cpu")) is None:
        report = bench.main([*MODEL, *flags])
        assert set(report["summary"]) == {"bf16", "promote", "megalm", "fast"}
        assert all(set(row[gemm]) == {"bf16", "fp8_fast=False", "fp8_fast=True"}
                   for row in report["rows"] for gemm in bench.GEMMS)
        megalm = sum(row[gemm][f"fp8_fast={gemm == 'fprop'}"]["ms"] for row in report["rows"] for gemm in bench.GEMMS)
        assert report["summary"]["megalm"]["block_ms"] == pytest.approx(megalm)
    monkeypatch.setattr(bench, "scaled_mm_runs", lambda device: "no kernel")
    report = bench.main([*MODEL, *flags])
    assert set(report["summary"]) == {"bf16"} and report["fp8_skipped"] == "no kernel"
    assert "FP8 skipped: torch._scaled_mm does not run here (no kernel)" in capsys.readouterr().out


def test_a_timed_call_launches_its_gemms_back_to_back_and_shares_its_time(monkeypatch):
    """--back-to-back 4: each timed call runs the GEMM 4 times, and a GEMM's time is the call's over 4."""
    monkeypatch.setattr(bench, "scaled_mm_runs", lambda device: "no kernel")  # bf16 alone: torch.mm counted
    launched = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: launched.append(1) or real_mm(a, b))
    monkeypatch.setattr(bench, "time_calls", lambda call, device, warmup, iters: [call(), 8.0][1:] * iters)
    report = bench.main([*MODEL, "--iters", "1", "--warmup", "0", "--back-to-back", "4"])
    assert len(launched) == 4 * len(report["rows"]) * len(bench.GEMMS)
    assert all(row[gemm]["bf16"]["ms"] == 2.0 for row in report["rows"] for gemm in bench.GEMMS)
