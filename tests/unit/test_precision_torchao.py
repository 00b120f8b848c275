"""precision.backend=torchao: torchao's Float8Linear (TorchTitan's fp8) on megalm's linear layers.

torchao's tensorwise float8 is megalm's `fp8` recipe (E4M3 input and weight, E5M2 output gradient, per-tensor
scales from the current amax), so the native path is the reference: a layer computes what the native layer
computes, and a run trains as the native run does, in fp32 around the recipe (in bf16 the two round their outputs
in other places). Both on the CPU's emulation and where torch._scaled_mm takes the GEMMs (the CPU's kernel,
driven as a GPU from sm89 drives it); compiled blocks hold torchao's casts and GEMMs as ops of their graphs.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from megalm.errors import ConfigError
from megalm.model import GPT
from megalm.model.linear import Linear
from megalm.model.naming import canonical_named_parameters
from megalm.precision import Precision, torchao_fp8
from megalm.precision.install import apply_precision
from megalm.precision.recipes import get_recipe
from megalm.training.trainer import Trainer
from megalm.training.validation import validate_run
from tests.conftest import compose_config
from tests.unit.test_compile_blocks import EQUAL_DOCS, train_compiled_against_eager

pytestmark = pytest.mark.skipif(torchao_fp8.torchao_problem() is not None,
                                reason=f"{torchao_fp8.torchao_problem()}")

TORCHAO = ["precision=fp8", "precision.backend=torchao"]
FP32_AROUND = ["precision.autocast=false"]  # fp32 activations: both backends then round only in their FP8 casts


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _layer_pair(emulate: bool) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ours = nn.Sequential(Linear(64, 96, bias=False))
    theirs = nn.Sequential(Linear(64, 96, bias=False))
    theirs[0].weight.data.copy_(ours[0].weight.data)
    apply_precision(ours, get_recipe("fp8"))
    assert torchao_fp8.apply_torchao(theirs, emulate=emulate) == (1, 0, [])
    return ours, theirs


def _compare_layers(ours: nn.Module, theirs: nn.Module) -> list[float]:
    x = torch.randn(256, 64) * 3
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = ours(x1), theirs(x2)
    dy = torch.randn_like(y1)
    y1.backward(dy)
    y2.backward(dy)
    return [_relative(y2, y1), _relative(x2.grad, x1.grad), _relative(theirs[0].weight.grad, ours[0].weight.grad)]


def test_a_torchao_layer_computes_megalm_fp8_emulated():
    ours, theirs = _layer_pair(emulate=True)
    assert type(theirs[0]).__name__ == "Float8Linear"
    # y, dx, dW: the same FP8 operands; only the order of the fp32 sums may differ
    assert max(_compare_layers(ours, theirs)) < 1e-6


def test_a_torchao_layer_computes_megalm_fp8_through_scaled_mm(scaled_mm_on_cpu):
    ours, theirs = _layer_pair(emulate=False)
    calls = []
    original = torch._scaled_mm

    def counted(*args, **kwargs):
        calls.append(args[0].dtype)
        return original(*args, **kwargs)

    torch._scaled_mm = counted
    try:
        errors = _compare_layers(ours, theirs)
    finally:
        torch._scaled_mm = original
    assert max(errors) < 1e-6, errors
    # both backends' three GEMMs, and in the backward E5M2 gradients (dgrad and wgrad, whichever operand they are)
    assert len(calls) == 6 and calls.count(torch.float8_e5m2) == 4, calls


def _assert_adamw_close(got: torch.Tensor, want: torch.Tensor, flip_bound: float, name: str) -> None:
    """Weights after a few AdamW steps from the same start, whose gradients agree but for the order of fp32 sums:
    equal to 1e-4 but in a few elements (at most 1 in 1,000), and those within `flip_bound`. AdamW divides m by
    sqrt(v), so a gradient near zero moves its weight by about lr whatever its size, and one whose last bits flip
    its sign moves it 2 lr the other way (2026-12-03: one embedding element of 20,480, 3.3e-4 apart on one CPU machine,
    under 1e-4 on another). A backend that computes something else misses the 1e-4 in most elements."""
    off = (got - want).abs() > 1e-4 + 1e-4 * want.abs()
    assert off.float().mean().item() <= 1e-3, f"{name}: {int(off.sum())} of {off.numel()} elements differ"
    assert (got - want).abs().max().item() <= flip_bound, f"{name}: {(got - want).abs().max().item():.3g} apart"


@pytest.mark.parametrize("layout", [[], ["offload.enabled=true", "offload.min_tensor_bytes=0"],
                                    ["parallel.recompute=full"]], ids=["plain", "offload", "recompute"])
def test_torchao_trains_as_native_fp8_keeping_the_parameters(tmp_path, layout):
    """The same parameters (names and initial values: checkpoints and initialisation by name see no change), the log
    names the backend, and over 3 steps the same losses (1e-6) and weights; with layer offload (torchao keeps the
    weight for the backward as a view of the parameter, which stays in place) and full recomputation too."""
    native = Trainer(compose_config("precision=fp8", *FP32_AROUND, *layout), tmp_path / "native")
    ours = Trainer(compose_config(*TORCHAO, *FP32_AROUND, *layout), tmp_path / "torchao")
    assert "torchao Float8Linear" in ours.precision.note, ours.precision.note
    swapped = [m for m in ours.model.modules() if type(m).__name__ == "Float8Linear"]
    assert len(swapped) == 8 and type(ours.model.output) is Linear, "every linear but the skipped head"
    torch.testing.assert_close(ours.model.state_dict(), native.model.state_dict(), rtol=0, atol=0)
    lrs = []
    for step in range(3):
        a, b = native.train_step(step), ours.train_step(step)
        assert b.loss == pytest.approx(a.loss, rel=1e-6), step
        lrs.append(a.lr)
    theirs = dict(canonical_named_parameters(ours.model))
    for name, p in canonical_named_parameters(native.model):
        _assert_adamw_close(theirs[name], p, flip_bound=2 * sum(lrs), name=name)
    if layout and layout[0] == "offload.enabled=true":  # torchao keeps what F.linear keeps (the input, and the
        # weight as a view of the parameter, which stays in place): the bytes of a run without a recipe, to the byte
        plain = Trainer(compose_config("precision=fp32", *layout), tmp_path / "fp32")
        for step in range(3):
            plain.train_step(step)
        offloaded = [t.parallel.offload_store.offloaded_bytes for t in (ours, plain)]
        assert offloaded[0] == offloaded[1] > 0, offloaded


@pytest.mark.parametrize("overrides, fix", [
    (["precision=fp8_delayed"], "precision.backend=native"),
    (["precision=mxfp4"], "precision.backend=native"),
    (["parallel.tp=2"], "parallel.tp=1"),
    (["parallel.pp=2", "parallel.pp_schedule=zb", "model.num_layers=4"], "parallel.pp_schedule"),
], ids=["fp8_delayed", "mxfp4", "tp2", "zero_bubble"])
def test_what_torchao_cannot_run_is_refused_naming_the_fix(overrides, fix):
    cfg = compose_config("precision=fp8", "precision.backend=torchao", *overrides)
    with pytest.raises(ConfigError, match=fix.replace(".", r"\.")):
        validate_run(cfg, world_size=2 if any("=2" in o for o in overrides) else 1)


@pytest.mark.parametrize("overrides, fix", [
    (["precision=fp8", "precision.backend=torchao", "parallel.dp=2"], "parallel.fsdp=true"),
    (["precision=fp8", "parallel.dp=2", "parallel.fsdp=true"], "precision.backend=torchao"),
    (["precision=bf16", "parallel.dp=2", "parallel.fsdp=true"], "precision=fp8"),
    (["precision=fp8", "precision.backend=torchao", "parallel.dp=2", "parallel.fsdp=true",
      "parallel.fsdp_cpu_offload=true"], "drop one"),
], ids=["without_fsdp", "native", "bf16", "cpu_offload"])
def test_fp8_all_gather_outside_torchao_under_fsdp_is_refused_naming_the_fix(overrides, fix):
    cfg = compose_config(*overrides, "precision.fp8_all_gather=true")
    with pytest.raises(ConfigError, match=fix.replace(".", r"\.")):
        validate_run(cfg, world_size=2)


def test_fp8_all_gather_leaves_weights_whose_rows_do_not_divide_over_the_shards_plain_and_says_so(caplog):
    """torchao casts an FSDP shard without its padding, so a weight whose rows do not divide over the shards would
    send fewer bytes than its peers (gloo: a mismatch; tests/dist/test_fsdp_fp8_all_gather.py runs dp 3): those are
    gathered in their own dtype, named in one warning line."""
    cfg = compose_config(*TORCHAO, "precision.fp8_all_gather=true")
    model = GPT(cfg.model, device="meta")
    with caplog.at_level(logging.WARNING, logger="megalm"):
        Precision(cfg.precision, 0, torch.device("cpu")).convert(model, fsdp_shards=3)
    converted = {name: m for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    in_fp8 = {name for name, m in converted.items() if type(m.weight).__name__ == "WeightWithDynamicFloat8CastTensor"}
    assert in_fp8 == {name for name, m in converted.items() if m.out_features % 3 == 0} != set(converted)
    [line] = [r.getMessage() for r in caplog.records if "precision.fp8_all_gather" in r.getMessage()]
    assert f"{len(converted) - len(in_fp8)} linear layers" in line and "FSDP's 3 shards" in line


def test_without_torchao_the_native_path_runs_and_says_so(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(torchao_fp8, "torchao_problem", lambda: "torchao is not importable (here, on purpose)")
    with caplog.at_level(logging.WARNING, logger="megalm"):
        trainer = Trainer(compose_config(*TORCHAO), tmp_path)
    assert "precision.backend=torchao but torchao is not importable" in caplog.text
    assert "precision.fp8_all_gather" not in caplog.text  # not asked for: not mentioned
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megalm"):
        asked = Precision(compose_config(*TORCHAO, "precision.fp8_all_gather=true").precision, 0, torch.device("cpu"))
    assert not asked.fp8_all_gather
    [line] = [r.getMessage() for r in caplog.records if "torchao is not importable" in r.getMessage()]
    assert "precision.fp8_all_gather needs torchao" in line  # the slower path, said in the same line
    assert not [m for m in trainer.model.modules() if type(m).__name__ == "Float8Linear"]
    assert all(m.gemm_recipe is not None for m in trainer.model.layers[0].modules() if type(m) is Linear)


@pytest.mark.parametrize("layout", [[], ["parallel.recompute=selective"]], ids=["plain", "recompute"])
def test_compiled_blocks_run_torchao_casts_and_gemms_in_their_graphs(tmp_path, scaled_mm_on_cpu,
                                                                      layout):
    """As TorchTitan compiles Float8Linear: one `_scaled_mm` per layer in a block's forward graph, two in its
    backward, no break, and the losses and weights of the eager run."""
    float8_layers = lambda model: sum(type(m).__name__ == "Float8Linear" for m in model.layers[1].modules())  # noqa: E731
    train_compiled_against_eager(tmp_path, [*EQUAL_DOCS, *TORCHAO, *FP32_AROUND, *layout], float8_layers)


@pytest.mark.parametrize("gpu_like", [False, True], ids=["emulated", "scaled_mm"])
def test_torchao_blocks_compile_once_without_breaks(tmp_path, request, gpu_like):
    """`trainer.compile=true` over 20 steps: one graph per block's code, never recompiled, no break."""
    from tests.unit.test_compile_blocks import assert_compiles_once, compiled_trainer

    if gpu_like:
        request.getfixturevalue("scaled_mm_on_cpu")
    assert_compiles_once(compiled_trainer(tmp_path, "eager", *TORCHAO))


def test_layers_scaled_mm_cannot_take_stay_unconverted_and_the_log_says_so(tmp_path, scaled_mm_on_cpu,  # noqa: F811
                                                                          caplog):
    """torch._scaled_mm takes dimensions in multiples of 16 only: an MLP 36 wide keeps its two projections in the
    trainer's precision (the native path emulates them instead), with a warning, and the run trains."""
    with caplog.at_level(logging.WARNING, logger="megalm"):
        trainer = Trainer(compose_config(*TORCHAO, "model.ffn_hidden_size=36"), tmp_path)
    mlp = trainer.model.layers[0].mlp
    assert {type(m).__name__ for m in mlp.children()} == {"Linear"}, mlp
    attention_layers = [m for m in trainer.model.layers[0].modules() if type(m).__name__ == "Float8Linear"]
    assert len(attention_layers) == 2, "q/k/v and the output projection: 64 wide"
    assert "4 linear layers stay in the trainer's precision" in caplog.text
    assert "4 layers left unconverted" in trainer.precision.note
    assert trainer.train_step(0).loss > 0
