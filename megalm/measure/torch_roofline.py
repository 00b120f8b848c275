"""megalm's roofline (op_cost.OpCosts) checked against torch's own, op by op, on the live GPU.

torch has a roofline of its own: `torch.distributed._tools.runtime_estimator.RuntimeEstimator` in its
"operator-level-cost-model" mode prices every dispatched op as max(compute time, transfer time), as OpCosts does, but
reads the device it runs on (its peak by `torch.cuda.get_device_name()` from inductor's datasheet table, else from
Triton's clocks; its DRAM bandwidth from Triton), so it needs CUDA, and it is not how step_cost.py prices a step on a
CPU. `compared_with_torch` runs both over the same ops (the estimator first, OpCosts under it) and pairs their times
call by call. Both are written independently (which tensors an op reads, which ops count, the FLOP formulas), so an
op where they agree is counted right by both or wrong by both in the same way.

Their conventions differ, and each call is sorted into the reason its times may differ (`REASONS`), or none:
- The rates. torch's compute time is MACs / (0.75 · peak), and its peak comes in two units: inductor's datasheet
  table gives TFLOP/s (found only by exact device name, which a real H100, "NVIDIA H100 80GB HBM3", or an H200 does
  not match), Triton's formula from nvidia-smi's SM clock gives peta-MAC/s. torch 2.11 multiplies it by 1e15, 2.13
  by 1e12, each right for one of the two: on a real H100 or H200, 2.11 prices a bf16 GEMM at 75% of the clock's peak
  and 2.13 at a thousandth of that; given a datasheet number (`torch_given`), 2.13 at 1.5 times it and 2.11 at 1,500
  times. So OpCosts prices the step at the rates torch's own functions give (`torch_rates`, probed with one GEMM and
  one copy), and what is left is what each counts.
- What each counts: see `REASONS`. Everything else must agree to rounding (`Comparison.unexplained`), each call
  priced on its own.

The GPU tier runs it (tests/gpu/test_gpu_roofline.py), and `tools/bench/step_cost.py --torch-estimator` prints it.
A CPU gives torch's estimator the datasheet numbers of a named GPU instead (`torch_given`): that checks what the two
count, not the live GPU's rates (tests/unit/test_torch_roofline.py).
Eager steps only: a compiled block's generated kernels are inductor's (measure/compiled_cost.py), which torch's
estimator does not see; the FP8 casts an eager step counts as their compiled kernel are the row `fused`.
"""

from __future__ import annotations

import contextlib
import io
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from megalm.measure.op_cost import (
    GPUS,
    Gpu,
    OpCosts,
    category,
    causal_attention,
    dispatches_no_kernel,
    indexed_bytes,
    reads_every_argument,
)

REASONS = {
    "no kernel": "launches no kernel (a view missing from torch's list, a metadata query, an allocation); torch prices "
                 "its tensors as moved",
    "created": "a creation op (zeros_like, arange, ...), which torch prices at zero",
    "not read": "megalm reads no destination it overwrites, nothing a fill is given, no out= tensor; torch counts "
                "every tensor argument",
    "in place": "an in-place op that returns nothing; torch counts no write",
    "no formula": "FLOPs from megalm's formula (the CPU flash kernel, grouped GEMMs); torch has none and prices bytes "
                  "only",
    "broadcast": "an input with a stride-0 dimension, which torch counts once and megalm at its full size",
    "output dtype": "a GEMM whose output dtype is not its operands': torch takes the peak of its output's dtype, "
                    "megalm of its operands'",
    "fused": "megalm counts these as the one kernel the GPU fuses them into (a compiled FP8 cast, its row "
             "`fused kernel`); torch prices each op",
    "indexed": "an op that reads or writes only the elements its indices name (gather, embedding, an in-place "
               "scatter, nll_loss); torch counts whole tensors",
    "causal": "a causal call of torch's attention kernels, whose FLOPs megalm halves (flash kernels skip the masked "
              "blocks); torch's formula counts the whole square",
}


