"""`optim.implementation=triton`: megalm's one-pass AdamW kernel (megalm/parallel/data_parallel/adamw_kernel.py)
steps as torch's fused AdamW does, writes the working copies torch's path casts in a second kernel, and trains as
torch's does. On a CPU it runs under the Triton interpreter (tests/unit/triton_env.py); on CUDA compiled."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch

from tests.unit.triton_env import interpreter_fixture, restore_env, use_interpreter_without_cuda

use_interpreter_without_cuda()  # before triton is imported anywhere in this process

if importlib.util.find_spec("triton") is None:
    restore_env()
    pytest.skip("triton is not installed", allow_module_level=True)

from torch.optim.adamw import adamw  # noqa: E402

from megalm import compat  # noqa: E402
from megalm.errors import ConfigError  # noqa: E402
from megalm.parallel.data_parallel import adamw_kernel  # noqa: E402
from megalm.training.optim import full_precision_weights  # noqa: E402
from megalm.training.trainer import Trainer  # noqa: E402
from tests.conftest import compose_config  # noqa: E402

DEVICE = "cpu" if compat.triton_interpreted() else "cuda"
if not adamw_kernel.runnable(torch.device(DEVICE)):
    restore_env()
    pytest.skip(f"triton cannot run on {DEVICE}", allow_module_level=True)

_triton_interpret = interpreter_fixture(DEVICE)
HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}


@pytest.mark.parametrize("weight_decay, scaled", [(0.1, True), (0.0, False)], ids=["decay_clip", "plain"])
def test_the_kernel_steps_as_torch_s_fused_adamw(weight_decay, scaled):
    """Three steps of 10,007 elements (two programs and a ragged end) against torch's fused AdamW (the step
    counter torch increments first, as BucketAdamW hands it): the weights and moments within a few fp32 roundings
    (FMA contraction and the lerp's form differ), the bf16 working copy exactly the main weights rounded to
    nearest even, the gradients untouched (torch's kernel writes the unscaled ones back)."""
    gen = torch.Generator().manual_seed(0)
    n = 10_007
    start = [torch.randn(n, generator=gen), torch.randn(n, generator=gen), 0.1 * torch.randn(n, generator=gen),
             0.01 * torch.rand(n, generator=gen)]
    ours = [t.clone().to(DEVICE) for t in start]
    torch_s = [t.clone().to(DEVICE) for t in start]
    work = torch.empty(n, dtype=torch.bfloat16, device=DEVICE)
    scale = torch.tensor(2.5, device=DEVICE) if scaled else None
    for step in (1, 2, 3):
        adamw(*[[t] for t in torch_s], [], [torch.tensor(float(step - 1), device=DEVICE)], fused=True,
              grad_scale=None if scale is None else scale.clone(), amsgrad=False, weight_decay=weight_decay,
              maximize=False, **HYPER)
        torch_s[1].copy_(start[1])
        adamw_kernel.adamw_step_(*ours, work, weight_decay=weight_decay, step=step, grad_scale=scale, **HYPER)
    for name, got, want in zip(("weights", "gradients", "first moments", "second moments"), ours, torch_s,
                               strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")
    assert torch.equal(ours[1], start[1].to(DEVICE)), "the gradients were written"
    assert torch.equal(work, ours[0].to(torch.bfloat16)), "the working copy is not the rounded main weights"


def test_bf16_gradients_are_read_as_they_are():
    """parallel.grad_reduce_dtype=bf16 without ZeRO-1 hands the kernel the bf16 buckets: it widens them in registers
    (no fp32 copy of the gradients), the same step as on their fp32 values, bit for bit."""
    gen = torch.Generator().manual_seed(1)
    n = 5_003
    start = [torch.randn(n, generator=gen), torch.randn(n, generator=gen).bfloat16(),
             0.1 * torch.randn(n, generator=gen), 0.01 * torch.rand(n, generator=gen)]
    runs = []
    for grad in (start[1], start[1].float()):
        tensors = [t.clone().to(DEVICE) for t in (start[0], grad, start[2], start[3])]
        work = torch.empty(n, dtype=torch.bfloat16, device=DEVICE)
        adamw_kernel.adamw_step_(*tensors, work, weight_decay=0.1, step=2, grad_scale=torch.tensor(1.5, device=DEVICE),
                                 **HYPER)
        runs.append([tensors[0], tensors[2], tensors[3], work])
    for got, want in zip(*runs, strict=True):
        assert torch.equal(got, want)


def test_bad_tensors_are_refused():
    x = torch.zeros(8, device=DEVICE)
    with pytest.raises(ValueError, match="1-D contiguous tensors of one length"):
        adamw_kernel.adamw_step_(x, x[:4], x, x, None, weight_decay=0.0, step=1, **HYPER)
    with pytest.raises(TypeError, match="fp32 main weights"):
        adamw_kernel.adamw_step_(x, x.half(), x, x, None, weight_decay=0.0, step=1, **HYPER)
    with pytest.raises(TypeError, match="their bf16 copy"):
        adamw_kernel.adamw_step_(x, x, x, x, x.clone(), weight_decay=0.0, step=1, **HYPER)


TRAIN = ["data=synthetic", "trainer.device=cpu"]


@pytest.mark.skipif(DEVICE != "cpu", reason="the trainer comparison runs on the CPU (the GPU tier trains on CUDA)")
@pytest.mark.parametrize("layout", [["precision=bf16"], ["precision=fp32", "parallel.zero1=true"]],
                         ids=["bf16_main_weights", "zero1"])
def test_training_with_the_kernel_matches_torch_s(tmp_path, layout):
    """Four steps of the tiny model, clipped (the scale folded into the step), the kernel against torch's fused
    AdamW: the same losses, weights and optimizer states after each step. bf16: the kernel writes the working copies
    itself; ZeRO-1 (one rank): the all-gather refreshes them. After each comparison the kernel's run takes torch's
    weights and states, so every step compares the two updates of the same inputs: carried on, the runs part by
    chance, not by a fault, as Adam's first steps move a weight by lr * sign(g), and a gradient that cancels to
    nearly 0 takes either sign from a last-bit difference in the weights (0.01 apart in 4 steps at lr 3e-3)."""
    runs = {impl: Trainer(compose_config(*TRAIN, *layout, f"optim.implementation={impl}", "trainer.grad_clip=0.1"),
                          tmp_path / impl) for impl in ("auto", "triton")}
    assert runs["triton"].optimizer.kernel == "triton" and runs["auto"].optimizer.kernel == "torch"
    optimizers = {impl: runs[impl].optimizer for impl in runs}
    params = {impl: list(runs[impl].model.parameters()) for impl in runs}
    for step in range(4):
        a, b = (runs[impl].train_step(step).loss for impl in ("auto", "triton"))
        assert a == pytest.approx(b, rel=1e-5), step
        for (name, p), q in zip(runs["auto"].model.named_parameters(), params["triton"], strict=True):
            # bf16: within one rounding (the main weights differ in the last bits); fp32: as the moments
            tolerance = {"rtol": 2**-7, "atol": 1e-5} if p.dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-7}
            torch.testing.assert_close(q, p, **tolerance,
                                       msg=lambda m, name=name, step=step: f"step {step}, {name}: {m}")
        for state in ("main", "exp_avg", "exp_avg_sq"):
            got, want = (torch.cat(getattr(optimizers[impl], state) or [torch.zeros(0)]) for impl in ("triton", "auto"))
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7,
                                       msg=lambda m, state=state, step=step: f"step {step}, {state}: {m}")
        with torch.no_grad():  # the next step from the same inputs
            for p, q in zip(params["auto"], params["triton"], strict=True):
                q.copy_(p)
            for state in ("main", "exp_avg", "exp_avg_sq"):
                for x, y in zip(getattr(optimizers["auto"], state) or [], getattr(optimizers["triton"], state) or [],
                                strict=True):
                    y.copy_(x)


@pytest.mark.skipif(DEVICE != "cpu", reason="the trainer comparison runs on the CPU (the GPU tier trains on CUDA)")
def test_under_muon_the_matrices_working_copies_are_cast_from_their_main_weights(tmp_path):
    """optim.name=muon on bf16 weights: the kernel writes the AdamW parameters' working copies, and the matrices'
    (stepped by Muon on their main weights) are cast from theirs after it; two steps train as torch's AdamW beside
    Muon does, every working weight the cast of its main weight."""
    runs = {impl: Trainer(compose_config(*TRAIN, "precision=bf16", "optim.name=muon", f"optim.implementation={impl}"),
                          tmp_path / impl) for impl in ("auto", "triton")}
    assert runs["triton"].optimizer.kernel == "triton" and runs["triton"].optimizer.matrix_groups
    for step in range(2):
        a, b = (runs[impl].train_step(step).loss for impl in ("auto", "triton"))
        assert a == pytest.approx(b, rel=1e-5), step
    mains = {}
    for impl, run in runs.items():
        named = dict(run.model.named_parameters())
        working = {name: p.detach().clone() for name, p in named.items()}
        with full_precision_weights(run.optimizer):
            mains[impl] = {name: p.detach().clone() for name, p in named.items()}
        for name, p in working.items():
            assert torch.equal(p, mains[impl][name].to(torch.bfloat16)), f"{impl}: {name}'s working weight is stale"
    for name, main in mains["auto"].items():
        torch.testing.assert_close(mains["triton"][name], main, rtol=1e-4, atol=1e-6, msg=name)


def test_without_main_weights_or_zero1_it_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="optim.implementation=triton steps fp32 main weights") as error:
        Trainer(compose_config(*TRAIN, "precision=fp32", "optim.implementation=triton"), tmp_path)
    assert "\n" not in str(error.value)


def test_where_triton_cannot_run_torch_s_adamw_steps_and_says_so(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(adamw_kernel, "runnable", lambda device: False)
    with caplog.at_level(logging.WARNING, logger="megalm"):
        trainer = Trainer(compose_config(*TRAIN, "precision=bf16", "optim.implementation=triton"), tmp_path)
    assert trainer.optimizer.kernel == "torch"
    assert any("the Triton AdamW kernel cannot run on cpu" in r.getMessage() for r in caplog.records)


def test_under_fsdp_the_refusal_names_the_one_fix_that_applies():
    """FSDP steps its own shards: bf16 weights or ZeRO-1, the fixes for a run without them, are no fixes there (the
    line named both, with precision=bf16 set and ZeRO-1 refused beside FSDP: an audit)."""
    from megalm.training.validation import validate_run

    cfg = compose_config(*TRAIN, "precision=bf16", "optim.implementation=triton", "parallel.fsdp=true")
    with pytest.raises(ConfigError, match="which parallel.fsdp=true replaces") as error:
        validate_run(cfg, world_size=2)
    assert "precision=bf16" not in str(error.value) and "zero1" not in str(error.value)
