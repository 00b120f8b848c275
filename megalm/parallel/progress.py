"""Where this rank is inside a step: the last pipeline action, collective and micro-batch it started.

A hang in distributed training is a rank waiting in a collective or a p2p receive that its peers never enter;
NCCL's timeout then kills the job minutes later with little to go on. The parallel code notes in a `Progress`,
with a few attribute writes and no synchronisation, what it is about to do; the trainer's watchdog
(megalm/training/watchdog.py) prints this record for every rank when a step stops making progress, so that the
rank that is elsewhere stands out. One `Progress` per rank, carried by its `ParallelMesh` (`mesh.progress`) and
handed to the runners, layers and reducers built from that mesh: nothing here is process-wide.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class Progress:
    step: int | None = None
    micro_batch: str = "-"
    pipeline_action: str = "-"
    collective: str = "-"
    since: dict[str, float] = field(default_factory=dict)  # when each field last changed (time.monotonic)

    def note(self, **fields: object) -> None:
        if torch.compiler.is_compiling():  # inside a compiled block: no Python side effect can run in its graph;
            return  # the notes made around the block (its micro-batch, the pipeline action) remain
        now = time.monotonic()
        if "step" in fields and fields["step"] != self.step:  # what the last step did is not the new one's
            for key in ("micro_batch", "pipeline_action", "collective"):
                value = getattr(self, key)
                if key not in fields and value != "-" and not value.startswith("- ("):
                    setattr(self, key, f"- (step {self.step}'s last: {value})")
        for key, value in fields.items():
            setattr(self, key, value)
            self.since[key] = now

    def report(self) -> str:
        """One line per field, with how long ago it was set."""
        now = time.monotonic()
        ago = lambda key: f" ({now - self.since[key]:.0f} s ago)" if key in self.since else ""
        return "; ".join(f"{key.replace('_', ' ')}: {getattr(self, key)}{ago(key)}"
                         for key in ("step", "micro_batch", "pipeline_action", "collective"))


def note_collective(progress: Progress | None, name: str, group_size: int) -> None:
    """Before a collective: its name and how many ranks take part (nothing for `progress` None: code run outside
    a mesh, as unit tests of one layer do)."""
    if progress is not None:
        progress.note(collective=f"{name} over {group_size} ranks")
