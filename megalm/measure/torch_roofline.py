"""megalm's roofline (op_cost.OpCosts) checked against torch's own, op by op, on the live GPU.

torch has a roofline of its own: `torch.distributed._tools.runtime_estimator.RuntimeEstimator` in its
"operator-level-cost-model" mode prices every dispatched op as max(compute time, transfer time), as OpCosts does, but
reads the device it runs on (its peak by `torch.cuda.get_device_name()` from inductor's datasheet table, else from
Triton's clocks; its DRAM bandwidth from Triton), so it needs CUDA, and it is not how step_cost.py prices a step on a
CPU. `compared_with_torch` runs both over the same ops (the estimator first, OpCosts under it) and pairs their times
call by call. Both are written independently (which tensors an op reads, which ops count, the FLOP formulas), so an
op where they agree is counted right by both or wrong by both in the same way.

Their conventions differ, and each call is sorted into the reason its times may differ (`REASONS`), or none:
- The rates. torch's compute time is not FLOPs / peak: in torch 2.13 it is MACs / (0.75 · peak), and torch 2.11 reads
  its TFLOP/s as PFLOP/s (`peak * 1e15`), which makes every op memory-bound there. So OpCosts prices the step at the
  rates torch's own functions give (`torch_rates`, probed with one GEMM and one copy), and what is left is what each
  counts.
- What each counts: see `REASONS`. Everything else must agree to rounding (`Comparison.unexplained`).

The GPU tier runs it (tests/gpu/test_gpu_roofline.py), and `tools/bench/step_cost.py --torch-estimator` prints it.
A CPU gives torch's estimator the datasheet numbers of a named GPU instead (`torch_given`): that checks what the two
count, not the live GPU's rates (tests/unit/test_torch_roofline.py).
Eager steps only: a compiled block's generated kernels are inductor's (measure/compiled_cost.py), which torch's
estimator does not see.
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

from megalm.measure.op_cost import GPUS, Gpu, OpCosts, category, launches_no_kernel, reads_every_argument

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
    if func.is_view or func.namespace in ("prim", "profiler") or launches_no_kernel(name):
        return "no kernel"
    if func._overloadpacket in _IGNORE_OPS:
        return "created"
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
    dtype, its DRAM bandwidth), and is told CUDA is there (its one check): how a CPU runs the comparison, which then
    checks what the two count, not the live GPU's rates."""
    import torch.utils._runtime_estimation as estimation

    saved = estimation.get_device_tflops, estimation.get_gpu_dram_gbps, torch.cuda.is_available
    estimation.get_device_tflops = lambda dtype: gpu.bf16_tflops if dtype in (torch.bfloat16, torch.float16) else (
        gpu.tf32_tflops)
    estimation.get_gpu_dram_gbps = lambda: gpu.hbm_tbytes_per_s * 1000
    torch.cuda.is_available = lambda: True
    try:
        yield
    finally:
        estimation.get_device_tflops, estimation.get_gpu_dram_gbps, torch.cuda.is_available = saved


@contextlib.contextmanager
def compared_with_torch(tf32: bool = True, given: Gpu | None = None) -> Iterator[Comparison]:
    """Inside (under a FakeTensorMode), every op is priced by torch's RuntimeEstimator and by OpCosts at
    `torch_rates()`; the yielded Comparison holds both, op by op, once the block ends. torch's estimator reads the
    live GPU, or `given`'s numbers (`torch_given`: a CPU). Its own printout goes nowhere (a --json run prints one
    object)."""
    with torch_given(given) if given is not None else contextlib.nullcontext():
        yield from _compared(tf32, f"{given.name}'s datasheet, given" if given else
                             f"the live GPU ({torch.cuda.get_device_name()})")


def _compared(tf32: bool, source: str) -> Iterator[Comparison]:
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator

    comparison = Comparison(torch_rates(), source)
    costs, estimator = OpCosts(comparison.rates, tf32), RuntimeEstimator()

    def estimate(func: torch._ops.OpOverload, args: tuple, kwargs: dict | None) -> tuple[object, float]:
        kwargs = kwargs or {}
        before = costs.total()
        out, torch_ms = RuntimeEstimator._roofline_estimate(func, args, kwargs)  # runs the op, under OpCosts
        after = costs.total()
        pair = comparison.pairs[(func._overloadpacket.__name__,
                                 _reason(func, args, kwargs, out, after.flops - before.flops))]
        pair.calls += 1
        pair.megalm_ms += after.ms - before.ms
        pair.torch_ms += torch_ms
        return out, torch_ms

    with costs, contextlib.redirect_stdout(io.StringIO()), estimator("operator-level-cost-model"):
        estimator._estimate = estimate  # per call, where its own mode only sums
        yield comparison
    comparison.torch_total_ms = estimator.total_runtime
    comparison.megalm_total_ms = costs.total().ms


def datasheet(device_name: str) -> Gpu | None:
    """megalm's datasheet `Gpu` for a CUDA device name (`torch.cuda.get_device_name()`), or None: the SXM parts
    only (a PCIe or NVL card of the same name has other clocks and bandwidth)."""
    name = device_name.upper()
    if "PCIE" in name or "NVL" in name:
        return None
    return next((gpu for key, gpu in GPUS.items() if key.upper() in name), None)