def torch_rates() -> Gpu:
    """The rates torch's roofline prices ops at on this device, as a `Gpu`: the FLOP/s its compute time implies for
    a bf16 and an fp32 GEMM (probed through `get_compute_time`, whatever its convention; fp32's as torch's matmul
    precision is set now), and the bytes/s of its transfer time (through `get_transfer_time`). fp8 at twice bf16
    (torch's estimator takes a GEMM's output dtype, which FP8 GEMMs never have)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._runtime_estimation import get_compute_time, get_transfer_time

    n = 4096
    with FakeTensorMode():
        rates = {}
        for dtype in (torch.bfloat16, torch.float32):
            a = torch.empty(n, n, dtype=dtype)
            out = torch.empty(n, n, dtype=dtype)
            ns = get_compute_time(torch.ops.aten.mm, (a, a), {}, out, {dtype})
            rates[dtype] = 2.0 * n**3 / (ns * 1e-9) if ns > 0 else float("inf")
        moved = torch.empty(n, n, dtype=torch.float32)
        bytes_per_s = 2 * moved.numel() * 4 / (get_transfer_time([moved], [moved]) * 1e-9)
    tflops = rates[torch.bfloat16] / 1e12
    return Gpu("torch's estimator", tflops, 2 * tflops, rates[torch.float32] / 1e12, bytes_per_s / 1e12, (9, 0))


@dataclass
class OpPair:
    """One op's calls under one reason: how many, and the two rooflines' milliseconds."""

    calls: int = 0
    megalm_ms: float = 0.0
    torch_ms: float = 0.0


@dataclass
class Comparison:
    """megalm's and torch's roofline of the same ops, by (op name, reason) (reason None: the same conventions)."""

    rates: Gpu
    source: str  # where torch's estimator read its device numbers
    pairs: dict[tuple[str, str | None], OpPair] = field(default_factory=lambda: defaultdict(OpPair))
    torch_total_ms: float = 0.0  # the estimator's own total, to check the pairing against
    megalm_total_ms: float = 0.0

    def unexplained(self, rtol: float = 1e-6) -> list[str]:
        """The ops of the same conventions whose times differ by more than `rtol` (relative), with both times."""
        return [f"{name}: megalm {p.megalm_ms:.6g} ms, torch {p.torch_ms:.6g} ms ({p.calls} calls)"
                for (name, reason), p in self.pairs.items() if reason is None
                and abs(p.megalm_ms - p.torch_ms) > rtol * max(p.megalm_ms, p.torch_ms, 1e-12)]

    def by_reason(self) -> dict[str, dict[str, float]]:
        """{reason or "same conventions": {calls, megalm_ms, torch_ms}}."""
        out: dict[str, dict[str, float]] = {}
        for (_, reason), p in self.pairs.items():
            if not p.calls:  # the fused kernels' row of a step without any
                continue
            row = out.setdefault(reason or "same conventions", {"calls": 0, "megalm_ms": 0.0, "torch_ms": 0.0})
            row["calls"] += p.calls
            row["megalm_ms"] += p.megalm_ms
            row["torch_ms"] += p.torch_ms
        return out

    def summary(self) -> dict:
        r = self.rates
        return {"source": self.source, "torch_rates": {"bf16_tflops": r.bf16_tflops, "tf32_tflops": r.tf32_tflops,
                                "hbm_tbytes_per_s": r.hbm_tbytes_per_s},
                "torch_ms": self.torch_total_ms, "megalm_ms_at_torch_rates": self.megalm_total_ms,
                "by_reason": self.by_reason(), "unexplained": self.unexplained()}


def _reason(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: object, flops: float) -> str | None:
    from torch.utils._runtime_estimation import _IGNORE_OPS

    name = func._overloadpacket.__name__
    if dispatches_no_kernel(func):
        return "no kernel"
    if func._overloadpacket in _IGNORE_OPS:
        return "created"
    if indexed_bytes(func, args, kwargs, out) is not None:
        return "indexed"
    if causal_attention(func, args, kwargs):
        return "causal"
    if not reads_every_argument(func, args, kwargs):
        return "not read"
    outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    if not outputs:
        return "in place"
    if flops and func._overloadpacket not in flop_registry:
        return "no formula"
    inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    if any(0 in t.stride() and t.numel() > 1 for t in inputs):
        return "broadcast"
    if category(name) == "gemm" and {t.dtype for t in outputs} != {t.dtype for t in inputs[:2]}:
        return "output dtype"
    return None


@contextlib.contextmanager
def torch_given(gpu: Gpu) -> Iterator[None]:
    """While inside, torch's estimator reads `gpu`'s datasheet numbers where it reads the live GPU's (its peak by
    dtype, its DRAM bandwidth): how a CPU runs the comparison, which then checks what the two count, not the live
    GPU's rates. (`compared_with_torch` also answers the estimator's one CUDA check, call by call.)"""
    import torch.utils._runtime_estimation as estimation

    saved = estimation.get_device_tflops, estimation.get_gpu_dram_gbps
    estimation.get_device_tflops = lambda dtype: gpu.bf16_tflops if dtype in (torch.bfloat16, torch.float16) else (
        gpu.tf32_tflops)
    estimation.get_gpu_dram_gbps = lambda: gpu.hbm_tbytes_per_s * 1000
    try:
        yield
    finally:
        estimation.get_device_tflops, estimation.get_gpu_dram_gbps = saved


@contextlib.contextmanager
def _cuda_said_available() -> Iterator[None]:
    """`torch.cuda.is_available()` true while inside: RuntimeEstimator's roofline checks it before each op, on a CPU
    given a datasheet."""
    available = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    try:
        yield
    finally:
        torch.cuda.is_available = available


class _CallCosts(OpCosts):
    """OpCosts that also keeps what the op of the estimator's current call adds (`call_ms`, `call_flops`), so that a
    call's megalm time is its own and not a difference of running totals (which loses the small ops of a large step
    to rounding), and what is added between calls (a fused kernel's `add_kernel`) apart."""

    def __init__(self, gpu: Gpu, between: OpPair) -> None:
        super().__init__(gpu, tf32=True)  # the probed fp32 rate is already torch's for its matmul precision
        self.in_call, self.call_ms, self.call_flops, self.between = False, 0.0, 0.0, between

    def _add(self, name: str, flops: float, nbytes: float, peak: float, cat: str | None = None) -> float:
        ms = super()._add(name, flops, nbytes, peak, cat)
        if self.in_call:
            self.call_ms += ms
            self.call_flops += flops
        else:
            self.between.calls += 1
            self.between.megalm_ms += ms
        return ms


@contextlib.contextmanager
def compared_with_torch(given: Gpu | None = None) -> Iterator[Comparison]:
    """Inside (under a FakeTensorMode), every op is priced by torch's RuntimeEstimator and by OpCosts at
    `torch_rates()`; the yielded Comparison holds both, op by op, once the block ends. torch's estimator reads the
    live GPU, or `given`'s numbers (`torch_given`: a CPU). Its own printout goes nowhere (a --json run prints one
    object)."""
    with torch_given(given) if given is not None else contextlib.nullcontext():
        yield from _compared(given)


def _compared(given: Gpu | None) -> Iterator[Comparison]:
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator

    source = f"{given.name}'s datasheet, given" if given else f"the live GPU ({torch.cuda.get_device_name()})"
    comparison = Comparison(torch_rates(), source)
    costs = _CallCosts(comparison.rates, comparison.pairs[("fused kernel", "fused")])
    estimator = RuntimeEstimator()

    def estimate(func: torch._ops.OpOverload, args: tuple, kwargs: dict | None) -> tuple[object, float]:
        kwargs = kwargs or {}
        fused = not costs.recording_every_op  # inside `op_cost.one_kernel`: counted as its one kernel after it
        costs.in_call, costs.call_ms, costs.call_flops = True, 0.0, 0.0
        try:
            with _cuda_said_available() if given is not None else contextlib.nullcontext():
                out, torch_ms = RuntimeEstimator._roofline_estimate(func, args, kwargs)  # runs the op, under OpCosts
        finally:
            costs.in_call = False
        reason = "fused" if fused else _reason(func, args, kwargs, out, costs.call_flops)
        pair = comparison.pairs[(func._overloadpacket.__name__, reason)]
        pair.calls += 1
        pair.megalm_ms += costs.call_ms
        pair.torch_ms += torch_ms
        return out, torch_ms

    with costs, contextlib.redirect_stdout(io.StringIO()), estimator("operator-level-cost-model"):
        estimator._estimate = estimate  # per call, where its own mode only sums
        yield comparison
    comparison.torch_total_ms = estimator.total_runtime
    comparison.megalm_total_ms = costs.total().ms


def datasheet(device_name: str) -> Gpu | None:
    """megalm's datasheet `Gpu` for a CUDA device name (`torch.cuda.get_device_name()`), or None: by its model
    ("NVIDIA H100 80GB HBM3" is h100), SXM parts of the memory in `GPUS` only (a PCIe, NVL or 40 GB card, a GH200,
    have other clocks or bandwidth)."""
    import re

    name = device_name.upper()
    model = re.search(r"(?<![A-Z])[A-Z]\d{3}\b", name)
    if model is None or any(other in name for other in ("PCIE", "NVL", "40GB")):
        return None
    return GPUS.get(model.group(0).lower())
