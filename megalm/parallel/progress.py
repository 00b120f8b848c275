"""Where this rank is inside a step: the last pipeline action, collective and micro-batch it started.

A hang in distributed training is a rank waiting in a collective or a p2p receive that its peers never enter;
NCCL's timeout then kills the job minutes later with little to go on. The parallel code notes here, with a few
attribute writes and no synchronisation, what it is about to do; the trainer's watchdog
(megalm/training/watchdog.py) prints this record for every rank when a step stops making progress, so that the
rank that is elsewhere stands out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Progress:
    step: int | None = None
    micro_batch: str = "-"
    pipeline_action: str = "-"
    collective: str = "-"
    since: dict[str, float] = field(default_factory=dict)  # when each field last changed (time.monotonic)

    def note(self, **fields: object) -> None:
        now = time.monotonic()
        for key, value in fields.items():
            setattr(self, key, value)
            self.since[key] = now

    def report(self) -> str:
        """One line per field, with how long ago it was set."""
        now = time.monotonic()
        ago = lambda key: f" ({now - self.since[key]:.0f} s ago)" if key in self.since else ""
        return "; ".join(f"{key.replace('_', ' ')}: {getattr(self, key)}{ago(key)}"
                         for key in ("step", "micro_batch", "pipeline_action", "collective"))


PROGRESS = Progress()


def note_collective(name: str, group_size: int) -> None:
    """Before a collective: its name and how many ranks take part."""
    PROGRESS.note(collective=f"{name} over {group_size} ranks")
