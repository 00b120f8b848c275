"""A profile of a few training steps, asked for in the config (`profiling.*`): torch.profiler's trace, and the CUDA
caching allocator's memory snapshot.

Megatron-LM (`--profile`, `--profile-step-start/-end`, `--profile-ranks`, `--record-memory-history`) and TorchTitan
(`[profiling]`: `enable_profiling`, `enable_memory_snapshot`) profile from inside the trainer, and so does megalm: a run
shows where its own step's time and memory go, at its own layout and shapes, without a bench tool. torch records; this
module picks the steps and the ranks and writes what torch recorded, per profiling rank, in RUN_DIR/profile/ (steps
numbered as the log numbers them):

- `rank{r}_steps{a}-{b}.json.gz`: torch.profiler's Chrome trace (ui.perfetto.dev or chrome://tracing open it), each
  step in a span `megalm step N`;
- `rank{r}_steps{a}-{b}_summary.json`, and the same in the log: the steps' wall time, how long the GPU ran anything
  (the rest of the wall it waited on the host or on a sync), kernel time by kind and the kernels that took most
  (megalm/measure/kernel_profile.py sums torch's events; on a CPU, the aten ops' own time);
- `rank{r}_memory_steps{a}-{b}.pickle` (`profiling.memory_snapshot`, CUDA): the allocator's snapshot, with the stack of
  every allocation since training began (pytorch.org/memory_viz draws it); a run that runs out of memory before that
  writes `rank{r}_memory_oom_step{n}.pickle` instead: what filled the memory when it ran out.

The window is the `profiling.steps` steps after the first `profiling.start_step` of this process. The last step
before it warms the profiler up (torch.profiler's `schedule(warmup=1)`: its own start-up is not in the figures), and a
resumed run counts from its resume, so each job of a requeued run profiles. The profiled steps run slower (the
profiler's host cost), so their log line's tokens/s is no measurement; writing the files is kept off the clock.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path
from types import TracebackType

import torch

from megalm.config import MegalmConfig, ProfilingConfig, set_away_from_default
from megalm.errors import ConfigError
from megalm.measure.kernel_profile import STEP_SPAN, format_profile, step_profiler, summarize, synchronize

log = logging.getLogger("megalm")

MEMORY_ENTRIES = 100_000  # allocator events kept (TorchTitan's figure): the oldest are dropped past it


def validate_profiling(cfg: MegalmConfig, world_size: int) -> None:
    """`profiling.*` against the run: a window of at least one step after at least one, inside the steps the run
    takes, on ranks the job has (the last two only where something is profiled)."""
    p = cfg.profiling
    if p.start_step < 1:
        raise ConfigError(f"profiling.start_step={p.start_step} must be >= 1: the step before the profiled ones warms "
                          "the profiler up")
    if p.steps < 1:
        raise ConfigError(f"profiling.steps={p.steps} must be >= 1")
    if not (p.trace or p.memory_snapshot):
        if unread := set_away_from_default(p, ProfilingConfig, ["start_step", "steps", "ranks"]):
            log.warning(f"profiling.{', profiling.'.join(unread)} set with profiling.trace and "
                        "profiling.memory_snapshot false, which profile nothing: not used")
        return
    run_steps = cfg.trainer.stop_at_step or cfg.trainer.max_steps
    if p.start_step + p.steps > run_steps:
        key = "trainer.stop_at_step" if cfg.trainer.stop_at_step else "trainer.max_steps"
        raise ConfigError(f"profiling.start_step={p.start_step} + profiling.steps={p.steps} go past the run's "
                          f"{run_steps} steps ({key}): lower profiling.start_step")
    if p.ranks is not None and (not p.ranks or any(not 0 <= r < world_size for r in p.ranks)):
        raise ConfigError(f"profiling.ranks={list(p.ranks)}: this job has {world_size} rank(s), 0 to "
                          f"{world_size - 1}; list some of them, or null for every rank")


class StepProfiler:
    """A context manager around the training loop; `before_step(i)` / `after_step(i)` around step index i (0-based:
    the log's step i + 1). `first_step`: the index of this process's first step (its resume point). Nothing it does
    stops the training: a file it cannot write is a warning, and an error inside the loop leaves it stopped."""

    def __init__(self, cfg: MegalmConfig, run_dir: Path, rank: int, device: torch.device, first_step: int) -> None:
        p, t = cfg.profiling, cfg.trainer
        on_rank = p.ranks is None or rank in p.ranks
        self.trace = p.trace and on_rank
        self.memory = p.memory_snapshot and on_rank and device.type == "cuda"
        if p.memory_snapshot and on_rank and device.type != "cuda":
            log.warning("profiling.memory_snapshot=true: the snapshot is the CUDA caching allocator's, and this run is "
                        "on %s: none is written%s", device.type,
                        " (profiling.trace=true still records the steps)" if p.trace else "")
        self.first = first_step + p.start_step  # the first profiled step's index
        self.last = self.first + p.steps - 1
        self.rank, self.device, self.dir = rank, device, Path(run_dir) / "profile"
        # the log's step numbers after which the loop evaluates or saves inside the window: the profiler records it
        self.between = [n for n in range(self.first + 1, self.last + 1) if any(
            every and n % every == 0 for every in (t.eval_interval, t.save_interval))]
        self.written: list[Path] = []
        self._profiler: torch.profiler.profile | None = None
        self._spans: contextlib.ExitStack | None = None
        self._recording = False
        self._started = self._wall = 0.0  # the profiled steps' wall: each step's own, between two syncs
        self._index = self._done = first_step  # the step running, and the steps done (the log's last step number)

    def _steps(self, last: int | None = None) -> str:
        """The profiled steps up to index `last` (default: the window's), in the log: 'steps 11 to 12'."""
        return f"steps {self.first + 1} to {(self.last if last is None else last) + 1}"

    def _label(self, last: int | None = None) -> str:
        """The same in the files' names: 'steps11-12'."""
        return f"steps{self.first + 1}-{(self.last if last is None else last) + 1}"

    def __enter__(self) -> StepProfiler:
        if self.trace:
            log.info("profiling.trace: torch.profiler records %s on rank %d, into %s", self._steps(), self.rank,
                     self.dir)
            if self.between:
                log.warning("profiling: the run evaluates or saves after step(s) %s, inside the profiled %s: the "
                            "summary's kernels count that work too (the wall does not)", self.between, self._steps())
        if self.memory:
            # Python's stacks only: C++ frames on every allocation would slow each step of this rank until the dump
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_ENTRIES, stacks="python")
            self._recording = True
            log.info("profiling.memory_snapshot: recording the CUDA allocator's history until step %d",
                     self.last + 1)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if self._recording and isinstance(exc, torch.OutOfMemoryError):
                self._dump_memory(f"rank{self.rank}_memory_oom_step{self._index + 1}.pickle")
            elif self._recording and exc is None and self._done > self.first:  # stopped inside the window
                self._dump_memory(f"rank{self.rank}_memory_{self._label(self._done - 1)}.pickle")
        finally:
            try:
                if self._recording:
                    self._stop_recording()
            finally:
                if self._spans is not None:
                    self._spans.close()
                    self._spans = None
                if self._profiler is not None:  # the loop ended inside the window
                    self._finish(self._done - 1 if exc is None and self._done > self.first else None)
        if (self.trace or self.memory) and not self.written and exc is None:
            log.warning("profiling: this process stopped after step %d, before its profiled %s: nothing was written "
                        "(lower profiling.start_step)", self._done, self._steps())

    def before_step(self, index: int) -> None:
        self._index = index
        if self.trace and index == self.first - 1:
            self._profiler = step_profiler(self.device, self.last - self.first + 1, record_shapes=True)
            self._profiler.start()
        if self._profiler is not None and self.first <= index <= self.last:
            synchronize(self.device)
            self._started = time.perf_counter()
            from torch.profiler import record_function

            self._spans = contextlib.ExitStack()  # the host syncs are counted inside STEP_SPAN (kernel_profile)
            self._spans.enter_context(record_function(STEP_SPAN))
            self._spans.enter_context(record_function(f"megalm step {index + 1}"))

    def after_step(self, index: int) -> None:
        """Call after step `index` returned; at the window's end this writes the files (seconds for a GPU's trace):
        the trainer keeps it off the throughput clock."""
        self._done = index + 1
        if self._spans is not None:
            self._spans.close()
            self._spans = None
        if self._profiler is not None:
            if self.first <= index:
                synchronize(self.device)
                self._wall += time.perf_counter() - self._started
            if index < self.last:
                self._profiler.step()
            else:
                self._finish(index)
        if self._recording and index == self.last:
            self._dump_memory(f"rank{self.rank}_memory_{self._label()}.pickle")
            self._stop_recording()

    def _finish(self, last: int | None) -> None:
        """Stop the profiler; write the trace and summary of the steps up to index `last` (None: none, or an error
        ended the loop: nothing is written)."""
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        if last is None:
            return
        steps = last - self.first + 1
        if last < self.last:
            log.warning("profiling rank %d: the run stopped inside the profiled steps; the trace holds %s",
                        self.rank, self._steps(last))
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            trace = self.dir / f"rank{self.rank}_{self._label(last)}.json.gz"
            profiler.export_chrome_trace(str(trace))
            self.written.append(trace)
            profile = summarize(profiler.events(), steps, self._wall)
            summary = trace.with_name(trace.name.replace(".json.gz", "_summary.json"))
            summary.write_text(json.dumps(profile.as_dict(), indent=1) + "\n")
            self.written.append(summary)
        except Exception as e:  # noqa: BLE001 - a profile that cannot be written must not end the training
            log.warning("profiling rank %d: the profile of %s could not be written (%s: %s); training goes on",
                        self.rank, self._steps(last), type(e).__name__, e)
            return
        log.info("profiling rank %d, %s (trace %s):\n%s", self.rank, self._steps(last), trace, format_profile(profile))

    def _dump_memory(self, name: str) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            path = self.dir / name
            torch.cuda.memory._dump_snapshot(str(path))
        except Exception as e:  # noqa: BLE001 - as above
            log.warning("profiling rank %d: the CUDA allocator's snapshot could not be written (%s: %s)", self.rank,
                        type(e).__name__, e)
            return
        self.written.append(path)
        log.info("profiling rank %d: the CUDA allocator's snapshot is %s (pytorch.org/memory_viz draws it)",
                 self.rank, path)

    def _stop_recording(self) -> None:
        self._recording = False
        torch.cuda.memory._record_memory_history(enabled=None)
