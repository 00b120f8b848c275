"""Where a step's time went, read from torch.profiler: on a GPU its kernels (how long the GPU was busy at all, the
time per kind of kernel, the kernels that took most); on a CPU the aten ops' own time.

Why this exists beside the step-cost trace (op_cost.py): the trace prices each kernel by a roofline and cannot see
the host that launches them. On the first GPU run (H200, 2026-11-28) FP8 ran at 0.67x bf16's tokens/s where the
trace predicted 1.08x. A profile separates the two explanations: a GPU that waits on the host (busy time well
below the step's wall time; the host syncs per step say whether the host also waits on the GPU, draining the queue
of launches it had run ahead with) or kernels slower than their roofline. torch.profiler records; this module only sums
its events, so the figures are torch's and CUPTI's, not megalm's bookkeeping.
"""

from __future__ import annotations

import errno
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from megalm.measure.op_cost import category as aten_category

# Substrings of CUDA kernel names, checked in this order (the first that matches names the kind).
_KERNEL_KINDS = (
    ("communication", ("nccl",)),
    # cuDNN's: cudnn_generated_fort_native_sdpa_sm90_... and its backward's helpers (megalm runs cuDNN for nothing else)
    ("attention", ("flash", "fmha", "attention", "attn", "_sdpa_", "cudnn")),
    ("optimizer", ("adam", "multi_tensor_apply", "foreach")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "scaled_mm", "sm90_", "sm80_", "splitk")),
    ("compiled (triton)", ("triton_",)),
    ("copy/cast", ("memcpy", "memset", "copy", "cat_", "catarray", "index", "gather", "scatter", "fill")),
    ("reduction", ("reduce", "norm", "softmax")),
    ("elementwise", ("elementwise", "unrolled", "vectorized")),
)


def kernel_kind(name: str) -> str:
    """The kind of a CUDA kernel from its name: gemm, attention, compiled (triton), copy/cast, reduction,
    elementwise, optimizer, communication, or other. Inductor names a generated kernel after the ops fused into it
    (`triton_poi_fused__scaled_mm__to_copy_...`: an FP8 cast feeding a GEMM), so its prefix decides first: a template
    (`triton_tem_`, a GEMM inductor tuned) is a GEMM, every other one compiled. Until 2026-12-05 the names' ops decided,
    and the compiled FP8 rows of that day counted 4 to 13 ms of casts a step as GEMMs."""
    lowered = name.lower()
    if lowered.startswith("triton_"):
        return "gemm" if lowered.startswith("triton_tem_") else "compiled (triton)"
    for kind, needles in _KERNEL_KINDS:
        if any(needle in lowered for needle in needles):
            return kind
    return "other"


@dataclass
class StepProfile:
    """Per-step figures of `steps` profiled steps (every time in ms per step)."""

    steps: int
    wall_ms: float  # a timer around the profiled steps, synchronized, over `steps`
    device: str  # "cuda": kernels; "cpu": aten ops' self time
    busy_ms: float  # cuda: the union of kernel intervals (the GPU doing anything); cpu: the ops' self time
    kernel_ms: float  # cuda: the sum of kernel durations (> busy_ms when kernels overlap); cpu: = busy_ms
    kernels: float  # kernel launches (cpu: aten op calls) per step
    by_kind: dict[str, float] = field(default_factory=dict)
    top: list[tuple[str, float, float]] = field(default_factory=list)  # (name, calls per step, ms per step)

    unprofiled_ms: float | None = None  # the same step timed without the profiler (its host cost is not in it)
    # cuda: calls per step that make the host wait for the GPU (cudaStreamSynchronize and kin: an `.item()`, a
    # `.tolist()`, a pageable copy to the host), and the device-to-host copies; each sync drains the launch queue
    host_syncs: float = 0.0
    device_to_host: float = 0.0

    @property
    def idle_share(self) -> float | None:
        """The share of the wall time the GPU ran nothing (waiting on the host, or on a sync); None on a CPU. The
        profiler slows the host, which this share includes; `unprofiled_idle_share` sets the same busy time
        against the step timed without it."""
        return max(0.0, 1 - self.busy_ms / self.wall_ms) if self.device == "cuda" and self.wall_ms > 0 else None

    @property
    def unprofiled_idle_share(self) -> float | None:
        if self.device != "cuda" or not self.unprofiled_ms:
            return None
        return max(0.0, 1 - self.busy_ms / self.unprofiled_ms)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"idle_share": self.idle_share, "unprofiled_idle_share": self.unprofiled_idle_share}


