"""Activation recomputation gives the same gradients, and recomputes what its mode says.

`full` re-runs whole blocks in backward (their matmuls included); `selective` re-runs the cheap ops
(norms, activations, RoPE) but none of the matmuls; `none` re-runs nothing. Counted by watching
which ops the backward pass executes.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megalm.errors import ConfigError
from megalm.model import GPT, init_weights
from megalm.parallel.recompute import apply_recompute, stage_mode
from tests.conftest import compose_config

aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default}


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def run(model: GPT, mode: str) -> tuple[torch.Tensor, dict[str, torch.Tensor], Counter]:
    """Output, gradients, and the ops the backward pass ran."""
    model = copy.deepcopy(model)
    apply_recompute(model, mode)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.cfg.vocab_size, (96,), generator=g)
    positions = torch.cat([torch.arange(64), torch.arange(32)])
    cu = torch.tensor([0, 64, 96], dtype=torch.int32)
    torch.manual_seed(7)  # dropout masks
    out = model(tokens, positions, cu, 64)
    loss = out.float().pow(2).mean()
    with OpCounter() as counter:
        loss.backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters()}, counter.ops


def test_recompute_modes_same_gradients_and_what_they_recompute():
    model = GPT(compose_config("model.dropout=0.1", "model.hidden_size=64", "model.num_layers=2").model)
    init_weights(model, 0)
    results = {mode: run(model, mode) for mode in ("none", "full", "selective")}
    out, grads, ops = results["none"]
    for mode in ("full", "selective"):
        torch.testing.assert_close(results[mode][0], out, rtol=0, atol=0)
        for name, grad in grads.items():
            torch.testing.assert_close(results[mode][1][name], grad, rtol=1e-5, atol=1e-7)

    def matmuls(counter: Counter) -> int:
        return sum(counter[op] for op in MATMULS)

    def norms(counter: Counter) -> int:  # RMSNorm's forward: x * rsqrt(mean(x^2) + eps)
        return counter[aten.rsqrt.default]

    none, full, selective = ops, results["full"][2], results["selective"][2]
    assert matmuls(full) > matmuls(none), "full recomputation must re-run the blocks' matmuls"
    assert matmuls(selective) == matmuls(none), "selective recomputation must keep every matmul output"
    assert norms(selective) > norms(none) and norms(full) > norms(none), "norms must be recomputed"


def test_stage_mode():
    assert stage_mode("full", 1, 4) == "full"
    assert stage_mode(["full", "selective", "none", "none"], 1, 4) == "selective"
    with pytest.raises(ConfigError, match="one mode per pipeline rank"):
        stage_mode(["full"], 0, 2)
    with pytest.raises(ValueError, match="recompute mode"):
        apply_recompute(torch.nn.Linear(2, 2), "some")


@torch.library.custom_op("megalm_test::fake_flash_attn_fwd", mutates_args=())
def _fake_flash_attn(x: torch.Tensor) -> torch.Tensor:
    return x.tanh()


@_fake_flash_attn.register_fake
def _(x):
    return torch.empty_like(x)


_fake_flash_attn.register_autograd(lambda ctx, grad: grad * (1 - ctx.y ** 2),
                                   setup_context=lambda ctx, inputs, output: setattr(ctx, "y", output))


def test_selective_keeps_attention_custom_ops():
    """Selective recomputation saves attention kernels registered as custom ops (flash-attn's, torch's varlen,
    TE's), matched by name, instead of running them again in the backward (full recomputation re-runs it)."""
    class Block(torch.nn.Module):
        def forward(self, x):
            return _fake_flash_attn(x * 2).sum(-1, keepdim=True) * x

    reruns = {}
    for mode in ("selective", "full"):
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleList([Block()])
        apply_recompute(model, mode)
        out = model.layers[0](torch.randn(4, 3, requires_grad=True)).sum()
        with OpCounter() as counter:
            out.backward()
        reruns[mode] = sum(n for op, n in counter.ops.items() if "fake_flash_attn" in str(op))
    assert reruns == {"selective": 0, "full": 1}


def test_selective_keeps_the_gemms_compiled_linears_run_as_ops():
    """A compiled block runs some linears' GEMMs as custom ops (an FP8/MX recipe's, a zero-bubble layer's): selective
    recomputation saves their outputs, as it saves a plain GEMM's, rather than running the GEMM again in the backward
    (megalm::deferred_fprop was recomputed until it was named: a third read of each weight per micro-batch)."""
    from torch.utils.checkpoint import CheckpointPolicy

    import megalm.model.deferred_wgrad  # noqa: F401 - registers megalm::deferred_fprop
    import megalm.precision.compiled_linear  # noqa: F401 - registers megalm::recipe_linear, megalm::fp8_linear
    from megalm.parallel.recompute import _selective_policy

    ops = torch.ops.megalm
    for op in (ops.deferred_fprop.default, ops.recipe_linear.default, ops.fp8_linear.default,
               torch.ops.aten.mm.default):
        assert _selective_policy(None, op) is CheckpointPolicy.MUST_SAVE, op
    assert _selective_policy(None, torch.ops.aten.mul.Tensor) is CheckpointPolicy.PREFER_RECOMPUTE
