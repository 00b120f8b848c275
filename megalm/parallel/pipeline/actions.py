"""A pipeline schedule's data: `Action`s (compute, point-to-point, memory) and the `Schedule` holding one list of
them per pipeline rank (the vocabulary is in schedules.py's docstring). Generators, validation and timing live in
schedules.py; the communication actions are inserted by rendezvous.py (`with_comm`), which knows NCCL's rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

COMPUTE_KINDS = ("F", "B", "W")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
# Activation offload (PipeOffload): move a micro-batch's saved activations to host memory after its
# forward and bring them back before its backward. Executed by the runtime's `memory_hooks`.
MEMORY_KINDS = ("OFFLOAD", "RELOAD")
KINDS = COMPUTE_KINDS + COMM_KINDS + MEMORY_KINDS


@dataclass(frozen=True)
class Action:
    """One step of one rank: compute (F/B/W) or point-to-point communication of one micro-batch."""

    kind: str
    micro_batch: int
    chunk: int = 0  # model chunk (virtual stage index) on this rank
    peer: int | None = None  # the other rank, for SEND_*/RECV_* only

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; expected one of {KINDS}")
        if self.micro_batch < 0 or self.chunk < 0:
            raise ValueError(f"negative micro_batch/chunk in {self.kind} {self.micro_batch} c{self.chunk}")
        if (self.peer is not None) != (self.kind in COMM_KINDS):
            raise ValueError(f"{self.kind} needs peer={'a rank' if self.kind in COMM_KINDS else 'None'}")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def __str__(self) -> str:
        s = f"{self.kind}{self.micro_batch}" + (f".c{self.chunk}" if self.chunk else "")
        if self.kind.startswith("SEND"):
            s += f"->{self.peer}"
        elif self.kind.startswith("RECV"):
            s += f"<-{self.peer}"
        return s


@dataclass
class Schedule:
    """`actions[rank]` is the ordered list of actions pipeline rank `rank` executes for one step."""

    num_stages: int  # p, pipeline ranks
    num_micro_batches: int  # m
    vpp: int
    name: str
    split_backward: bool
    actions: list[list[Action]] = field(default_factory=list)

    @property
    def num_virtual_stages(self) -> int:
        return self.num_stages * self.vpp

    def stage_of(self, rank: int, chunk: int) -> int:
        """Virtual stage of `chunk` on `rank` (Megatron layout: chunk-major)."""
        return chunk * self.num_stages + rank

    def place_of(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) holding virtual stage `stage`."""
        return stage % self.num_stages, stage // self.num_stages

    def with_offload(self, offloaded: set[tuple[int, int, int]]) -> Schedule:
        """A copy with OFFLOAD after the F (after its SEND_F, if any: the send reads the output), and
        RELOAD one compute action ahead of the B (prefetch: the copy runs under that action, and the wait for
        the B's RECV_B), of each (rank, micro_batch, chunk) in `offloaded`; right before the B (or its
        RECV_B) where the action ahead is the F itself."""
        out: list[list[Action]] = []
        for rank, acts in enumerate(self.actions):
            new: list[Action] = []
            reloaded: set[tuple[int, int]] = set()
            for i, a in enumerate(acts):
                key = (a.micro_batch, a.chunk)
                if a.kind in ("RECV_B", "B") and (rank, *key) in offloaded and key not in reloaded:
                    new.append(Action("RELOAD", *key))
                    reloaded.add(key)
                new.append(a)
                nxt = acts[i + 1] if i + 1 < len(acts) else None
                sent_next = nxt is not None and nxt.kind == "SEND_F" and (nxt.micro_batch, nxt.chunk) == key
                if (rank, *key) in offloaded and (a.kind == "SEND_F" or (a.kind == "F" and not sent_next)):
                    new.append(Action("OFFLOAD", *key))
            out.append(_prefetch_reloads(new))
        return Schedule(self.num_stages, self.num_micro_batches, self.vpp, self.name, self.split_backward, out)

    def compute_actions(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.is_compute]


def _prefetch_reloads(actions: list[Action]) -> list[Action]:
    """Move each RELOAD to just before the compute action that precedes it, if that comes after the key's
    OFFLOAD (megalm.offload.policy mirrors this placement in its peak estimate)."""
    out = list(actions)
    for i in [i for i, a in enumerate(actions) if a.kind == "RELOAD"]:
        reload = actions[i]
        at = out.index(reload)
        ahead = max((j for j in range(at) if out[j].is_compute), default=None)
        offload_at = out.index(Action("OFFLOAD", reload.micro_batch, reload.chunk))
        if ahead is not None and ahead > offload_at:
            out.pop(at)
            out.insert(ahead, reload)
    return out
