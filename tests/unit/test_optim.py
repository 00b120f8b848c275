import math
from types import SimpleNamespace

import pytest
import torch

from megalm.config import OptimConfig
from megalm.data.steps import GlobalBatchSteps
from megalm.training.optim import build_optimizer, full_precision_weights, lr_at, param_groups


def test_warmup_is_linear_then_cosine_reaches_min_lr():
    o = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, schedule="cosine")
    assert lr_at(0, o, 110) == pytest.approx(0.1)
    assert lr_at(9, o, 110) == pytest.approx(1.0)  # warmup's last step runs at lr, the decay's first below it
    assert lr_at(10, o, 110) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.01)))
    assert lr_at(59, o, 110) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(109, o, 110) == pytest.approx(0.1)  # the run's last step: min_lr (it ran a step short of it)
    assert lr_at(500, o, 110) == pytest.approx(0.1)
    lrs = [lr_at(s, o, 110) for s in range(9, 110)]
    assert all(a > b for a, b in zip(lrs, lrs[1:], strict=False)), "cosine decay must fall every step"


def test_wsd_is_flat_then_decays_over_last_fraction():
    o = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=0, schedule="wsd", wsd_decay_fraction=0.25)
    assert [lr_at(s, o, 100) for s in (0, 50, 74)] == [1.0, 1.0, 1.0]
    assert lr_at(75, o, 100) == pytest.approx(1 - 1 / 25)
    assert lr_at(99, o, 100) == pytest.approx(0.0)


def test_wsd_reaches_min_lr_when_warmup_runs_into_the_decay_window():
    """The decay starts after warmup and spans what is left of the run: divided by the window's nominal length, it
    ended part-way down (0.00165 for a min_lr of 0.0003 at warmup 90 of 100, fraction 0.2)."""
    o = OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=90, schedule="wsd", wsd_decay_fraction=0.2)
    assert lr_at(89, o, 100) == pytest.approx(3e-3) and lr_at(99, o, 100) == pytest.approx(3e-4)
    lrs = [lr_at(s, o, 100) for s in range(90, 100)]
    assert all(a > b for a, b in zip(lrs, lrs[1:], strict=False))
    whole = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=20, schedule="wsd", wsd_decay_fraction=1.0)
    assert lr_at(99, whole, 100) == pytest.approx(0.0)


def test_linear_and_constant():
    lin = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=0, schedule="linear")
    # without warmup the first step runs at lr, the last at min_lr
    assert lr_at(0, lin, 100) == 1.0 and lr_at(33, lin, 100) == pytest.approx(2 / 3) and lr_at(99, lin, 100) == 0.0
    # the same window as wsd's over the whole run: the same rates, step for step
    wsd = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=10, schedule="wsd", wsd_decay_fraction=0.9)
    lin_warm = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=10, schedule="linear")
    assert [lr_at(s, lin_warm, 100) for s in range(100)] == pytest.approx([lr_at(s, wsd, 100) for s in range(100)])
    const = OptimConfig(lr=0.3, warmup_steps=0, schedule="constant")
    assert lr_at(99, const, 100) == 0.3


def test_norms_and_biases_are_not_decayed():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = param_groups(model, 0.1)
    assert [p.ndim for p in decay["params"]] == [2]
    assert len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0
    opt = build_optimizer(model, OptimConfig())
    assert opt.param_groups[0]["weight_decay"] == 0.1


@pytest.mark.parametrize("extra", [[], ["parallel.zero1=true"]], ids=["plain", "zero1"])
def test_grad_norm_launches_the_same_kernels_for_any_depth(tmp_path, extra):
    """The norm is foreach over all gradients: doubling the layers adds no kernel, and it equals the norm of
    torch's clip_grad_norm_ computed from the same gradients."""
    from megalm.training.trainer import Trainer
    from tests.conftest import LaunchedOps, compose_config

    counts = []
    for layers in (2, 4):
        trainer = Trainer(compose_config(f"model.num_layers={layers}", *extra), tmp_path / f"{layers}")
        trainer.forward_backward(0)
        with LaunchedOps() as launched:  # a view (a slice of a ZeRO-1 shard) launches no kernel
            norm = trainer.grad_norm()
        counts.append(len(launched.ops))
        grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
        if grads:  # without ZeRO-1 the gradients sit in p.grad
            expected = torch.nn.utils.get_total_norm(grads) if hasattr(torch.nn.utils, "get_total_norm") else \
                torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
            torch.testing.assert_close(norm, expected, rtol=1e-5, atol=0)
    assert counts[0] == counts[1], counts


