import math

import pytest
import torch

from megalm.config import OptimConfig
from megalm.training.optim import build_optimizer, lr_at, param_groups


def test_warmup_is_linear_then_cosine_reaches_min_lr():
    o = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, schedule="cosine")
    assert lr_at(0, o, 110) == pytest.approx(0.1)
    assert lr_at(9, o, 110) == pytest.approx(1.0)
    assert lr_at(10, o, 110) == pytest.approx(1.0)
    assert lr_at(60, o, 110) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(110, o, 110) == pytest.approx(0.1)
    assert lr_at(500, o, 110) == pytest.approx(0.1)
    lrs = [lr_at(s, o, 110) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False)), "cosine decay must be monotone"


def test_wsd_is_flat_then_decays_over_last_fraction():
    o = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=0, schedule="wsd", wsd_decay_fraction=0.25)
    assert [lr_at(s, o, 100) for s in (0, 50, 74)] == [1.0, 1.0, 1.0]
    assert lr_at(75, o, 100) == pytest.approx(1 - 1 / 25)
    assert lr_at(99, o, 100) == pytest.approx(0.0)


def test_linear_and_constant():
    lin = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=0, schedule="linear")
    assert lr_at(50, lin, 100) == pytest.approx(0.5)
    const = OptimConfig(lr=0.3, warmup_steps=0, schedule="constant")
    assert lr_at(99, const, 100) == 0.3


def test_norms_and_biases_are_not_decayed():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = param_groups(model, 0.1)
    assert [p.ndim for p in decay["params"]] == [2]
    assert len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0
    opt = build_optimizer(model, OptimConfig())
    assert opt.param_groups[0]["weight_decay"] == 0.1
