"""Run a function on N local processes joined in a torch.distributed group, for tests.

    run_distributed(fn, world_size, *args, timeout=120)

starts `world_size` processes (torch.multiprocessing, "forkserver" start method: each forks from one server
process that imported torch and megalm once, a clean interpreter as a spawned one would be, without importing them
again: a dist test takes 40% of the time it took spawned), each of which joins a gloo group on 127.0.0.1 at a free
port and calls `fn(rank, world_size, *args)`; the group is destroyed afterwards. `fn` and `args` must be picklable:
define `fn` at module level in the test file. The server keeps the environment it started with: a test that needs
other environment variables in its workers sets them inside `fn`.

Failures surface in the calling test:
  * an exception in a worker raises WorkerError in the parent with the traceback of every worker that
    failed, earliest first: when one rank raises, its peers usually fail next inside a collective
    ("connection closed by peer"), and the earliest traceback is the cause;
  * a worker that dies without a Python exception (segfault, os._exit) raises torch's
    ProcessExitedException;
  * if the workers have not all finished within `timeout` seconds (a hang, e.g. a collective some rank
    never reaches) they are killed and TimeoutError is raised, so CI does not stall.
Workers use one intra-op thread: tests run several processes on few cores.
"""

from __future__ import annotations

import datetime
import gc
import multiprocessing
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tools.bench.ranks import free_port  # the benchmarks' ranks take their port the same way

PORT_TAKEN = "rendezvous port taken before rank 0 listened"  # marks the only failure run_distributed retries


class WorkerError(RuntimeError):
    """One or more workers raised; the message holds their tracebacks, earliest failure first."""


def _worker(
    rank: int, fn: Callable[..., Any], world_size: int, port: int, backend: str, timeout: float, args: tuple,
    error_dir: str,
) -> None:
    torch.set_num_threads(1)
    try:
        try:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=timeout))
        except dist.DistNetworkError as error:
            if "EADDRINUSE" in str(error):
                raise RuntimeError(f"{PORT_TAKEN}: {error}") from error
            raise
        fn(rank, world_size, *args)
    except BaseException:
        # Recorded before the group is torn down: peers only fail (connection closed) after that. Written to a
        # temporary name and renamed: the parent kills the other ranks once one fails, and a rank killed mid-write
        # must leave no file rather than an empty one.
        with open(f"{error_dir}/.{rank}", "w") as f:
            f.write(f"{time.time()!r}\n{traceback.format_exc()}")
        os.replace(f"{error_dir}/.{rank}", f"{error_dir}/{rank}")
        raise
    finally:
        # Objects in reference cycles (torch optimizers make some) can keep the process group alive
        # past destroy_process_group(); if the GC frees them at interpreter exit, gloo's threads
        # release tensors without Python and the worker dies with SIGABRT. Collect them first.
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


def _worker_errors(error_dir: str, world_size: int) -> list[tuple[float, int, str]]:
    """(time, rank, traceback) of every worker that recorded a failure, earliest first."""
    errors = []
    for rank in range(world_size):
        try:
            with open(f"{error_dir}/{rank}") as f:
                when, text = f.read().split("\n", 1)
        except FileNotFoundError:
            continue
        errors.append((float(when), rank, text))
    return sorted(errors)


# What the fork server imports once (the module docstring): it only imports, so a fork of it starts as clean as a
# spawned interpreter. torch._dynamo is imported by torch itself in every rank's first optimizer and meta-device init
# (1.1 s of CPU a rank), hydra by the config a test composes: preloaded, three dist test files took 148 s, not 234 s.
# The last, tests.dist.frozen_imports, moves what the others imported to the collector's permanent generation
# (gc.freeze): each rank's collections (the gc.collect before destroy_process_group above, the trainer's full
# collections at step boundaries) walk only what the rank made, not torch's and megalm's objects: 0.23-0.39 s a
# collection less, most of what a two-rank run_distributed of nothing cost (0.51 s a run before, 2026-12-07).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "hydra.compose", "megalm.train", "megalm.training.trainer",
           "tests.dist.launch", "tests.conftest", "tests.dist.frozen_imports"]
multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, backend: str = "gloo"
) -> None:
    """Call `fn(rank, world_size, *args)` on `world_size` processes in one process group.

    Raises WorkerError (tracebacks of the failed workers, earliest first), torch's
    ProcessExitedException (a worker died without an exception), or TimeoutError after `timeout` s. A rendezvous
    port another process took between `free_port` and rank 0's listen (EADDRINUSE, before `fn` runs) is retried on
    a new port, twice at most.
    """
    for attempt in range(3):
        try:
            return _run_once(fn, world_size, args, backend, timeout)
        except WorkerError as error:  # free_port's race: another process took the port before rank 0 listened
            if PORT_TAKEN not in str(error) or attempt == 2:
                raise


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple, backend: str, timeout: float) -> None:
    name = getattr(fn, "__name__", repr(fn))
    with tempfile.TemporaryDirectory(prefix="run_distributed_") as error_dir:
        context = mp.start_processes(
            _worker, args=(fn, world_size, free_port(), backend, timeout, args, error_dir),
            nprocs=world_size, join=False, start_method="forkserver",
        )
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    alive = [rank for rank, p in enumerate(context.processes) if p.is_alive()]
                    raise TimeoutError(f"run_distributed({name}): ranks {alive} still running after "
                                       f"{timeout:.0f}s (a hang?); killed them")
        except mp.ProcessRaisedException as error:
            errors = _worker_errors(error_dir, world_size)
            if not errors:
                raise
            report = "\n".join(f"--- rank {rank} ---\n{text}" for _, rank, text in errors)
            raise WorkerError(f"run_distributed({name}): {len(errors)} worker(s) failed, earliest first:\n"
                              f"{report}") from error
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join()
