"""parallel.gradient_accumulation_fusion: the weight-gradient GEMMs add into the fp32 main gradients themselves.

Checked against an independent computation: each fused layer's input x and output gradient dy as autograd hands
them over (a forward hook and a tensor hook), multiplied and summed over the micro-batches in fp64. The fused sums
match it to fp32's rounding; the unfused ones are a bf16 rounding off (each micro-batch's dW is written in bf16),
which is what the check can tell apart. The CUDA kernel (torch's `out_dtype` addmm) is checked by the GPU tier
(tests/gpu/test_gpu_fused_wgrad.py); here the CPU's fp32 emulation runs, and cost traces price the CUDA path.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.utils import counters

from megalm.errors import ConfigError
from megalm.model.linear import linear_modules
from megalm.model.naming import canonical_named_parameters
from megalm.parallel.data_parallel.fused_wgrad import MainGradAccumulator, wgrad_into
from megalm.training.trainer import Trainer
from megalm.training.validation import validate_run
from tests.conftest import compose_config
from tests.unit.test_compile_blocks import EQUAL_DOCS

# 4 micro-batches of 2 samples: enough partial sums for bf16 rounding to show
MICRO = ["precision=bf16", "trainer.global_batch_size=8", "trainer.micro_batch_size=2"]
FUSED = ["parallel.gradient_accumulation_fusion=true"]


def fused_layers(trainer: Trainer) -> dict[str, torch.nn.Module]:
    names = {id(p): n for n, p in canonical_named_parameters(trainer.model)}
    return {names[id(m.weight)]: m for m in linear_modules(trainer.model)}


def errors_against_fp64(trainer: Trainer, step: int) -> dict[str, float]:
    """Relative error of each linear weight's summed gradient after `step`'s forward and backward against the fp64
    sum of dyᵀ x over its micro-batches, from hooks."""
    operands: dict[str, list] = {}
    handles = []
    for name, module in fused_layers(trainer).items():
        def keep(module, inputs, output, name=name):  # noqa: ANN001, ANN202
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1])
            output.register_hook(lambda dy: operands.setdefault(name, []).append((dy.reshape(-1, dy.shape[-1]), x)))
        handles.append(module.register_forward_hook(keep))
    try:
        trainer.forward_backward(step)
    finally:
        for handle in handles:
            handle.remove()
    params = dict(canonical_named_parameters(trainer.model))
    errors = {}
    for name, pairs in operands.items():
        expected = sum(dy.double().t() @ x.double() for dy, x in pairs)
        got = trainer.parallel.reducer.summed_grad(params[name]).double()
        errors[name] = ((got - expected).norm() / expected.norm()).item()
    assert len(errors) == len(fused_layers(trainer)), "a linear layer ran no backward"
    return errors


def test_fused_gradients_are_the_unrounded_sum_of_the_micro_batches(tmp_path):
    """Step 1, after a whole step 0: the buckets hold step 0's sums, which the first micro-batch's GEMM must ignore
    (beta = 0), not add to."""
    fused = Trainer(compose_config(*MICRO, *FUSED), tmp_path / "fused")
    fused.train_step(0)
    errors = errors_against_fp64(fused, 1)
    assert max(errors.values()) < 1e-5, errors
    unfused = Trainer(compose_config(*MICRO), tmp_path / "unfused")
    unfused.train_step(0)
    rounded = errors_against_fp64(unfused, 1)
    assert min(rounded.values()) > 1e-4, rounded  # bf16 weight gradients: what the check above tells apart


def test_a_fused_run_trains_as_the_unfused_one_and_reduces_its_buckets_in_the_backward(tmp_path):
    """The same losses to bf16's rounding of the weight gradients, every bucket launched from the backward as the
    hooks launch them, and every other gradient (norms, embedding: autograd's) bit for bit."""
    fused = Trainer(compose_config(*MICRO, *FUSED), tmp_path / "fused")
    plain = Trainer(compose_config(*MICRO), tmp_path / "plain")
    fused.forward_backward(0)
    plain.forward_backward(0)
    linears = set(fused_layers(fused))
    grads = [{n: t.parallel.reducer.summed_grad(p) for n, p in canonical_named_parameters(t.model)}
             for t in (fused, plain)]
    for name, grad in grads[0].items():
        if name in linears:
            torch.testing.assert_close(grad, grads[1][name], rtol=2e-2, atol=1e-4, msg=name)
        else:
            assert torch.equal(grad, grads[1][name]), name
    stats = [t.parallel.reducer.stats for t in (fused, plain)]
    assert stats[0]["buckets_in_backward"] == stats[1]["buckets_in_backward"] == len(fused.parallel.reducer.buckets)
    losses = [[t.train_step(s).loss for s in range(1, 4)] for t in (fused, plain)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-3)


def test_bf16_buckets_take_the_gemm_in_their_own_dtype(tmp_path):
    """parallel.grad_reduce_dtype=bf16: the buckets, and so the sums the GEMM adds into, are bf16, each sum rounded as
    unfused; step 1, after a whole step 0, still ignores step 0's sums (Adam's updates barely move if a gradient
    doubles: the fp64 sums of the operands are the check)."""
    trainer = Trainer(compose_config(*MICRO, "parallel.grad_reduce_dtype=bf16", *FUSED), tmp_path)
    assert {b.buffer.dtype for b in trainer.parallel.reducer.buckets} == {torch.bfloat16}
    trainer.train_step(0)
    errors = errors_against_fp64(trainer, 1)
    assert max(errors.values()) < 2e-2, errors  # bf16 sums of 4 micro-batches; a stale sum added is O(1)


def test_fusion_is_said_with_what_it_leaves_out(tmp_path, caplog):
    def said(*overrides: str) -> tuple[Trainer, str]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="megalm"):
            trainer = Trainer(compose_config(*overrides, *FUSED), tmp_path / str(len(overrides)))
        return trainer, next(r.getMessage() for r in caplog.records if "gradient_accumulation_fusion" in r.getMessage())

    trainer, line = said(*MICRO)
    assert f"{len(fused_layers(trainer))} linear layers" in line and "unfused" not in line.split("(")[0]
    assert "emulated" in line  # the CPU's slower path is named
    fp8, line = said("precision=fp8", "precision.bf16_weights=true")
    sinks = [m.weight_grad_sink for m in linear_modules(fp8.model)]
    assert sum(s is not None and isinstance(s.sink, MainGradAccumulator) for s in sinks) == 1  # the bf16 head
    assert "1 linear layers" in line and f"unfused: {len(sinks) - 1} with a precision recipe" in line