# CUDA runtime calls that wait for the GPU (an `.item()` records cudaMemcpyAsync then cudaStreamSynchronize)
_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
STEP_SPAN = "profiled_train_step"  # a record_function span around each profiled step: syncs are counted inside it


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals (µs)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def summarize(events: Iterable[Any], steps: int, wall_s: float, top: int = 15) -> StepProfile:
    """Sum torch.profiler's `events` (prof.events(): FunctionEvents) of `steps` steps that took `wall_s` in all.

    Where CUDA kernels were recorded they are what is counted (each event's own interval); else the aten ops'
    self CPU time (what the CPU spent in each op, its children excluded, so nothing is counted twice)."""
    events = list(events)
    # GPU-side user annotations (record_function spans such as `Optimizer.step#AdamW.step`) sit on the device's
    # timeline too, spanning kernels and the gaps between them: not kernels (torch's own tables leave them out)
    kernels = [e for e in events if getattr(e.device_type, "name", str(e.device_type)) == "CUDA"
               and not getattr(e, "is_user_annotation", False)]
    per: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # name -> [calls, µs]
    if kernels:
        device = "cuda"
        for e in kernels:
            per[e.name][0] += 1
            per[e.name][1] += e.time_range.end - e.time_range.start
        busy_us = _union_us([(e.time_range.start, e.time_range.end) for e in kernels])
        kind_of = kernel_kind
    else:
        device = "cpu"
        for e in events:
            if e.name.startswith("aten::"):
                per[e.name][0] += 1
                per[e.name][1] += e.self_cpu_time_total
        busy_us = sum(us for _, us in per.values())
        kind_of = lambda name: aten_category(name.removeprefix("aten::"))  # noqa: E731
    by_kind: dict[str, float] = defaultdict(float)
    for name, (_, us) in per.items():
        by_kind[kind_of(name)] += us / 1e3 / steps
    ranked = sorted(per.items(), key=lambda item: -item[1][1])[:top]
    # CUDA runtime calls, on the host's timeline; inside the steps' spans where there are any (the harness that times
    # the steps synchronizes too, outside them)
    spans = [(e.time_range.start, e.time_range.end) for e in events if e.name == STEP_SPAN]
    syncs = sum(1 for e in events if e.name in _SYNC_CALLS
                and (not spans or any(start <= e.time_range.start < end for start, end in spans)))
    device_to_host = sum(1 for e in kernels if "DtoH" in e.name)
    return StepProfile(
        host_syncs=syncs / steps, device_to_host=device_to_host / steps,
        steps=steps, wall_ms=wall_s * 1e3 / steps, device=device, busy_ms=busy_us / 1e3 / steps,
        kernel_ms=sum(us for _, us in per.values()) / 1e3 / steps,
        kernels=sum(calls for calls, _ in per.values()) / steps,
        by_kind=dict(sorted(by_kind.items(), key=lambda item: -item[1])),
        top=[(name, calls / steps, us / 1e3 / steps) for name, (calls, us) in ranked])


def synchronize(device: torch.device) -> None:
    """Wait for the kernels queued on `device` (a CPU's ops have run when they return)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_profiler(device: torch.device, steps: int, **options: Any) -> torch.profiler.profile:
    """torch.profiler (CPU ops, and CUDA kernels on a GPU; `options` are its own) for one warm-up step it records and
    discards (its own set-up is not in the figures), then `steps` steps, each ended by `prof.step()` but the last.
    One cycle, so acc_events=True keeps what it would keep anyway (without it torch 2.11 warns that events are cleared
    between cycles)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
                   acc_events=True, **options)


def profile_steps(step: Callable[[int], object], first_step: int, steps: int, device: torch.device,
                  trace: Path | None = None) -> StepProfile:
    """`steps` calls of `step(i)` (one training step each, any framework's) under `step_profiler`, summed per step,
    after one call the profiler records and discards; `trace` also gets the Chrome trace."""
    from torch.profiler import record_function

    with step_profiler(device, steps) as prof:
        step(first_step)
        prof.step()
        synchronize(device)
        start = time.perf_counter()
        for i in range(first_step + 1, first_step + 1 + steps):
            with record_function(STEP_SPAN):  # the host syncs are counted inside it, not this loop's own
                step(i)
            if i < first_step + steps:
                prof.step()
        synchronize(device)
        wall = time.perf_counter() - start
    if trace is not None:
        prof.export_chrome_trace(str(trace))
        if not Path(trace).is_file():  # the profiler logs its own failure to write, and returns
            raise OSError(errno.EIO, "the profiler wrote no Chrome trace", str(trace))
    return summarize(prof.events(), steps, wall)


def format_profile(profile: StepProfile, name_width: int = 90) -> str:
    """The profile as a few lines of text: the step's wall, busy and idle time, the time per kind, the top kernels."""
    what = "kernels" if profile.device == "cuda" else "aten ops (self CPU time)"
    lines = [f"profile of {profile.steps} step(s), per step: wall {profile.wall_ms:.1f} ms, {what} "
             f"{profile.kernel_ms:.1f} ms in {profile.kernels:.0f} calls"]
    if profile.idle_share is not None:
        lines[0] += (f", GPU busy {profile.busy_ms:.1f} ms (idle {100 * profile.idle_share:.1f}% of the wall: "
                     "waiting on the host or a sync)")
    if profile.unprofiled_idle_share is not None:
        lines[0] += (f"; against the unprofiled step ({profile.unprofiled_ms:.1f} ms) idle "
                     f"{100 * profile.unprofiled_idle_share:.1f}%")
    if profile.device == "cuda":
        lines.append(f"host syncs {profile.host_syncs:.1f} per step (cudaStreamSynchronize and kin: the host waits "
                     f"for the GPU to drain), device-to-host copies {profile.device_to_host:.1f}")
    lines.append("by kind: " + ", ".join(f"{kind} {ms:.1f} ms" for kind, ms in profile.by_kind.items()))
    lines.append(f"{'ms/step':>9} {'calls':>7}  name")
    for name, calls, ms in profile.top:
        short = name if len(name) <= name_width else name[:name_width - 3] + "..."
        lines.append(f"{ms:9.2f} {calls:7.1f}  {short}")
    return "\n".join(lines)
