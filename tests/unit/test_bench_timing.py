"""tools/bench/timing.py, the kernel benchmarks' shared timer: on a CPU, `warmup` untimed calls then one time per
timed call, each at least as long as the call itself takes (a 2 ms sleep)."""

from __future__ import annotations

import time

import torch

from tools.bench.timing import time_calls


def test_time_calls_times_each_call_after_the_warmup():
    calls = []

    def call():
        calls.append(time.perf_counter())
        time.sleep(0.002)

    times = time_calls(call, torch.device("cpu"), warmup=2, iters=3)
    assert len(calls) == 5 and len(times) == 3
    assert all(2.0 <= ms < 1000.0 for ms in times), times
