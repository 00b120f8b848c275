"""The hang watchdog: a thread that ends a run whose steps stopped making progress, saying where each rank was.

A rank that never enters a collective leaves its peers waiting inside it until the process group's timeout
(`parallel.timeout_minutes`; NCCL's default is 10 minutes) and the job dies with an error that names neither the
rank nor the action. The trainer beats this watchdog after every step, evaluation and save. When no beat came for
`trainer.hang_minutes`, every rank's watchdog (each fires on its own clock) prints one report line: the step, and
the last micro-batch, pipeline action and collective its parallel code noted in the mesh's `Progress`
(megalm/parallel/progress.py), plus the Python stacks of its threads, writes the line to RUN_DIR/hang-rankR.txt,
and exits with `HANG_EXIT_CODE` so that torchrun (`--max-restarts`) or the scheduler restarts the job from its last
checkpoint. The rank whose report differs from the others' is the one to look at. In a distributed run it also writes
torch's flight recorder (RUN_DIR/hang-rankR.flight.json: the rank's last collectives, numbered per process group),
which `python -m megalm.parallel.flight_recorder RUN_DIR` compares across ranks (megalm/parallel/flight_recorder.py).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megalm.parallel.flight_recorder import dump, group_names
from megalm.parallel.progress import Progress

log = logging.getLogger("megalm")

HANG_EXIT_CODE = 124  # as coreutils' timeout


def joining_watchdog(init_hang_minutes: float, run_dir: Path) -> Watchdog:
    """The watchdog of joining the job (rendezvous, process groups, the model's build): a rank stuck there is
    reported, with what it was joining, and exits with `HANG_EXIT_CODE` after `trainer.init_hang_minutes`, not at
    the process group's timeout. The rank is torchrun's (RANK), known before the group exists."""
    watch = Watchdog(init_hang_minutes * 60, int(os.environ.get("RANK", "0")), run_dir,
                     setting="trainer.init_hang_minutes")
    watch.progress.note(collective=f"init_process_group (world size {os.environ.get('WORLD_SIZE', '1')}, store "
                                   f"{os.environ.get('MASTER_ADDR', '-')}:{os.environ.get('MASTER_PORT', '-')})")
    return watch


class Watchdog:
    """`with Watchdog(...)`: a daemon thread checks the last `beat()`; `timeout_s` <= 0 turns it off."""

    def __init__(self, timeout_s: float, rank: int, run_dir: Path, exit: Callable[[int], None] = os._exit,
                 progress: Progress | None = None, setting: str = "trainer.hang_minutes",
                 groups: dict[str, Any] | None = None) -> None:
        self.timeout_s, self.rank, self.run_dir, self._exit = timeout_s, rank, Path(run_dir), exit
        self.setting = setting  # the config key of `timeout_s`, named in the report
        self.progress = progress or Progress()  # the rank's record (`mesh.progress`), written by its parallel code
        # a distributed run's groups by role (`ParallelMesh.groups()`): torch's flight recorder is dumped with them
        self.groups = None if groups is None else group_names(groups)  # (None for one process)
        self.last_beat = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, step: int | None = None) -> None:
        """Progress: a step, eval or save ended; `step` is the one that starts now (for the report)."""
        self.last_beat = time.monotonic()
        if step is not None:
            self.progress.note(step=step)

    def __enter__(self) -> Watchdog:
        if self.timeout_s > 0:
            self.beat()
            self._stop.clear()
            self._thread = threading.Thread(target=self._watch, name="megalm-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _watch(self) -> None:
        poll = min(10.0, max(self.timeout_s / 4, 0.05))
        while not self._stop.wait(poll):
            idle = time.monotonic() - self.last_beat
            if idle > self.timeout_s:
                self._fire(idle)
                return

    def report(self, idle: float) -> str:
        return (f"hang: rank {self.rank} made no progress for {idle:.0f} s ({self.setting}="
                f"{self.timeout_s / 60:g}); {self.progress.report()}")

    def _fire(self, idle: float) -> None:
        line = self.report(idle)
        print(line, file=sys.stderr, flush=True)
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / f"hang-rank{self.rank}.txt").write_text(line + "\n")
        except OSError as e:
            print(f"hang report not written to {self.run_dir}: {e}", file=sys.stderr, flush=True)
        if self.groups is not None:
            self._dump_flight_recorder()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        print(f"exiting with {HANG_EXIT_CODE} so that the launcher restarts the run from its last checkpoint",
              file=sys.stderr, flush=True)
        self._exit(HANG_EXIT_CODE)

    def _dump_flight_recorder(self) -> None:
        """torch's record of this rank's last collectives, beside the report (megalm/parallel/flight_recorder.py)."""
        try:
            written = dump(self.run_dir / f"hang-rank{self.rank}.flight.json", self.rank, self.groups)
        except (OSError, RuntimeError, ValueError) as e:
            print(f"flight recorder not written to {self.run_dir}: {e}", file=sys.stderr, flush=True)
            return
        if written is not None:
            print(f"flight recorder: {written}; `python -m megalm.parallel.flight_recorder {self.run_dir}` compares "
                  "the ranks' files", file=sys.stderr, flush=True)
