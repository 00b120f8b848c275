"""AdamW with decoupled weight decay and the learning-rate schedules megalm offers.

The schedule is a pure function of the step (`lr_at`), so resuming needs no scheduler state
beyond the step counter and a resumed run follows exactly the curve of one that never stopped.

- cosine: linear warmup, then cosine from lr to min_lr over `decay_steps` (default: the rest of the run, whose last
  step runs at min_lr), then min_lr.
- linear: linear warmup, then linear decay to min_lr, likewise.
- wsd: warmup-stable-decay (Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training Beyond
  Fixed Training Durations"): warmup, constant lr, then a decay to min_lr over the last
  `wsd_decay_fraction` of the run, shaped by `wsd_decay_style` as Megatron-LM's --lr-wsd-decay-style: linear,
  cosine, exponential (2·0.5^progress − 1), or minus_sqrt (1 − √progress, the cooldown the paper found best).
- constant: warmup, then lr.
- inverse_sqrt: warmup, then lr·√(warmup_steps / step), never below min_lr (Vaswani et al. 2017; Megatron's
  inverse-square-root).

The clock is the step, unless the global batch ramps up (`trainer.rampup_batch_size`): then it is the samples
consumed, counted in whole global batches, so that warmup_steps, decay_steps and the run's end mean the same samples
whatever the ramp (Megatron-LM's schedule in samples, which its ramp requires: `--lr-warmup-samples` is warmup_steps
× global_batch_size, `--lr-decay-samples` the run's samples). Step s sits at samples(through s) / global_batch_size
− 1, behind s by the samples the ramp's smaller batches did not take, and the run's last step still at min_lr. Each
step runs at the rate Megatron-Core's scheduler gives for the samples through it (`tests/unit/test_optim.py`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from megalm.config import OptimConfig
from megalm.data.steps import GlobalBatchSteps
from megalm.parallel.data_parallel.optimizer_face import fused_adamw_kernel
from megalm.parallel.matrices import whole_matrices
from megalm.training.muon import Muon, MuonMatrices

# wsd's decay, the fraction of (lr - min_lr) left at a progress through it (0 to 1): Megatron-LM's shapes
WSD_DECAY: dict[str, Callable[[float], float]] = {
    "linear": lambda progress: 1.0 - progress,
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
    "exponential": lambda progress: 2.0 * 0.5 ** progress - 1.0,
    "minus_sqrt": lambda progress: 1.0 - math.sqrt(progress),
}


def lr_at(step: int, optim: OptimConfig, max_steps: int, batches: Any = None) -> float:
    """Learning rate for the optimizer step with 0-based index `step`. `batches`, the run's steps
    (megalm.data.steps.step_samples): under a batch-size ramp the schedule counts samples (module docstring)."""
    if isinstance(batches, GlobalBatchSteps) and batches.rampup:
        whole = batches.global_batch_size
        return _lr_at(batches.start(step + 1) / whole - 1, optim, batches.start(max_steps) / whole)
    return _lr_at(step, optim, max_steps)


def _lr_at(step: float, optim: OptimConfig, max_steps: float) -> float:
    """The schedule at `step`, a step index or, under a ramp, samples through it in global batches, minus one."""
    if optim.warmup_steps > 0 and step + 1 <= optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return optim.lr
    if optim.schedule == "inverse_sqrt":
        # (under a ramp without warmup the first steps sit below one whole batch: at lr, not above it)
        return max(optim.min_lr, optim.lr * min(1.0, math.sqrt(max(optim.warmup_steps, 1) / (step + 1))))
    if optim.schedule == "wsd":
        decay_steps = max(1, round(optim.wsd_decay_fraction * max_steps))
        decay_start = max(optim.warmup_steps, max_steps - decay_steps)
        if step < decay_start:
            return optim.lr
        # over what is left after warmup: a warmup into the decay window still ends at min_lr
        progress = min(1.0, (step - decay_start + 1) / max(1, max_steps - decay_start))
        return optim.min_lr + (optim.lr - optim.min_lr) * WSD_DECAY[optim.wsd_decay_style](progress)
    # from the peak, warmup's last step (or step 0 without warmup), to min_lr on the run's last step: it was a step
    # late (lr twice after warmup, and the last step short of min_lr: 45% of the way on a 20-step linear decay)
    peak = max(optim.warmup_steps - 1, 0)
    decay_steps = optim.decay_steps or max(1, max_steps - 1 - peak)
    progress = min(1.0, max(0.0, step - peak) / decay_steps)  # (a ramp's steps before the peak: at lr)
    if optim.schedule == "linear":
        return optim.lr + (optim.min_lr - optim.lr) * progress
    return optim.min_lr + 0.5 * (optim.lr - optim.min_lr) * (1.0 + math.cos(math.pi * progress))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (linear and embedding weights); leave norms and biases undecayed."""
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, optim: OptimConfig, layout: Any = None):
    """AdamW over `model`'s param groups: torch's (fused kernel when the parameters' device supports it,
    foreach otherwise), or the layout's own class when it brings one (`layout.optimizer_factory`, e.g. ZeRO-1's
    sharded AdamW: megalm.parallel.parallelism.Parallelism). `optim.name=muon`: Muon over `layout.matrices()` (the
    transformer blocks' matrices as whole ones; one process's without a layout), AdamW over the rest (muon.py): on
    the layout's BucketAdamW's fp32 main weights where it brings one (bf16 working weights)."""
    factory = getattr(layout, "optimizer_factory", None)
    groups = param_groups(model, optim.weight_decay)
    hyper = {"lr": optim.lr, "betas": (optim.beta1, optim.beta2), "eps": optim.eps}
    update = None
    if optim.name == "muon":
        matrices = layout.matrices() if layout is not None else whole_matrices(model, model.cfg, None)
        decay, no_decay = groups
        muon = [p for p in decay["params"] if id(p) in matrices]
        decay["params"] = [p for p in decay["params"] if id(p) not in matrices]
        groups.append({"params": muon, "weight_decay": optim.weight_decay, "muon": True,
                       "momentum": optim.muon_momentum, "nesterov": optim.muon_nesterov,
                       "ns_steps": optim.muon_ns_steps, "scale": str(optim.muon_scale)})
        update = MuonMatrices(matrices, muon)
    if factory is not None:  # (Muon: the matrices step on BucketAdamW's fp32 main weights behind bf16 working ones)
        return factory(groups, weight_decay=optim.weight_decay, **hyper,
                       **({"matrix_update": update} if update else {}))
    use_fused = fused_adamw_kernel(str(optim.implementation), next(model.parameters()).device)
    if update is not None:
        return Muon(groups, update, weight_decay=optim.weight_decay, fused=use_fused, **hyper)
    return torch.optim.AdamW(groups, **hyper, **({"fused": True} if use_fused else {"foreach": True}))


def current_weights(optimizer: Any) -> None:
    """Finish what the last optimizer step left in flight on the parameters (ZeRO-1's all-gather, when it overlaps
    the next forward: `parallel.overlap_param_gather`), before reading them outside a forward."""
    getattr(optimizer, "finish_param_gather", lambda: None)()


def full_precision_weights(optimizer: Any) -> contextlib.AbstractContextManager:
    """Inside, the model's parameters hold the fp32 weights training steps: what checkpoints save and loads write.
    With bf16 working weights those are the optimizer's main weights (BucketAdamW swaps them in and, on exit,
    takes them back and casts the working copies again); a plain AdamW's parameters are them already."""
    return getattr(optimizer, "full_precision_weights", contextlib.nullcontext)()


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
