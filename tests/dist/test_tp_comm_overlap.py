"""Tensor parallelism's backward collectives run in flight beside the GEMMs (Megatron's async TP communication):
a column-parallel layer's eager backward starts the input's re-gather (SP) before dgrad's GEMM and waits for it
only before wgrad's, and starts the input gradient's reduction (SP's reduce-scatter, plain TP's all-reduce) before
wgrad's GEMM and waits for it after. Recorded on 2 gloo ranks: every collective's start (and whether it was left in
flight) and wait, and every GEMM, in the order they ran; the gradients against the unsharded layer's. And the layer's
own GEMM function, which plain TP now runs too, adds a bias as F.linear does."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from megalm.parallel.tensor import ColumnParallelLinear
from megalm.parallel.tensor import comm as tp_comm

from .launch import run_distributed

GEMMS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


class _Gemms(TorchDispatchMode):
    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's signature
        if func in GEMMS:
            self.events.append("gemm")
        return func(*args, **(kwargs or {}))


class _Work:
    def __init__(self, work: dist.Work, name: str, events: list[str]) -> None:
        self.work, self.name, self.events = work, name, events

    def wait(self) -> bool:
        self.events.append(f"wait {self.name}")
        return self.work.wait()


def _recorded(collective, name: str, events: list[str]):  # noqa: ANN001, ANN202 - wraps any collective
    def call(*args, async_op: bool = False, **kwargs):  # noqa: ANN002, ANN003, ANN202
        events.append(f"start {name}{' in flight' if async_op else ''}")
        work = collective(*args, async_op=async_op, **kwargs)
        return _Work(work, name, events) if work is not None else None

    return call


class _Deferred:
    """A zero-bubble weight-gradient sink: wgrad's GEMM leaves the backward, to run later (the W action)."""

    accumulates = False

    def __init__(self) -> None:
        self.stashed: list = []

    def stash(self, param: torch.nn.Parameter, compute) -> None:  # noqa: ANN001 - any callable
        self.stashed.append((param, compute))


def _backward_order(rank: int, world_size: int, sequence_parallel: bool, deferred: bool, out: str) -> None:
    torch.manual_seed(0)
    full = torch.nn.Linear(16, 32, bias=False)
    tokens = torch.randn(8, 16)
    grad = torch.randn(8, 32)
    layer = ColumnParallelLinear.from_linear(full, dist.group.WORLD, sequence_parallel=sequence_parallel)
    if deferred:
        layer.weight_grad_sink = _Deferred()
    shard = tokens.chunk(world_size)[rank] if sequence_parallel else tokens
    x = shard.clone().requires_grad_()
    events: list[str] = []
    tp_comm.all_gather_flat = _recorded(tp_comm.all_gather_flat, "all_gather", events)
    tp_comm.reduce_scatter_flat = _recorded(tp_comm.reduce_scatter_flat, "reduce_scatter", events)
    dist.all_reduce = _recorded(dist.all_reduce, "all_reduce", events)
    y = layer(x)
    forward = list(events)
    events.clear()
    with _Gemms(events):
        y.backward(grad.chunk(world_size, dim=1)[rank])
        if deferred:  # the W action, after the backward: its GEMM reads the gathered input the backward waited for
            events.append("W")
            ((param, compute),) = layer.weight_grad_sink.stashed
            param.grad = compute()
    # the unsharded layer's gradients: this rank's rows of dW, and dx (this rank's tokens under SP)
    reference = tokens.clone().requires_grad_()
    full(reference).backward(grad)
    assert_close(layer.weight.grad, full.weight.grad.chunk(world_size)[rank], rtol=1e-6, atol=1e-6)
    expected_dx = reference.grad.chunk(world_size)[rank] if sequence_parallel else reference.grad
    assert_close(x.grad, expected_dx, rtol=1e-6, atol=1e-6)
    torch.save({"forward": forward, "backward": events}, f"{out}.{rank}")


@pytest.mark.parametrize("sequence_parallel, deferred, backward", [
    (True, False, ["start all_gather in flight", "gemm", "start reduce_scatter in flight", "wait all_gather", "gemm",
                   "wait reduce_scatter"]),
    (False, False, ["gemm", "start all_reduce in flight", "gemm", "wait all_reduce"]),
    # zero bubble: wgrad's GEMM waits for the W action; the gathered input it reads is complete before the B ends
    (True, True, ["start all_gather in flight", "gemm", "start reduce_scatter in flight", "wait all_gather",
                  "wait reduce_scatter", "W", "gemm"]),
], ids=["sp", "plain_tp", "sp_zero_bubble"])
def test_column_parallel_backward_collectives_run_beside_its_gemms(tmp_path, sequence_parallel, deferred, backward):
    """dgrad's GEMM runs while the re-gather is in flight, wgrad's while the input gradient's reduction is; the
    forward's gather stays synchronous (its GEMM needs it at once)."""
    run_distributed(_backward_order, 2, sequence_parallel, deferred, str(tmp_path / "events"), timeout=120)
    for rank in range(2):
        events = torch.load(tmp_path / f"events.{rank}")
        assert events["forward"] == (["start all_gather"] if sequence_parallel else []), (rank, events)
        assert events["backward"] == backward, (rank, events)


class _OneRank:
    """Plain TP's input collectives over one rank: nothing to gather or sum."""

    shards_input = False

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def start_gather(self, x: torch.Tensor) -> tp_comm.Pending:
        return tp_comm.Pending(x)

    def start_scatter(self, dx: torch.Tensor) -> tp_comm.Pending:
        return tp_comm.Pending(dx)


def test_a_biased_layer_adds_its_bias_as_f_linear_does():
    """Under plain TP a column-parallel layer runs its GEMM in its own function (for the all-reduce in flight); with a
    bias it runs F.linear's GEMM, bias included, so that a biased bf16 layer computes what one process's F.linear
    does (a separate add rounds twice)."""
    from megalm.model.linear import linear

    torch.manual_seed(0)
    x, weight, bias = (torch.randn(*shape).to(torch.bfloat16) for shape in ((64, 48), (32, 48), (32,)))
    x.requires_grad_()
    y = linear(x, weight, bias, input_comm=_OneRank())
    assert torch.equal(y, torch.nn.functional.linear(x, weight, bias))