def _first_moments(optimizer) -> torch.Tensor:
    """AdamW's exp_avg over every parameter, flat: BucketAdamW's buckets, or torch's per-parameter state."""
    if hasattr(optimizer, "exp_avg"):
        return torch.cat(optimizer.exp_avg)
    return torch.cat([optimizer.state[p]["exp_avg"].reshape(-1) for group in optimizer.param_groups
                      for p in group["params"] if p in optimizer.state])


@pytest.mark.parametrize("precision", ["bf16", "fp32"], ids=["bucket_adamw", "torch_fused_adamw"])
def test_the_clip_folded_into_fused_adamw_saves_a_read_of_the_gradients(tmp_path, precision):
    """`clip_grad_norm_(max_norm, optimizer)` leaves the scale to fused AdamW's step (`grad_scale`, which the kernel
    divides each gradient by as it reads it) instead of a pass that multiplies the gradients first: the first moments
    and the weights after the step are those of clipping first (within a rounding: the kernel divides by 1/coef where
    the pass multiplied by coef), and the clip and the step together move 4 bytes a gradient element less (the pass read
    and wrote the fp32 gradients; the kernel writes them once more), counted by the op-cost trace. A clip to 1e-3
    scales every gradient: an unclipped step's moments differ from these by orders of magnitude."""
    from megalm.measure.op_cost import GPUS, OpCosts
    from megalm.training.trainer import Trainer
    from tests.conftest import compose_config

    results = {}
    for folded in (False, True):
        trainer = Trainer(compose_config(f"precision={precision}"), tmp_path / f"{precision}{folded}")
        assert (type(trainer.optimizer).__name__ == "BucketAdamW") == (precision == "bf16")
        trainer.forward_backward(0)
        grads = trainer.parallel.reducer.grad_shards() if precision == "bf16" else \
            [p.grad for p in trainer.model.parameters() if p.grad is not None]
        grad_bytes = sum(g.numel() * g.element_size() for g in grads)
        with OpCosts(GPUS["h100"]) as costs:
            norm = trainer.parallel.clip_grad_norm_(1e-3, trainer.optimizer if folded else None)
            trainer.optimizer.step()
        assert (getattr(trainer.optimizer, "grad_scale", None) is not None) == folded
        trainer.optimizer.grad_scale = None
        assert norm > 1e-2  # the clip scales by less than 1/10
        with full_precision_weights(trainer.optimizer):  # bf16: the fp32 main weights (a bf16 copy may round apart)
            weights = torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])
        results[folded] = (costs.total().bytes, _first_moments(trainer.optimizer), weights, grad_bytes)
    (plain_bytes, plain_m, plain_w, grad_bytes), (folded_bytes, folded_m, folded_w, _) = results[False], results[True]
    torch.testing.assert_close(folded_m, plain_m, rtol=1e-5, atol=0)
    torch.testing.assert_close(folded_w, plain_w, rtol=1e-6, atol=1e-8)  # near 0: eps weighs on tiny gradients
    assert abs((plain_bytes - folded_bytes) - grad_bytes) <= 64, (plain_bytes, folded_bytes, grad_bytes)


@pytest.mark.parametrize("layout", [["precision=bf16"], ["precision=fp32", "parallel.zero1=true"]],
                         ids=["bf16_main_weights", "zero1"])
