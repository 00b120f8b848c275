"""Timing a call where it runs, for the kernel benchmarks (attention_kernels.py, mx_quantize_bandwidth.py,
hdp_calibrate.py): on CUDA, events around each call started from an idle device (the call's launch gaps count,
as they do in training; a host timer would also count the host's wait for the device), on a CPU `perf_counter`."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def time_calls(call: Callable[[], object], device: torch.device, warmup: int, iters: int) -> list[float]:
    """Milliseconds of each of `iters` calls of `call`, after `warmup` untimed ones."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            call()
            times.append((time.perf_counter() - begin) * 1e3)
    return times
