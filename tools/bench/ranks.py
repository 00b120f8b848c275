"""The CPU ranks of the benchmarks that run a gloo group on one machine (comm_volume.py, context_parallel.py,
fsdp_memory.py, offload.py).

Each rank is forked from a server process that imported torch and megalm's trainer once (multiprocessing's
"forkserver" start method with a preload list, as tests/dist/launch.py starts the tests' ranks), not a fresh
interpreter that imports them again: about 8 s of CPU a rank on a 2-core machine, 24 s saved for four ranks. The server
only imported, so a fork of it starts as clean as a spawned interpreter; each rank still imports the benchmark's own
module, as a spawned one does.
"""

from __future__ import annotations

import multiprocessing
import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "megalm.training.trainer"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for rank 0 to listen on (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_cpu_ranks(fn: Callable[..., Any], nprocs: int, *args: Any) -> None:
    """Call `fn(rank, *args)` on `nprocs` processes and wait for them (torch.multiprocessing raises a rank's
    failure here). `fn` is a module-level function of the calling benchmark."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")