def test_optim_implementation_chooses_bucket_adamw_s_kernel(tmp_path, layout):
    """`optim.implementation` reaches BucketAdamW (bf16 main weights, ZeRO-1) as it reaches torch's AdamW: foreach
    steps torch's foreach kernels (the clip then scales the gradients, which foreach takes no scale for), fused and
    auto (on a CPU) its fused kernel; every one gives the update of the others, within a rounding. Until 2026-12-04
    the setting was dropped on the way and BucketAdamW stepped fused whatever was asked, without a word."""
    from megalm.training.trainer import Trainer
    from tests.conftest import compose_config

    moments = {}
    for implementation, fused in (("auto", True), ("fused", True), ("foreach", False)):
        trainer = Trainer(compose_config(*layout, f"optim.implementation={implementation}", "trainer.grad_clip=1e-3"),
                          tmp_path / implementation)
        assert type(trainer.optimizer).__name__ == "BucketAdamW"
        assert trainer.optimizer.fused is fused, implementation
        trainer.train_step(0)
        moments[implementation] = _first_moments(trainer.optimizer)
    for implementation in ("fused", "foreach"):
        torch.testing.assert_close(moments[implementation], moments["auto"], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("kernel, copies", [("fused", 1), ("foreach", 2)])  # foreach: its own temporaries, as many
def test_bf16_gradient_buckets_are_cast_one_bucket_at_a_time(kernel, copies):
    """parallel.grad_reduce_dtype=bf16 without ZeRO-1: the optimizer steps whole bf16 buckets, which torch's AdamW
    kernels take in fp32. Cast one bucket at a time, the step's extra memory is one bucket's fp32 copy (it was every
    bucket's at once: 4 bytes a parameter on top of the 2 the setting keeps, more than fp32 buckets hold), measured
    by the live-storage probe; the update is the one of the same gradients in fp32."""
    from torch import nn

    from megalm.measure.storage import LiveStorages
    from megalm.parallel.data_parallel.bucket_adamw import BucketAdamW
    from megalm.parallel.data_parallel.reducer import GradReducer

    def stepped(reduce_dtype: torch.dtype | None) -> tuple[list[torch.Tensor], int, int, int]:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(8)])
        initial = {id(p): p.detach().clone() for p in model.parameters()}
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
        reducer = GradReducer(list(model.parameters()), None, bucket_size_mb=0.125, reduce_dtype=reduce_dtype,
                              accumulate=True)
        optimizer = BucketAdamW(list(model.parameters()), reducer, working_dtype=torch.bfloat16,
                                initial_weights=initial, kernel=kernel)
        reducer.start_step(1)
        model(torch.randn(4, 256, dtype=torch.bfloat16)).float().sum().backward()
        reducer.finish()
        if reduce_dtype is None:  # the bf16 run's gradients, held in fp32: the same update expected
            for bucket in reducer.buckets:
                bucket.buffer.copy_(bucket.buffer.bfloat16())
        with LiveStorages() as live:
            optimizer.step()
        largest = max(b.buffer.numel() for b in reducer.buckets) * 4
        return [t.clone() for t in optimizer.main], live.peak(), largest, len(reducer.buckets)

    cast, peak, largest, buckets = stepped(torch.bfloat16)
    held, _, _, _ = stepped(None)
    assert buckets >= 4
    assert peak <= copies * largest + 4096, (peak, largest, buckets)  # the step counters and the like: a few bytes
    for a, b in zip(cast, held, strict=True):
        assert torch.equal(a, b)


def megatron_lr(optim: OptimConfig, warmup_samples: int, decay_samples: int, wsd_samples: int,
                samples: list[int]) -> list[float]:
    """Megatron-Core's OptimizerParamScheduler, counted in samples (as its batch-size ramp needs) and stepped by each
    step's batch: its learning rate once `samples[i]` samples are consumed."""
    core = pytest.importorskip("megatron.core.optimizer_param_scheduler", reason="megatron-core: the interop extra")
    holder = SimpleNamespace(param_groups=[{}])
    scheduler = core.OptimizerParamScheduler(
        holder, init_lr=0.0, max_lr=optim.lr, min_lr=optim.min_lr, lr_warmup_steps=warmup_samples,
        lr_decay_steps=decay_samples, start_wd=0.0, end_wd=0.0, wd_incr_steps=1, wd_incr_style="constant",
        lr_decay_style={"wsd": "WSD", "inverse_sqrt": "inverse-square-root"}.get(optim.schedule, optim.schedule),
        wsd_decay_steps=wsd_samples, lr_wsd_decay_style=optim.wsd_decay_style)
    rates, consumed = [], 0
    for through in samples:
        scheduler.step(through - consumed)
        consumed = through
        rates.append(holder.param_groups[0]["lr"])
    return rates