@pytest.mark.parametrize("overrides, fix", [
    (["precision=fp32"], "use precision=bf16"),
    (["precision=fp8", "precision.bf16_weights=false"], "precision.bf16_weights=true"),
    (["precision=bf16", "parallel.dp=2", "parallel.fsdp=true"], "FSDP replaces"),
])
def test_fusion_without_fp32_main_gradients_is_refused_in_one_line(overrides, fix):
    with pytest.raises(ConfigError, match=fix) as err:
        validate_run(compose_config(*overrides, *FUSED), world_size=2)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_gemm_overwrites_then_adds(dtype):
    """beta = 0 ignores what the accumulator held (NaNs included), beta = 1 adds; in bf16 or fp32 operands."""
    generator = torch.Generator().manual_seed(0)
    dy, x = (torch.randn(64, n, generator=generator).to(dtype) for n in (16, 8))
    out = torch.full((16, 8), float("nan"))
    wgrad_into(out, dy, x, first=True)
    expected = dy.double().t() @ x.double()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    wgrad_into(out, dy, x, first=False)
    torch.testing.assert_close(out.double(), 2 * expected, rtol=1e-5, atol=1e-5)


def test_compiled_blocks_add_the_same_gradients_in_their_op(tmp_path, monkeypatch):
    """Inside a compiled block the layer's custom op runs the fused GEMM (megalm/model/deferred_wgrad.py): AOT autograd
    traces forward and backward; step 1, after a whole step 0, adds once per layer and micro-batch (a block left
    unfused adds none), and its summed gradients are the eager fused run's, to bf16's rounding of AOT's elementwise
    decompositions (a GEMM run twice is off by O(1)); no graph break."""
    from megalm.parallel.data_parallel.reducer import GradReducer

    arrivals = []
    added = GradReducer.added_to_main_grad
    monkeypatch.setattr(GradReducer, "added_to_main_grad", lambda self, p: (arrivals.append(p), added(self, p)))
    eager = Trainer(compose_config(*MICRO, *FUSED, *EQUAL_DOCS, "trainer.compile=false"), tmp_path / "eager")
    torch._dynamo.reset()
    counters.clear()
    compiled = Trainer(compose_config(*MICRO, *FUSED, *EQUAL_DOCS, "trainer.compile=true",
                                      "trainer.compile_backend=aot_eager"), tmp_path / "compiled")
    for trainer in (eager, compiled):
        trainer.train_step(0)
        arrivals.clear()
        _, share = trainer.forward_backward(1)
        assert len(arrivals) == len(fused_layers(trainer)) * len(share.micro_batches), len(arrivals)
    grads = [{n: t.parallel.reducer.summed_grad(p).double() for n, p in canonical_named_parameters(t.model)}
             for t in (eager, compiled)]
    for name in fused_layers(eager):  # a step apart from eager's: 1.6e-2 at most on torch 2.9, 3e-3 on 2.13
        error = ((grads[1][name] - grads[0][name]).norm() / grads[0][name].norm()).item()
        assert error < 5e-2, (name, error)
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_a_torch_whose_cuda_gemm_cannot_accumulate_in_fp32_is_said_and_left_unfused(tmp_path, monkeypatch, caplog):
    from megalm.parallel.data_parallel import fused_wgrad

    trainer = Trainer(compose_config(*MICRO), tmp_path)
    monkeypatch.setattr(fused_wgrad, "accumulator_problem", lambda device: "torch X's addmm takes no fp32 accumulator")
    with caplog.at_level(logging.WARNING, logger="megalm"):
        assert fused_wgrad.fuse_weight_grads(trainer.model, trainer.parallel.reducer, torch.device("cuda")) == 0
    assert "takes no fp32 accumulator" in caplog.text and "accumulate unfused" in caplog.text
    assert all(m.weight_grad_sink is None for m in linear_modules(trainer.model))
