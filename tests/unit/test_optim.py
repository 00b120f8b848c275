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


@pytest.mark.parametrize("extra", [[], ["parallel.zero1=true"]], ids=["plain", "zero1"])
def test_grad_norm_launches_the_same_kernels_for_any_depth(tmp_path, extra):
    """The norm is foreach over all gradients: doubling the layers adds no kernel, and it equals the norm of
    torch's clip_grad_norm_ computed from the same gradients."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megalm.training.trainer import Trainer
    from tests.conftest import compose_config

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += not func.is_view  # kernels; a view (a slice of a ZeRO-1 shard) launches none
            return func(*args, **(kwargs or {}))

    counts = []
    for layers in (2, 4):
        trainer = Trainer(compose_config(f"model.num_layers={layers}", *extra), tmp_path / f"{layers}")
        trainer.forward_backward(0)
        with CountOps() as count:
            norm = trainer.grad_norm()
        counts.append(count.ops)
        grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
        if grads:  # without ZeRO-1 the gradients sit in p.grad
            expected = torch.nn.utils.get_total_norm(grads) if hasattr(torch.nn.utils, "get_total_norm") else \
                torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
            torch.testing.assert_close(norm, expected, rtol=1e-5, atol=0)
    assert counts[0] == counts[1], counts