SCHEDULES = [("cosine", "linear"), ("linear", "linear"), ("constant", "linear"), ("inverse_sqrt", "linear"),
             *[("wsd", style) for style in ("linear", "cosine", "exponential", "minus_sqrt")]]


@pytest.mark.parametrize("schedule, wsd_decay_style", SCHEDULES)
@pytest.mark.parametrize("rampup, warmup", [(None, 4), ([2, 2, 24], 3), ([2, 2, 24], 12), ([4, 2, 40], 1),
                                            ([4, 4, 8], 5)])
def test_each_schedule_is_megatrons_counted_in_samples(schedule, wsd_decay_style, rampup, warmup):
    """Each schedule and WSD decay shape is Megatron-Core's: without a ramp, step s at Megatron's rate for the
    (s + 1) global batches through it; with trainer.rampup_batch_size the schedule's clock is the samples consumed,
    each step at the rate Megatron-Core's scheduler gives for the samples through it, with --lr-warmup-samples =
    warmup_steps × the global batch and --lr-decay-samples the run's samples (WSD's decay window: wsd_decay_fraction
    of them, in whole batches). Warmups that end inside the ramp and after it; the ramp's steps take fractions of a
    batch."""
    optim = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=warmup, schedule=schedule, wsd_decay_fraction=0.3,
                        wsd_decay_style=wsd_decay_style)
    batches, max_steps = GlobalBatchSteps(8, rampup), 30
    through = [batches.start(s + 1) for s in range(max_steps)]
    total = through[-1]
    wsd_samples = round(0.3 * total / 8) * 8
    ours = [lr_at(s, optim, max_steps, batches) for s in range(max_steps)]
    assert ours == pytest.approx(megatron_lr(optim, warmup * 8, total, wsd_samples, through), abs=1e-12)
    assert max(ours) <= 1.0 + 1e-12
    if schedule not in ("constant", "inverse_sqrt"):
        assert ours[-1] == pytest.approx(0.1)
    if rampup and schedule != "constant":  # the ramp's clock is not the steps'
        assert ours != pytest.approx([lr_at(s, optim, max_steps) for s in range(max_steps)])


def test_without_a_ramp_the_clock_is_the_step():
    """A fixed global batch (or a ramp that starts whole) keeps the step's schedule exactly, and a token budget's
    steps, which have no whole batch to count in, keep counting steps."""
    optim = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=7, schedule="cosine")
    for batches in (None, GlobalBatchSteps(8), GlobalBatchSteps(8, [8, 4, 16]), object()):
        assert [lr_at(s, optim, 50, batches) for s in range(60)] == [lr_at(s, optim, 50) for s in range(60)]


@pytest.mark.parametrize("schedule, wsd_decay_style", SCHEDULES)
def test_without_warmup_a_ramp_s_first_steps_run_at_lr_never_above(schedule, wsd_decay_style):
    """Without warmup the ramp's first steps sit before the first whole batch (the clock below 0): they run at lr,
    as step 0 without a ramp does; they ran above it (1.08 lr on the linear schedule, 1.73 on inverse_sqrt: a second
    reader, 2026-12-07)."""
    optim = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=0, schedule=schedule, wsd_decay_style=wsd_decay_style)
    batches = GlobalBatchSteps(12, [4, 4, 16])
    rates = [lr_at(s, optim, 30, batches) for s in range(30)]
    assert rates[0] == rates[1] == 1.0 and max(rates) == 1.0
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False)), rates
